"""Library entry points the CLI calls: profile a model file, make a plan."""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from costmodels.calibration import Calibration, apply_calibration
from costmodels.compute import MEGATRON_MOE_HOST_S, moe_host_wait_s, unit_time
from costmodels.fp8 import FP8_RECIPES
from costmodels.hardware import Hardware
from costmodels.memory import activation_bytes
from passes.check import PricingError
from passes.errors import UserError
from passes.errors import UNLAUNCHABLE
from passes.pipeline import ModelProfile, analyze
from passes.sharding.check import refusal_sentence
from targets.registry import get_target

from . import __version__
from .config import ParallelConfig
from .engines import ENGINES, Engine
from .evaluate import Evaluation, Evaluator
from .launch import launch_script, torchrun_commands
from .layout import layout_bounds, layout_stages
from .plan import (Alternative, ConfigModel, Launch, Plan, Predictions, RankMemory, SearchInfo, Source,
                   Stage)
from .fill.joint import JointChoice, choose_joint, choose_shrink_or_fill, greedy_proven_optimal
from .fill.packing import cpsat_budget
from .fill.profiles import profile_job, shared_profile
from .fill.section import fill_section
from .fill.spec import FillSpec
from .schedules import SCHEDULES
from .options import check_cluster, check_fill_time_limit, check_fill_value, check_main_slack, parse_model_args
from .search import NoFeasibleConfig, Pins, SearchResult, search
from .simulate import SimResult, with_bubbles

__all__ = ["parse_model_args", "profile_rows", "make_plan", "check_fill_value", "PHASES"]

PHASES = ("tracing", "pricing", "searching", "simulating", "packing the fill")
"""What make_plan's `progress` is told, in this order: each phase's name, alone or followed by ": " and what in it
(a pass's name; CP-SAT's solves). "packing the fill" only with fill jobs. (What the fxplanner runtime can split is
priced with the model: passes.pipeline's "runtime" pass.)"""
TRACE_PASSES = ("load", "build", "capture")  # passes.pipeline.PASSES that trace the model; the rest price it


def profile_rows(profile: ModelProfile, hw: Hardware, cfg: ParallelConfig) -> list[dict[str, Any]]:
    """One row per unit at cfg's microbatch and tensor-parallel degree (no recomputation)."""
    rows = []
    for u in profile.units:
        ut = unit_time(u, hw, cfg)
        rows.append({"unit": u.name, "kind": u.kind, "params": u.params, "fwd_flops": u.fwd_flops(cfg.b),
                     "bwd_flops": u.bwd_flops(cfg.b), "activation_bytes": activation_bytes(u, cfg),
                     "fwd_s": ut.fwd_s, "bwd_s": ut.bwd_s})
    return rows


def _elsewhere(has: Callable[[Engine], object]) -> tuple[str, str]:
    """The engines that run something, as sentences name them and as the --engine flags that choose them."""
    them = [e for e in ENGINES.values() if has(e)]
    return " or ".join(e.title for e in them), " or ".join(f"--engine {e.name}" for e in them)


def engine_pins(pins: Pins, hw: Hardware) -> Pins:
    """The pins for what the plan's engine runs (planner.engines): what it does not run (FP8, parameters sharded over
    the data-parallel ranks, experts padded to a capacity) is refused in one sentence naming the engines that do
    (expert parallelism by make_plan, once it knows whether the model has experts at all); the search keeps to its
    schedules, and its default gradient precision is pinned. --fp8 auto becomes the engine's default recipe for the
    GPU, and a recipe the engine or the GPU cannot run is refused."""
    engine = ENGINES[pins.engine]
    if pins.moe_capacity and not engine.moe_capacity:
        where, flags = _elsewhere(lambda e: e.moe_capacity)
        raise UserError(f"experts padded to a capacity (--moe-capacity) run in {where}; {pins.engine} routes "
                        f"every token to its experts: add {flags}, or plan dropless")
    if pins.moe_capacity and pins.moe_dispatcher == "deepep":  # megatron-core TransformerConfig refuses it
        raise UserError("Megatron-Core's flex dispatcher with DeepEP does not pad experts to a capacity "
                        "(--moe-capacity): use --moe-dispatcher alltoall or hybridep, or dropless routing")
    if pins.moe_a2a_overlap and not engine.moe_a2a_overlap:
        where = " or ".join(f"{e.title} ({e.moe_a2a_overlap})" for e in ENGINES.values() if e.moe_a2a_overlap)
        raise UserError(f"hiding the expert all-to-alls behind another microbatch (--moe-a2a-overlap) runs in {where}; "
                        f"{engine.title}'s MoE layers wait for their dispatch and combine: add "
                        f"{_elsewhere(lambda e: e.moe_a2a_overlap)[1]}, or plan without --moe-a2a-overlap")
    if pins.fp8 and not engine.fp8:
        where = " or ".join(f"{e.title} ({e.fp8})" for e in ENGINES.values() if e.fp8)
        raise UserError(f"FP8 runs in {where}, not in {engine.title}: add {_elsewhere(lambda e: e.fp8)[1]}")
    if pins.async_tp and not engine.async_tp:
        where = " or ".join(f"{e.title} ({e.async_tp})" for e in ENGINES.values() if e.async_tp)
        raise UserError(f"async tensor parallelism (--async-tp) runs in {where}, not in {engine.title}: add "
                        f"{_elsewhere(lambda e: e.async_tp)[1]}, or plan without --async-tp")
    if pins.compile and not engine.compile:
        raise UserError(f"{engine.title} runs the model as written, without torch.compile (--compile): plan without "
                        f"--compile, or with {_elsewhere(lambda e: e.compile)[1]}, which compiles each block")
    if (pins.dp_replicate or 1) > 1 and not engine.hsdp:
        where = " or ".join(f"{e.title} ({e.hsdp})" for e in ENGINES.values() if e.hsdp)
        raise UserError(f"hybrid-sharded data parallelism (--dp-replicate {pins.dp_replicate}) runs in {where}, not in "
                        f"{engine.title}: add {_elsewhere(lambda e: e.hsdp)[1]}, or plan without --dp-replicate")
    if pins.zero == 3 and not engine.fsdp:
        where = " or ".join(f"{e.title} ({e.fsdp})" for e in ENGINES.values() if e.fsdp)
        raise UserError(f"parameters sharded over the data-parallel ranks (--zero 3, FSDP) run in {where}, not in "
                        f"{engine.title}, which runs up to --zero 2: add {_elsewhere(lambda e: e.fsdp)[1]}")
    if pins.zero == 1 and not engine.optimizer_only:
        raise UserError(f"{engine.title} shards with {engine.fsdp} only, which shards the gradients with the optimizer "
                        f"state: plan with --zero 2 ({engine.fsdp} keeping the parameters whole through the step) or "
                        f"--zero 3 (resharding them after each forward), or with "
                        f"{_elsewhere(lambda e: e.optimizer_only and e.export)[1]} for a sharded optimizer alone")
    if not engine.expert_parallel and (pins.ep or 1) == 1:  # more: refused once the model is known
        pins = replace(pins, ep=1)
    if engine.schedules is not None:
        if pins.schedule is not None and pins.schedule not in engine.schedules:
            raise UserError(f"{engine.title} runs the {' and '.join(engine.schedules)} schedules, not {pins.schedule}: "
                            f"pin one of those or plan with "
                            f"{_elsewhere(lambda e: e.export and e.schedules is None)[1]}")
        pins = replace(pins, schedules=tuple(k for k in (pins.schedules or engine.schedules) if k in engine.schedules))
    if pins.compile is None:  # (compiled where the engine compiles: planner.config)
        pins = replace(pins, compile=bool(engine.compile))
    if pins.grad_fp32 is False and pins.precision == "bf16" and not engine.grad_reduce_bf16:
        raise UserError(f"{engine.title} reduces bf16 training's gradients in fp32 only (its training."
                        f"mixed_precision_reduce takes float32): plan without --grad-reduce-in-bf16, or with "
                        f"{_elsewhere(lambda e: e.grad_reduce_bf16 and e.export)[1]} to reduce them in bf16")
    if engine.grad_fp32 and pins.grad_fp32 is None:
        pins = replace(pins, grad_fp32=pins.precision == "bf16")
    if not pins.fp8:
        return pins
    keys = hw.gpu.peak_flops
    name = engine.fp8_default(keys) if pins.fp8 == "auto" else pins.fp8
    recipe = FP8_RECIPES[name]
    if not engine.fp8_recipe(recipe):
        runs = [r for r, x in FP8_RECIPES.items() if engine.fp8_recipe(x)]
        raise UserError(f"{pins.engine} does not run the FP8 recipe {name}; it runs {', '.join(runs)}")
    need = recipe.gemm_dtype
    if need not in keys:
        has = "Blackwell's MX block-scaled tensor cores" if need == "mxfp8" else "FP8 tensor cores"
        raise UserError(f"the FP8 recipe {name} needs {has}, which the {hw.gpu.name} lacks (its peaks: "
                        f"{', '.join(hw.gpu.dtypes)}); choose another --fp8 recipe or --target, or plan without FP8")
    return replace(pins, fp8=name)


def engine_launch(plan: Plan, plan_path: str) -> Launch:
    """An exported engine's launch: the export's script (torchrun rendezvous assigns the node ranks), run on every
    node."""
    from . import export

    engine, flags = plan.source.engine, ""
    script = f"{Path(plan_path).with_suffix('')}.{engine}.sh"
    try:
        text = getattr(export, ENGINES[engine].export)(plan).text
    except UserError as why:  # torchtitan ships no model of this family: the user names its config function
        text, flags = f"# {why}\n", " --titan-module MODULE --titan-config CONFIG"
        plan.source.notes.append(f"{why}: the launch commands leave MODULE and CONFIG for you to fill in")
    return Launch(nnodes=plan.launch.nnodes, nproc_per_node=plan.launch.nproc_per_node,
                  commands=[f"planner export {plan_path} --to {engine}{flags} -o {script} && bash {script}"]
                  * plan.launch.nnodes, script=text)


def _host_notes(ev: Evaluator, c: ParallelConfig) -> list[str]:
    """Where the chosen configuration's MoE layers wait for the engine's host, say so and what would hide it."""
    moe = next((u for u in ev.units if u.experts), None)
    wait = moe_host_wait_s(moe, ev.hw, c) if moe is not None else 0.0
    if wait <= 0:
        return []
    return [f"each MoE layer's forward waits {wait * 1e3:.1f} ms for Megatron-Core's host beyond its kernels (at least "
            f"{ev.hw.eff.moe_host_s * 1e3:.1f} ms a layer: the dropless dispatch drains the stream every layer); a "
            "larger microbatch, --moe-capacity, or a full-iteration CUDA graph hides it"]


def make_plan(model: str, *, gpus: int, global_batch: int, target: str, gpus_per_node: int | None = None,
              model_args: dict[str, Any] | None = None, pins: Pins = Pins(), leaves: tuple[str, ...] = (),
              plan_path: str = "plan.json", fill: FillSpec | None = None, main_slack: float = 0.0, offload: str = "auto",
              fill_solver: str = "greedy", fill_time_limit_s: float = 5.0, calibration: Calibration | None = None, progress: Callable[[str], None] | None = None,
              search_progress: Callable[[int, int], None] | None = None, fill_value: float = 0.0) -> tuple[Plan, SearchResult]:
    """`fill_value`: what one recovered fill GPU-second is worth against one main-job GPU-second (0: the fastest
    main job wins and fill only breaks ties); `main_slack`: how much slower than the fastest a main configuration
    may be and still be considered (planner/fill/joint.py). `progress`: told each phase (PHASES) as it starts;
    `search_progress`: (configurations taken from the search's queue, configurations queued so far)."""
    check_fill_value(fill_value)
    check_main_slack(main_slack)
    if fill is not None:  # (before the model is traced)
        check_fill_time_limit(fill_time_limit_s)
    hw = Hardware(target=get_target(target, gpus_per_node))
    check_cluster(gpus, hw.cluster.gpus_per_node)  # (before the model is traced)
    if calibration is not None:
        hw = apply_calibration(calibration, hw)
    pins, engine = engine_pins(pins, hw), ENGINES[pins.engine]
    hw = replace(hw, attention=engine.attention)  # (its flash attention kernel's share of the peak: targets)
    kernels = engine.compile if pins.compile else engine.kernels  # (as it runs the units: passes.kernels)
    if fill is not None and not engine.fill:
        raise UserError(f"fill jobs run in the pipeline bubbles of {_elsewhere(lambda e: e.fill)[0]}, not in "
                        f"{pins.engine}: plan them without --engine (or the main job alone with it)")
    profile, _ = analyze(model, model_args, leaves=leaves, dtype=pins.precision, kernels=kernels,
                         progress=(lambda name: progress(f"{'tracing' if name in TRACE_PASSES else 'pricing'}: {name}"))
                         if progress else None)
    if engine.selective != "core":  # what the engine's selective recomputation checkpoints (planner.engines)
        profile = replace(profile, units=tuple(replace(u, checkpoint=engine.selective) for u in profile.units))
    if engine.memory.loss_parallel and profile.units:  # (its loss on each rank's vocabulary shard)
        profile = replace(profile, units=(*profile.units[:-1], replace(profile.units[-1], loss_parallel=True)))
    if (pins.ep or 1) > 1:  # (after the model: a dense one is told so first, whatever the engine)
        if not any(u.experts for u in profile.units):
            raise UserError(f"--ep {pins.ep} divides the experts of mixture-of-experts layers over expert-parallel "
                            f"ranks, but {model} builds a dense model (no MoE layers): drop --ep")
        if not engine.expert_parallel:
            where, flags = _elsewhere(lambda e: e.expert_parallel)
            raise UserError(f"expert parallelism (--ep {pins.ep}) runs in {where}, not in {engine.title}: add {flags}")
    if pins.layout and (stages := layout_stages(pins.layout)):  # a layout the model cannot take: one sentence now
        layout_bounds(pins.layout, [u.kind for u in profile.units], stages)
    if kernels not in ("traced", "titan"):  # the units are priced as the engine's fused kernels (the blocks
        # torch.compile fuses, the rest as eager as they run): nothing more to fuse
        hw = hw.with_eff(fusion=0.0)
    elif engine.eager:  # op by op, as eager PyTorch runs each (costmodels.eager)
        hw = hw.with_eff(fusion=0.0, eager=True)
    if kernels == "megatron":  # an eager Megatron-Core's MoE layers wait for its host
        hw = hw.with_eff(moe_host_s=MEGATRON_MOE_HOST_S)
    if engine.grouped_mm:  # (how its MoE layers' experts and router run)
        hw = hw.with_eff(grouped_mm=True)
    refused = {} if engine.export else profile.tp_refusals  # (what the fxplanner runtime cannot split)
    _check_pinned_split(pins, refused)
    ev = Evaluator(units=profile.units, hw=hw, global_batch=global_batch, n_gpus=gpus,
                   tokens_per_sample=profile.tokens_per_sample, layout=pins.layout or "", refused=refused,
                   memory=engine.memory)  # (how the engine holds its memory)
    start = time.perf_counter()
    wide = fill is not None and main_slack > 0
    if progress:
        progress("searching")
    with _gc_frozen():
        result = search(ev, pins, top=8 if wide else 6, simulate_top=8 if wide else 3, progress=search_progress,
                        simulating=(lambda: progress("simulating")) if progress else None)
    best, sim, joint = result.best, result.simulation, None
    if fill is not None:
        if progress:
            progress("packing the fill")
        alone = {}
        for j in fill.jobs:  # (each job's model traced and priced)
            if progress:
                progress(f"packing the fill: profiling job {j.name}")
            alone[j.name] = profile_job(j, hw, pins.precision, host=fill.gpu_sharing != "none")
        jobs = {name: [shared_profile(p, fill.gpu_sharing) for p in profs] for name, profs in alone.items()}
        with cpsat_budget(fill_time_limit_s, progress=(lambda n, s: progress(
                f"packing the fill: CP-SAT solve {n} ({s:.1f} s of {fill_time_limit_s:g})")) if progress
                          else None) as budget, _gc_frozen():
            joint = _choose_fill(ev, pins, result, jobs, main_slack=main_slack, offload=offload,
                                 safety_margin=fill.safety_margin, solver=fill_solver, fill_value=fill_value,
                                 policy=fill.policy,
                                 top=8 if wide else 6, simulate_top=8 if wide else 3)
        best, sim = joint.evaluation, joint.simulation
    seconds = time.perf_counter() - start
    _check_physics(ev, best)
    runners = [e for e in (result.best, *result.runners_up) if e.config != best.config]
    plan = _to_plan(profile, ev, best, sim, runners, result, seconds, pins, plan_path, leaves,
                    mps=fill is not None and fill.gpu_sharing == "mps")
    if joint is not None:
        section = fill_section(joint.fill, fill, offload=joint.offload, main_useful_per_gpu=joint.main_useful_per_gpu,
                               offload_bytes=joint.offloaded)
        if fill_solver != "greedy":
            section.predictions.solver = (budget.summary() if joint.solver == fill_solver
                                          else greedy_proven_optimal(fill_solver))
        section.predictions.choice = joint.choice
        plan = plan.model_copy(update={"fill": section})
        if fill.gpu_sharing == "timeslice":  # what MPS would buy on this plan: its units at their own speed
            from .validate import repack_fill
            mps = repack_fill(plan, fill.model_copy(update={"gpu_sharing": "mps"}), alone=alone)
            plan.fill.predictions.under_mps_tflops_per_gpu = mps.fill.predictions.fill_tflops_per_gpu
    if engine.export:
        return plan.model_copy(update={"launch": engine_launch(plan, plan_path)}), result
    if any(u.experts for u in profile.units) and not engine.expert_parallel:
        others = " or ".join(e.name for e in ENGINES.values() if e.expert_parallel)
        plan.search.rejected[f"expert parallelism, which {engine.title} does not run (--engine {others} plans it)"] = 1
    return plan, result


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """The objects alive now (torch's, the model's and its graphs: ~0.5M) kept out of the cyclic GC's passes while
    the search makes its ~1M small ones, and put back after: of Llama-3-405B's search on 1024 GPUs, 1.7 s of 8.8 were
    full collections walking them, 0.6 s with them frozen (nothing in them is garbage the search could free)."""
    if gc.get_freeze_count():  # frozen already, by a caller
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_pinned_split(pins: Pins, refused: dict[str, str]) -> None:
    """A tensor-parallel degree (with sequence parallelism) or a context-parallel one the user pinned and the runtime
    cannot split the model at: one sentence naming the op and its source line. Where the search chooses, it leaves
    them out (Evaluator.refused)."""
    if (pins.cp or 1) > 1 and (op := refused.get("cp")) is not None:
        raise UserError(refusal_sentence("context", op))
    if not pins.tp or pins.tp == 1:
        return
    if pins.sp and (op := refused.get(f"{pins.tp}+sp")) is not None and str(pins.tp) not in refused:
        raise UserError(refusal_sentence("sequence", op))
    if (op := refused.get(str(pins.tp))) is not None:
        raise UserError(refusal_sentence("sequence", op) if pins.sp else refusal_sentence("tensor", op, pins.tp))


def _choose_fill(ev: Evaluator, pins: Pins, result: SearchResult, jobs: dict, *, main_slack: float, offload: str,
                 safety_margin: float, solver: str, fill_value: float, top: int, simulate_top: int,
                 policy: str) -> JointChoice:
    """The main configuration and its fill. Unless the user pinned the schedule, the best configurations that
    shrink the bubbles (zero-bubble schedules) and that keep and fill them are compared: the side the search's
    best is on comes from the search, the other from a search pinned to its schedule kinds."""
    kw = dict(main_slack=main_slack, offload=offload, safety_margin=safety_margin, solver=solver,
              fill_value=fill_value, policy=policy)
    candidates = [result.best, *result.runners_up]
    zero = tuple(n for n, k in SCHEDULES.items() if k.split_backward)
    bubbly = tuple(n for n, k in SCHEDULES.items() if not k.split_backward)
    pinned = pins.schedule or (", ".join(pins.schedules) if pins.schedules is not None else None)
    if pinned or not zero or not bubbly:
        joint = choose_joint(ev, candidates, jobs, **kw)
        why = (f"the schedule is pinned ({pinned})" if pinned else
               f"every schedule kind is {'zero-bubble' if not bubbly else 'one that keeps its bubbles'}")
        return replace(joint, choice=f"{why}: shrinking the bubbles and filling them were not compared")
    best_shrinks = result.best.config.schedule_kind.split_backward
    own = [e for e in candidates if e.config.schedule_kind.split_backward == best_shrinks]
    kinds = bubbly if best_shrinks else zero
    try:
        pinned_result = search(ev, replace(pins, schedule=None, schedules=kinds), top=top, simulate_top=simulate_top)
        other, why_none = [pinned_result.best, *pinned_result.runners_up], ""
    except NoFeasibleConfig:
        other, why_none = [], f"no configuration with a schedule of {', '.join(kinds)} is feasible here"
    shrink, keep = (own, other) if best_shrinks else (other, own)
    return choose_shrink_or_fill(ev, shrink, keep, jobs, no_shrink=why_none, no_keep=why_none, **kw)


MAX_MFU = 0.75  # no published dense training run comes near; above it the cost model is wrong


def _check_physics(ev: Evaluator, best: Evaluation) -> None:
    """A plan faster than the GPU can compute is a pricing error: refuse it, naming the unit whose
    priced time implies the highest FLOP rate."""
    c, peak = best.config, ev.hw.gpu.peak(best.config.peak_dtype)
    if best.mfu <= MAX_MFU and best.hardware_tflops_per_gpu * 1e12 <= peak:
        return
    rates = []
    for u in ev.units:
        ut = unit_time(u, ev.hw, c)
        if ut.fwd_s + ut.bwd_s > 0:
            rates.append(((u.fwd_flops(c.b) + u.bwd_flops(c.b)) / c.tp / (ut.fwd_s + ut.bwd_s), u.name))
    rate, name = max(rates, default=(0.0, "?"))
    raise PricingError(f"pricing error: the best plan ({c}) would run at MFU {best.mfu:.0%} / "
                       f"{best.hardware_tflops_per_gpu:.0f} TFLOP/s per GPU against a {peak / 1e12:.0f} TFLOP/s peak; "
                       f"unit {name} is priced at {rate / 1e12:.0f} TFLOP/s; please report this model")


def _to_plan(profile: ModelProfile, ev: Evaluator, best: Evaluation, sim: SimResult,
             runners: list[Evaluation], r: SearchResult, seconds: float, pins: Pins, plan_path: str,
             leaves: tuple[str, ...], mps: bool = False) -> Plan:
    c = best.config
    stages = []
    rank_of = c.placement.rank_of
    for j, (a, b) in enumerate(zip(best.bounds, best.bounds[1:])):
        units = profile.units[a:b]
        stages.append(Stage(stage=j, rank=rank_of[j], units=[u.name for u in units],
                            nodes=[n for u in units for n in u.nodes], forward_s=best.forward_s[j],
                            backward_s=best.backward_s[j], weight_s=best.weight_s[j] if best.weight_s else 0.0,
                            activation_bytes=best.activation_bytes[j],
                            weight_bytes=best.weight_bytes[j] if best.weight_bytes else 0.0,
                            tensor_parallel=dict(pair for u in units for pair in u.tp_layout) if c.tp > 1 else {}))
    sched = with_bubbles(ev.schedule(c), sim)
    mem = [RankMemory(rank=i, weights=m.weights, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                      reserve=m.reserve, total=m.total, capacity=ev.capacity) for i, m in enumerate(best.rank_memory)]
    tokens = profile.tokens_per_sample
    hw = ev.hw
    nnodes, nproc, cmds = torchrun_commands(plan_path, ev.n_gpus, hw.cluster.host_gpus, mps=mps)
    gpu = asdict(hw.gpu) | {"peak_flops": dict(hw.gpu.peak_flops)}
    return Plan(
        source=Source(model_file=profile.path, model_sha256=profile.sha256, model_args=profile.kwargs,
                      frontend=profile.frontend, engine=pins.engine,
                      model_shape=profile.model_shape,
                      notes=[*(f"unpriced op {op} ({share:.1%} of the forward's bytes)" for op, share in profile.unpriced),
                             *_host_notes(ev, c),
                             *(n for n in profile.notes  # what the fxplanner runtime needs: its plans only
                               if not ENGINES[pins.engine].export or not n.startswith(UNLAUNCHABLE))],
                      leaves=list(leaves), target=hw.name, gpu=gpu, cluster=asdict(hw.cluster),
                      efficiency=asdict(hw.eff), reserve_bytes=hw.reserve_bytes, gpus=ev.n_gpus,
                      gpus_per_node=hw.cluster.gpus_per_node, global_batch=ev.global_batch,
                      tool_version=__version__),
        config=ConfigModel.of(c),
        alternatives=[Alternative(config=ConfigModel.of(e.config), iteration_s=e.iteration_s, tflops_per_gpu=e.tflops_per_gpu,
                                  mfu=e.mfu, peak_memory=max(m.total for m in e.rank_memory), simulated=e.simulated)
                      for e in runners],
        partition=stages,
        actions=[[str(a) for a in acts] for acts in sched.ranks],
        bubbles=list(sim.bubbles),
        predictions=Predictions(iteration_s=best.iteration_s, samples_per_s=best.samples_per_s,
                                tokens_per_s=best.samples_per_s * tokens, tflops_per_gpu=best.tflops_per_gpu,
                                mfu=best.mfu, hfu=best.hfu, hardware_tflops_per_gpu=best.hardware_tflops_per_gpu,
                                bubble_fraction=best.bubble_fraction, p2p_s=best.p2p_s,
                                tp_comm_s=best.tp_comm_s, allreduce_s=list(best.allreduce_s),
                                optimizer_s=list(best.optimizer_s), memory=mem,
                                action_overhead_s=hw.eff.action_overhead_s),
        launch=Launch(nnodes=nnodes, nproc_per_node=nproc, commands=cmds,
                      script=launch_script(plan_path, ev.n_gpus, hw.cluster.host_gpus, mps=mps)),
        search=SearchInfo(evaluated=r.evaluated, rejected=r.rejected, seconds=seconds, pinned=pins.pinned()),
    )
