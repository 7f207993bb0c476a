"""The one named pipeline: load -> build (meta) -> capture -> measure -> costs -> units.

Each pass is a function of a `Context`; the runner records every pass's name and wall time, and an
error names the passes that had already run.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from .costs import annotate_costs
from .check import Conservation, PricingError, conservation
from .errors import UNLAUNCHABLE, UserError
from .load import ModelFile, file_sha256, load_model_file
from .capture import capture
from .measure import measure
from .repeat import Cut, expand, representatives
from .shape import model_shape
from .poly import Poly
from .shapes import B, tensor_info
from .sharding.check import DEGREES, cp_refusal, graph_shapes, tp_refusals
from .kernels import KERNELS
from .units import Unit, expert_layers, lower_units
from .sharding.vocab import VOCAB_STYLES, vocab_refusal

__all__ = ["Context", "ModelProfile", "PASSES", "analyze", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(kw_only=True)
class Context:
    path: Path
    kwargs: dict[str, Any]
    leaves: tuple[str, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    kernels: str = "traced"  # how the units are priced (passes.kernels.KERNELS)
    model_file: ModelFile | None = None
    model: torch.nn.Module | None = None
    gm: fx.GraphModule | None = None
    frontend: str = ""  # "export" | "fx"
    export_error: str = ""
    units: list[Unit] = field(default_factory=list)
    priced: list[Unit] = field(default_factory=list)  # the units of the traced representatives
    conservation: Conservation | None = None
    notes: list[str] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)  # block containers priced by representatives
    tp_refusals: dict[str, str] = field(default_factory=dict)  # ModelProfile.tp_refusals


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """What the planner needs of a model: plain data, no fx objects."""

    name: str
    path: str
    sha256: str
    kwargs: dict[str, Any]
    dtype: str
    frontend: str  # "export" (torch.export) or "fx" (symbolic_trace)
    total_params: int  # unique parameters (tied weights once)
    tokens_per_sample: int  # sequence length of a token-id input; 0 when the input is not token ids
    model_shape: dict[str, Any]  # passes.shape: layers, hidden, heads, ... in the engines' words ({} if unknown)
    unpriced: tuple[tuple[str, float], ...]  # (op, share of the forward's bytes) the tables do not know
    notes: tuple[str, ...]  # what the user should know about how the model was priced
    units: tuple[Unit, ...]
    pass_times: tuple[tuple[str, float], ...]
    tp_refusals: dict[str, str] = field(default_factory=dict)
    """{"t" or "t+sp": the op and source line} the fxplanner runtime's Megatron layout refuses at that tensor-parallel
    degree (with sequence parallelism); a degree missing runs (passes/sharding/check.py). "cp": what its context
    parallelism refuses, at any degree. Empty for a model the
    runtime cannot train, or one priced as another engine's kernels."""


def _load(ctx: Context) -> None:
    ctx.model_file = load_model_file(ctx.path, ctx.kwargs)


def _build(ctx: Context) -> None:
    # as training code does: the whole model (buffers such as RoPE tables too) in the training dtype
    ctx.model = ctx.model_file.build("meta", ctx.dtype).to(ctx.dtype)
    ctx.model.train()
    ctx.notes.extend(experts_routed(ctx.model))


def experts_routed(model: torch.nn.Module) -> list[str]:
    """Mixture-of-experts layers (passes.units.expert_layers): Hugging Face experts run as `batched_mm`, which
    computes exactly the top-k experts of each token with no data-dependent shapes, so they can be captured and are
    priced at the routed top-k, not as dense; expert parallelism divides them (ParallelConfig.ep)."""
    layers = expert_layers(model)
    if not layers:
        return []
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "batched_mm"
    name, (experts, k) = next(iter(layers.items()))
    return [f"{len(layers)} mixture-of-experts layers ({experts} experts, top-{k or '?'} routing, e.g. {name}) are "
            f"priced at the {k or '?'} experts each token is routed to; expert parallelism divides the experts"]


def _inputs(ctx: Context, b: int) -> tuple[Any, ...]:
    """Example inputs on meta tensors, floating-point ones cast to the training dtype."""
    return tuple(x.to(ctx.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                 for x in ctx.model_file.inputs(b, "meta"))


def _tokens_per_sample(ctx: Context) -> int:
    """Sequence length when the first input is a (batch, seq) tensor of token ids, else 0."""
    first = next((x for x in _inputs(ctx, 2) if isinstance(x, torch.Tensor)), None)
    if first is None or first.is_floating_point() or first.dim() != 2:
        return 0
    return int(first.shape[1])


def _capture(ctx: Context) -> None:
    with representatives(ctx.model) as ctx.cuts:
        captured = capture(ctx.model, _inputs(ctx, 2), ctx.leaves)
    ctx.gm, ctx.frontend, ctx.export_error = captured.gm, captured.frontend, captured.export_error


def _measure(ctx: Context) -> None:
    with representatives(ctx.model):
        measure(ctx.gm, ctx.model, lambda b: _inputs(ctx, b))


def _costs(ctx: Context) -> None:
    annotate_costs(ctx.gm)


def _units(ctx: Context) -> None:
    with representatives(ctx.model):
        ctx.priced = lower_units(ctx.gm, ctx.model, ctx.kernels)
        # the engine runs its own loss (Megatron's vocabulary-parallel cross-entropy, priced with the head)
        kept, work = (Poly(), Poly()) if ctx.kernels == "megatron" else _loss_bytes(ctx)
    ctx.units = expand(ctx.priced, ctx.cuts)
    if ctx.units:
        ctx.units[-1] = replace(ctx.units[-1], loss_bytes=kept, loss_work=work)


class _NewBytes(TorchDispatchMode):
    """The bytes of the storages the ops run under it allocate (an op's output that is a view of one of its inputs
    allocates none), live at once: now, and the most."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage()._cdata for x in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(x, torch.Tensor)}
        for x in torch.utils._pytree.tree_leaves(out):
            if not isinstance(x, torch.Tensor):
                continue
            storage = x.untyped_storage()
            key = storage._cdata
            if key in given or key in self._live:
                continue
            self._live.add(key)
            self.now += (n := storage.nbytes())
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key, n)
        return out

    def _freed(self, key: int, n: int) -> None:
        self._live.discard(key)
        self.now -= n


def _loss_bytes(ctx: Context) -> tuple[Poly, Poly]:
    """(Bytes the model file's loss_fn keeps for its backward, the most its backward holds at once beyond them) per
    microbatch (linear in b): the tensors its autograd saves, measured with saved-tensor hooks on meta tensors at
    b = 1 and 2 (the model's output itself is the last unit's, not counted again); then the storages its backward
    allocates down to the gradient of the model's output, live at once at the most (_NewBytes: torch.nn.functional.
    cross_entropy's backward holds nll_loss_backward's gradient and _log_softmax_backward_data's, each of the fp32
    logits' size, with the saved log-softmax; torchtitan's train step (torchtitan/train.py, forward_backward_step)
    drops the logits before loss.backward(), so its peak is there, with every block's kept activations)."""
    if not ctx.model_file.has("loss_fn") or not ctx.model_file.has("sample_batch"):
        return Poly(), Poly()
    result = next(n for n in ctx.gm.graph.nodes if n.op == "output").args[0]
    leaves = [tensor_info(x) for x in torch.utils._pytree.tree_leaves(result)]
    if not leaves or any(info is None for info in leaves):
        return Poly(), Poly()
    sizes, works = [], []
    try:
        for b in (1, 2):  # the model's output as the traced graph describes it, at microbatch b, in fp32 as the
            # runtime hands it to the loss (Megatron computes its cross-entropy in fp32 too)
            outs = [torch.empty([int(d.subs(B, b)) for d in info.shape], device="meta", requires_grad=True,
                                dtype=torch.float32 if info.dtype.is_floating_point else info.dtype) for info in leaves]
            _, targets = ctx.model_file.call("sample_batch", b, 0)
            targets = torch.utils._pytree.tree_map(
                lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, targets)
            saved: dict[int, int] = {}

            def pack(x: torch.Tensor) -> torch.Tensor:
                if not any(x is o for o in outs):  # the output itself belongs to the last unit
                    saved[id(x)] = x.numel() * x.element_size()
                return x

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                loss = ctx.model_file.module.loss_fn(outs[0] if len(outs) == 1 else tuple(outs), targets)
            sizes.append(sum(saved.values()))
            grads = [o for o in outs if o.is_floating_point()]
            work = 0
            if isinstance(loss, torch.Tensor) and loss.requires_grad and grads:
                with _NewBytes() as new:  # (autograd.grad: the gradients handed back, not accumulated into .grad)
                    torch.autograd.grad(loss, grads, allow_unused=True)
                work = new.peak
            works.append(work)
    except Exception:  # noqa: BLE001 - a loss that cannot run on meta tensors is left unpriced
        return Poly(), Poly()
    return (Poly((2.0 * sizes[0] - sizes[1], float(sizes[1] - sizes[0]))),
            Poly((2.0 * works[0] - works[1], float(works[1] - works[0]))))


def _check(ctx: Context) -> None:
    """Conservation: the priced units hold the model's parameters, and their forward FLOPs equal the
    model's own forward counted independently (torch.utils.flop_counter over the module), within 1%."""
    with representatives(ctx.model):
        ctx.conservation = conservation(ctx.model, ctx.gm, ctx.priced, _inputs(ctx, 2))
    missing = [f"{fn}()" for fn in ("sample_batch", "loss_fn") if not ctx.model_file.has(fn)]
    if ctx.kernels == "megatron":
        ctx.notes.append("priced as megatron runs it (Transformer Engine's fused kernels: normalization, "
                         "activation and rotary embedding as one kernel each, grouped keys/values read as they are, "
                         "its vocabulary-parallel cross-entropy in place of the file's loss_fn)")
    if ctx.kernels == "inductor":
        ctx.notes.append("priced as torch.compile runs each block (Inductor's fused kernels: normalization, "
                         "activation, rotary embedding and residual adds fused between the matrix products and "
                         "attention); the embedding, the head and the file's loss_fn eager, as traced")
    if missing:  # (planner.api keeps it for the plans the fxplanner runtime runs)
        ctx.notes.append(f"{UNLAUNCHABLE}: {ctx.path.name} defines no {' and no '.join(missing)}, "
                         "which the fxplanner runtime calls for each step's data and loss")
    if not ctx.conservation.flops_ok:
        raise PricingError(ctx.conservation.flops_message())


def _runtime(ctx: Context) -> None:
    """What of a tensor-parallel or a context-parallel split fxplanner's runtime would refuse (ctx.tp_refusals): the
    priced graph, which the runtime splits its stages from, walked with the sharding rules. Only for a model the
    runtime can train (its file defines sample_batch and loss_fn), priced as traced."""
    if ctx.kernels != "traced" or not all(ctx.model_file.has(fn) for fn in ("sample_batch", "loss_fn")):
        return
    with representatives(ctx.model):
        gm = ctx.gm
        styles = {path: style for u in ctx.priced for path, style in u.tp_layout if style in ("colwise", "rowwise")}
        shapes = graph_shapes(gm, _inputs(ctx, 2))  # (one meta pass for both walks)
        ctx.tp_refusals = tp_refusals(gm, shapes, styles, [(u.heads, u.kv_heads) for u in ctx.priced], ctx.path)
        if (op := cp_refusal(gm, shapes, ctx.path)) is not None:  # at every degree
            ctx.tp_refusals["cp"] = op
        vocab = {path for u in ctx.priced for path, style in u.tp_layout if style in VOCAB_STYLES}
        if vocab and (op := vocab_refusal(gm, ctx.model, vocab, ctx.path)) is not None:  # its rows split: every t
            ctx.tp_refusals.update({key: op for t in DEGREES for key in (str(t), f"{t}+sp")})


PASSES: tuple[tuple[str, Callable[[Context], None]], ...] = (
    ("load", _load), ("build", _build), ("capture", _capture), ("measure", _measure),
    ("costs", _costs), ("units", _units), ("check", _check), ("runtime", _runtime),
)


def run_passes(ctx: Context, passes=PASSES, progress: Callable[[str], None] | None = None) -> list[tuple[str, float]]:
    times: list[tuple[str, float]] = []
    for name, fn in passes:
        if progress:
            progress(name)
        start = time.perf_counter()
        try:
            fn(ctx)
        except UserError as exc:
            done = ", ".join(n for n, _ in times) or "none"
            raise type(exc)(f"{exc} [pass '{name}'; passes done: {done}]") from exc
        times.append((name, time.perf_counter() - start))
    return times


def analyze(path: str | Path, kwargs: dict[str, Any] | None = None, *, leaves: tuple[str, ...] = (),
            dtype: str = "bf16", kernels: str = "traced",
            progress: Callable[[str], None] | None = None) -> tuple[ModelProfile, Context]:
    """Run every pass over a model file; returns the plain profile and the context (graph etc.). `kernels`: price
    the ops as traced or as an engine's kernels run them (passes.kernels.KERNELS)."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if kernels not in KERNELS:
        raise UserError(f"unknown kernels {kernels!r}; use one of {', '.join(KERNELS)}")
    ctx = Context(path=Path(path), kwargs=dict(kwargs or {}), leaves=tuple(leaves), dtype=DTYPES[dtype],
                  kernels=kernels)
    times = run_passes(ctx, progress=progress)
    profile = ModelProfile(name=ctx.path.stem, path=str(ctx.path), sha256=file_sha256(ctx.path),
                           kwargs=dict(ctx.kwargs), dtype=dtype, frontend=ctx.frontend,
                           total_params=sum(p.numel() for p in ctx.model.parameters()),
                           tokens_per_sample=(seq := _tokens_per_sample(ctx)),
                           model_shape=model_shape(ctx.model, tuple(ctx.units), seq), unpriced=ctx.conservation.unpriced,
                           notes=tuple(ctx.notes) + ctx.conservation.notes + ((f"captured with torch.fx ({ctx.export_error})",)
                                                          if ctx.export_error else ()),
                           units=tuple(ctx.units), pass_times=tuple(times), tp_refusals=dict(ctx.tp_refusals))
    return profile, ctx
