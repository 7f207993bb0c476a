"""``python -m planner.runtime PLAN [PLAN ...]`` under torchrun: run a plan on this rank.

Exit codes: 0 done; 2 a user error (bad plan, changed model file, wrong world size, model file
without sample_batch/loss_fn) - one line on stderr, no traceback, raised identically on every rank
before any collective; 1 a failure while running (the schedule grid marks the failing action).

Several plans (same world size) run in turn in one process group; tests use that to pay torchrun's
start-up once. Metrics hold one entry per plan.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from passes.errors import UserError

from . import METRICS_SCHEMA, CheckedPlan, check_plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m planner.runtime", description="Run an fxplanner plan (under torchrun).")
    ap.add_argument("plans", nargs="+", metavar="PLAN", help="plan.json; several run in turn (same world size)")
    ap.add_argument("--steps", type=int, default=3, help="training iterations (default 3)")
    ap.add_argument("--no-fill", action="store_true", help="never hand bubbles to fill jobs")
    ap.add_argument("--metrics", metavar="OUT", help="write per-rank, per-step metrics JSON here (rank 0)")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed before build_model on every rank")
    ap.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA is available, else cpu), cpu, cuda")
    ap.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    ap.add_argument("--dump-params", metavar="DIR", help=argparse.SUPPRESS)  # debug: DIR/<plan#>/rank<R>.pt
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    return args


def _error(rank: int, world: int, message: str) -> int:
    print(f"error: rank {rank}/{world}: {message}", file=sys.stderr, flush=True)
    return 2


@contextmanager
def _sigterm_deferred() -> Iterator[list[int]]:
    """torchrun SIGTERMs every rank as soon as one exits; the plan checks take under a second, so a
    rank finishes its own check (and prints its message) first, then honours the signal."""
    got: list[int] = []
    try:
        old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main thread
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    with _sigterm_deferred() as term:
        args = parse_args(argv)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        try:  # no torch yet: these checks take a fraction of a second on every rank
            checked = [check_plan(p, world) for p in args.plans]
        except UserError as exc:
            return _error(rank, world, str(exc))
    if term:
        return 128 + signal.SIGTERM  # the launcher stopped the job while this rank was checking
    try:
        return _run(args, checked, rank, world)
    except UserError as exc:
        return _error(rank, world, str(exc))
    except KeyboardInterrupt:
        return _error(rank, world, "interrupted")


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        choice = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return choice


def _run(args: argparse.Namespace, checked: list[CheckedPlan], rank: int, world: int) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from passes.load import load_model_file

    from .executor import ActionError, RunOptions, prepare, schedule_of
    from ..schedule import grid

    files = []
    for c in checked:  # still before any collective: a model file without data or loss stops every rank
        mf = load_model_file(c.model_file, dict(c.plan.source.model_args))
        missing = [fn for fn in ("sample_batch", "loss_fn") if not mf.has(fn)]
        if missing:
            raise UserError(f"model file {c.model_file} does not define {' and '.join(missing)}; the runtime needs "
                            "sample_batch(batch_size, step, **model_args) -> (inputs, targets) and "
                            "loss_fn(output, targets)")
        files.append(mf)
    device = _device(args.device)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(seconds=args.timeout))
    runs = []
    try:
        for i, (c, mf) in enumerate(zip(checked, files)):
            opts = RunOptions(steps=args.steps, fill=not args.no_fill, optimizer=args.optimizer, lr=args.lr,
                              seed=args.seed, device=device,
                              dump_dir=Path(args.dump_params) / str(i) if args.dump_params else None)
            ex = prepare(c.plan, mf, opts)
            log = lambda text: print(f"[rank {rank}] {c.path.name}: {text}", flush=True)  # noqa: E731
            try:
                record = ex.run(log=log)
            except ActionError as exc:
                print(f"[rank {rank}] error: {exc}\n{grid(schedule_of(c.plan), mark=(exc.pipeline_rank, exc.step))}",
                      file=sys.stderr, flush=True)
                traceback.print_exception(exc.__cause__, file=sys.stderr)
                return 1
            if opts.dump_dir is not None:
                ex.dump(opts.dump_dir / f"rank{rank}.pt")
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(record, gathered if rank == 0 else None, dst=0)
            if rank == 0:
                runs.append(_run_entry(c, gathered, args, device))
        if rank == 0 and args.metrics:
            out = Path(args.metrics)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"schema": METRICS_SCHEMA, "runs": runs}, indent=1) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _run_entry(c: CheckedPlan, ranks: list[dict[str, Any]], args: argparse.Namespace, device: str) -> dict[str, Any]:
    cfg = c.plan.config
    last = [r for r in ranks if r["pp"] == cfg.pp - 1 and r["dp"] == 0 and r["tp"] == 0][0]
    return {"plan": str(c.path), "config": cfg.model_dump(), "world": len(ranks), "device": device,
            "steps": args.steps, "fill": not args.no_fill, "optimizer": args.optimizer, "lr": args.lr,
            "seed": args.seed, "dtype": "float32",
            "loss": [s["loss"] for s in last["steps"]],
            "predicted_iteration_s": c.plan.predictions.iteration_s,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}


if __name__ == "__main__":
    sys.exit(main())
