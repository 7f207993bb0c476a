"""Trace a model with torch.fx.symbolic_trace semantics, naming the module and line that break it."""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.fx as fx

from .errors import TraceFailure
from .meta_keys import MODULE

__all__ = ["trace_model", "LeafTracer", "user_line"]


class LeafTracer(fx.Tracer):
    """fx.Tracer with extra leaf modules (by class name or qualified name) and a module stack."""

    def __init__(self, leaves: Iterable[str] = ()) -> None:
        super().__init__()
        self.leaves = set(leaves)
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if type(m).__name__ in self.leaves or qualname in self.leaves:
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.stack.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            self.failed_in = self.failed_in or self.stack[-1]
            raise
        finally:
            self.stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[MODULE] = self.stack[-1][0] if self.stack else ""
        return node


def user_line(exc: BaseException) -> str:
    """The deepest traceback frame outside torch, as 'file:line (`source`)'."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(torch_dir) and "/passes/" not in f.filename]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"


def trace_model(model: torch.nn.Module, leaves: Iterable[str] = (), *, stack_traces: bool = False) -> fx.GraphModule:
    """Symbolically trace `model`; on failure raise TraceFailure naming module, line and the fix. `stack_traces`:
    each node keeps where in the model's source it was made (node.meta["stack_trace"], as torch.export's do)."""
    tracer = LeafTracer(leaves)
    tracer.record_stack_traces = stack_traces
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear message
        path, cls = tracer.failed_in or ("", type(model).__name__)
        where = f"module '{path}' ({cls})" if path else f"the top-level module ({cls})"
        hint = f"mark it a leaf with --leaf {cls}" if path else "move the untraceable code into a submodule and mark that a leaf"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceFailure(f"torch.fx cannot trace {where} at {user_line(exc)}: {reason}; {hint} "
                           "(a leaf is priced as one opaque node)") from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)
