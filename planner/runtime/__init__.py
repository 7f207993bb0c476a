"""The runtime: execute a plan under torchrun (``python -m planner.runtime plan.json``).

This package's top level imports neither torch nor pydantic: the checks every rank makes before any
collective (schema version, model file hash, world size) and the local launcher live here, and
``python -m planner.runtime`` guards SIGTERM before the plan module is even imported, so that a bad
plan makes every rank print its message even while torchrun is tearing the others down.

- ``check_plan(path, world_size)``: validate a plan for this launch, or raise UserError.
- ``launch_local(plan, ...)``: run the plan's torchrun command on this machine, stream rank logs.
- ``summarize(metrics)``: per-step figures of a metrics document (what ``planner launch`` prints).

The metrics document's models (``planner.metrics``, pydantic) are imported lazily; its schema string
``METRICS_SCHEMA`` is defined here so that this package stays light.

The executor (torch) is ``planner.runtime.executor``; stage building is ``planner.runtime.stage``.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from passes.host import available_host_bytes
from passes.errors import UNLAUNCHABLE, UserError

from ..engines import ENGINES

if TYPE_CHECKING:
    from ..metrics import MetricsDocument
    from ..plan import Plan

__all__ = ["CheckedPlan", "LocalRun", "check_plan", "load_runtime_model_file", "resolve_model_file", "torchrun_command", "launch_local",
           "local_overload",
           "child_env", "summarize", "mean_iteration_s", "METRICS_SCHEMA"]

METRICS_SCHEMA = "fxplanner.metrics/v1"
"""Schema string of the metrics document (planner.metrics.MetricsDocument)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckedPlan:
    path: Path
    plan: Plan
    model_file: Path


def resolve_model_file(plan: Plan, plan_path: Path) -> Path:
    """The plan's model file: absolute as is; relative to the working directory, else to the plan."""
    given = Path(plan.source.model_file)
    for candidate in ([given] if given.is_absolute() else [Path.cwd() / given, plan_path.parent / given]):
        if candidate.is_file():
            return candidate
    raise UserError(f"plan {plan_path} was made from model file {given}, which does not exist here (looked in "
                    f"{Path.cwd()} and next to the plan)")


def check_plan(path: str | Path, world_size: int) -> CheckedPlan:
    """Everything a rank checks before any collective; every rank reaches the same verdict."""
    from ..plan import load_plan

    path = Path(path)
    plan = load_plan(path)  # schema version, fields, and their consistency (the action lists included)
    model = resolve_model_file(plan, path)
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    if digest != plan.source.model_sha256:
        raise UserError(f"model file {model} has sha256 {digest[:16]}..., but plan {path} was made from "
                        f"{plan.source.model_sha256[:16]}...; the file changed since planning - re-run `planner plan`")
    c = plan.config.to_config()
    if c.tp_comm_overlap:  # refused rather than run unlike what was priced
        raise UserError(f"plan {path} uses tensor-parallel communication overlap (Transformer Engine's userbuffers), "
                        "which this runtime does not run; re-plan without --tp-comm-overlap (or export it to "
                        "Megatron-LM with `planner export`)")
    if ENGINES[plan.source.engine].export:
        raise UserError(f"plan {path} was made for {plan.source.engine}: launch it with `planner export {path} --to "
                        f"{plan.source.engine}` (its plan.launch commands), not with the fxplanner runtime")
    if c.ep > 1:
        raise UserError(f"plan {path} divides its experts over {c.ep} expert-parallel ranks, which this runtime does "
                        "not run; export it with `planner export --to megatron` or re-plan with --ep 1")
    if c.zero == 3:
        raise UserError(f"plan {path} shards its parameters over the data-parallel ranks (ZeRO-3 / FSDP), which this "
                        "runtime does not run (it runs ZeRO-1 and ZeRO-2); re-plan with --engine megatron or "
                        "--engine torchtitan, or pin --shard-optimizer")
    if c.fp8:
        raise UserError(f"plan {path} runs its linear layers' GEMMs in FP8 ({c.fp8}), which this runtime does not run; "
                        "export it with `planner export --to megatron` (Transformer Engine recipes) or re-plan without "
                        "--fp8")
    unlaunchable = next((n for n in plan.source.notes if n.startswith(UNLAUNCHABLE)), None)
    if unlaunchable is not None:  # passes.pipeline's note: the model file gives the runtime no data or no loss
        raise UserError(f"{unlaunchable[len(UNLAUNCHABLE):].lstrip(': ')}: define what is missing and re-plan "
                        f"(plan {path} cannot be launched)")
    need = c.world
    if need != world_size:
        raise UserError(f"plan {path} needs tp*cp*pp*dp = {c.tp}*{c.cp}*{c.pp}*{c.dp} = {need} processes, but this "
                        f"launch has WORLD_SIZE={world_size}; start it with {need} processes (torchrun --nproc-per-node ...)")
    return CheckedPlan(path=path, plan=plan, model_file=model)


def load_runtime_model_file(c: CheckedPlan) -> Any:
    """Import the plan's model file (and torch); it must also define sample_batch and loss_fn."""
    from passes.load import load_model_file

    mf = load_model_file(c.model_file, dict(c.plan.source.model_args))
    missing = [fn for fn in ("sample_batch", "loss_fn") if not mf.has(fn)]
    if missing:
        raise UserError(f"model file {c.model_file} does not define {' and '.join(f'{m}()' for m in missing)}; the "
                        "runtime needs sample_batch(batch_size, step, **model_args) -> (inputs, targets) and "
                        "loss_fn(output, targets)")
    return mf


# ---------------------------------------------------------------------------------------------
# Local launch


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalRun:
    returncode: int
    metrics: MetricsDocument | None
    command: list[str]


def torchrun_command(plan_path: str | Path, world: int, runtime_args: list[str]) -> list[str]:
    """``torchrun --standalone --nnodes 1 --nproc-per-node WORLD -m planner.runtime PLAN ...``."""
    return [sys.executable, "-m", "planner.runtime.torchrun", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(world), "--tee", "3", "-m", "planner.runtime", str(plan_path), *runtime_args]


_TEE_PREFIX = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(?:\[rank \1\] )?")

RANK_PROCESS_BYTES = 220 << 20
"""Host memory of one rank process before its model: Python, torch and gloo (219 MB max RSS of `import torch,
torch.distributed` measured on the 2-core CI machine)."""
RANKS_PER_CORE = 4
"""A local launch with more rank processes per core than this is refused (gloo's collectives time out long before)."""


def local_overload(plan: Plan) -> str | None:
    """Why this machine cannot hold the plan's ranks (processes against cores, memory against what is available),
    or None. A rank holds its stage in host memory as the plan predicts it on the target GPU."""
    c = plan.config.to_config()
    cores = os.cpu_count() or 1
    replicas = c.world // max(c.pp, 1)
    need = c.world * RANK_PROCESS_BYTES + replicas * sum(m.total - m.reserve for m in plan.predictions.memory)
    have = available_host_bytes()
    why = []
    if c.world > RANKS_PER_CORE * cores:
        why.append(f"{c.world} rank processes on {cores} cores (at most {RANKS_PER_CORE} per core)")
    if need > have:
        why.append(f"about {need / 2**30:.1f} GiB for the ranks' processes and stages, {have / 2**30:.1f} GiB "
                   "available")
    return "; ".join(why) or None


def launch_local(plan_path: str | Path, *, steps: int = 3, fill: bool = True, metrics: str | Path | None = None,
                 extra: list[str] | None = None, on_line: Callable[[str], None] = print,
                 timeout_s: float | None = None, oversubscribe: bool = False) -> LocalRun:
    """Run the plan on this machine, one process per rank (gloo on CPU); stream each rank's lines
    prefixed ``[rank N]``; return the exit code and the metrics document (validated). A launch this machine cannot
    hold is refused (`local_overload`) unless `oversubscribe`; interrupted, torchrun and every rank are stopped."""
    from ..metrics import load_metrics

    checked = check_plan(plan_path, _world(plan_path))
    why = None if oversubscribe else local_overload(checked.plan)
    if why:
        raise UserError(f"this machine cannot hold plan {plan_path}'s local launch: {why}; run it on the plan's nodes "
                        "(`planner launch` without --local prints their commands), plan for fewer GPUs, or pass "
                        "--oversubscribe to start it anyway")
    with tempfile.TemporaryDirectory(prefix="fxp-launch-") as tmp:
        out = Path(metrics) if metrics else Path(tmp) / "metrics.json"
        args = ["--steps", str(steps), "--metrics", str(out), *([] if fill else ["--no-fill"]), *(extra or [])]
        cmd = torchrun_command(checked.path, _world(plan_path), args)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=child_env(), start_new_session=True)  # its own group: the ranks stop with it
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                on_line(_TEE_PREFIX.sub(lambda m: f"[rank {m.group(1)}] ", line.rstrip("\n")))
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            _stop_group(proc)
            raise
        doc = load_metrics(out) if rc == 0 and out.is_file() else None
    return LocalRun(returncode=rc, metrics=doc, command=cmd)


def _stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """torchrun and every process it started (its session's group): SIGTERM, then SIGKILL after `grace_s`."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:  # whatever is left of the group (torchrun, or ranks lingering after it)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=1.0)


def child_env() -> dict[str, str]:
    """This environment, with this very ``planner`` package first on PYTHONPATH: the ranks run the
    code that launched them, whatever the working directory or the installed copy."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _world(plan_path: str | Path) -> int:
    from ..plan import load_plan

    return load_plan(plan_path).config.to_config().world


def summarize(metrics: MetricsDocument) -> list[dict[str, Any]]:
    """One row per (run, step): loss, slowest rank's iteration time, bubble time, fill figures."""
    rows = []
    for run in metrics.runs:
        ranks = run.ranks
        for i, loss in enumerate(run.loss):
            steps = [r.steps[i] for r in ranks]
            bubbles = [b for s in steps for b in s.bubbles]
            rows.append({"plan": run.plan, "step": i, "loss": loss, "fill": any(s.fill for s in steps),
                         "iteration_s": max(s.iteration_s for s in steps),
                         "bubble_s": sum(b.duration_s for b in bubbles) / max(len(ranks), 1),
                         "bubbles": len(bubbles)})
    return rows


def mean_iteration_s(metrics: MetricsDocument) -> float:
    """Mean over steps after the first (step 0 runs without fill) of the slowest rank's time."""
    rows = [r for r in summarize(metrics) if r["step"] > 0] or summarize(metrics)
    return sum(r["iteration_s"] for r in rows) / max(len(rows), 1)
