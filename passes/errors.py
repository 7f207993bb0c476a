"""Errors that mean the user's input is wrong; the CLI prints the message alone, no traceback."""
from __future__ import annotations

__all__ = ["UserError", "ModelFileError", "TraceFailure", "invalid_file", "output_path", "write_atomic"]


class UserError(Exception):
    """Bad input. The message is one or two sentences: what was wrong and what to do."""


class ModelFileError(UserError):
    """The model file is missing, raises, or lacks a required function."""


class TraceFailure(UserError):
    """torch.fx could not trace the model."""


def invalid_file(kind: str, path: object, exc: Exception) -> UserError:
    """One sentence for a pydantic ValidationError: the first bad field, its problem, how many in all."""
    errors = exc.errors()  # type: ignore[attr-defined]
    err = errors[0]
    where = ".".join(str(x) for x in err["loc"]) or "(top level)"
    more = f" ({len(errors)} problems in all)" if len(errors) > 1 else ""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:  # a rule between fields (a model validator): its sentence says which
        return UserError(f"{kind} {path} is inconsistent: {msg}{more}")
    return UserError(f"{kind} {path}: field {where}: {msg}{more}")


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
