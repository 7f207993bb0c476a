"""Errors that mean the user's input is wrong; the CLI prints the message alone, no traceback."""
from __future__ import annotations

__all__ = ["UserError", "ModelFileError", "TraceFailure", "invalid_file"]


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
    return UserError(f"{kind} {path}: field {where}: {err['msg']}{more}")
