"""Stage modules from a plan: trace, split by the plan's partition, tensor parallelism, shared weights.

The traced graph is split with ``passes.split.split_by`` into *pieces*: one per virtual stage, or,
when the plan recomputes activations, one per (stage, unit) so that each block unit can run under
``torch.utils.checkpoint``. The split's top-level graph (placeholders, get_attr, calls of pieces,
getitems, output) is the program the stages run between them:

- a piece's result and its getitems belong to the piece's stage;
- placeholders (model inputs) and get_attr nodes are evaluated locally by every stage that reads
  them: every rank loads the data itself, and a weight read at top level (a tied LM head) is a
  parameter of each stage that reads it;
- a value produced by stage j and read by stage k > j travels j -> j+1 -> ... -> k: it is part of
  every boundary in between (``StageProgram.send``/``recv``), so skip connections work too.

Shapes of boundary tensors come from a meta pass: the model is built again on the meta device,
traced and split the same way, and run on meta inputs of one microbatch; every rank runs it locally,
so the receiver of a p2p transfer knows shape and dtype without a handshake. Non-tensor boundary
values (Python ints of shapes) are constants of that pass and never travel.

Tensor (and sequence) parallelism: Megatron's layout on local shards (planner/runtime/megatron_tp.py: attention
split by heads, sizes rewritten from a meta shape pass), and the vocabulary split by rows over the embedding and the
LM head (planner/runtime/vocab_parallel.py). A plan whose split those rules cannot place is refused, at
trace time (passes/sharding/check.py, passes/sharding/vocab.py: the search leaves it out) and again here, naming the
op and its source line: nothing runs unlike it was priced. Stage outputs leave as full tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from passes.errors import UserError
from passes.capture import export_graph
from passes.load import ModelFile
from passes.split import split_by
from passes.trace import trace_model
from passes.costs import node_kind
from passes.sharding.check import refusal_sentence, refused_op
from passes.units import attention_core, group_nodes

from ..plan import Plan
from .context_parallel import ContextParallel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Plan precision -> the dtype the runtime's parameters and activations take."""

__all__ = ["Piece", "StageProgram", "TensorSpec", "SplitModel", "StageModule", "build_split", "boundary_specs",
           "stage_modules", "apply_tensor_parallel", "to_precision"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One submodule of the split: part of one virtual stage."""

    index: int
    stage: int
    checkpoint: bool
    """Run under torch.utils.checkpoint: a block (full recomputation) or its attention core (selective)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def grad(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True, kw_only=True, slots=True)
class StageProgram:
    """What one virtual stage evaluates of the split's top-level graph."""

    stage: int
    rank: int
    nodes: tuple[str, ...]
    """Top-level node names it evaluates, in graph order (local placeholders/get_attrs included)."""
    recv: tuple[str, ...]
    """Values it receives from stage - 1 (empty for stage 0)."""
    send: tuple[str, ...]
    """Values it sends to stage + 1 (empty for the last stage)."""
    last: bool


@dataclass(kw_only=True)
class SplitModel:
    """The split of the whole model; every rank builds it, then keeps its own stages."""

    split: fx.GraphModule
    pieces: list[Piece]
    programs: list[StageProgram]
    canonical: dict[int, str]
    """id(parameter) -> its name in the model (the first name, for tied weights)."""
    holders: dict[str, set[int]]
    """Canonical parameter name -> pipeline ranks whose stages use it."""
    recompute: str = "none"
    """The plan's recomputation mode, as the checkpointed pieces run it."""
    out_spec: Any = None
    """How the model's output is structured where the graph returns it flattened (torch.export), else None: the last
    stage hands loss_fn what the model returns (a ModelOutput with its .logits), not its leaves."""


# ---------------------------------------------------------------------------------------------
# Splitting


def _pieces(gm: fx.GraphModule, root: nn.Module, plan: Plan) -> tuple[dict[str, int], list[Piece]]:
    """Node name -> piece index, and the pieces in graph order."""
    # units by position: two segments outside the blocks may share a name (an encoder-decoder's embeddings, its
    # middle and its head are all the root module's), so a name alone does not say which stage runs it
    placed = [(name, s.stage) for s in sorted(plan.partition, key=lambda s: s.stage) for name in s.units]
    mode = plan.config.recompute  # full: each block checkpointed; selective: each block's attention core; block:
    # the first recompute_layers blocks of each stage checkpointed
    unit_of: dict[str, tuple[int, str]] = {}
    core: set[str] = set()
    groups = group_nodes(gm, root)
    for i, (name, kind, nodes) in enumerate(groups):
        if len(groups) != len(placed) or placed[i][0] != name:
            raise UserError(f"the plan's partition does not place unit {name!r} (unit {i} of the model's "
                            f"{len(groups)}; the plan places {len(placed)}): the model traced differently than when "
                            "it was planned (leaves or model arguments changed?) - re-plan")
        unit_of.update({n.name: (i, kind) for n in nodes})
        if mode == "selective" and kind == "block":
            core |= attention_core(nodes, kind=lambda n: node_kind(n, gm))
    redo = {i for i, (_, kind, _) in enumerate(groups) if kind == "block"} if mode == "full" else set()
    if mode == "block":
        blocks = [i for i, (_, kind, _) in enumerate(groups) if kind == "block"]
        for stage in {st for _, st in placed}:
            redo.update([i for i in blocks if placed[i][1] == stage][:plan.config.recompute_layers])
    keys: dict[tuple[int, int, int], int] = {}
    part_of: dict[str, int] = {}
    pieces: list[Piece] = []
    segment: dict[int, int] = {}  # unit -> 0 before its attention core, 1 inside, 2 after
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        unit, kind = unit_of[node.name]
        if mode == "selective":
            seg = 1 if node.name in core else (2 if segment.get(unit, 0) >= 1 else 0)
            segment[unit] = seg
            key = (placed[unit][1], unit, seg)
            ckpt = seg == 1
        else:
            key = (placed[unit][1], unit if mode in ("full", "block") else -1, 0)
            ckpt = unit in redo
        if key not in keys:
            keys[key] = len(pieces)
            pieces.append(Piece(index=len(pieces), stage=key[0], checkpoint=ckpt))
        part_of[node.name] = keys[key]
    return part_of, pieces


def _node_stages(split: fx.GraphModule, pieces: list[Piece]) -> dict[str, int]:
    """Stage of each routed top-level node (piece calls and what is taken from their results)."""
    stage: dict[str, int] = {}
    for node in split.graph.nodes:
        if node.op == "call_module":
            stage[node.name] = pieces[int(str(node.target).removeprefix("submod_"))].stage
        elif node.op == "call_function":
            srcs = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
            if not srcs:
                raise UserError(f"top-level node {node.name} of the split reads no stage output; cannot place it")
            stage[node.name] = max(srcs)
    return stage


def _programs(split: fx.GraphModule, pieces: list[Piece], plan: Plan) -> list[StageProgram]:
    n_stages = len(plan.partition)
    rank_of = {s.stage: s.rank for s in plan.partition}
    last = n_stages - 1
    routed = _node_stages(split, pieces)
    send: list[list[str]] = [[] for _ in range(n_stages)]
    recv: list[list[str]] = [[] for _ in range(n_stages)]
    local: list[set[str]] = [set() for _ in range(n_stages)]
    for node in split.graph.nodes:
        if node.op == "output":
            continue
        users = {last if u.op == "output" else routed[u.name] for u in node.users}
        if node.name not in routed:  # placeholder / get_attr: evaluated by each reader
            for s in users:
                local[s].add(node.name)
            continue
        src = routed[node.name]
        if users and min(users) < src:
            raise UserError(f"value {node.name} of stage {src} is read by earlier stage {min(users)}; the plan's "
                            "stages are not in data-flow order - re-plan")
        for k in range(src, max(users, default=src)):
            send[k].append(node.name)
            recv[k + 1].append(node.name)
    order = [n.name for n in split.graph.nodes if n.op != "output"]
    return [StageProgram(stage=s, rank=rank_of[s], recv=tuple(recv[s]), send=tuple(send[s]), last=s == last,
                         nodes=tuple(n for n in order if routed.get(n) == s or n in local[s]))
            for s in range(n_stages)]


def _trace_split(model: nn.Module, plan: Plan, model_file: ModelFile) -> tuple[fx.GraphModule, list[Piece], Any]:
    """The model's graph split by the plan's partition: the graph the plan was made from (its torch.export graph,
    weights read as attributes; a torch.fx symbolic trace where export could not take the model or leaves were
    given), captured again from the real model, so the runtime splits the nodes the plan names. Exported at the
    plan's microbatch size, the only one the runtime runs: a static shape exports in half the time of a dynamic one."""
    if plan.source.frontend == "export":
        weight = next(model.parameters(), torch.empty(0))
        inputs = tuple(x.to(weight.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                       for x in model_file.inputs(plan.config.microbatch, weight.device))
        gm = export_graph(model, inputs, dynamic=False)
    else:
        gm = trace_model(model, plan.source.leaves, stack_traces=True)
    part_of, pieces = _pieces(gm, model, plan)
    if {pc.stage for pc in pieces} != set(range(len(plan.partition))):
        raise UserError(f"the plan has {len(plan.partition)} stages but its partition places nodes on stages "
                        f"{sorted({pc.stage for pc in pieces})}")
    return split_by(gm, model, part_of.__getitem__), pieces, _out_spec(gm)


def _out_spec(gm: fx.GraphModule) -> Any:
    """The pytree structure of what the model returns, where the graph returns it flattened (torch.export's: a
    transformers ModelOutput, a tuple), else None."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return getattr(info, "out_spec", None)


def build_split(model: nn.Module, plan: Plan, model_file: ModelFile) -> SplitModel:
    """Trace ``model`` (real weights) and split it by the plan's partition."""
    split, pieces, out_spec = _trace_split(model, plan, model_file)
    programs = _programs(split, pieces, plan)
    canonical = {}
    for name, param in model.named_parameters():  # dedup: a tied weight keeps its first name
        canonical[id(param)] = name
    holders: dict[str, set[int]] = {}
    for prog in programs:
        for param in _program_params(split, prog):
            holders.setdefault(canonical[id(param)], set()).add(prog.rank)
    return SplitModel(split=split, pieces=pieces, programs=programs, canonical=canonical, holders=holders,
                      recompute=plan.config.recompute, out_spec=out_spec)


def _program_params(split: fx.GraphModule, prog: StageProgram) -> list[nn.Parameter]:
    nodes = {n.name: n for n in split.graph.nodes}
    out: list[nn.Parameter] = []
    for name in prog.nodes:
        node = nodes[name]
        if node.op == "call_module":
            out.extend(split.get_submodule(str(node.target)).parameters())
        elif node.op == "get_attr":
            value = _attr(split, str(node.target))
            if isinstance(value, nn.Parameter):
                out.append(value)
    return out


def _attr(module: nn.Module, target: str) -> Any:
    *path, leaf = target.split(".")
    for part in path:
        module = getattr(module, part)
    return getattr(module, leaf)


def boundary_specs(model_file: ModelFile, plan: Plan, inner: dict[str, dict[str, Any]] | None = None,
                   cp: ContextParallel | None = None, split: fx.GraphModule | None = None
                   ) -> dict[str, TensorSpec | Any]:
    """Shape pass: every top-level value of one microbatch (b samples). With `inner`, also every value inside each
    piece: piece name -> node name -> shape (tensors) or value (ints). With `cp`, the split is rewritten for that
    context-parallel rank's tokens (its shapes are local). `split`: the runtime's split of the model (build_split's,
    already rewritten for `cp`), run on fake tensors of its own, whose strides are those of the device its graph was
    captured on; else the model is built and split on the meta device here."""
    dtype = DTYPES[plan.config.precision]
    inputs, _ = model_file.call("sample_batch", plan.config.microbatch, 0)
    if split is None:
        meta = to_precision(model_file.build("meta", torch.float32), dtype)  # boundary tensors take the precision's dtype
        meta.train()
        split, _, _ = _trace_split(meta, plan, model_file)
        if cp is not None:
            cp.apply(split)
        device, mode = torch.device("meta"), contextlib.nullcontext()
    else:
        device = next((p.device for p in split.parameters()), torch.device("cpu"))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    if cp is not None:
        inputs = tuple(cp.shard(x) for x in inputs)
    inputs = tuple(x.to(device, dtype if x.is_floating_point() else x.dtype) if isinstance(x, torch.Tensor) else x
                   for x in inputs)
    interp = _InnerShapes(split, inner) if inner is not None else fx.Interpreter(split, garbage_collect_values=False)
    with torch.no_grad(), mode:
        interp.run(*inputs)
    return {node.name: (TensorSpec(shape=tuple(v.shape), dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
            for node, v in interp.env.items()}


class _InnerShapes(fx.Interpreter):
    """Runs the split, recording what each piece computes inside (shapes of tensors, ints as they are)."""

    def __init__(self, split: fx.GraphModule, out: dict[str, dict[str, Any]]) -> None:
        super().__init__(split, garbage_collect_values=False)
        self.out = out

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        piece = self.fetch_attr(str(target))
        if not isinstance(piece, fx.GraphModule):
            return super().call_module(target, args, kwargs)
        sub = fx.Interpreter(piece, garbage_collect_values=False)
        result = sub.run(*args)
        self.out[str(target)] = {n.name: (tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                                 for n, v in sub.env.items()}
        return result


# ---------------------------------------------------------------------------------------------
# Stage modules


class StageModule(nn.Module):
    """One virtual stage: its pieces and the top-level weights it reads, plus the program to run."""

    def __init__(self, split: SplitModel, stage: int, constants: dict[str, Any]) -> None:
        super().__init__()
        self.program = split.programs[stage]
        self.index = stage
        nodes = {n.name: n for n in split.split.graph.nodes}
        self._nodes = [nodes[name] for name in self.program.nodes]
        self._output = next(n for n in split.split.graph.nodes if n.op == "output")
        self.pieces = nn.ModuleDict()
        self.attr_params = nn.ParameterDict()
        self._attr_values: dict[str, Any] = {}
        self._checkpointed = {f"submod_{pc.index}" for pc in split.pieces if pc.checkpoint}
        for node in self._nodes:
            if node.op == "call_module":
                self.pieces[str(node.target)] = split.split.get_submodule(str(node.target))
            elif node.op == "get_attr":
                value = _attr(split.split, str(node.target))
                if isinstance(value, nn.Parameter):
                    self.attr_params[_key(node.target)] = value
                else:
                    self._attr_values[str(node.target)] = value
        self._placeholders = [n.name for n in split.split.graph.nodes if n.op == "placeholder"]
        self._constants = {name: constants[name] for name in self.program.recv if name in constants}
        self.names = {local: split.canonical[id(p)] for local, p in self.named_parameters(remove_duplicate=False)}
        """Local parameter name -> canonical name in the model."""
        self.probe: Callable[[tuple[Any, ...]], None] | None = None  # sees the inputs a checkpoint keeps
        self.tp_sharded: set[str] = set()  # modules split Megatron's way (megatron_tp), on local tensors
        self.tp_full: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # id(param) -> gather of the whole
        self.tp_partial: list[tuple[nn.Parameter, int]] = []
        """(parameter, r): its gradient is a partial sum over each r consecutive tensor-parallel ranks (applied to
        this rank's part of the sequence under SP: r = t; a kv head replicated on r ranks)."""
        self.recompute = split.recompute if self._checkpointed else "none"
        self._out_spec = split.out_spec if self.program.last else None

    def run(self, received: dict[str, Any], data: Sequence[Any]) -> tuple[list[Any], Any]:
        """Evaluate the stage: returns (values to send, model output or None)."""
        env: dict[str, Any] = dict(self._constants)
        env.update(received)
        for node in self._nodes:
            if node.name in env:
                continue
            env[node.name] = self._eval(node, env, data)
        sends = [env[name] for name in self.program.send]
        out = fx.node.map_arg(self._output.args[0], lambda n: env[n.name]) if self.program.last else None
        spec = self._out_spec
        if spec is not None and isinstance(out, (tuple, list)) and len(out) == spec.num_leaves:
            out = torch.utils._pytree.tree_unflatten(list(out), spec)  # what the model returns
        return sends, out

    def _eval(self, node: fx.Node, env: dict[str, Any], data: Sequence[Any]) -> Any:
        if node.op == "placeholder":
            return data[self._placeholders.index(node.name)]
        if node.op == "get_attr":
            if _key(node.target) in self.attr_params:
                return self.attr_params[_key(node.target)]
            return self._attr_values[str(node.target)]
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        if node.op == "call_module":
            return self._call_piece(str(node.target), args)
        if node.op == "call_function":  # getitem of a piece's tuple of results
            return node.target(*args, **kwargs)
        raise RuntimeError(f"unexpected top-level node {node.format_node()}")

    def _call_piece(self, name: str, args: tuple[Any, ...]) -> Any:
        fn: Callable[..., Any] = self.pieces[name]
        if name in self._checkpointed and torch.is_grad_enabled():
            if self.probe is not None:
                self.probe(args)
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

def _key(target: Any) -> str:
    return str(target).replace(".", "__")


def stage_modules(split: SplitModel, pipeline_rank: int, constants: dict[str, Any]) -> list[StageModule]:
    """The stages this pipeline rank runs (the plan's partition places them), in stage order. The split
    drops every other piece, so that only this rank's weights stay referenced."""
    stages = [StageModule(split, prog.stage, constants) for prog in split.programs if prog.rank == pipeline_rank]
    for name, _ in list(split.split.named_children()):
        delattr(split.split, name)  # own pieces and top-level weights live on in the StageModules
    return stages


# ---------------------------------------------------------------------------------------------
# Tensor parallelism


def apply_tensor_parallel(stages: list[StageModule], plan: Plan, root: nn.Module, tp_mesh: Any,
                          shapes: dict[str, dict[str, Any]] | None = None) -> None:
    """Shard the plan's linears over ``tp_mesh``, Megatron's way on local tensors (planner.runtime.megatron_tp):
    attention split by heads, the MLP by its hidden features, every other weight replicated; it needs the pieces'
    meta `shapes` (boundary_specs with `inner`). A piece doing something to a sharded tensor that the rules do not
    know refuses the plan (UserError naming the op and source line)."""
    from .megatron_tp import apply_shards
    from .vocab_parallel import split_vocab

    paths = {id(m): path for path, m in root.named_modules()}
    t, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    work, colwise, refused = _shard_work(stages, plan, paths, t, shapes)
    if _runs(work, plan):
        for st, piece, mine, rewrites in work or ():
            done, partial, weights, attr_partial = apply_shards(piece, rewrites, colwise, mine, paths, t, rank, group)
            for path, module in done.items():
                st.tp_sharded.add(path)
                st.tp_full.update({id(p): module.full for p in module.parameters()})
            st.tp_partial.extend(partial)
            for path, style, rows in weights:
                if path not in st.tp_sharded:  # a weight read by several pieces (a layer applied again): once
                    _shard_attr(st, path, style, rows, t, rank, group)
            st.tp_partial.extend((st.attr_params[_key(k)], t) for k in attr_partial if _key(k) in st.attr_params)
        unknown = split_vocab(stages, plan, root, t, rank, group)  # the embedding's and head's vocabulary rows
        if unknown is not None:
            raise UserError(_vocab_refusal(plan, unknown))
        for st in stages:  # a linear wrapped whole (a replicated head reading the split sequence): its old name
            found = list(st.named_parameters(remove_duplicate=False))
            known = {id(p): st.names[n] for n, p in found if n in st.names}
            st.names.update({n: known[id(p)] for n, p in found if n not in st.names and id(p) in known})
        return
    raise UserError(_refusal(stages, plan, refused))


def _shard_work(stages: list[StageModule], plan: Plan, paths: dict[int, str], t: int,
                     shapes: dict[str, dict[str, Any]] | None) -> tuple[list | None, dict, Any]:
    """How Megatron's layout shards every stage's pieces (without a mesh: nothing changes): the work per piece,
    the column-parallel row groups, and where its rules stopped (a megatron_tp.Refusal) when the work is None."""
    from passes.sharding import Rows
    from passes.sharding.walk import Refusal, plan_shards

    heads = {v for k, v in (plan.source.model_shape or {}).items() if k in ("heads", "kv_heads") and v}
    colwise: dict[str, Rows] = {}
    sp = plan.config.sp
    work: list | None = []
    refused: Refusal | None = None
    for st in stages if shapes is not None else ():
        styles = _linear_styles(plan.partition[st.index].tensor_parallel)  # the vocabulary: vocab_parallel.py
        leaving = set(st.program.send) | ({a.name for a in st._output.all_input_nodes} if st.program.last else set())
        top: dict[str, Any] = {}  # top-level value -> how it is split: pieces pass shards on within the stage
        for node in st._nodes:
            if node.op == "call_function" and node.args and isinstance(top.get(getattr(node.args[0], "name", "")), list):
                item = top[node.args[0].name][node.args[1]]  # getitem of a piece's tuple of results
                if item is not None:
                    top[node.name] = item
                continue
            if node.op != "call_module":
                continue
            piece = st.pieces[str(node.target)]
            mine = {paths[id(m)]: styles[paths[id(m)]] for m in piece.modules() if paths.get(id(m)) in styles}
            placeholders = [n.name for n in piece.graph.nodes if n.op == "placeholder"]
            weights = {ph: str(a.target) for ph, a in zip(placeholders, node.args)  # the parameters it reads as inputs
                       if isinstance(a, fx.Node) and a.op == "get_attr"}
            linears = {w[:-len(".weight")] for w in weights.values() if w.endswith(".weight")}
            mine.update({w: styles[w] for w in linears if w in styles})  # an exported graph's linears
            given = [top.get(a.name) if isinstance(a, fx.Node) else None for a in node.args]
            if not mine and not any(given):
                continue
            out = frozenset(k for k, user in _result_users(node) if user in leaving)
            planned = plan_shards(piece, shapes.get(str(node.target), {}), mine, paths, t, heads, colwise, given,
                                  sp=sp, leaving=out, weights=weights)
            if isinstance(planned, Refusal):
                work, refused = None, planned
                break
            rewrites, outs = planned
            if any(outs):
                top[node.name] = outs if _returns_tuple(piece) else outs[0]
            work.append((st, piece, mine, rewrites))
        if work is None or any(top.get(v) is not None for v in leaving):
            work = None  # a sharded value would leave the stage
            break
    return work, colwise, refused


def _refusal(stages: list[StageModule], plan: Plan, refused: Any) -> str:
    """Where Megatron's layout does not apply, the sentence refusing the plan, naming the op and its source
    line."""
    split = "sequence" if plan.config.sp else "tensor"
    return refusal_sentence(split, refused_op(refused, plan.source.model_file), plan.config.tp)


def _linear_styles(styles: dict[str, str]) -> dict[str, str]:
    """The plan's column- and row-parallel linears (Megatron's layout, megatron_tp), without the vocabulary split."""
    return {path: style for path, style in styles.items() if style in ("colwise", "rowwise")}


def _vocab_refusal(plan: Plan, what: str) -> str:
    """The sentence refusing a plan whose vocabulary split the runtime cannot run."""
    return (f"the plan splits this model's vocabulary over {plan.config.tp} tensor-parallel ranks (embedding rows, LM "
            f"head outputs), but {what} (planner/runtime/vocab_parallel.py); re-plan with --tp 1 to run it here, or "
            "with --engine megatron or --engine torchtitan to train it there")


def _runs(work: list | None, plan: Plan) -> bool:
    """Whether the Megatron layout placed every op; under sequence parallelism it must also split something (a
    model whose layout splits no module would only be credited with a split that never happens)."""
    return bool(work) or (work is not None and not plan.config.sp)


def _shard_attr(st: StageModule, path: str, style: str, rows: Any, t: int, rank: int, group: Any) -> None:
    """Replace the whole weight `path`.weight the stage reads as an attribute by this rank's shard (and a
    column-parallel linear's bias by its rows; a row-parallel bias stays whole)."""
    from passes.sharding import shard_rows

    from .megatron_tp import gather_cols, gather_rows

    for key in (_key(f"{path}.weight"), _key(f"{path}.bias")):
        whole = st.attr_params[key] if key in st.attr_params else None
        if whole is None or style != "colwise" and whole.dim() == 1:
            continue
        if style == "colwise":
            r = rows.replicas
            part = whole.detach()[shard_rows(whole.shape[0], t // r, rank // r, rows.groups, rows.segments)]
            full = lambda local: gather_rows(local, t, rows, group)  # noqa: E731
        else:
            cols = whole.shape[1] // t
            part = whole.detach()[:, rank * cols:(rank + 1) * cols]
            full = lambda local: gather_cols(local, t, group)  # noqa: E731
        shard = nn.Parameter(part.clone(), requires_grad=whole.requires_grad)
        st.attr_params[key] = shard
        st.tp_full[id(shard)] = full
        if style == "colwise" and rows.replicas > 1:  # a kv head replicated on r ranks: their gradients summed
            st.tp_partial.append((shard, rows.replicas))
    st.tp_sharded.add(path)


def _result_users(node: fx.Node) -> list[tuple[int, str]]:
    """(output position, top-level node holding it) of a piece call: its getitems, or the call itself."""
    items = [(u.args[1], u.name) for u in node.users if u.op == "call_function" and len(u.args) == 2
             and isinstance(u.args[1], int)]
    return items or [(0, node.name)]


def _returns_tuple(piece: fx.GraphModule) -> bool:
    out = next(n for n in piece.graph.nodes if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def to_precision(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model's floating-point parameters and buffers in `dtype`; complex and integer ones as they are (a complex
    RoPE table, torchtitan's freqs_cis: `Module.to(dtype)` would keep its real part only), as torchtitan's mixed
    precision leaves them."""
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
