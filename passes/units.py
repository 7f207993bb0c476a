"""Group nodes into ordered partition units: one unit per repeated block, embedding and head apart.

A "block container" is an nn.ModuleList/Sequential whose children repeat a class (GPT layers,
ResNet blocks), or an nn.ModuleDict keyed "0", "1", ... as torchtitan holds its layers (so that pipeline stages can
delete theirs and keep the others' names). Each child is a block unit; whatever runs before the first block is the
embedding unit and whatever runs after the last is the head unit; other top-level modules between
blocks become units of their own. Costs are lowered from sympy to `Poly` so solvers get plain data.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import sympy
import torch
import torch.fx as fx
from torch import nn

from .costs import NodeCost, storage_of
from .kernels import KV_SOURCE, SHARED_INPUT, fuse_kernels, megatron_cross_entropy, titan_attention, written_cores
from .kernels import operands as attention_operands
from .meta_keys import COST, MODULE, TENSOR, TP, UNIT
from .poly import Poly
from .shapes import B, TensorInfo
from .tp import Heads, activation_input, annotate_tp_roles, linear_shape

__all__ = ["OpCheckpoint", "Part", "Unit", "attention_core", "expert_layers", "group_nodes", "lower_units", "op_checkpoint"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """Costs of the sharded (divided by t) or replicated part of a unit, per microbatch of size b."""

    fwd_flops: Poly = field(default_factory=Poly)
    bwd_flops: Poly = field(default_factory=Poly)
    wgrad_flops: Poly = field(default_factory=Poly)  # of bwd_flops, the parameters' gradients (W); the rest is the
    # input gradient (I), which zero-bubble schedules run first (passes.costs.NodeCost.wgrad_flops)
    mm_flops: Poly = field(default_factory=Poly)  # forward FLOPs in matrix products
    mm_bytes: Poly = field(default_factory=Poly)  # forward bytes moved by matrix products
    products: tuple[tuple[Poly, Poly, Poly, bool, Poly, Poly, Poly], ...] = ()  # (forward FLOPs, forward bytes,
    # backward FLOPs, fused attention kernel?, of the backward FLOPs the dW product's, a weight product's activation
    # input X bytes, its output Y bytes) of each matrix product: each is its own kernel, compute- or memory-bound on
    # its own (attention's score products are memory-bound where a layer's linears are not); a fused attention's
    # backward is 5 products for 2; a product of two activations has no dW (and no X, Y: FP8 casts only weight
    # products' operands, costmodels.fp8)
    model_flops: Poly = field(default_factory=Poly)  # mm_flops with causal attention counted in full (PaLM)
    fwd_bytes: Poly = field(default_factory=Poly)
    bwd_bytes: Poly = field(default_factory=Poly)
    saved_bytes: Poly = field(default_factory=Poly)  # activations kept for backward (no recompute)
    wgrad_bytes: Poly = field(default_factory=Poly)
    """What the W step needs that the I step cannot free: for each weight product (one with a dW), its saved input
    X (among saved_bytes) and the gradient of its output dY (made by I, kept until W: the product's output bytes),
    each tensor once (one X read by the q, k and v projections counts once). Bias and embedding-table gradients
    read a dY the W step keeps anyway, or run with I (an embedding's scatter-add): nothing more is counted."""
    gemm_input_bytes: Poly = field(default_factory=Poly)  # of saved_bytes, the weight products' inputs X (each
    # tensor once): what an FP8 recipe that saves the cast input keeps at 1 byte per element (costmodels.fp8)
    selective_bytes: Poly = field(default_factory=Poly)  # of saved_bytes, what selective recompute drops
    selective_flops: Poly = field(default_factory=Poly)  # forward FLOPs selective recompute redoes
    fused_core_bytes: Poly = field(default_factory=Poly)  # what a fused (flash) attention kernel keeps of the core
    # beyond its inputs and its output (laid out (b, s, h, d): the output projection's input is a view of it): an
    # fp32 log-sum-exp per query; under context parallelism every engine runs the core so (Transformer Engine's
    # ring attention), whatever the model file writes out
    params: int = 0
    weights: tuple[tuple[str, int], ...] = ()  # (name, elements) of each weight in `params`: a weight tied between
    # two units (embedding and LM head) appears in both, and a rank holding both holds it once
    kernels: int = 0  # nodes that launch a kernel (views excluded), for launch overhead
    memory_bound: tuple[tuple[str, Poly, Poly], ...] = ()  # (eager kernel kind, forward bytes, backward bytes) of the
    # memory-bound work (every node but the products, and the layout copies), grouped by the kernel eager PyTorch
    # runs for it (costmodels.eager): fwd_bytes - mm_bytes and bwd_bytes - 2 mm_bytes, split by kind
    row_products: tuple[int, ...] = ()  # indices into `products` of the row-parallel ones (their output is reduced
    # over the tensor-parallel ranks: the GEMMs a pipelined reduce-scatter overlaps)

    @property
    def fused_attention(self) -> bool:
        """The part's attention runs as one fused (flash) kernel."""
        return any(p[3] for p in self.products)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCheckpoint:
    """A block under per-op selective activation checkpointing as torchtitan runs it (torchtitan/distributed/
    activation_checkpoint.py, SelectiveAC: the block wrapped in torch.utils.checkpoint with a
    create_selective_checkpoint_contexts policy): the forward keeps the block's inputs and the outputs of the ops the
    policy saves, the backward reruns the rest of the forward (`op_checkpoint`)."""

    kept_sharded: Poly = field(default_factory=Poly)  # saved outputs made on a shard (column-parallel products, the
    # attention kernel): each tensor-parallel rank keeps 1/t of them
    kept: Poly = field(default_factory=Poly)  # the block's inputs and the other saved outputs (over the sequence-
    # parallel degree r)
    redo_sharded: Part = field(default_factory=Part)  # the forward nodes the backward reruns, of the sharded part
    redo: Part = field(default_factory=Part)  # and of the replicated part


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    index: int
    name: str
    kind: str  # embedding | block | head | layer
    module_type: str
    nodes: tuple[str, ...]
    sharded: Part
    replicated: Part
    param_bytes_per_param: int  # element size of the traced parameters
    input_bytes: Poly  # activation entering the unit (what full recompute keeps; what p2p sends)
    output_bytes: Poly
    tp_fwd_allreduce_bytes: Poly  # summed all-reduce messages under tensor parallelism, forward
    tp_bwd_allreduce_bytes: Poly
    tp_allreduces: int  # number of all-reduces forward (the same number backward)
    matmuls: int
    tp_layout: tuple[tuple[str, str], ...] = ()  # (module path, "colwise" | "rowwise" | "vocab" | "vocab_colwise")
    heads: int = 0  # attention heads (0: no attention found); tensor parallelism must divide them
    kv_heads: int = 0  # key/value heads (fewer than heads under grouped-query attention)
    kv: Part = field(default_factory=Part)  # the key/value projections (inside `sharded`): replicated past kv_heads
    attn_kv_bytes: Poly = field(default_factory=Poly)  # keys + values the attention core reads (all heads): what
    # context parallelism passes around its ring
    experts: int = 0  # experts of the unit's mixture-of-experts layer (0: none); expert parallelism divides them
    top_k: int = 0  # experts each token is routed to
    moe: Part = field(default_factory=Part)  # the experts' nodes (inside `replicated`): their weights are divided over
    # the expert-parallel ranks, their products run as grouped GEMMs of each local expert's tokens
    moe_dispatch_bytes: Poly = field(default_factory=Poly)  # the routed tokens' hidden states (tokens x top_k x h):
    # what one all-to-all of the dispatch (or of the combine) moves under expert parallelism
    router: Part = field(default_factory=Part)  # the router's gate (inside `replicated`): the linear of the MoE layer,
    # outside its experts, that scores each token against every expert (torchtitan runs it in fp32)
    loss_bytes: Poly = field(default_factory=Poly)  # the last unit only: what the model file's loss_fn keeps for its
    # backward (cross-entropy: an fp32 log-softmax of the logits), measured on meta tensors
    loss_work: Poly = field(default_factory=Poly)  # the last unit only: the most bytes the backward of the model
    # file's loss_fn holds at once beyond what it kept (cross-entropy: two fp32 logit-sized gradients, nll_loss's and
    # log_softmax's), measured on meta tensors; a working set of the last unit's backward, before its own
    op_checkpoint: OpCheckpoint | None = None  # blocks: the unit under per-op selective checkpointing (torchtitan's)
    loss_parallel: bool = False  # the last unit only: the loss runs on the logits each tensor-parallel rank holds,
    # 1/t of the vocabulary (loss parallelism: torchtitan's, planner.engines), its loss_bytes and loss_work split so
    checkpoint: str = "core"  # what recompute "selective" checkpoints in this unit: "core", the attention core
    # (Megatron-Core's --recompute-modules core_attn, the fxplanner runtime's); "op", per op as torchtitan's selective
    # activation checkpointing does (op_checkpoint; planner.engines.Engine.selective)

    @property
    def params(self) -> int:
        return self.sharded.params + self.replicated.params

    def loss_kept(self, b: float, t: int) -> float:
        """loss_bytes on one of t tensor-parallel ranks."""
        return self.loss_bytes(b) / (t if self.loss_parallel else 1)

    def loss_held(self, b: float, t: int) -> float:
        """loss_work on one of t tensor-parallel ranks."""
        return self.loss_work(b) / (t if self.loss_parallel else 1)

    def fwd_flops(self, b: float) -> float:
        return self.sharded.fwd_flops(b) + self.replicated.fwd_flops(b)

    def bwd_flops(self, b: float) -> float:
        return self.sharded.bwd_flops(b) + self.replicated.bwd_flops(b)

    def wgrad_flops(self, b: float) -> float:
        """Of bwd_flops, the parameters' gradients (W); the rest is the input gradient (I)."""
        return self.sharded.wgrad_flops(b) + self.replicated.wgrad_flops(b)

    def model_flops(self, b: float) -> float:
        """Model FLOPs of forward + backward as PaLM (appendix B) and Megatron count them for MFU: three
        times the forward's matrix products, attention in full (causal or not), no recomputation."""
        return 3 * (self.sharded.model_flops(b) + self.replicated.model_flops(b))


def stacked(container: nn.Module) -> list[nn.Module]:
    """A block container's blocks in order (a module held twice, twice)."""
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def block_containers(root: nn.Module) -> list[str]:
    found = []
    for name, mod in root.named_modules():
        if isinstance(mod, nn.ModuleDict) and list(mod.keys()) != [str(i) for i in range(len(mod))]:
            continue  # (a dict of named parts, not a stack of layers)
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(mod) >= 2:
            counts = Counter(type(c) for c in stacked(mod))
            if counts.most_common(1)[0][1] >= 2 and not any(name.startswith(f + ".") for f in found):
                found.append(name)
    return found


def _key(path: str, containers: list[str]) -> tuple[str, bool]:
    for c in containers:
        prefix = f"{c}." if c else ""
        if path.startswith(prefix) and path != c:
            idx = path[len(prefix):].split(".")[0]
            return f"{prefix}{idx}", True
    return path.split(".")[0], False


def group_nodes(gm: fx.GraphModule, root: nn.Module) -> list[tuple[str, str, list[fx.Node]]]:
    """Ordered (name, kind, nodes) groups; every node lands in exactly one group.

    `root` is the traced nn.Module (the GraphModule flattens containers into plain Modules)."""
    containers = block_containers(root)
    groups: list[tuple[str, bool, list[fx.Node]]] = []
    pending: list[fx.Node] = []  # nodes without a module of their own: join the next group
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            pending.append(node)  # parameters/buffers live with their first user
            continue
        key, is_block = _key(node.meta.get(MODULE, ""), containers)
        if node.op in ("placeholder", "output") or key == "":
            (groups[-1][2] if groups and node.op != "placeholder" else pending).append(node)
            continue
        if not groups or groups[-1][0] != key:
            groups.append((key, is_block, []))
        groups[-1][2].extend(pending + [node])
        pending = []
    if pending:
        groups[-1][2].extend(pending)
    return _merge_edges(groups)


def _merge_edges(groups: list[tuple[str, bool, list[fx.Node]]]) -> list[tuple[str, str, list[fx.Node]]]:
    blocks = [i for i, g in enumerate(groups) if g[1]]
    if not blocks:
        return [(name, "layer", nodes) for name, _, nodes in groups]
    first, last = blocks[0], blocks[-1]
    out: list[tuple[str, str, list[fx.Node]]] = []
    if first > 0:
        out.append(("+".join(g[0] for g in groups[:first]), "embedding", [n for g in groups[:first] for n in g[2]]))
    out.extend((name, "block" if is_b else "layer", nodes) for name, is_b, nodes in groups[first:last + 1])
    if last < len(groups) - 1:
        out.append(("+".join(g[0] for g in groups[last + 1:]), "head", [n for g in groups[last + 1:] for n in g[2]]))
    return out


def _part(nodes: list[fx.Node], selective: set[str]) -> Part:
    z = sympy.Integer(0)
    fw = bw = wg = mm = mmb = fb = bb = sel_f = full = z
    saved: dict[str, sympy.Expr] = {}
    products: list[tuple[sympy.Expr, ...]] = []
    rows: list[int] = []
    params: dict[str, int] = {}  # every weight a node of the part uses, once (a tied weight in each unit using it)
    bound: dict[str, list[sympy.Expr]] = {}
    for n in nodes:
        c: NodeCost = n.meta[COST]
        if c.mm_flops == 0 and (c.fwd_bytes != 0 or c.bwd_bytes != 0):
            slot = bound.setdefault(f"{_eager_kind(c.op, n)}/{_dtype_name(n)}", [z, z])
            slot[0], slot[1] = slot[0] + c.fwd_bytes, slot[1] + c.bwd_bytes
        if c.copy_bytes != 0:
            bound.setdefault(f"copy/{_dtype_name(n)}", [z, z])[0] += 2 * c.copy_bytes
        fw, bw, mm, bb = fw + c.fwd_flops, bw + c.bwd_flops, mm + c.mm_flops, bb + c.bwd_bytes
        fb += c.fwd_bytes + 2 * c.copy_bytes
        wg += c.wgrad_flops
        full += c.mm_flops if c.full_mm_flops is None else c.full_mm_flops
        if n.op == "call_module":  # keyed by the parameter's own name where it is one, as a get_attr of it is
            params[c.param_names[0] if len(c.param_names) == 1 else str(n.target)] = c.params
        params.update((str(a.target), a.meta[COST].params) for a in n.all_input_nodes if a.op == "get_attr")
        saved.update(c.saved)
        if c.mm_flops != 0:
            mmb += c.fwd_bytes
            if n.meta.get(TP) == "row":
                rows.append(len(products))
            weight = c.wgrad_mm_flops != 0
            products.append((c.mm_flops, c.fwd_bytes, c.bwd_flops - (c.fwd_flops - c.mm_flops), c.kind == "attention",
                             c.wgrad_mm_flops, sum((v for _, v in c.saved), z) if weight and not n.meta.get(
                                 SHARED_INPUT) else z,
                             c.out_bytes if weight else z))
        if n.name in selective:
            sel_f += c.fwd_flops
    sel_b = _selective_bytes(nodes, selective, saved)
    fused_b = sum((i.numel / i.shape[-1] * 4 for n in nodes if n.name in selective
                   and any(u.name not in selective for u in n.users)  # a core's result
                   for i in [n.meta.get(TENSOR)] if isinstance(i, TensorInfo) and i.shape), z)
    p = lambda e: Poly.of(e, B)  # noqa: E731
    kernels = sum(int(n.meta[COST].kind not in ("view", "none")) + int(n.meta[COST].copy_bytes != 0) for n in nodes)
    return Part(fwd_flops=p(fw), bwd_flops=p(bw), wgrad_flops=p(wg), mm_flops=p(mm), mm_bytes=p(mmb),
                model_flops=p(full), products=tuple((p(f), p(by), p(bf), fused, p(wf), p(x), p(y))
                                                    for f, by, bf, fused, wf, x, y in products),
                fwd_bytes=p(fb), bwd_bytes=p(bb), saved_bytes=p(sum(saved.values(), z)),
                wgrad_bytes=p(sum(_wgrad_tensors(nodes).values(), z)), selective_bytes=p(sel_b),
                selective_flops=p(sel_f), fused_core_bytes=p(fused_b), params=sum(params.values()),
                weights=tuple(sorted(params.items())), kernels=kernels, row_products=tuple(rows),
                memory_bound=tuple((k, p(f), p(bb)) for k, (f, bb) in sorted(bound.items())))


def _dtype_name(n: fx.Node) -> str:
    info = n.meta.get(TENSOR)
    return str(info.dtype).split(".")[-1] if isinstance(info, TensorInfo) else "float32"


def _eager_kind(op: str, n: fx.Node) -> str:
    """The eager kernel an op runs as, where its speed differs by more than its bytes (costmodels.eager): a
    LayerNorm or softmax over short rows or long ones (2048 elements and up), a batch norm; else the op's name."""
    info = n.meta.get(TENSOR)
    width = info.shape[-1] if isinstance(info, TensorInfo) and info.shape else None
    wide = width is not None and width.is_number and int(width) >= 2048
    if op in ("layer_norm", "softmax", "log_softmax"):
        return f"{op.replace('log_', '')}{'_wide' if wide else ''}"
    return op


def _wgrad_tensors(nodes: list[fx.Node]) -> dict[str, sympy.Expr]:
    """(name, bytes) of what the weight products' dW read (Part.wgrad_bytes): X by its storage's name, as saved
    bytes name it, and dY as '<product>.grad' (so it splits over tensor parallelism as the product's output)."""
    tensors = _gemm_inputs(nodes)
    tensors.update((f"{n.name}.grad", n.meta[COST].out_bytes) for n in nodes if n.meta[COST].wgrad_mm_flops != 0)
    return tensors


def _gemm_inputs(nodes: list[fx.Node]) -> dict[str, sympy.Expr]:
    """(name, bytes) of the inputs X the weight products save, by their storage's name (each tensor once)."""
    return {k: v for n in nodes if n.meta[COST].wgrad_mm_flops != 0 for k, v in n.meta[COST].saved}


def _selective_bytes(nodes: list[fx.Node], core: set[str], saved: dict[str, sympy.Expr]) -> sympy.Expr:
    """What checkpointing the attention core frees: everything the part saves, less what it still
    saves with the core checkpointed (the other nodes' saves, and the core's inputs, which the
    checkpoint keeps)."""
    if not core:
        return sympy.Integer(0)
    kept = {k: v for n in nodes if n.name not in core for k, v in n.meta[COST].saved}
    for n in nodes:
        if n.name in core:
            for a in n.all_input_nodes:
                info = a.meta.get(TENSOR)
                if a.name not in core and a.op != "get_attr" and isinstance(info, TensorInfo) and info.requires_grad:
                    src = storage_of(a)
                    src_info = src.meta.get(TENSOR)
                    kept[src.name] = src_info.nbytes if isinstance(src_info, TensorInfo) else info.nbytes
    return sum(saved.values(), sympy.Integer(0)) - sum(kept.values(), sympy.Integer(0))


SPLIT_OUTPUTS = {"col", "sharded", "vocab-col"}  # roles whose outputs each TP rank holds 1/t of


def _saved_by_layout(nodes: list[fx.Node], core: set[str], role_of: dict[str, str]) -> tuple[dict, dict]:
    """Saved bytes of the sharded and the replicated part, split by where each tensor lives: a tensor
    is divided over the tensor-parallel ranks when the op that produced it works on a shard, whatever
    op saves it. The input of a column-parallel linear (a norm's output) is whole on every rank
    (Korthikanti et al. 2022: sbh(10 + 24/t + 5as/ht) per GPT layer, not all of it over t). What the W step
    keeps (wgrad_bytes) splits the same way."""
    saved, wgrad, inputs = {k: v for n in nodes for k, v in n.meta[COST].saved}, _wgrad_tensors(nodes), _gemm_inputs(nodes)
    freed = _selective_bytes(nodes, core, saved)  # the attention core works on shards
    split = lambda name: role_of.get(name, "replicated") in SPLIT_OUTPUTS  # noqa: E731
    whole = lambda name: not split(name)  # noqa: E731
    return ({"saved_bytes": _tensor_bytes(saved, split), "wgrad_bytes": _tensor_bytes(wgrad, split),
             "gemm_input_bytes": _tensor_bytes(inputs, split), "selective_bytes": Poly.of(freed, B)},
            {"saved_bytes": _tensor_bytes(saved, whole), "wgrad_bytes": _tensor_bytes(wgrad, whole),
             "gemm_input_bytes": _tensor_bytes(inputs, whole),
             "selective_bytes": Poly()})


def _tensor_bytes(tensors: dict[str, sympy.Expr], keep: Callable[[str], bool]) -> Poly:
    """Bytes of the named tensors whose producing node (the name before any '.') `keep` accepts."""
    return Poly.of(sum((v for k, v in tensors.items() if keep(k.split(".")[0])), sympy.Integer(0)), B)


def _boundary_bytes(nodes: list[fx.Node]) -> tuple[sympy.Expr, sympy.Expr]:
    inside = set(nodes)
    ins: dict[fx.Node, sympy.Expr] = {}
    outs: dict[fx.Node, sympy.Expr] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            info = a.meta.get(TENSOR)
            if (a not in inside or a.op == "placeholder") and isinstance(info, TensorInfo) and a.op != "get_attr":
                ins[a] = info.nbytes
        info = n.meta.get(TENSOR)
        if isinstance(info, TensorInfo) and any(u not in inside or u.op == "output" for u in n.users):
            outs[n] = info.nbytes
    z = sympy.Integer(0)
    return sum(ins.values(), z), sum(outs.values(), z)


def attention_core(nodes: list[fx.Node], kind: Callable[[fx.Node], str] | None = None) -> set[str]:
    """The attention core, which selective recomputation redoes (Korthikanti et al. 2022): a fused
    attention kernel, or each product of two activations (Q K^T) up to the next one (scores x V).
    `kind` names a node's op (default: its priced cost's kind; the runtime, which prices nothing, passes
    passes.costs.node_kind)."""
    kind = kind or (lambda n: n.meta[COST].kind)
    chosen = {n.name for n in nodes if kind(n) == "attention"}  # a fused kernel is the whole core
    if chosen:
        return chosen
    for first, second in written_cores(nodes, kind):
        chosen.update(n.name for n in nodes[first:second + 1] if kind(n) != "none")
    return chosen


def expert_layers(root: nn.Module) -> dict[str, tuple[int, int]]:
    """Mixture-of-experts layers: {path of the module holding the experts: (experts, top-k)}. Such a module has an
    integer `num_experts` and its experts' weights stacked (first dimension E) or E expert modules; top-k is its
    parent's `top_k` or the config's `num_experts_per_tok` (0 if neither says)."""
    def holds(m: nn.Module) -> bool:
        n = getattr(m, "num_experts", None)
        return isinstance(n, int) and (any(p.dim() >= 3 and p.shape[0] == n for p in m.parameters(recurse=False))
                                       or any(isinstance(c, nn.ModuleList) and len(c) == n for c in m.children()))

    mods = dict(root.named_modules())
    config = getattr(root, "config", None)
    out = {}
    for name, m in mods.items():
        if holds(m):
            parent = mods.get(name.rsplit(".", 1)[0] if "." in name else "")
            k = getattr(parent, "top_k", None) or getattr(config, "num_experts_per_tok", None) or 0
            out[name] = (m.num_experts, int(k))
    return out


def _within(n: fx.Node, path: str) -> bool:
    module = n.meta.get(MODULE, "")
    return module == path or module.startswith(path + ".")


def _moe_nodes(nodes: list[fx.Node], layers: dict[str, tuple[int, int]],
               gm: fx.GraphModule) -> tuple[str, list[fx.Node], list[fx.Node]] | None:
    """The unit's mixture-of-experts layer: (the experts' module path, their nodes, the router's gate: the linears of
    the layer outside its experts with one output per expert); None for a unit without one."""
    path = next((p for n in nodes for p in layers if _within(n, p)), None)
    if path is None:
        return None
    layer = path.rsplit(".", 1)[0] if "." in path else ""
    inside = [n for n in nodes if n.meta[TP] == "replicated" and _within(n, path)]
    gate = [n for n in nodes if n.meta[TP] == "replicated" and _within(n, layer) and not _within(n, path)
            and (shape := linear_shape(n, gm)) is not None and shape[1] == layers[path][0]]
    return path, inside, gate


def _moe(found: tuple[str, list[fx.Node], list[fx.Node]] | None, layers: dict[str, tuple[int, int]],
         selective: set[str]) -> dict:
    """The Unit fields of its mixture-of-experts layer (`_moe_nodes`; none if it has none): the experts' nodes as a
    Part, the router's gate as another, and the bytes one dispatch moves (the hidden states entering the experts, once
    per routed expert)."""
    if found is None:
        return {}
    path, inside, gate = found
    names = {n.name for n in inside}
    entering = [i.nbytes for n in inside for a in n.all_input_nodes
                if a.name not in names and a.op != "get_attr" and isinstance(i := a.meta.get(TENSOR), TensorInfo)
                and i.dtype.is_floating_point]
    experts, k = layers[path]
    return {"experts": experts, "top_k": k, "moe": _part(inside, selective), "router": _part(gate, selective),
            "moe_dispatch_bytes": Poly.of(k * max(entering, key=lambda e: e.subs(B, 1), default=sympy.Integer(0)), B)}


def lower_units(gm: fx.GraphModule, root: nn.Module, kernels: str = "traced") -> list[Unit]:
    """Group, mark tensor-parallel roles, and lower node costs to plain `Unit`s, priced as `kernels` says
    (passes.kernels: as traced, or as Megatron-Core's fused kernels run the same ops)."""
    groups = group_nodes(gm, root)
    moe_layers = expert_layers(root)
    heads = annotate_tp_roles(gm, [nodes for _, _, nodes in groups],
                              splits=None if kernels == "megatron" else lambda n: _linear_module(n, root) is not None)
    if kernels == "megatron":
        for _, _, nodes in groups:
            fuse_kernels(nodes)
    elif kernels in ("titan", "inductor"):  # torchtitan: a written-out attention core as its own model's kernel,
        for _, kind, nodes in groups:  # and compiled, torch.compile per block (its apply_compile); the rest eager
            titan_attention(nodes)
            if kernels == "inductor" and kind == "block":
                fuse_kernels(nodes, megatron=False)
    role_of = {n.name: n.meta.get(TP, "replicated") for n in gm.graph.nodes}
    units = []
    for index, (name, kind, nodes) in enumerate(groups):
        for n in nodes:
            n.meta[UNIT] = index
        in_b, out_b = _boundary_bytes(nodes)
        elem = next((p.element_size() for p in gm.parameters()), 4)
        selective = attention_core(nodes)
        moe = _moe_nodes(nodes, moe_layers, gm)  # (its experts and router gate, or None)
        sharded = [n for n in nodes if n.meta[TP] != "replicated"]
        replicated = [n for n in nodes if n.meta[TP] == "replicated"]
        fwd_ar, bwd_ar, count = _tp_allreduces(nodes)
        mod_type = type(root.get_submodule(name)).__name__ if "+" not in name and name else kind
        split, whole = _saved_by_layout(nodes, selective, role_of)
        layout = _tp_layout(nodes, root)
        # a row-parallel linear's bias is added after the all-reduce: every tensor-parallel rank holds all of it
        row_bias = sum(b.numel() for path in {path for path, style in layout if style == "rowwise"}  # (a layer
                       for b in [root.get_submodule(path).bias] if b is not None)  # called twice: its bias once)
        sh, rep = _part(sharded, selective), _part(replicated, selective)
        sh, rep = replace(sh, params=sh.params - row_bias, **split), replace(rep, params=rep.params + row_bias, **whole)
        logits = [n for n in sharded if n.meta[TP] == "vocab-col"]
        if kernels == "megatron" and index == len(groups) - 1:  # the engine's own loss on each logits
            for lg in logits:
                ce = megatron_cross_entropy(lg.meta[TENSOR])
                sh = replace(sh, kernels=sh.kernels + ce.pop("kernels"), **{k: getattr(sh, k) + v for k, v in ce.items()})
        units.append(Unit(index=index, name=name, kind=kind, module_type=mod_type,
                          nodes=tuple(n.name for n in nodes),
                          sharded=sh, replicated=rep, param_bytes_per_param=elem,
                          input_bytes=Poly.of(in_b, B), output_bytes=Poly.of(out_b, B),
                          tp_fwd_allreduce_bytes=Poly.of(fwd_ar, B), tp_bwd_allreduce_bytes=Poly.of(bwd_ar, B),
                          tp_allreduces=count, tp_layout=layout,
                          heads=heads[index].heads, kv_heads=heads[index].kv_heads,
                          kv=_kv_part(nodes, heads[index], gm, selective), attn_kv_bytes=Poly.of(_attention_kv_bytes(nodes), B),
                          matmuls=sum(1 for n in nodes if n.meta[COST].mm_flops != 0),
                          op_checkpoint=op_checkpoint(nodes, role_of, root, compiled=kernels == "inductor",
                                                      recomputed=_titan_recomputed(moe))
                          if kind == "block" else None,
                          **_moe(moe, moe_layers, selective)))
    return units


def _titan_recomputed(found: tuple[str, list[fx.Node], list[fx.Node]] | None) -> set[str]:
    """The products of a mixture-of-experts layer torchtitan's per-op policy always recomputes, uncounted: its
    experts', which it runs as torch._grouped_mm (torchtitan/models/common/moe.py GroupedExperts), an op its save list
    does not hold, and the router's gate, whose weight shape SelectiveAC.Config.force_recompute_mm_shapes_by_fqns
    (["moe.router.gate"]) forces to recompute (torchtitan/distributed/activation_checkpoint.py, torchtitan 0.3)."""
    return set() if found is None else {n.name for n in (*found[1], *found[2]) if n.meta[COST].mm_flops != 0}


def _sac_policy(n: fx.Node, root: nn.Module) -> str:
    """What torchtitan's per-op policy does with the kernel a node dispatches (SelectiveAC._get_custom_policy, its
    save list _get_default_save_ops: torch._functorch.partitioners' compute-intensive ops and the SDPA kernels):
    "mm" for an aten.mm (the F.linear of a weight without bias, a 2-D product), which it saves or recomputes by its
    count; "save" for a kernel it always saves (the fused attention kernels, aten.addmm: a linear with a bias over a
    contiguous input; aten.bmm: a product of two batched activations; convolutions; aten.topk, a router's choice of
    experts, and aten.max, an FP8 scale's amax, both in torchtitan's own additions to the list); "" for the rest,
    recomputed."""
    c: NodeCost = n.meta[COST]
    if c.kind in ("attention", "conv") or n.target in (torch.ops.aten.topk.default, torch.ops.aten.max.default):
        return "save"
    if c.mm_flops == 0 or c.kind not in ("matmul", "linear"):
        return ""
    if c.wgrad_mm_flops != 0 or any(a.op == "get_attr" for a in n.all_input_nodes):
        if n.op == "call_module":
            bias = getattr(root.get_submodule(str(n.target)), "bias", None) is not None
        else:
            bias = (len(n.args) > 2 and n.args[2] is not None) or n.kwargs.get("bias") is not None
        return "save" if bias else "mm"
    info = n.meta.get(TENSOR)
    return "save" if isinstance(info, TensorInfo) and len(info.shape) >= 3 else "mm"


def op_checkpoint(nodes: list[fx.Node], role_of: dict[str, str], root: nn.Module,
                  compiled: bool = False, recomputed: set[str] = frozenset()) -> OpCheckpoint:
    """The block under torchtitan's per-op selective activation checkpointing: the policy saves the outputs of the
    kernels it always saves (_sac_policy) and of every aten.mm but the second, fourth, ... of the block's forward
    (its count restarts in each block's checkpoint), and recomputes every other op in the backward. The checkpoint
    keeps the block's inputs (only those that need a gradient: the others, rotary tables and masks, are the model's
    and passed to every block). A Llama block keeps its input and the outputs of wq, wv, the attention kernel (with
    its log-sum-exp), w1 and w2, and reruns wk, wo, w3, the norms, rotary embedding and SwiGLU's elementwise ops.
    The products named in `recomputed` (a MoE layer's experts and router gate: _titan_recomputed) are rerun and not
    counted. torch.distributed._tools.sac_estimator.SACEstimator measures the same policy's memory op by op.

    `compiled`: the block compiled with torch.compile (passes.kernels "inductor"), where the policy only tags the
    graph's nodes (must-save, prefer-recompute) for AOTAutograd's min-cut partitioner, which saves and reruns only
    what the backward graph reads: the outputs a backward saves (node costs' `saved`, as the fused kernels keep them)
    and what rebuilds them. An output the policy saves that no backward reads (w2's, added to the residual) is not
    kept, and what only leads to it (the block's last residual add) is not rerun; eager, the policy's cache holds
    every saved output until the rerun pops it (torch/utils/checkpoint.py _CachingTorchDispatchMode)."""
    inside = {n.name for n in nodes}
    kept: dict[str, sympy.Expr] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            info = a.meta.get(TENSOR)
            if (a.name not in inside or a.op == "placeholder") and a.op != "get_attr" and isinstance(info, TensorInfo) \
                    and info.requires_grad:
                kept[storage_of(a).name] = info.nbytes
    redo, count, saves = [], 0, set()
    for n in nodes:
        policy = "" if n.name in recomputed else _sac_policy(n, root)
        count += policy == "mm"
        if policy == "save" or policy == "mm" and count % 2:
            saves.add(n.name)
    read = _backward_reads(nodes, saves) if compiled else inside
    for n in nodes:
        if n.name in saves:
            if n.name not in read:  # (compiled: no backward reads it)
                continue
            c: NodeCost = n.meta[COST]
            own = [(k, v) for k, v in c.saved if k.split(".")[0] == n.name]  # the kernel's own outputs it saved
            kept.update(own if c.kind == "attention" and own else [(n.name, c.out_bytes)])
        elif n.name in read:
            redo.append(n)
    split = lambda name: role_of.get(name, "replicated") in SPLIT_OUTPUTS  # noqa: E731
    return OpCheckpoint(kept_sharded=_tensor_bytes(kept, split), kept=_tensor_bytes(kept, lambda k: not split(k)),
                        redo_sharded=_part([n for n in redo if n.meta[TP] != "replicated"], set()),
                        redo=_part([n for n in redo if n.meta[TP] == "replicated"], set()))


def _backward_reads(nodes: list[fx.Node], saves: set[str]) -> set[str]:
    """The block's nodes whose outputs a compiled backward reads: those some node saves for its backward (its cost's
    `saved`, by the producing node's name) and, for one the policy does not save, what the rerun needs to rebuild it,
    back to the saved outputs and the block's inputs."""
    by_name = {n.name: n for n in nodes}
    todo = [name.split(".")[0] for n in nodes for name, _ in n.meta[COST].saved]
    read: set[str] = set()
    while todo:
        name = todo.pop()
        if name in read or name not in by_name:
            continue
        read.add(name)
        if name not in saves:
            todo += [a.name for a in by_name[name].all_input_nodes]
    return read


def _attention_kv_bytes(nodes: list[fx.Node]) -> sympy.Expr:
    """Bytes of the keys and values the unit's attention reads: inputs 1 and 2 of a fused kernel, or the
    second operand of each product of two activations (K^T in Q K^T, V in P V)."""
    total = sympy.Integer(0)
    for n in nodes:
        kind = n.meta[COST].kind
        if kind == "attention":  # the grouped keys/values a repeat copied them from, where the engine reads those
            operands = [n.meta.get(KV_SOURCE, {}).get(i, a) for i, a in attention_operands(n).items() if i in (1, 2)]
        elif kind == "matmul" and len(n.all_input_nodes) == 2 and all(a.op != "get_attr" for a in n.all_input_nodes):
            operands = n.all_input_nodes[1:2]
        else:
            continue
        total += sum((a.meta[TENSOR].nbytes for a in operands if isinstance(a.meta.get(TENSOR), TensorInfo)),
                     sympy.Integer(0))
    return total


def _kv_part(nodes: list[fx.Node], heads: Heads, gm: fx.GraphModule, core: set[str]) -> Part:
    """Time and weights of the key/value projections of grouped-query attention, for pricing them replicated
    when t exceeds kv_heads; its saved_bytes are what the backward keeps of the keys and values on their way to
    the attention core (counted in the sharded part as split over t; a rank holding a whole replicated kv head
    keeps 1/kv_heads of them), its wgrad_bytes the gradients of the projections' outputs, kept so until their W."""
    if not heads.kv_width or heads.kv_heads >= heads.heads:
        return Part()
    kv = [n for n in nodes if n.meta[TP] == "col" and (linear_shape(n, gm) or (0, 0))[1] == heads.kv_width]
    reach = {n.name for n in kv}
    for n in nodes:  # keys and values (views, RoPE) up to the core
        if n.name not in core and any(a.name in reach for a in n.all_input_nodes):
            reach.add(n.name)
    saved = {k: v for n in nodes for k, v in n.meta[COST].saved}
    return replace(_part(kv, set()), saved_bytes=_tensor_bytes(saved, reach.__contains__),
                   wgrad_bytes=_tensor_bytes(_wgrad_tensors(kv), reach.__contains__), selective_bytes=Poly())


def _linear_module(n: fx.Node, root: nn.Module) -> str | None:
    """The path of the nn.Linear whose product `n` is (a call of the module, or an exported graph's linear
    inside it), or None (a weight used elsewhere: an nn.MultiheadAttention's packed in_proj_weight)."""
    if n.op not in ("call_module", "call_function"):
        return None
    path = str(n.target) if n.op == "call_module" else n.meta.get(MODULE, "")
    try:
        return path if path and isinstance(root.get_submodule(path), nn.Linear) else None
    except AttributeError:
        return None


def _tp_layout(nodes: list[fx.Node], root: nn.Module) -> tuple[tuple[str, str], ...]:
    """Megatron pairs as torch.distributed.tensor.parallel styles, for the runtime; and the vocabulary split: an
    embedding whose weight is split by vocabulary rows ("vocab", Megatron's VocabParallelEmbedding: every use of that
    weight is split so, a head tied to it included) and an nn.Linear LM head split by its output features
    ("vocab_colwise", Megatron's ColumnParallelLinear output layer, its logits gathered for the file's loss_fn)."""
    styles = {"col": "colwise", "row": "rowwise"}
    out = []
    for n in nodes:
        role = n.meta[TP]
        if role in styles and (path := _linear_module(n, root)) is not None:
            out.append((path, styles[role]))
        elif role == "vocab-emb" and (path := _embedding_module(n, root)) is not None:
            out.append((path, "vocab"))
        elif role == "vocab-col":
            if (path := _linear_module(n, root)) is not None:
                out.append((path, "vocab_colwise"))
            elif (path := _weight_owner(n.args[1] if len(n.args) > 1 else None, root, nn.Embedding)) is not None:
                out.append((path, "vocab"))  # F.linear(h, embedding.weight): a head tied to the embedding
    return tuple(out)


def _weight_owner(node: object, root: nn.Module, kind: type) -> str | None:
    """The path of the `kind` module whose .weight a get_attr node reads, or None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or not str(node.target).endswith(".weight"):
        return None
    path = str(node.target)[:-len(".weight")]
    try:
        return path if isinstance(root.get_submodule(path), kind) else None
    except AttributeError:
        return None


def _embedding_module(n: fx.Node, root: nn.Module) -> str | None:
    """The path of the nn.Embedding a lookup reads (a call of the module, or an exported graph's embedding op or
    F.embedding reading its weight), or None."""
    if n.op == "call_module":
        path = str(n.target)
        return path if isinstance(root.get_submodule(path), nn.Embedding) else None
    if n.op != "call_function" or not n.args:
        return None
    path = n.meta.get(MODULE, "")  # an exported graph's op, inside the module that made it
    try:
        if path and isinstance(root.get_submodule(path), nn.Embedding):
            return path
    except AttributeError:
        pass
    return _weight_owner(embedding_weight(n), root, nn.Embedding)


def embedding_weight(n: fx.Node) -> object:
    """The weight argument of an embedding op: aten.embedding(weight, ids, ...), F.embedding(ids, weight, ...)."""
    if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return n.args[0] if n.args else n.kwargs.get("weight")
    return n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")


def _tp_allreduces(nodes: list[fx.Node]) -> tuple[sympy.Expr, sympy.Expr, int]:
    """All-reduce bytes (forward, backward) and count that tensor parallelism adds to a unit."""
    z = sympy.Integer(0)
    fwd, count = z, 0
    grads: dict[str, sympy.Expr] = {}  # column-parallel linears reading one input (q, k, v) share its all-reduce
    for n in nodes:
        role = n.meta[TP]
        if role in ("row", "vocab-emb"):
            fwd += n.meta[TENSOR].nbytes
            count += 1
        act = activation_input(n) if role in ("col", "vocab-col") else None
        if act is not None and isinstance(act.meta.get(TENSOR), TensorInfo):
            grads[storage_of(act).name] = act.meta[TENSOR].nbytes
    return fwd, sum(grads.values(), z), count
