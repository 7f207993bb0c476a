"""The MoE host floor (costmodels.compute.MEGATRON_MOE_HOST_S) against the runs that fit it and check it: each priced
with the floor and without it (0), beside what was measured.

    python bench/moe_host_floor.py [--json out.json]

- fit: Qwen3-30B-A3B, FP8-CS, HybridEP, 16 H100 (bench/reference_runs_2026.json mbridge-26041-qwen3-30b-a3b-fp8cs-16);
- checks in the same file: the model's B200 and GB200 rows (MXFP8, EP 8 in one node, MBS 4);
- checks not in the file (runs documented outside the performance tables, added here, priced after they were found):
  Megatron-Bridge's eager BF16 run of the H100 row's shape with Megatron's all-to-all dispatcher (docs/training/
  cuda-graphs.md at the Megatron-Bridge mirror's HEAD, 2026-08: "replay iterations 5-8 averaged 42.00 s versus
  41.36 s for eager"; 16 H100, TP1 PP1 CP1 EP16, MBS 1, GBS 1024, no all-to-all overlap), whose forward's kernels are
  longer than the host's time so the floor must not move it; and the 26.08 container's GB200 run of the model
  (docs/performance-summary.md at HEAD: 39936 tokens/s/GPU, 8 GB200, MXFP8, MBS 4, GBS 512, EP 8; perf_recipes/qwen/
  gb200/qwen3_moe.py qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config: a full-iteration CUDA graph with the paged stash
  (no drain), the 1F1B all-to-all overlap and delayed weight gradients, FP8 attention, which is priced in bf16 here).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import planner.api as api  # noqa: E402
from reference_runs import price_row  # noqa: E402

ROWS = {r["id"]: r for r in json.loads((ROOT / "bench" / "reference_runs_2026.json").read_text())["runs"]}
H100, GB200 = ROWS["mbridge-26041-qwen3-30b-a3b-fp8cs-16"], ROWS["mbridge-26041-qwen3-30b-a3b-mxfp8-gb200-8"]
CHECKS = [
    ("fit", H100),
    ("check", ROWS["mbridge-26041-qwen3-30b-a3b-mxfp8-b200-8"]),
    ("check", GB200),
    ("check, eager BF16 all-to-all", dict(H100, id="mbridge-docs-qwen3-30b-a3b-bf16-alltoall-16", fp8=None,
                                          fp8_params=False, moe_dispatcher="alltoall", measured_iter_s=41.36)),
    ("check, 26.08 full-iteration graph", dict(GB200, id="mbridge-2608-qwen3-30b-a3b-mxfp8-gb200-8",
                                               moe_a2a_overlap=True, measured_iter_s=512 * 4096 / (39936 * 8))),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    floor, out = api.MEGATRON_MOE_HOST_S, []
    for role, row in CHECKS:
        priced = {}
        for host in (floor, 0.0):
            api.MEGATRON_MOE_HOST_S = host
            priced[host] = price_row(row)[0].predictions.iteration_s
        api.MEGATRON_MOE_HOST_S = floor
        meas = row["measured_iter_s"]
        out.append({"id": row["id"], "role": role, "measured_s": meas, "with_floor_s": priced[floor],
                    "without_s": priced[0.0], "error_with": priced[floor] / meas - 1,
                    "error_without": priced[0.0] / meas - 1})
        print(f"{row['id']:45s} {role:34s} measured {meas:7.3f}s  with the floor {priced[floor]:7.3f}s "
              f"({out[-1]['error_with']:+6.1%})  without {priced[0.0]:7.3f}s ({out[-1]['error_without']:+6.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps({"floor_s": floor, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
