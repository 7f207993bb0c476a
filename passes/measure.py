"""Run the graph on meta tensors and measure, per node, what the field's own tools count.

The graph runs forward twice (b = 2 and b = 3; nothing is allocated) in training mode, and for
every node records
- its output shapes (as `passes.shapes` does: sizes that differ between the runs are linear in b);
- the FLOPs it dispatches, counted with `torch.utils.flop_counter`'s formulas (matrix products,
  convolutions, attention kernels; composite ops such as linear, matmul and einsum are counted as
  the kernels they dispatch to);
- the bytes its layout copies write (the aten.clone / aten.copy_ it dispatches: `.contiguous()` of a transposed
  tensor, a reshape no view can express, a batched matmul of permuted heads, which at::matmul copies first; a
  `.contiguous()` of a contiguous tensor dispatches nothing);
- the tensors autograd saves for backward, seen by `torch.autograd.graph.saved_tensors_hooks`:
  each is named after the node that produced its storage (so a tensor saved by two ops, or saved
  through a view, counts once), parameters and buffers excluded, and sized by its storage.

Attention is run as the fused flash kernel that training on a GPU executes
(`aten._scaled_dot_product_flash_attention`: it saves q, k, v, the output and the logsumexp, not
the s x s probabilities that the meta device's math fallback would), and is marked causal when the
call says so or its module has `is_causal` set (Hugging Face materializes the causal mask while
tracing but skips it in training). A mask is read by the fused kernels (efficient attention takes an
additive bias), not kept as s x s probabilities, and does not change the FLOPs: attention with a mask
is priced as the flash kernel too. Dropout likewise runs as the fused kernel (a one-byte mask).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .errors import TraceFailure
from .meta_keys import MEASURED, MODULE, TENSOR
from .shapes import _PROBES, _describe, _merge, _size

__all__ = ["Measured", "attended_fraction", "measure", "is_attention"]

_SDPA = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """What one node dispatched, as expressions in the microbatch size b."""

    flops: sympy.Expr  # forward FLOPs in matrix products / convolutions / attention, as executed
    full_flops: sympy.Expr  # the same with causal attention counted in full (the PaLM/Megatron convention)
    causal: bool  # an attention kernel with a causal mask
    saved: tuple[tuple[str, sympy.Expr], ...]  # (storage name, bytes) kept for backward
    weight_gather: bool = False  # experts' weights gathered per token: a grouped GEMM reads them in place
    copy_bytes: sympy.Expr = sympy.Integer(0)  # bytes written by layout copies the node dispatched (aten.clone,
    # aten.copy_): a reshape or matmul of a tensor no view can express (a permuted q, k or v) materializes it
    in_causal: bool = False  # run inside a module that attends causally (its `is_causal`, as Hugging Face's
    # attention modules state it): an attention core it writes out is causal where an engine fuses it
    window: int = 0  # that module's sliding window (its `sliding_window`, or its config's: each query attends to the
    # last `window` keys, itself included), 0 where it has none


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA


class _FlopCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.copied = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        elif func in _COPIES and isinstance(out, torch.Tensor):
            self.copied += out.numel() * out.element_size()
        return out


_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default}


def _cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Run(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, root: torch.nn.Module) -> None:
        super().__init__(gm)
        self.root = root
        self.values: dict[fx.Node, Any] = {}
        self.flops: dict[fx.Node, int] = {}
        self.copied: dict[fx.Node, int] = {}
        self.causal: dict[fx.Node, bool] = {}
        self.attends: dict[fx.Node, int] = {}  # nodes of a causal attention module: its sliding window, or 0
        self.saved: dict[fx.Node, dict[str, int]] = {}
        self.producer: dict[int, str] = {}
        self.skip = {_cdata(t) for t in [*gm.parameters(), *gm.buffers(), *root.parameters(), *root.buffers()]}
        self.current: fx.Node | None = None
        self.alive: list[torch.Tensor] = []
        self.pending: list[tuple[int, str | None, int]] = []
        self.alias: dict[int, tuple[str | None, int]] = {}  # kv heads repeated for the kernel -> the originals
        self.weights: set[str] = set()  # nodes computed from parameters alone (e.g. experts' weights gathered)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        node = self.current
        if node is None or not isinstance(t, torch.Tensor):
            return t
        key = _cdata(t)
        if key in self.skip or self.producer.get(key) in self.weights:
            return t
        name, nbytes = self.alias.get(key) or (self.producer.get(key), t.untyped_storage().nbytes())
        self.pending.append((key, name, nbytes))  # named once the node's outputs are known
        self.alive.append(t)
        return t

    def _name_saved(self, n: fx.Node) -> None:
        """Name what `n` saved: by the node that produced the storage (`n` itself for its own outputs,
        e.g. attention's output), else as a tensor internal to `n` (a mask, a logsumexp)."""
        slots = self.saved.setdefault(n, {})
        for key, name, nbytes in self.pending:
            name = name or self.producer.get(key) or f"{n.name}.{len(slots)}"
            slots[name] = max(slots.get(name, 0), nbytes)
        self.pending = []

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        counter = _FlopCount()
        try:
            with counter:
                out = self._attention(n) if is_attention(n) else self._dropout(n) if _is_dropout(n, self.module) \
                    else super().run_node(n)
        except Exception as exc:  # noqa: BLE001
            raise TraceFailure(f"running node '{n.name}' ({n.op} {n.target}, from module "
                               f"'{n.meta.get(MODULE, '')}') on meta tensors failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}; code that needs real data "
                               "cannot be planned on meta tensors") from exc
        self.flops[n] = counter.flops
        self.copied[n] = counter.copied
        if (mod := self._module(n)) is not None and getattr(mod, "is_causal", False) is True:
            # its window: the module's own (Gemma 2, gpt-oss, Qwen2: per layer type), else its config's (Mistral)
            window = getattr(mod, "sliding_window") if hasattr(mod, "sliding_window") else \
                getattr(getattr(mod, "config", None), "sliding_window", None)
            self.attends[n] = int(window) if isinstance(window, int) and not isinstance(window, bool) else 0
        if n.op == "call_function" and self._from_weights(n):
            self.weights.add(n.name)
        for t in _tensors(out):
            self.producer.setdefault(_cdata(t), n.name)
            self.alive.append(t)  # a freed storage's address could be reused by a later tensor
        self._name_saved(n)
        self.values[n] = _describe(out)
        return out

    def _attention(self, n: fx.Node) -> torch.Tensor:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        q, k, v = args[:3]
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        causal = causal or bool(getattr(self._module(n), "is_causal", False) and q.shape[-2] == k.shape[-2])
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: the kernel reads each kv head per group
            rep = q.shape[-3] // k.shape[-3]
            kv = [(x, x.repeat_interleave(rep, dim=-3)) for x in (k, v)]
            for x, y in kv:  # what the kernel keeps for backward is the kv heads themselves
                self.alias[_cdata(y)] = (self.producer.get(_cdata(x)), x.untyped_storage().nbytes())
                self.alive.append(y)
            (_, k), (_, v) = kv
        self.causal[n] = causal
        if v.shape[-1] != q.shape[-1]:  # values narrower than the queries (multi-head latent attention): a fused
            # kernel that takes both widths (the memory-efficient one here; cuDNN / FlashAttention-3 on Hopper), which
            # keeps the same for backward (q, k, v, output, log-sum-exp)
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, float(dropout), causal, scale=kwargs.get("scale"))[0]
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, float(dropout), causal, scale=kwargs.get("scale"))
        return out[0]

    def _dropout(self, n: fx.Node) -> torch.Tensor:
        """Dropout as the fused GPU kernel runs it: the mask it saves is one byte per element (the CPU
        path that meta tensors follow would save a mask in the activation's dtype)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_module":
            p = self.module.get_submodule(str(n.target)).p
        else:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        return torch.ops.aten.native_dropout(args[0], float(p), True)[0]

    def _from_weights(self, n: fx.Node) -> bool:
        """Experts' weights gathered per token (`gate_up_proj[expert_ids]`, Hugging Face's batched_mm
        experts): a grouped GEMM reads them in place, so the copy is no activation kept per microbatch."""
        first = n.all_input_nodes[0] if n.all_input_nodes else None
        value = self.env.get(first) if first is not None else None
        return (getattr(n.target, "__name__", "").startswith("index") and isinstance(value, torch.nn.Parameter)
                and value.dim() >= 3)

    def _module(self, n: fx.Node) -> torch.nn.Module | None:
        path = n.meta.get(MODULE, "")
        try:
            return self.root.get_submodule(path) if path else self.root
        except AttributeError:
            return None


_DROPOUT = {F.dropout, torch.ops.aten.dropout.default}


def _is_dropout(n: fx.Node, gm: torch.nn.Module) -> bool:
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return isinstance(mod, torch.nn.Dropout) and mod.training and mod.p > 0
    if n.op == "call_function" and n.target in _DROPOUT:
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        train = n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True)
        return train is True and (not isinstance(p, (int, float)) or p > 0)
    return False


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _linear(at2: int, at3: int) -> sympy.Expr:
    return _size(int(at2), int(at3))


def measure(gm: fx.GraphModule, root: torch.nn.Module, make_inputs: Callable[[int], tuple[Any, ...]]) -> None:
    """Write node.meta[TENSOR] and node.meta[MEASURED] for every node."""
    runs: list[_Run] = []
    for b in _PROBES:
        run = _Run(gm, root)
        with torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t), torch.enable_grad():
            run.run(*make_inputs(b))
        runs.append(run)
    r2, r3 = runs
    for node in gm.graph.nodes:
        node.meta[TENSOR] = _merge(r2.values.get(node), r3.values.get(node))
        s2, s3 = r2.saved.get(node, {}), r3.saved.get(node, {})
        saved = tuple((name, _linear(s2.get(name, 0), s3.get(name, 0))) for name in dict.fromkeys([*s2, *s3]))
        flops = _linear(r2.flops.get(node, 0), r3.flops.get(node, 0))
        causal = r2.causal.get(node, False)
        executed = flops * _causal_fraction(node) if causal else flops
        node.meta[MEASURED] = Measured(flops=executed, full_flops=flops, causal=causal, saved=saved,
                                       weight_gather=node.name in r2.weights, in_causal=node in r2.attends,
                                       window=r2.attends.get(node, 0),
                                       copy_bytes=_linear(r2.copied.get(node, 0), r3.copied.get(node, 0)))


def _causal_fraction(node: fx.Node) -> sympy.Expr:
    """Share of the score matrix a causal kernel computes: (s + 1) / 2s for s query = key positions."""
    info = node.meta.get(TENSOR)
    s = info.shape[-2] if info is not None and len(info.shape) >= 2 else None
    return attended_fraction(int(s)) if s is not None and s.is_number else sympy.Rational(1, 2)


def attended_fraction(s: int, window: int = 0) -> sympy.Expr:
    """Share of the s x s score matrix a causal kernel computes over s query = key positions, each query attending to
    itself and the keys before it, the last `window` of them where the attention is a sliding window: query i reads
    min(i + 1, window) keys, w (w + 1) / 2 + (s - w) w in all."""
    w = min(window, s) if window > 0 else s
    return sympy.Rational(w * (w + 1) // 2 + (s - w) * w, s * s)
