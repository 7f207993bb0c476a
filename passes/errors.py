"""Errors that mean the user's input is wrong; the CLI prints the message alone, no traceback."""
from __future__ import annotations

__all__ = ["UserError", "ModelFileError", "TraceFailure", "invalid_file", "output_path", "write_atomic"]


class UserError(Exception):
    """Bad input. The message is one or two sentences: what was wrong and what to do."""


class ModelFileError(UserError):
    """The model file is missing, raises, or lacks a required function."""


class TraceFailure(UserError):
    """torch.fx could not trace the model."""


UNLAUNCHABLE = "the plan cannot be launched"
"""How a note begins where the model file lacks what the fxplanner runtime calls (sample_batch, loss_fn)."""
SHOWN_PROBLEMS = 5  # problems a file's one message names; more are counted


def invalid_file(kind: str, path: object, exc: Exception) -> UserError:
    """One sentence for a pydantic ValidationError: every bad field (up to SHOWN_PROBLEMS, then how many in all),
    each with its problem; an unknown field next to a missing one it is close to (a typo) is named with the
    spelling it was meant to have, and that missing field is not counted again."""
    import difflib

    errors = list(exc.errors())  # type: ignore[attr-defined]
    missing = [(tuple(e["loc"][:-1]), str(e["loc"][-1])) for e in errors if e["type"] == "missing" and e["loc"]]
    meant: dict[int, str] = {}  # index of an unknown field's error -> the missing field it is a typo of
    for i, e in enumerate(errors):
        if e["type"] == "extra_forbidden" and e["loc"]:
            parent = tuple(e["loc"][:-1])
            near = difflib.get_close_matches(str(e["loc"][-1]), [n for p, n in missing if p == parent], n=1)
            if near:
                meant[i] = near[0]
                missing.remove((parent, near[0]))
    explained = {(tuple(errors[i]["loc"][:-1]), name) for i, name in meant.items()}
    problems = []
    for i, e in enumerate(errors):
        where = ".".join(str(x) for x in e["loc"])
        if e["type"] == "missing" and e["loc"] and (tuple(e["loc"][:-1]), str(e["loc"][-1])) in explained:
            continue
        if e["type"] == "extra_forbidden":
            problems.append(f"unknown field {where}" + (f" (did you mean {meant[i]}?)" if i in meant else ""))
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
            problems.append(f"field {where}: {msg}" if where else msg)
    more = f" ({len(problems)} problems in all)" if len(problems) > SHOWN_PROBLEMS else ""
    if len(problems) == 1 and not errors[0]["loc"]:  # a rule between fields (a model validator): its sentence
        return UserError(f"{kind} {path} is inconsistent: {problems[0]}")  # says which
    return UserError(f"{kind} {path}: {'; '.join(problems[:SHOWN_PROBLEMS])}{more}")


def load_document(path: object, kind: str, schema: str, model: type, *, missing: str, other_schema: str):
    """Read the JSON document `path`, check its "schema" string and validate it with the pydantic `model`.
    Every failure is one UserError sentence starting "{kind} {path}": `missing` says what to do when the
    file does not exist, `other_schema` what to do when it carries another schema string."""
    import json
    from pathlib import Path

    from pydantic import ValidationError

    path = Path(str(path))
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{kind} {path} does not exist; {missing}") from None
    except UnicodeDecodeError:
        raise UserError(f"{kind} {path} is not valid JSON (it is not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{kind} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except OSError as exc:
        raise UserError(f"cannot read {kind} {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{kind} {path} must hold a JSON object")
    if data.get("schema") != schema:
        raise UserError(f"{kind} {path} has schema {data.get('schema')!r}, {other_schema}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_file(kind, path, exc) from None


def output_path(path: object, what: str = "output"):
    """`path` as a Path to write to; a folder that does not exist is one sentence, before anything is written."""
    from pathlib import Path

    p = Path(str(path))
    if not p.parent.is_dir():
        raise UserError(f"cannot write {what} {p}: folder {p.parent} does not exist; create it or choose another "
                        "output path")
    return p


def write_atomic(path: object, data: str | bytes, what: str = "output") -> None:
    """Write `data` to `path` whole or not at all: into a temporary file beside it, then renamed over it."""
    import os

    p = output_path(path, what)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
