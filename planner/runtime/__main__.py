"""``python -m planner.runtime PLAN [PLAN ...]`` under torchrun: run a plan on this rank.

Exit codes: 0 done; 2 a user error (bad plan, changed model file, wrong world size, model file
without sample_batch/loss_fn) - one line on stderr, no traceback, raised identically on every rank
before any collective; 1 a failure while running (the schedule grid marks the failing action).

Several plans (same world size) run in turn in one process group; tests use that to pay torchrun's
start-up once. Metrics hold one entry per plan.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from passes.errors import UserError

from . import CheckedPlan, check_plan, load_runtime_model_file
from .fill_executor import GRACE_S

if TYPE_CHECKING:
    from ..metrics import RunEntry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m planner.runtime",
                                 description="Run an fxplanner plan (under torchrun).")
    ap.add_argument("plans", nargs="+", metavar="PLAN", help="plan.json; several run in turn (same world size)")
    ap.add_argument("--steps", type=int, default=3, help="training iterations (default 3)")
    ap.add_argument("--no-fill", action="store_true", help="never hand bubbles to fill jobs")
    ap.add_argument("--fill-grace", type=float, default=GRACE_S, metavar="SECONDS",
                    help="how long past a bubble's end a fill job may take to pause before it is killed (FreeRide's "
                         f"grace period; default {GRACE_S})")
    ap.add_argument("--metrics", metavar="OUT", help="write per-rank, per-step metrics JSON here (rank 0)")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="torch.manual_seed before build_model on every rank")
    ap.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA is available, else cpu), cpu, cuda")
    ap.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    ap.add_argument("--characterize", metavar="RANK:BUBBLE", help="after the steps, measure that bubble by "
                    "doubling waits inside it until the step slows (PipeFill 4.2); result in the metrics")
    ap.add_argument("--dump-params", metavar="DIR", help=argparse.SUPPRESS)  # debug: DIR/<plan#>/rank<R>.pt
    ap.add_argument("--record-boundary", metavar="DIR", help=argparse.SUPPRESS)  # debug: received tensors, same paths
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    return args


def _error(rank: int, world: int, message: str) -> int:
    print(f"error: rank {rank}/{world}: {message}", file=sys.stderr, flush=True)
    return 2


_PRECHECK_FAILED: list[bool] = []
_TERM: list[int] = []
LINGER_S = 2.0
"""How long a rank that failed its checks waits before exiting (see _linger)."""


def _defer_sigterm() -> Any:
    """torchrun SIGTERMs every rank as soon as one exits. The checks before any collective are short,
    so a rank finishes its own and prints its own message first: on an error it exits with 2 still
    ignoring the signal; otherwise main() restores the old handler and honours a signal it got."""
    try:
        return signal.signal(signal.SIGTERM, lambda signum, frame: _TERM.append(signum))
    except ValueError:  # not the main thread (main() called from a test)
        return None


def _linger() -> None:
    """A rank that failed its checks waits (up to LINGER_S, less once torchrun signals it) so that a
    rank started later reaches its own check and prints its own message before torchrun, seeing
    the first exit, terminates it. Under torchrun with several ranks only."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import time

    until = time.monotonic() + LINGER_S
    while not _TERM and time.monotonic() < until:
        time.sleep(0.02)


def _rank_bubble(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    rank, _, bubble = text.partition(":")
    if not (rank.isdigit() and bubble.isdigit()):
        raise SystemExit(f"error: --characterize takes RANK:BUBBLE (e.g. 0:3), got {text!r}")
    return int(rank), int(bubble)


def main(argv: list[str] | None = None) -> int:
    old_handler = _defer_sigterm()
    term = _TERM
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:  # the plan checks need no torch: a fraction of a second on every rank
        checked = [check_plan(p, world) for p in args.plans]
        files = [load_runtime_model_file(c) for c in checked]
    except UserError as exc:
        _PRECHECK_FAILED.append(True)
        return _error(rank, world, str(exc))
    if old_handler is not None:
        signal.signal(signal.SIGTERM, old_handler)
    if term:
        return 128 + signal.SIGTERM  # the launcher stopped the job while this rank was checking
    try:
        return _run(args, checked, files, rank, world)
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


def _run(args: argparse.Namespace, checked: list[CheckedPlan], files: list[Any], rank: int, world: int) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..metrics import MetricsDocument, save_metrics
    from .executor import ActionError, RunOptions, failure_text, prepare

    device = _device(args.device)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend, timeout = ("nccl" if device.startswith("cuda") else "gloo"), timedelta(seconds=args.timeout)
    if "MASTER_ADDR" in os.environ:  # torchrun (or a launcher setting its environment)
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python -m planner.runtime` of a one-process plan
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    runs = []
    try:
        for i, (c, mf) in enumerate(zip(checked, files)):
            opts = RunOptions(steps=args.steps, fill=not args.no_fill, fill_grace_s=args.fill_grace,
                              optimizer=args.optimizer, lr=args.lr,
                              seed=args.seed, device=device,
                              dump_dir=Path(args.dump_params) / str(i) if args.dump_params else None,
                              characterize=_rank_bubble(args.characterize), record=bool(args.record_boundary))
            ex = prepare(c.plan, mf, opts)
            log = lambda text: print(f"[rank {rank}] {c.path.name}: {text}", flush=True)  # noqa: E731
            try:
                record = ex.run(log=log)
            except ActionError as exc:
                print(f"[rank {rank}] {failure_text(c.plan, exc)}", file=sys.stderr, flush=True)
                traceback.print_exception(exc.__cause__, file=sys.stderr)
                return 1
            if opts.dump_dir is not None:
                ex.dump(opts.dump_dir / f"rank{rank}.pt")
            if args.record_boundary:
                where = Path(args.record_boundary) / str(i)
                where.mkdir(parents=True, exist_ok=True)
                torch.save(ex.recorded, where / f"rank{rank}.pt")
            gathered: list[Any] = [None] * world if rank == 0 else []
            dist.gather_object(record, gathered if rank == 0 else None, dst=0)
            if rank == 0:
                runs.append(_run_entry(c, gathered, args, device))
        if rank == 0 and args.metrics:
            save_metrics(MetricsDocument(runs=runs), args.metrics)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _run_entry(c: CheckedPlan, ranks: list[dict[str, Any]], args: argparse.Namespace, device: str) -> RunEntry:
    """The run's metrics from the gathered rank records, validated: a nonconforming record fails here."""
    from ..metrics import RunEntry
    from ..plan import run_key
    from ..validate import DTYPES

    cfg = c.plan.config
    holder = next(s.rank for s in c.plan.partition if s.stage == len(c.plan.partition) - 1)  # runs the loss
    last = [r for r in ranks if r["pp"] == holder and r["dp"] == 0 and r["tp"] == 0][0]
    return RunEntry.model_validate({
        "plan": str(c.path), "plan_key": run_key(c.plan), "config": cfg.model_dump(), "world": len(ranks), "device": device,
        "steps": args.steps, "fill": not args.no_fill, "optimizer": args.optimizer, "lr": args.lr,
        "seed": args.seed, "dtype": DTYPES[cfg.precision],
        "loss": [s["loss"] for s in last["steps"]],
        "predicted_iteration_s": c.plan.predictions.iteration_s,
        "ranks": sorted(ranks, key=lambda r: r["rank"])})


def _cli() -> None:
    code = main()
    if _PRECHECK_FAILED:  # interpreter shutdown restores SIGTERM's default; nothing to clean up yet
        _linger()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _cli()
