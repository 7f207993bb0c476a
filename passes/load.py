"""Load a user's model file: `build_model(**kw) -> nn.Module`, `example_inputs(batch_size, **kw)`."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from .errors import ModelFileError

__all__ = ["ModelFile", "load_model_file", "user_frame", "file_sha256"]

REQUIRED = ("build_model", "example_inputs")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFile:
    """A loaded model file and the keyword arguments it is built with."""

    path: Path
    module: ModuleType
    kwargs: dict[str, Any] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return callable(getattr(self.module, name, None))

    def call(self, name: str, *args: Any, **extra: Any) -> Any:
        """Call a function of the user's file; an exception becomes a ModelFileError quoting their line."""
        fn: Callable[..., Any] = getattr(self.module, name)
        try:
            return fn(*args, **self.kwargs, **extra)
        except Exception as exc:  # noqa: BLE001 - any user error is reported, not propagated
            raise ModelFileError(f"{name}() in {user_frame(exc, self.path)} raised "
                                 f"{type(exc).__name__}: {exc}") from exc

    def build(self, device: str | torch.device = "meta", dtype: torch.dtype | None = None) -> torch.nn.Module:
        old = torch.get_default_dtype()
        try:
            if dtype is not None:
                torch.set_default_dtype(dtype)
            with torch.device(device):
                model = self.call("build_model")
        finally:
            torch.set_default_dtype(old)
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(f"build_model() in {self.path} returned {type(model).__name__}, not an nn.Module")
        return model

    def inputs(self, batch_size: int, device: str | torch.device = "meta") -> tuple[Any, ...]:
        with torch.device(device):
            out = self.call("example_inputs", batch_size)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in out)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def user_frame(exc: BaseException, path: Path) -> str:
    """'file:line: source' of the deepest frame of `exc` inside the user's file (else the file name)."""
    target = str(path.resolve())
    best = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) == target:
            best = frame
    if best is None:
        return str(path)
    return f"{path}:{best.lineno} (`{(best.line or '').strip()}`)"


def load_model_file(path: str | Path, kwargs: dict[str, Any] | None = None) -> ModelFile:
    """Import `path` as a module and check it defines what fxplanner needs. Never executes plans. Its folder joins
    sys.path, so a model file may import a module beside it (the hf_*.py examples: examples/_hf_models.py)."""
    path = Path(path)
    if path.is_dir():
        py = sorted(p.name for p in path.glob("*.py"))
        has = f" (in it: {', '.join(py[:3])}{', …' if len(py) > 3 else ''})" if py else ""
        raise ModelFileError(f"model file {path} is a directory; pass a model file, one .py file that defines "
                             f"build_model() and example_inputs(){has}")
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass the path of a .py file that "
                             "defines build_model() and example_inputs()")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # it may import its neighbours, as a script would (installed modules win a clash)
        sys.path.append(folder)
    name = f"fxp_model_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {path}: it is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        del sys.modules[name]
        where = f"{path}:{exc.lineno}" if isinstance(exc, SyntaxError) else user_frame(exc, path)
        raise ModelFileError(f"importing {where} raised {type(exc).__name__}: {exc}") from exc
    missing = [fn for fn in REQUIRED if not callable(getattr(module, fn, None))]
    if missing:
        raise ModelFileError(f"{path} does not define {' and '.join(f'{m}()' for m in missing)}; a model file "
                             "needs build_model(**kwargs) -> nn.Module and example_inputs(batch_size, **kwargs)")
    return ModelFile(path=path, module=module, kwargs=dict(kwargs or {}))
