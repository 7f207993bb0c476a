"""Capture a model as one fx graph: torch.export first, torch.fx.symbolic_trace as the fallback.

`torch.export.export(..., strict=False)` traces through Python control flow, ModelOutput
dataclasses and `**kwargs` forwards (every Hugging Face model once `use_cache=False`), which
symbolic tracing cannot. The batch dimension of every tensor input is exported as a symbol, so one
capture holds for every microbatch size. The exported program is unlifted (`ep.module()`):
parameters become `get_attr` nodes, each moved to just before its first user, and every node
records the innermost module it came from (from export's `nn_module_stack`), which is what
`passes.units` groups by. When neither front-end can take the model, the message names the module
and line each stopped at.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

from .errors import TraceFailure
from .meta_keys import MODULE
from .trace import trace_model, user_line

__all__ = ["Captured", "capture", "export_graph"]


@dataclass(frozen=True, slots=True)
class Captured:
    gm: fx.GraphModule
    frontend: str  # "export" | "fx"
    export_error: str = ""  # why export was not used, when it was not


def _dynamic_batch(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    b = torch.export.Dim("b", min=2)
    return tuple({0: b} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs)


@contextlib.contextmanager
def _source_lines() -> Iterator[None]:
    """Each exported node's stack trace down to the line of the model's source that made it, as a symbolic trace
    records it: export keeps only the frames of `forward` methods, so an op in a helper function (a rotary
    embedding, Hugging Face's repeat_kv) would be named by the forward line that called it. Frames inside torch are
    left out. (torch.fx.proxy.TracerBase._filter_traceback_frames is the hook torch provides for this.)"""
    tracer = getattr(torch.fx.proxy, "TracerBase", None)
    own = getattr(tracer, "_filter_traceback_frames", None)
    if own is None:  # another torch: its traces as they are
        yield
        return
    torch_dir = str(Path(torch.__file__).parent)

    def user_frames(self: Any, summary: traceback.StackSummary) -> traceback.StackSummary:
        self._record_forward_stack_traces_only = False
        frames = own(self, summary)
        return traceback.StackSummary.from_list([f for f in frames if not f.filename.startswith(torch_dir)])

    tracer._filter_traceback_frames = user_frames
    try:
        yield
    finally:
        tracer._filter_traceback_frames = own


def export_graph(model: torch.nn.Module, inputs: tuple[Any, ...], dynamic: bool = True) -> fx.GraphModule:
    """torch.export (non-strict; the batch dimension dynamic, or with `dynamic` False the inputs' own shapes) as a
    GraphModule with parameters as get_attr nodes."""
    import io
    import logging
    import os
    import warnings
    from contextlib import redirect_stderr, redirect_stdout

    quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    # Hugging Face repeats the kv heads of grouped-query attention when a mask is passed, which is
    # the case while tracing (in training on a GPU the causal mask is skipped and SDPA reads the kv
    # heads natively): have it call SDPA with enable_gqa, as it trains
    gqa = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        # export prints graph dumps and warnings on its way to an error; the error is what we report
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()), _source_lines():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, tuple(inputs), dynamic_shapes=_dynamic_batch(inputs) if dynamic else None,
                                    strict=False)
    finally:
        quiet.setLevel(level)
        if gqa is None:
            del os.environ["TRANSFORMERS_SDPA_FORCE_GQA"]
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = gqa
    gm = ep.module()
    graph = gm.graph
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        node.meta[MODULE] = "" if path.startswith("_") else path  # export's own helpers count as top level
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.users]:
        first = min(node.users, key=_position(graph))
        first.prepend(node)  # a weight lives with the op that reads it, so units own their parameters
    graph.lint()
    gm.recompile()
    return gm


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _reason(exc: BaseException) -> str:
    """The sentence of export's message that says what went wrong (it may come after a graph dump)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith((" ", "def "))]
    text = next((ln for ln in lines if not ln.startswith(("#", "For more", "For C++"))), type(exc).__name__)
    return text if len(text) <= 200 else text[:197] + "..."


def capture(model: torch.nn.Module, inputs: tuple[Any, ...], leaves: Iterable[str] = ()) -> Captured:
    """The model's graph. Leaves (`--leaf`) are an fx notion: with leaves, symbolic tracing is used."""
    leaves = tuple(leaves)
    if leaves:
        return Captured(trace_model(model, leaves, stack_traces=True), "fx", "leaves were given")
    try:
        return Captured(export_graph(model, inputs), "export")
    except Exception as exc:  # noqa: BLE001 - fall back to symbolic tracing, and say why if that fails too
        export_error = f"torch.export stopped at {user_line(exc)}: {_reason(exc)}"
    try:
        return Captured(trace_model(model, leaves, stack_traces=True), "fx", export_error)
    except TraceFailure as fx_exc:
        raise TraceFailure(f"{export_error}; and {fx_exc}") from fx_exc
