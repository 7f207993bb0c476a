"""At trace time, what the fxplanner runtime would refuse of a tensor-parallel split: the graph it runs walked with the
sharding rules, for each tensor-parallel degree the heads allow, with and without sequence parallelism; and of a
context-parallel split, the same graph walked with context parallelism's rules (passes/sharding/context.py). The result is
plain data on the model's profile, so the search never proposes a split the runtime cannot run, and planning needs
no runtime, no second trace and no second search."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.fx as fx

from torch import nn

from .context import ContextWalk, Unsupported
from .walk import Refusal, plan_shards

__all__ = ["cp_refusal", "graph_shapes", "tp_refusals", "refused_op", "refusal_sentence", "DEGREES"]

DEGREES = tuple(range(2, 17)) + (24, 32, 48, 64)  # the tensor-parallel degrees checked (those the heads allow)


def graph_shapes(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Every value of the graph on meta tensors: tensors by their shape, other values as they are."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*inputs)
    return {n.name: tuple(v.shape) if isinstance(v, torch.Tensor) else v for n, v in interp.env.items()}


def _allowed(t: int, heads: Iterable[tuple[int, int]]) -> bool:
    """The degrees the search may try (planner/search.py tp_reason): t divides the heads, and divides or is a
    multiple of the kv heads."""
    return all(not (h and h % t) and not (kv and kv % t and t % kv) for h, kv in heads)


def tp_refusals(gm: fx.GraphModule, shapes: dict[str, Any], styles: dict[str, str],
                heads: Iterable[tuple[int, int]], model_file: str | Path) -> dict[str, str]:
    """{"t" or "t+sp": the op the runtime's Megatron layout refuses and its source line} for each degree the heads
    allow; a degree missing runs. `shapes`: graph_shapes'; `styles`: {module path: "colwise" | "rowwise"} of the
    whole graph."""
    heads = [(h, kv) for h, kv in heads if h or kv]
    head_sizes = {x for pair in heads for x in pair if x}
    paths = {id(m): path for path, m in gm.named_modules()}
    weights = {n.name: str(n.target) for n in gm.graph.nodes
               if n.op == "get_attr" and str(n.target).endswith(".weight")}  # an exported graph's linears
    weights = {k: v for k, v in weights.items() if v[:-len(".weight")] in styles}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    leaving = frozenset(range(len(results)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    refused: dict[str, str] = {}
    for t in DEGREES:
        if not _allowed(t, heads):
            continue
        for sp in (False, True):
            if not styles:  # nothing to split: runs as replicated; under sequence parallelism it splits nothing
                if sp:
                    refused[f"{t}+sp"] = "it splits no module of this model"
                continue
            walked = plan_shards(gm, shapes, styles, paths, t, head_sizes, {}, [None] * len(placeholders), sp=sp,
                                 leaving=leaving, weights=weights or None)
            if isinstance(walked, Refusal):
                refused[f"{t}+sp" if sp else str(t)] = refused_op(walked, model_file)
                if not sp:
                    refused[f"{t}+sp"] = refused[str(t)]
                    break
    return refused


class _StandIns:
    """What the context-parallel walk inserts, for a check: modules never run (the runtime's ring attention and
    position selection in planner/runtime/context_parallel.py)."""

    size = 2  # the rules place an op or not whatever the degree

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def attention(self, *, k_transposed: bool, scale: Any, layout: tuple[int, ...] | None = None) -> nn.Module:
        return nn.Identity()

    def positions(self, dim: int) -> nn.Module:
        return nn.Identity()


def cp_refusal(gm: fx.GraphModule, shapes: dict[str, Any], model_file: str | Path) -> str | None:
    """The op the runtime's context parallelism refuses and its source line (any cp > 1), else None: the walk the
    runtime rewrites its pieces with, run on a copy of the graph. The sequence is the first batch-first input's
    second dim (as the runtime reads it). `shapes`: graph_shapes'."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seq = next((s[1] for s in (shapes.get(n.name) for n in placeholders) if isinstance(s, tuple) and len(s) >= 2), 0)
    if not seq:
        return "the model's inputs hold no sequence to split"
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph)
    given = [1 if isinstance(s := shapes.get(n.name), tuple) and len(s) >= 2 and s[1] == seq else None
             for n in placeholders]
    try:
        ContextWalk(copy, shapes, _StandIns(seq), given).run()
    except Unsupported as exc:
        name = str(exc).split(":", 1)[0]
        node = next((n for n in gm.graph.nodes if n.name == name), None)
        return refused_op(Refusal(node=node, why=str(exc)), model_file)
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def refused_op(refused: Refusal | None, model_file: str | Path) -> str:
    """The op the Megatron layout refused and the model's source line that made it ("aten.flip at model.py:42
    (`x.flip(1)`)"), as far as the graph says."""
    node = getattr(refused, "node", None)
    if node is None:
        return f"at {refused.why}" if refused is not None else "it splits no module of this model"
    target = getattr(node.target, "overloadpacket", node.target)  # aten.cumsum.default: `cumsum`
    op = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    detail = refused.why.split(":", 1)[1].strip() if ":" in refused.why else ""
    text = f"`{op}`" + (f" ({detail})" if detail and detail != op else "")
    trace = str(node.meta.get("stack_trace") or "")
    lines = trace.splitlines()
    target = Path(model_file).name
    for i, line in reversed(list(enumerate(lines))):  # the innermost frame in the model file, else the innermost
        m = _FRAME.search(line)
        if m and Path(m.group(1)).name == target:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{text} at {model_file}:{m.group(2)}" + (f" (`{code}`)" if code else "")
    frames = [m for m in map(_FRAME.search, lines) if m]
    return f"{text} at {frames[-1].group(1)}:{frames[-1].group(2)}" if frames else text


def refusal_sentence(split: str, op: str, degree: int = 0) -> str:
    """The one sentence refusing a plan whose `split` ("tensor", "sequence" or "context" parallelism) the runtime's
    rules do not place, naming the op and its source line (`op`, refused_op's) and what to do instead."""
    if split == "context":
        return (f"the plan runs context parallelism, but this model's graph applies an op to the split sequence that "
                f"the runtime's context-parallel rules do not place ({op}; passes/sharding/context.py); re-plan with "
                "--cp 1 to run it here, or with --engine megatron or --engine torchtitan to train it there")
    where = f"a split tensor that the runtime's Megatron layout does not know ({op}; passes/sharding/)"
    if split == "tensor":
        return (f"the plan splits this model over {degree} tensor-parallel ranks, but its graph applies an op to {where}; "
                "re-plan with --tp 1 to run it here, or with --engine megatron or --engine torchtitan to train it there")
    return f"the plan runs {split} parallelism, but this model's graph applies an op to {where}; re-plan with --no-sequence-parallel to run it here"
