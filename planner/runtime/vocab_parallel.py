"""The vocabulary split over the tensor-parallel ranks as Megatron-LM runs it (megatron/core/tensor_parallel/layers.py).

The plan prices an embedding of at least VOCAB_MIN rows (passes/tp.py) split by vocabulary rows and an LM head split
by its vocabulary outputs, each rank holding 1/t of their weights; the plan's partition names them ("vocab": an
embedding, "vocab_colwise": an nn.Linear head). Each tensor-parallel rank r keeps rows [r V/t, (r+1) V/t) of such a
weight (a vocabulary that t does not divide is padded with zero rows to the next multiple of t, as Megatron pads it
to make_vocab_size_divisible_by x t: the padded rows are never looked up and their logits are dropped, so they get
no gradient and stay zero), and every use of the weight is split so:

- a lookup (an nn.Embedding, F.embedding or an exported graph's aten.embedding) is Megatron's VocabParallelEmbedding:
  ids outside the rank's rows are masked, their outputs zeroed, and the output all-reduced over the group (identity
  backward); it leaves the lookup whole, so what reads it (a sequence-parallel region scattering it) is unchanged;
- a product (the LM head: an nn.Linear, F.linear with the weight of an embedding it is tied to, an exported graph's
  aten.linear) is a ColumnParallelLinear: its input enters through Megatron's f (identity; all-reduce of the input
  gradient), or, read sequence-parallel, is all-gathered along the sequence for the product and its gradient leaves
  reduce-scattered; its logits are all-gathered along the vocabulary (Megatron's gather_from_tensor_model_parallel_
  region: all-gather forward, this rank's slice backward) before they leave the model, since the model file's loss_fn
  reads the whole logits.

A tied embedding and head share the one shard. The weight's uses are found in the stage pieces after Megatron's layout
(planner.runtime.megatron_tp) rewrote them: a head read sequence-parallel has become a gathered linear there. A use
of the weight other than these (an op reading it whole) refuses the plan, at plan time too.

Against the pricing (passes/units.py, costmodels/compute.py): the weights, the head's FLOPs and the lookup's forward
all-reduce and the head's input-gradient all-reduce are the plan's; its logits are priced left split over t (as
Megatron's vocabulary-parallel cross-entropy reads them), so the forward all-gather of b x s x V logits here, and the
model file's loss on the whole logits on every rank, are not priced. Under sequence parallelism the lookup all-reduces
and the layout then keeps this rank's part of the sequence, where Megatron reduce-scatters (priced so).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.costs import node_kind
from passes.units import embedding_weight
from passes.sharding.vocab import VOCAB_STYLES, vocab_use

from .megatron_tp import (_CopyToTP, _GatheredLinear, _GatheredLinearOp, _GatheredReplicatedLinear, _ReduceFromTP,
                          _gather, swap)

__all__ = ["VocabParallelEmbedding", "VocabParallelLinear", "vocab_rows", "split_vocab"]


def vocab_rows(vocab: int, t: int, rank: int) -> tuple[int, int]:
    """(first row, rows per rank) of tensor-parallel rank `rank`: V padded to a multiple of t, in equal blocks."""
    per = -(-vocab // t)
    return rank * per, per


class _GatherVocab(torch.autograd.Function):
    """Megatron's gather_from_tensor_model_parallel_region along the last dim: all-gather forward, this rank's slice of
    the gradient backward; a padded vocabulary's padding dropped from the whole."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, vocab: int, group: Any) -> torch.Tensor:
        ctx.group, ctx.per = group, x.shape[-1]
        return _gather(x, x.dim() - 1, group).narrow(-1, 0, vocab)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = dist.get_rank(ctx.group) * ctx.per
        local = grad.narrow(-1, start, max(0, min(ctx.per, grad.shape[-1] - start)))
        if local.shape[-1] < ctx.per:  # the padded rows' logits: no gradient
            local = F.pad(local, (0, ctx.per - local.shape[-1]))
        return local.contiguous(), None, None


def _lookup(ids: torch.Tensor, weight: torch.Tensor, start: int, padding_idx: int | None, group: Any) -> torch.Tensor:
    """Megatron's VocabParallelEmbedding.forward: this rank's rows, the other ids' outputs zeroed, summed over the
    group (all-reduce forward, identity backward)."""
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < weight.shape[0] else None
    out = F.embedding(local, weight, pad).masked_fill(outside.unsqueeze(-1), 0)
    return _ReduceFromTP.apply(out, group)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, vocab: int, seq_dim: int | None,
             group: Any) -> torch.Tensor:
    """Megatron's ColumnParallelLinear over the vocabulary, its logits gathered."""
    if seq_dim is None:
        out = F.linear(_CopyToTP.apply(x, group), weight, bias)
    else:  # the input holds 1/t of the sequence: gathered for the product, its gradient reduce-scattered
        out = _GatheredLinear.apply(x, weight, bias, seq_dim, group, False)
    return _GatherVocab.apply(out, vocab, group)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of an nn.Embedding's weight (Megatron's VocabParallelEmbedding)."""

    def __init__(self, weight: nn.Parameter, start: int, padding_idx: int | None, group: Any) -> None:
        super().__init__()
        self.weight, self.start, self.padding_idx, self.group = weight, start, padding_idx, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _lookup(ids, self.weight, self.start, self.padding_idx, self.group)


class _LookupOp(nn.Module):
    """An embedding op reading this rank's rows as an input (an exported graph's aten.embedding, F.embedding)."""

    def __init__(self, start: int, padding_idx: int | None, group: Any) -> None:
        super().__init__()
        self.start, self.padding_idx, self.group = start, padding_idx, group

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _lookup(ids, weight, self.start, self.padding_idx, self.group)


class VocabParallelLinear(nn.Module):
    """This rank's output rows of an LM head (column-parallel over the vocabulary), its logits gathered whole;
    `seq_dim`: its input holds 1/t of the sequence along that dim (sequence parallelism)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, vocab: int, group: Any,
                 seq_dim: int | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.vocab, self.group, self.seq_dim = weight, bias, vocab, group, seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.weight, self.bias, self.vocab, self.seq_dim, self.group)


class _ProductOp(nn.Module):
    """An LM head reading this rank's rows (and bias) as inputs: an exported graph's, a head tied to an embedding."""

    def __init__(self, vocab: int, group: Any, seq_dim: int | None = None) -> None:
        super().__init__()
        self.vocab, self.group, self.seq_dim = vocab, group, seq_dim

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _product(x, weight, bias, self.vocab, self.seq_dim, self.group)


class _Refused(Exception):
    """A use of a split vocabulary weight the split does not know: the sentence's 'what'."""


class _Split:
    """The vocabulary weights of a plan and this rank's shards of them (made once per rank: a weight tied between an
    embedding and a head, or read by several stages, has one shard)."""

    def __init__(self, plan: Any, root: nn.Module, t: int, rank: int, group: Any) -> None:
        self.t, self.rank, self.group = t, rank, group
        self.paths: dict[int, list[str]] = {}  # id(weight) -> the plan's paths of modules holding it
        self.vocab: dict[int, int] = {}  # id(weight or bias) -> its vocabulary (rows)
        self.bias: set[int] = set()  # of those, the heads' biases
        for stage in plan.partition:
            for path, style in stage.tensor_parallel.items():
                if style not in VOCAB_STYLES:
                    continue
                module = root.get_submodule(path)
                weight = getattr(module, "weight", None)
                if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
                    raise _Refused(f"{path} has no weight matrix to split over the vocabulary")
                self.paths.setdefault(id(weight), [])
                if path not in self.paths[id(weight)]:
                    self.paths[id(weight)].append(path)
                self.vocab[id(weight)] = weight.shape[0]
                bias = getattr(module, "bias", None) if style == "vocab_colwise" else None
                if isinstance(bias, nn.Parameter):
                    self.vocab[id(bias)] = bias.shape[0]
                    self.bias.add(id(bias))
        self.shards: dict[int, nn.Parameter] = {}
        self.modules: dict[int, nn.Module] = {}  # id(original module) -> its replacement

    def start(self, p: torch.Tensor) -> int:
        return vocab_rows(self.vocab[id(p)], self.t, self.rank)[0]

    def shard(self, p: nn.Parameter) -> nn.Parameter:
        """This rank's rows of p (padded with zero rows to V/t rounded up)."""
        if id(p) not in self.shards:
            start, per = vocab_rows(p.shape[0], self.t, self.rank)
            rows = p.detach()[start:start + per]
            if rows.shape[0] < per:
                rows = torch.cat([rows, rows.new_zeros((per - rows.shape[0], *rows.shape[1:]))])
            self.shards[id(p)] = nn.Parameter(rows.clone(), requires_grad=p.requires_grad)
        return self.shards[id(p)]

    def full(self, vocab: int) -> Any:
        t, group = self.t, self.group

        def gather(local: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(local) for _ in range(t)]
            dist.all_gather(parts, local.contiguous(), group=group)
            return torch.cat(parts, dim=0)[:vocab]
        return gather


def split_vocab(stages: list, plan: Any, root: nn.Module, t: int, rank: int = 0, group: Any = None) -> str | None:
    """Split every use of the plan's vocabulary weights in this rank's `stages` (planner.runtime.stage.StageModule).
    Returns what it does not know ("`op` reads the weight of PATH whole": refused at trace time already, passes/
    sharding/vocab.py), else None."""
    try:
        split = _Split(plan, root, t, rank, group)
        if split.paths:
            for st in stages:
                _split_stage(st, plan.partition[st.index].tensor_parallel, split)
    except _Refused as exc:
        return str(exc)
    return None


def _split_stage(st: Any, styles: dict[str, str], split: _Split) -> None:
    """Split the vocabulary weights one stage reads; `styles`: the plan's tensor_parallel of the stage."""
    from .stage import _key  # noqa: PLC0415 - stage imports this module

    used: set[int] = set()  # ids of the vocabulary weights (and head biases) this stage reads
    for node in st._nodes:
        if node.op != "call_module":
            continue
        piece = st.pieces[str(node.target)]
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        given: dict[str, nn.Parameter] = {}  # placeholder -> the top-level weight passed in
        for ph, a in zip(placeholders, node.args):
            if isinstance(a, fx.Node) and a.op == "get_attr" and _key(a.target) in st.attr_params:
                p = st.attr_params[_key(a.target)]
                if id(p) in split.vocab:
                    given[ph.name] = p
        used |= _split_piece(piece, given, split)
    for key, p in list(st.attr_params.items()):
        if id(p) in split.vocab:
            used.add(id(p))
            st.attr_params[key] = split.shard(p)
    for w in used:
        st.tp_full[id(split.shards[w])] = split.full(split.vocab[w])
        if w not in split.bias:  # the modules split: the plan's for this stage (else the weight's first)
            paths = split.paths.get(w, [])
            st.tp_sharded.update([p for p in paths if p in styles] or paths[:1])


def _split_piece(piece: fx.GraphModule, given: dict[str, nn.Parameter], split: _Split) -> set[int]:
    """Rewrite the uses of vocabulary weights in one piece; returns the ids of the weights it reads."""
    used: set[int] = set()

    def weight_of(a: Any) -> nn.Parameter | None:
        return given.get(a.name) if isinstance(a, fx.Node) else None

    def bias_of(n: fx.Node) -> Any:
        return n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")

    for n in list(piece.graph.nodes):
        if n.op == "get_attr":
            if id(_attr(piece, str(n.target))) in split.vocab:
                raise _Refused(f"`{n.target}` is read inside a piece, not as the piece's input")
            continue
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        reads = [weight_of(a) for a in n.all_input_nodes if weight_of(a) is not None]
        module = piece.get_submodule(str(n.target)) if n.op == "call_module" else None
        owned = [p for p in (module.parameters() if module is not None else ()) if id(p) in split.vocab]
        if not reads and not owned:
            continue
        use = vocab_use(n, module, weight_of, lambda p: id(p) in split.vocab)
        used.update(id(p) for p in reads + owned)
        if use == "lookup" and module is not None:
            _replace(piece, module, split.modules.setdefault(id(module), VocabParallelEmbedding(
                split.shard(module.weight), split.start(module.weight), module.padding_idx, split.group)))
        elif use == "product" and module is not None:
            _replace(piece, module, _head(module, split))
        elif use == "lookup":
            w = weight_of(embedding_weight(n))
            aten = isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            ids = n.args[1] if aten else n.args[0]
            pad = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx", -1 if aten else None)
            pad = None if pad is None or (aten and pad == -1) else int(pad) % w.shape[0]
            swap(piece, n, _LookupOp(split.start(w), pad, split.group), (ids, embedding_weight(n)), prefix="_vocab")
        elif use == "product":
            swap(piece, n, _ProductOp(split.vocab[id(weight_of(n.args[1]))], split.group),
                 (n.args[0], n.args[1], bias_of(n)), prefix="_vocab")
        elif isinstance(module, _GatheredReplicatedLinear) and not reads and id(module.linear.weight) in split.vocab \
                and (module.linear.bias is None or id(module.linear.bias) in split.vocab):
            head = _head(module.linear, split)  # a head read sequence-parallel (megatron_tp's rewrite of it)
            swap(piece, n, VocabParallelLinear(head.weight, head.bias, head.vocab, split.group, module.dim),
                 (n.args[0],), prefix="_vocab")
        elif isinstance(module, _GatheredLinearOp) and weight_of(n.args[1]) is not None \
                and weight_of(n.args[0]) is None and (bias_of(n) is None or id(weight_of(bias_of(n))) in split.bias):
            # a head reading its weight as an input, sequence-parallel (megatron_tp's rewrite of it)
            swap(piece, n, _ProductOp(split.vocab[id(weight_of(n.args[1]))], split.group, module.dim),
                 (n.args[0], n.args[1], bias_of(n)), prefix="_vocab")
        else:
            path = next((p for w in reads + owned for p in split.paths.get(id(w), [])), "a vocabulary weight")
            raise _Refused(f"`{node_kind(n, piece)}` ({n.name}) reads the weight of {path} whole")
    for parent in list(piece.modules()):  # what else still holds a replaced module (one a rewrite wrapped)
        for name, child in list(parent.named_children()):
            if id(child) in split.modules and split.modules[id(child)] is not child:
                setattr(parent, name, split.modules[id(child)])
        if used:
            piece.recompile()
    return used


def _head(linear: nn.Linear, split: _Split) -> VocabParallelLinear:
    """The column-parallel replacement of an nn.Linear head (one per rank: the same module wherever it is read)."""
    if id(linear) not in split.modules:
        bias = split.shard(linear.bias) if linear.bias is not None else None
        split.modules[id(linear)] = VocabParallelLinear(split.shard(linear.weight), bias,
                                                        split.vocab[id(linear.weight)], split.group)
    return split.modules[id(linear)]


def _replace(piece: fx.GraphModule, old: nn.Module, new: nn.Module) -> None:
    for parent in list(piece.modules()):
        for name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, name, new)


def _attr(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module
