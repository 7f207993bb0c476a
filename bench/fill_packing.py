"""Fill-job packing: PipeFill's greedy (Algorithm 1) against the CP-SAT packer.

    python bench/fill_packing.py [--json out.json] [--time-limit 1.0] [--cycles 4]

Seeded 1F1B-shaped bubble cycles (one long fill-drain bubble with most memory free, a few short
bubbles inside the steady phase with little memory free) x fill jobs (BERT inference, MLP and
ResNet-50 training, XLM inference), each packed in two models:

* ``base``: PipeFill's model, a chunk boundary costs only the launch overhead. Greedy is provably
  optimal here (see planner/fill/packing.py), so CP-SAT can only match it.
* ``swap``: state live at a chunk boundary (activations saved for backward) is offloaded to the
  host when the bubble ends and reloaded before the next chunk, over PCIe.

``ff`` is greedy taking the farthest end that fits instead of stopping at the first unit that
does not (``greedy_pack(farthest_fit=True)``); CP-SAT is hinted with the better of the two.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.fill import BubbleSlot, FillUnit, cpsat_pack, greedy_pack, validate_packing  # noqa: E402

MS, MB, GB = 1e-3, 1 << 20, 1 << 30
PCIE_BW = 12e9  # bytes/s, host<->device for state swapping
SEED = 20240917


def one_f_one_b_cycle(rng: random.Random, *, stages: int, stage: int, t_f_ms: float,
                      short: int, free_gb: float) -> list[BubbleSlot]:
    """A rank's per-iteration bubbles: the fill-drain bubble, then ``short`` steady-phase gaps."""
    fill_drain = (stages - 1) * 3 * t_f_ms * rng.uniform(0.9, 1.1)  # (p-1)(t_f + t_b), t_b = 2 t_f
    slots = [BubbleSlot(id=0, duration_s=fill_drain * MS, free_bytes=int(free_gb * GB))]
    in_flight = stages - stage  # microbatches whose activations the main job holds
    for i in range(1, short + 1):
        slots.append(BubbleSlot(
            id=i, duration_s=rng.uniform(0.3, 1.5) * t_f_ms * MS,
            free_bytes=int(max(0.5, free_gb - in_flight * rng.uniform(1.0, 3.0)) * GB),
        ))
    return slots


def imbalanced_cycle(rng: random.Random) -> list[BubbleSlot]:
    """A middle rank of an imbalanced pipeline: the fill-drain bubble, a short gap, and a medium
    gap while the main job holds most of its activations (little memory free)."""
    return [BubbleSlot(id=0, duration_s=rng.uniform(45, 65) * MS, free_bytes=int(rng.uniform(14, 20) * GB)),
            BubbleSlot(id=1, duration_s=rng.uniform(5, 10) * MS, free_bytes=int(rng.uniform(8, 16) * GB)),
            BubbleSlot(id=2, duration_s=rng.uniform(30, 45) * MS, free_bytes=int(rng.uniform(2, 4) * GB))]


def cycles(seed: int) -> dict[str, list[BubbleSlot]]:
    """Each cycle draws from its own seeded stream, so adding a case does not change the others."""
    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}/{name}")

    return {
        "pp4.s0": one_f_one_b_cycle(rng("pp4.s0"), stages=4, stage=0, t_f_ms=12, short=4, free_gb=18),
        "pp4.s3": one_f_one_b_cycle(rng("pp4.s3"), stages=4, stage=3, t_f_ms=12, short=3, free_gb=22),
        "pp8.s5": one_f_one_b_cycle(rng("pp8.s5"), stages=8, stage=5, t_f_ms=6, short=6, free_gb=12),
        "pp3.s1": imbalanced_cycle(rng("pp3.s1")),
    }


def _unit(name: str, ms: float, mem_gb: float, tflop: float, state_mb: float = 0.0) -> FillUnit:
    return FillUnit(name=name, time_s=ms * MS, mem_bytes=int(mem_gb * GB), flops=tflop * 1e12,
                    state_bytes=int(state_mb * MB))


def training(name: str, fwd: list[tuple[float, float, float]], opt_ms: float) -> list[FillUnit]:
    """fwd: (ms, activation GB saved for backward, TFLOP) per block; backward takes twice as long
    and frees the block's activations; nothing is live after the optimizer step."""
    units, live = [], 0.0
    for i, (ms, act, tflop) in enumerate(fwd):
        live += act
        units.append(_unit(f"{name}.f{i}", ms, live + act, tflop, live * 1024))
    for i, (ms, act, tflop) in reversed(list(enumerate(fwd))):
        live -= act
        units.append(_unit(f"{name}.b{i}", 2 * ms, live + 2 * act, 2 * tflop, live * 1024))
    units.append(_unit(f"{name}.opt", opt_ms, 0.2, 0.01))
    return units


def jobs(rng: random.Random) -> dict[str, tuple[list[FillUnit], int]]:
    """Units and resident bytes (weights, plus optimizer state when training)."""
    bert = [_unit("bert.embed", 0.6, 0.3, 0.05, 1.5)]
    bert += [_unit(f"bert.layer{i}", rng.uniform(1.0, 1.4), 0.4, 0.9, 1.5) for i in range(12)]
    bert += [_unit("bert.head", 0.4, 0.3, 0.02)]
    mlp = training("mlp", [(rng.uniform(0.6, 1.2), 0.15, 0.2) for _ in range(4)], 0.5)
    resnet = training("rn50", [(3.0, 0.8, 0.9), (4.5, 0.6, 1.2), (5.0, 0.4, 1.5), (3.5, 0.2, 1.0),
                               (1.5, 0.1, 0.5)], 2.0)
    gpt = training("gpt-mini", [(rng.uniform(2.5, 3.5), rng.uniform(0.08, 0.35), 0.8)
                                for _ in range(5)], 1.0)
    xlm = [_unit(f"xlm.layer{i}", rng.uniform(3.5, 4.5), rng.choice([2.5, 6.0]), 4.0, 8)
           for i in range(24)]
    return {"bert-infer": (bert, 440 * MB), "mlp-train": (mlp, 300 * MB),
            "rn50-train": (resnet, 300 * MB), "gpt-mini-train": (gpt, 500 * MB),
            "xlm-infer": (xlm, int(2.2 * GB))}


def run_case(units, cycle, resident: int, model: str, n_cycles: int, limit: float) -> dict:
    kwargs = dict(resident_bytes=resident, cycles=n_cycles,
                  state_swap_bw=PCIE_BW if model == "swap" else None)
    greedy = greedy_pack(units, cycle, **kwargs)
    farthest = greedy_pack(units, cycle, **kwargs, farthest_fit=True)
    best = cpsat_pack(units, cycle, **kwargs, time_limit_s=limit)
    for packing in (greedy, farthest, best):
        validate_packing(packing, units, cycle)
    return {
        "greedy_fill": greedy.filled_fraction, "cpsat_fill": best.filled_fraction,
        "greedy_units_per_cycle": greedy.units_per_cycle, "cpsat_units_per_cycle": best.units_per_cycle,
        "farthest_fit_units_per_cycle": farthest.units_per_cycle,
        "greedy_s": greedy.solve_time_s, "cpsat_s": best.solve_time_s,
        "solver": best.solver, "status": best.status,
        "empty_bubbles_greedy": len(greedy.empty_bubbles), "empty_bubbles_cpsat": len(best.empty_bubbles),
    }


HEADER = (f"{'case':<26}{'model':<6}{'greedy fill':>12}{'cp-sat fill':>12}{'greedy u/cyc':>13}"
          f"{'ff u/cyc':>9}{'cp-sat u/cyc':>13}{'greedy s':>10}{'cp-sat s':>10}  status")


def fmt(row: dict) -> str:
    gain = "  +" if row["cpsat_units_per_cycle"] > row["greedy_units_per_cycle"] else "   "
    return (f"{row['case']:<26}{row['model']:<6}{row['greedy_fill']:>12.3f}{row['cpsat_fill']:>12.3f}"
            f"{row['greedy_units_per_cycle']:>13.2f}{row['farthest_fit_units_per_cycle']:>9.2f}"
            f"{row['cpsat_units_per_cycle']:>13.2f}"
            f"{row['greedy_s']:>10.4f}{row['cpsat_s']:>10.3f}{gain}{row['solver']}/{row['status']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per case")
    ap.add_argument("--cycles", type=int, default=4, help="bubble cycles in the horizon")
    args = ap.parse_args()
    all_cycles, all_jobs = cycles(SEED), jobs(random.Random(f"{SEED}/jobs"))
    rows = []
    print(HEADER, flush=True)
    for cname, cycle in all_cycles.items():
        for jname, (units, resident) in all_jobs.items():
            for model in ("base", "swap"):
                row = {"case": f"{cname}/{jname}", "model": model,
                       **run_case(units, cycle, resident, model, args.cycles, args.time_limit)}
                rows.append(row)
                print(fmt(row), flush=True)
    better = sum(r["cpsat_units_per_cycle"] > r["greedy_units_per_cycle"] for r in rows)
    beyond = sum(r["cpsat_units_per_cycle"] > r["farthest_fit_units_per_cycle"] for r in rows)
    print(f"CP-SAT completes more units than greedy in {better} of {len(rows)} cases and more than "
          f"farthest-fit (ff) in {beyond} (horizon {args.cycles} cycles, {args.time_limit:g} s limit)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
