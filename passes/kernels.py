"""Price a unit as an engine's kernels run it, not op by op as the model file writes it.

Megatron-Core with Transformer Engine runs a transformer layer as a handful of fused kernels: one normalization
kernel (input read once, output written once; the backward keeps the input and a per-row fp32 statistic), one
SwiGLU / bias-GeLU kernel, a fused rotary embedding, a fused bias-dropout-add, a flash attention kernel that reads
grouped keys and values as they are (no repeated copy), and its own vocabulary-parallel cross-entropy. A model file
that writes RMSNorm as pow / mean / rsqrt / mul, SwiGLU as silu and mul, and grouped-query attention with
`repeat_interleave` (or Hugging Face's expand + reshape) keeps about 1.45x the activations and moves several times
the elementwise bytes of the same layer in Megatron-Core. `fuse_kernels` rewrites the priced node costs of one unit
so the same model, however written, is priced as the engine runs it:

- **Fused regions.** Elementwise, normalization and layout nodes connected to one another with no matrix product,
  attention or gather between them form one kernel (the same rule an epilogue-fusing compiler applies: a region is
  closed, no path leaves it and comes back). The kernel reads the region's inputs once and writes its outputs
  once; its backward moves twice that, as every op's backward does in passes.costs. What it keeps for the
  backward: the tensors the ops saved that exist outside the kernel anyway (its inputs, its outputs), the small
  ones it computes (a norm's per-row statistic, a dropout mask), and in place of a full-size intermediate (a norm's
  fp32 copy, SwiGLU's silu output) the region inputs it is computed from, which is what the fused kernels keep.
- **Layout copies** (`contiguous`, a reshape of a transposed tensor) between kernels are folded into them.
- **Grouped keys and values** repeated for the attention kernel are read at their grouped size (the flash kernel
  takes the kv heads as they are): the copies cost nothing and the kernel keeps, and context parallelism's ring
  passes, the grouped tensors (node.meta[KV_SOURCE]).
- **Mixture of experts.** Tokens repeated once per chosen expert are Megatron's permute kernel, never part of the
  norm before it (so the norm keeps what a norm keeps, not an fp32 copy at the routed size); an expert's output
  scaled by its routing probability keeps the probability only, as Megatron-Core's weighted SwiGLU applies it
  before fc2 (`_weighted_products`): per routed token fc1's input and output and fc2's input, as TEGroupedMLP keeps.

FLOPs are unchanged (a fused kernel does the same arithmetic). `megatron_cross_entropy` is the loss Megatron runs
in place of the model file's `loss_fn`.

torch.compile's Inductor (kernels "inductor": torchtitan's --compile.enable, which compiles each TransformerBlock on
its own) fuses by the same rule: its scheduler merges the pointwise and reduction nodes that read and write the same
buffers into one Triton kernel (torch/_inductor/scheduler.py fuse_nodes / can_fuse), and without max-autotune fuses
nothing into a matrix product (torch/_inductor/kernel/mm.py tuned_mm: the extern cuBLAS kernel) or into the flash
attention kernel (a fallback kernel). So the fused regions and what they keep are priced as above; what is
Megatron's alone is not applied: no grouped keys and values (SDPA reads them as the model file passes them: repeated
where it repeats them, grouped where it passes enable_gqa), no weighted SwiGLU, and the model file's own loss. The
blocks are fused only: the embedding, final norm, output projection and loss run eagerly, as traced.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import sympy
import torch.fx as fx

from .costs import LIKE, NodeCost, node_kind, storage_of
from .measure import attended_fraction
from .meta_keys import COST, MEASURED, TENSOR, TP
from .poly import Poly
from .shapes import B, TensorInfo

__all__ = ["KERNELS", "KV_SOURCE", "OPERANDS", "SHARED_INPUT", "fuse_kernels", "megatron_cross_entropy", "operands",
           "titan_attention", "written_attention", "written_cores"]

KERNELS = ("traced", "titan", "megatron", "inductor")
"""How units are priced (passes.pipeline.analyze's `kernels`; planner.engines says each engine's): "traced", op by op
as the model file writes them; "titan", as torchtitan runs them eagerly: op by op but for an attention core the file
writes out, which torchtitan's own model runs as one fused kernel (`titan_attention`); "megatron", as Megatron-Core
with Transformer Engine runs them (`fuse_kernels`, and `megatron_cross_entropy` in place of the file's loss_fn);
"inductor", as torchtitan runs them compiled: the blocks as torch.compile runs each (`fuse_kernels(...,
megatron=False)`), the rest as "titan"."""
KV_SOURCE = "fxp.kv_source"  # on an attention node: {operand index: the grouped tensor a repeat copied it from}
SHARED_INPUT = "fxp.shared_input"  # on a weight product: an earlier product of the unit reads the same input X
OPERANDS = "fxp.operands"  # on an attention core the file writes out, priced as the fused kernel: {0: q, 1: k, 2: v}

FUSED = {"elementwise", "norm", "view", "none"}  # priced kinds a fused kernel absorbs
LAYOUT = {"view", "reshape", "permute", "transpose", "contiguous", "flatten", "unflatten", "squeeze", "unsqueeze",
          "expand", "t", "alias", "getitem", "slice", "select", "chunk", "split", "unbind", "detach", "to",
          "type_as", "repeat_interleave", "repeat", "clone", "view_as_complex",
          "view_as_real"}  # ops that only move or relabel elements
SHAPING = {"cat", "stack", "pad", "constant_pad_nd", "roll", "flip", "tril", "triu", "arange", "zeros", "ones",
           "full", "empty", "new_zeros", "new_ones", "zeros_like", "ones_like", "full_like", "empty_like", "size",
           "sym_size", "getattr", "float", "half", "bfloat16", "assert_tensor_metadata", "lift_fresh_copy",
           "scalar_tensor", "sym_numel"}  # other ops priced as views that an elementwise kernel computes in place
ZERO = sympy.Integer(0)


def _info(n: fx.Node) -> TensorInfo | None:
    info = n.meta.get(TENSOR)
    return info if isinstance(info, TensorInfo) else None


def _size(e: sympy.Expr) -> float:
    return float(sympy.sympify(e).subs(B, 1))


def operands(attention: fx.Node) -> dict[int, fx.Node]:
    """{0: query, 1: key, 2: value} of a fused attention node: its inputs, or (an attention core the file writes out,
    which the engine runs fused: `written_attention`) the operands of its two products."""
    return attention.meta.get(OPERANDS) or dict(list(enumerate(attention.all_input_nodes))[:3])


def _repeats(attention: fx.Node) -> dict[int, tuple[list[fx.Node], fx.Node]]:
    """{operand index: (the layout nodes between the grouped tensor and the operand, the grouped tensor)} for the
    key and value operands of a fused attention node that a repeat made bigger than what it was made from."""
    gm = attention.graph.owning_module
    out = {}
    for i, operand in ((i, x) for i, x in operands(attention).items() if i in (1, 2)):
        chain, x = [], operand
        while x.op in ("call_function", "call_method") and node_kind(x, gm) in LAYOUT:
            srcs = [a for a in x.all_input_nodes if _info(a) is not None]
            if len(srcs) != 1 or len(x.users) != 1 and x is not operand:
                break
            chain.append(x)
            x = srcs[0]
        if _info(operand) is None or _info(x) is None or _size(_info(x).numel) >= _size(_info(operand).numel):
            continue
        out[i] = (chain, x)
    return out


def _grouped_attention(nodes: list[fx.Node]) -> set[str]:
    """Read repeated keys/values at their grouped size (see the module docstring); returns the repeat nodes."""
    freed: set[str] = set()
    for n in nodes:
        cost: NodeCost = n.meta[COST]
        if cost.kind != "attention" or not (reps := _repeats(n)):
            continue
        swap = {storage_of(c).name: x for chain, x in reps.values() for c in chain}
        saved = {}
        for name, by in cost.saved:
            x = swap.get(name.split(".")[0])
            saved[storage_of(x).name if x is not None else name] = _info(x).nbytes if x is not None else by
        less = sum((_info(operands(n)[i]).nbytes - _info(x).nbytes for i, (_, x) in reps.items()), ZERO)
        n.meta[COST] = replace(cost, saved=tuple(saved.items()), fwd_bytes=cost.fwd_bytes - less,
                               bwd_bytes=cost.bwd_bytes - 2 * less)
        n.meta[KV_SOURCE] = {i: x for i, (_, x) in reps.items()}
        for chain, _ in reps.values():
            freed.update(c.name for c in chain)
    return freed


def _reads(n: fx.Node) -> list[fx.Node]:
    """The nodes whose elements `n` reads: not the tensor whose dtype or shape `x.type_as(other)` and the like take."""
    if node_kind(n, n.graph.owning_module) in LIKE and \
            isinstance(n.args[0], fx.Node):
        return [n.args[0]]
    return n.all_input_nodes


def _casts(n: fx.Node) -> bool:
    """Whether the node's output has another dtype than what it reads (a cast, a complex view of reals)."""
    out = _info(n)
    return out is not None and any((i := _info(a)) is not None and i.dtype != out.dtype for a in _reads(n))


def _complex(n: fx.Node) -> bool:
    """Whether the node reads or writes a complex tensor."""
    return any((i := _info(x)) is not None and i.dtype.is_complex for x in (n, *n.all_input_nodes))


def _gathers(n: fx.Node) -> bool:
    """A view-priced node that gathers rows by a tensor of indices (token routing, experts' weights per token): its
    own kernel (or read in place by a grouped GEMM), never the body of an elementwise one."""
    if n.meta[COST].kind not in ("view", "none"):
        return False
    if (m := n.meta.get(MEASURED)) is not None and m.weight_gather:
        return True
    kind = node_kind(n, n.graph.owning_module)
    if kind not in LAYOUT | SHAPING:
        return True
    if kind in ("repeat_interleave", "repeat") and (out := _info(n)) is not None and \
            any((i := _info(a)) is not None and _size(out.numel) > _size(i.numel) for a in n.all_input_nodes):
        return True  # tokens copied once per chosen expert: Megatron's permute kernel, not a norm's epilogue
    indices = [x for a in n.args[1:] for x in (a if isinstance(a, (list, tuple)) else (a,))]
    return any(isinstance(x, fx.Node) and _info(x) is not None for x in indices)


def _regions(nodes: list[fx.Node], fusable: set[str], closing: set[str] = frozenset()) -> list[list[fx.Node]]:
    """Closed regions of fusable nodes: connected, and at one level, a node's level being the most matrix products
    or other kernels on a path to it (a path that leaves a region through a kernel and comes back would arrive a
    level higher). A `closing` node ends its region: its users start another kernel."""
    level: dict[str, int] = {}
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in nodes:
        level[n.name] = max((level[a.name] + (a.name not in fusable and a.op not in ("get_attr", "placeholder"))
                             for a in n.all_input_nodes if a.name in level), default=0)
        if n.name in fusable:
            parent[n.name] = n.name
            for a in n.all_input_nodes:
                if a.name in fusable and a.name not in closing and level[a.name] == level[n.name]:
                    parent[root(a.name)] = root(n.name)
    regions: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.name in fusable:
            regions.setdefault(root(n.name), []).append(n)
    return list(regions.values())


def _fuse(region: list[fx.Node]) -> None:
    """Price the region as one kernel on its first computing node; the others cost nothing (see the docstring)."""
    gm = region[0].graph.owning_module
    inside = {n.name for n in region}
    costs = [n.meta[COST] for n in region]
    compute = [n for n, c in zip(region, costs) if c.kind in ("elementwise", "norm")]
    if not compute:  # layout only: folded into the kernels around it, unless it gathers or concatenates
        if all(node_kind(n, gm) in LAYOUT for n in region):
            for n, c in zip(region, costs):
                n.meta[COST] = replace(c, fwd_bytes=ZERO, bwd_bytes=ZERO)
        return
    if len({n.meta.get(TP) for n in compute}) > 1:
        return  # a region across tensor-parallel layouts is left as traced
    external: dict[str, fx.Node] = {a.name: a for n in region for a in _reads(n)
                                    if a.name not in inside and _info(a) is not None}  # the region's inputs
    aliased: set[str] = set()  # region nodes that only relabel a region input (no bytes written)
    for n in region:  # (a cast to another dtype is computed: it writes its output where it leaves the kernel)
        if node_kind(n, gm) in LAYOUT and all(a.name not in inside or a.name in aliased for a in _reads(n)) \
                and not _casts(n):
            aliased.add(n.name)
    outputs = [n for n in region if n.name not in aliased and _info(n) is not None
               and any(u.name not in inside or u.op == "output" for u in n.users)]
    written = {storage_of(n).name for n in outputs}
    # region node -> {tensor: bytes} of what the backward can recompute it from: the nearest tensors that exist
    # outside the kernel (the region's outputs it writes, its inputs needing a gradient)
    sources: dict[str, dict[str, sympy.Expr]] = {}
    for n in region:
        if n.name in written:
            sources[n.name] = {n.name: _info(n).nbytes}
            continue
        sources[n.name] = {}
        for a in n.all_input_nodes:
            if a.name in inside:
                sources[n.name].update(sources[a.name])
            elif a.name in external and _info(a).requires_grad and a.op != "get_attr":
                sources[n.name][storage_of(a).name] = _info(a).nbytes
    # full size: the largest tensor the kernel computes (a view of one of its inputs, SwiGLU's gate|up halves of
    # the fc1 output, is not computed here)
    largest = max((_size(i.numel) for n in region if n.name not in aliased and (i := _info(n)) is not None),
                  default=0.0)
    by_name = {n.name: n for n in region}
    saved: dict[str, sympy.Expr] = {}
    masks = ZERO  # what a dropout saves is its mask (however measured or named): the kernel writes and keeps it
    for n, c in zip(region, costs):
        dropout = node_kind(n, gm) == "dropout"
        for name, by in c.saved:
            src = by_name.get(name.split(".")[0])
            info = _info(src) if src is not None else None
            if dropout:
                saved[name], masks = by, masks + by
            elif src is not None and info is not None and name not in written and not name.endswith(".mask") \
                    and _size(info.numel) >= largest:  # a full-size intermediate: the kernel keeps its sources
                saved.update(sources[src.name])
            elif src is None and name in external:  # a region input, at its own size (not a copy's)
                saved[name] = _info(external[name]).nbytes
            else:
                saved[name] = by
    moved = sum((_info(a).nbytes for a in external.values()), ZERO) + sum((_info(n).nbytes for n in outputs), ZERO) \
        + masks
    head = compute[0]
    total = lambda field: sum((getattr(c, field) for c in costs), ZERO)  # noqa: E731
    for n, c in zip(region, costs):
        n.meta[COST] = (replace(c, kind="norm" if any(x.kind == "norm" for x in costs) else "elementwise",
                                fwd_flops=total("fwd_flops"), bwd_flops=total("bwd_flops"),
                                wgrad_flops=total("wgrad_flops"), fwd_bytes=moved, bwd_bytes=2 * moved,
                                saved=tuple(saved.items()))
                        if n is head else
                        replace(c, kind="view", fwd_flops=ZERO, bwd_flops=ZERO, wgrad_flops=ZERO, fwd_bytes=ZERO,
                                bwd_bytes=ZERO, saved=()))


def _weighted_products(nodes: list[fx.Node]) -> None:
    """A product's output scaled by a per-row weight that needs a gradient (an expert's output by its token's
    routing probability, as Hugging Face's MoE blocks write it): Megatron-Core applies the probability inside its
    weighted SwiGLU before fc2 instead (TEGroupedMLP with weighted_bias_swiglu_impl, which keeps fc1's output and the
    probabilities), so the scale's backward keeps the small weights, not the product's output."""
    def gemm(x: fx.Node) -> bool:  # a matrix product's output, through its views
        return storage_of(x).meta[COST].kind in ("matmul", "linear")

    for n in nodes:
        cost: NodeCost = n.meta[COST]
        if cost.kind != "elementwise" or node_kind(n, n.graph.owning_module) != "mul" or len(n.all_input_nodes) != 2:
            continue
        a, w = n.all_input_nodes
        if not gemm(a):
            a, w = w, a
        if not gemm(a) or _info(a) is None or _info(w) is None or not _info(w).requires_grad \
                or _size(_info(w).numel) * 64 > _size(_info(a).numel):
            continue
        product = storage_of(a).name
        n.meta[COST] = replace(cost, saved=tuple((k, v) for k, v in cost.saved if k.split(".")[0] != product))


def _windowed(attention: fx.Node) -> None:
    """A fused causal attention kernel over its module's sliding window (Measured.window): its FLOPs the share of
    the full score matrix the window's queries read (passes.measure.attended_fraction), as FlashAttention's and
    cuDNN's window_size skip the blocks outside it."""
    m, cost, q = attention.meta.get(MEASURED), attention.meta[COST], _info(operands(attention)[0])
    if m is None or not m.window or q is None or not q.shape[-2].is_number or cost.mm_flops == 0:
        return
    flops = m.full_flops * attended_fraction(int(q.shape[-2]), m.window)
    attention.meta[COST] = replace(cost, fwd_flops=cost.fwd_flops - cost.mm_flops + flops, mm_flops=flops,
                                   bwd_flops=cost.bwd_flops * flops / cost.mm_flops)


def written_cores(nodes: list[fx.Node], kind: Callable[[fx.Node], str] | None = None) -> list[tuple[int, int]]:
    """(first, last) indices in `nodes` of each attention core written out as products of two activations: a
    product (Q K^T) up to the next one (scores x V); a product whose operand is a weight gathered per token (grouped
    experts) is none. `kind` names a node's op (default: its priced cost's kind)."""
    kind = kind or (lambda n: n.meta[COST].kind)
    products = [i for i, n in enumerate(nodes) if kind(n) == "matmul"
                and all(a.op != "get_attr" for a in n.all_input_nodes)
                and not (COST in n.meta and n.meta[COST].wgrad_mm_flops != 0)]
    return list(zip(products[::2], products[1::2]))


def written_attention(nodes: list[fx.Node]) -> None:
    """An attention core the model file writes out in a causal attention module (Hugging Face's eager attention:
    Q K^T, scaled, the mask added, gpt-oss's sinks concatenated to the scores, softmax, P V), run by Megatron-Core
    as one fused kernel (Transformer Engine's DotProductAttention: FlashAttention or cuDNN, the sinks as its
    learnable softmax offset, a sliding window as its window_size): priced on the P V node as that kernel, the two
    products' FLOPs over the causal (or windowed) share of the scores, reading q, k and v and writing the output,
    keeping those and the log-sum-exp (4 bytes per query row) for its backward, not the s x s probabilities; the
    rest of the core costs nothing. torchtitan runs such a model as its own, whose attention is one fused kernel too
    (gpt-oss: torch's varlen FlashAttention with the layer's window, the sinks a rescale of its output by the
    log-sum-exp: torchtitan/models/gpt_oss/model.py), priced the same way ("titan", "inductor")."""
    gm = nodes[0].graph.owning_module if nodes else None
    for first, second in written_cores(nodes):
        core, qk, pv = nodes[first:second + 1], nodes[first], nodes[second]
        m = qk.meta.get(MEASURED)
        q, k, v, out = qk.all_input_nodes[0], qk.all_input_nodes[1], pv.all_input_nodes[1], pv
        if m is None or not m.in_causal or not any(node_kind(n, gm) in ("softmax", "log_softmax") for n in core) \
                or any(_info(x) is None for x in (q, k, v, out)) or not _info(q).shape[-2].is_number:
            continue
        full = sum((n.meta[COST].mm_flops for n in (qk, pv)), ZERO)
        flops = full * attended_fraction(int(_info(q).shape[-2]), m.window)
        lse = _info(out).numel / _info(out).shape[-1] * 4
        moved = sum((_info(x).nbytes for x in (q, k, v, out)), ZERO)
        saved = {storage_of(x).name: _info(x).nbytes for x in (q, k, v)}
        saved.update({out.name: _info(out).nbytes, f"{out.name}.lse": lse})
        for n in core:
            n.meta[COST] = replace(n.meta[COST], kind="view", fwd_flops=ZERO, bwd_flops=ZERO, mm_flops=ZERO,
                                   full_mm_flops=ZERO, fwd_bytes=ZERO, bwd_bytes=ZERO, saved=(), copy_bytes=ZERO)
        pv.meta[COST] = replace(pv.meta[COST], kind="attention", fwd_flops=flops, mm_flops=flops,
                                full_mm_flops=full, bwd_flops=flops * sympy.Rational(5, 2), fwd_bytes=moved,
                                bwd_bytes=2 * moved, out_bytes=_info(out).nbytes, saved=tuple(saved.items()))
        pv.meta[OPERANDS] = {0: q, 1: k, 2: v}


def _free(nodes: list[fx.Node], freed: set[str]) -> set[str]:
    """Price the named nodes (the repeats a kernel reading grouped keys and values does without) as views."""
    for n in nodes:
        if n.name in freed:
            n.meta[COST] = replace(n.meta[COST], kind="view", fwd_bytes=ZERO, bwd_bytes=ZERO)
    return freed


def titan_attention(nodes: list[fx.Node]) -> None:
    """A written-out attention core as torchtitan's own model runs it (`written_attention`), its kernel reading the
    grouped keys and values as they are (torch's varlen FlashAttention and FlexAttention take grouped-query attention
    without repeats): the repeats that fed the core cost nothing. Other attention stays as the file calls it."""
    written_attention(nodes)
    _free(nodes, _grouped_attention([n for n in nodes if OPERANDS in n.meta]))


def fuse_kernels(nodes: list[fx.Node], megatron: bool = True) -> None:
    """Rewrite the priced costs (node.meta[COST]) of one unit's nodes as Megatron-Core with Transformer Engine runs
    them, or (not `megatron`) as torch.compile's Inductor does: the fused regions without Megatron's grouped keys and
    values and weighted SwiGLU (module docstring). Needs the tensor-parallel roles (passes.tp) written."""
    freed: set[str] = set()
    if megatron:
        _weighted_products(nodes)
        written_attention(nodes)
        for n in nodes:  # a sliding window as its window (the written-out cores have theirs already)
            if n.meta[COST].kind == "attention" and OPERANDS not in n.meta:
                _windowed(n)
        freed = _free(nodes, _grouped_attention(nodes))
    fusable = {n.name for n in nodes if n.op in ("call_function", "call_method", "call_module")
               and n.name not in freed and n.meta[COST].kind in FUSED and not _gathers(n)
               and (megatron or not _complex(n))}  # Inductor generates no code for complex tensors: each such op
    # is its own (ATen) kernel, and what it reads is written out for it (torch/_inductor/lowering.py,
    # unsupported_input_tensor: "Torchinductor does not support code generation for complex operators")
    gm = nodes[0].graph.owning_module if nodes else None
    softmax = {n.name for n in nodes if n.name in fusable and node_kind(n, gm) in ("softmax", "log_softmax")}
    for region in _regions(nodes, fusable, softmax):
        _fuse(region)
    if not megatron:  # one compiled graph: AOTAutograd's CSE merges the identical FP8 casts of one input
        # (costmodels.fp8 Fp8Recipe.activation_casts), e.g. wq, wk and wv's, w1 and w3's
        seen: set[str] = set()
        for n in nodes:
            cost = n.meta[COST]
            if cost.wgrad_mm_flops != 0 and cost.saved:
                names = {name for name, _ in cost.saved}
                n.meta[SHARED_INPUT] = names <= seen
                seen |= names


def megatron_cross_entropy(logits: TensorInfo) -> dict[str, Poly]:
    """Megatron-Core's vocabulary-parallel cross-entropy over a rank's shard of the logits (its default, without
    --cross-entropy-loss-fusion; tensor_parallel/cross_entropy.py): the logits cast to fp32 (read 2 B, write 4 B per
    element), the maximum (read 4), subtracted in place (8), exponentiated in place (8), summed (4) and divided in
    place (8): the softmax it keeps for the backward, 4 B per element. The backward scales it by the incoming
    gradient in place (8) and casts the result back to bf16 (6). About 6 FLOPs per element forward, 3 backward.
    Returned as the Part fields it adds to the logits' (vocabulary-parallel) part."""
    n = logits.numel
    p = lambda e: Poly.of(e, B)  # noqa: E731
    return {"fwd_bytes": p(38 * n), "bwd_bytes": p(14 * n), "fwd_flops": p(6 * n), "bwd_flops": p(3 * n),
            "saved_bytes": p(4 * n), "kernels": 7}
