"""torchrun driver of tests/engines/test_pipelining_fill.py: train the plans' model with torch's own pipeline runtime
(`_PipelineScheduleRuntime`, loaded from the schedule CSV `planner export --to torchtitan` writes), with the fill
adapter (planner/engines/pipelining.py) attached unless --no-fill, and write each rank's losses, bubbles and fill
report. Each plan runs twice:

- "torch": the schedule built directly, the adapter attached with `attach`;
- "titan": as torchtitan's trainer builds it. The export's command line is parsed by torchtitan's ConfigManager into
  the fill trainer's config (planner/engines/titan.py), torchtitan's `_build_pipeline_schedule` builds the schedule
  from it (its CSV, its loss convention, unscaled gradients), and the fill trainer's own `attach_fill` and `close`
  attach the adapter and write the report. torchtitan's whole trainer does not run here: it needs its tokenizer
  and dataset assets, which its package does not ship.

The model is split as torchtitan splits one (a stage holds the plan's units of that stage, in order): the plans
here are for examples/mlp.py, whose forward runs its units one after the other.

    torchrun --nproc-per-node 2 -m tests.engines.pipelining_run OUT.json PLAN.json [PLAN.json ...] [--no-fill]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from passes.load import load_model_file
from planner.engines.pipelining import attach
from planner.export import to_torchtitan
from planner.plan import load_plan

MODES = ("torch", "titan")
GRACE_S = 0.3
"""The fill's grace period here: two ranks, their fill executors and the suite's other worker share 2 cores, so a unit
may be descheduled past the runtime's 50 ms default (tests/runtime/test_fill_divide.py takes the same)."""


def _titan(plan_path: Path, export, stages: list, loss_fn, fill: bool):
    """The schedule and the fill trainer as torchtitan builds them from the export's command line."""
    from types import SimpleNamespace

    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    from planner.engines.titan import FillTrainer

    argv = [a.replace('"$(dirname "$0")"/', "") for a in export.argv]
    if not fill:
        argv = [a for a in argv if not a.startswith("--fill.") and a != str(plan_path)]
    # the activation-checkpoint subcommand stays last (tyro)
    grace = ["--fill.grace_s", str(GRACE_S)] if fill else []
    cfg = ConfigManager().parse_args([*argv[:-1], *grace, "--dump-folder", str(plan_path.parent / "titan"), argv[-1]])
    assert type(cfg) is FillTrainer.Config, type(cfg)
    schedule = _build_pipeline_schedule(parallelism=cfg.parallelism, local_batch_size=cfg.training.local_batch_size,
                                        stages=stages, loss_fn=lambda out, target: (loss_fn(out, target), None))
    trainer = object.__new__(FillTrainer)  # what FillTrainer.__init__ does after torchtitan's own
    trainer.config, trainer.parallel_dims, trainer.pp_schedule = cfg, SimpleNamespace(pp_enabled=True), schedule
    trainer.device = torch.device("cpu")
    trainer.attach_fill()
    return schedule, trainer


def run(plan_path: Path, steps: int, fill: bool, mode: str) -> dict:
    plan = load_plan(plan_path)
    rank, c = dist.get_rank(), plan.config
    mf = load_model_file(plan.source.model_file, dict(plan.source.model_args))
    torch.manual_seed(0)
    model = mf.build("cpu", torch.float32)
    mine = sorted((s for s in plan.partition if s.rank == rank), key=lambda s: s.stage)
    stages = [PipelineStage(nn.Sequential(*(model.get_submodule(u) for u in s.units)), s.stage, len(plan.partition),
                            torch.device("cpu")) for s in mine]
    csv_path = str(plan_path.with_suffix(".schedule.csv"))
    export = to_torchtitan(plan, module="llama3", config="llama3_debugmodel", schedule_csv=csv_path,
                           fill_plan=str(plan_path))
    if rank == 0:
        Path(csv_path).write_text(export.files[csv_path])
    dist.barrier()
    trainer = None
    if mode == "titan":
        schedule, trainer = _titan(plan_path, export, stages, mf.module.loss_fn, fill)
        adapter = trainer.fill
    else:
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=c.microbatches, loss_fn=mf.module.loss_fn)
        schedule._load_csv(csv_path)
        adapter = attach(schedule, plan, device="cpu", grace_s=GRACE_S) if fill else None
    optimizer = torch.optim.Adam([p for st in stages for p in st.submod.parameters()], lr=1e-3)
    first, last = any(s.stage == 0 for s in mine), any(s.stage == len(plan.partition) - 1 for s in mine)
    step_losses = []
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = mf.call("sample_batch", plan.source.global_batch, step)
        losses: list[torch.Tensor] = []
        schedule.step(*(inputs if first else ()), target=targets if last else None, losses=losses)
        optimizer.step()
        step_losses.append(float(torch.stack(losses).detach().mean()) if losses else None)
    # evaluation runs without the adapter's hooks
    with torch.no_grad():
        schedule.eval(*(inputs if first else ()), target=targets if last else None)
    out = {"plan": str(plan_path), "mode": mode, "rank": rank, "loss": step_losses, "fill": fill}
    if trainer is not None and adapter is not None:  # the fill trainer writes what its rank's fill did
        trainer.close()
        out.update(json.loads((plan_path.parent / "titan" / "fill" / f"rank{rank}.json").read_text()))
    elif adapter is not None:
        out.update(adapter.report())
        adapter.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("plans", type=Path, nargs="+")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-fill", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    runs = [run(p, args.steps, not args.no_fill, mode) for mode in MODES for p in args.plans]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, runs)
    if dist.get_rank() == 0:  # per mode, per plan: each rank's record
        args.out.write_text(json.dumps({mode: [[ranks[i * len(args.plans) + j] for ranks in gathered]
                                               for j in range(len(args.plans))] for i, mode in enumerate(MODES)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
