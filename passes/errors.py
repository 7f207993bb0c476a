"""Errors that mean the user's input is wrong; the CLI prints the message alone, no traceback."""
from __future__ import annotations

__all__ = ["UserError", "ModelFileError", "TraceFailure"]


class UserError(Exception):
    """Bad input. The message is one or two sentences: what was wrong and what to do."""


class ModelFileError(UserError):
    """The model file is missing, raises, or lacks a required function."""


class TraceFailure(UserError):
    """torch.fx could not trace the model."""
