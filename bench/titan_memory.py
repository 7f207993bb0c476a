"""The torchtitan Llama-3.1-8B reference configuration (shared/references/reference_runs_torchtitan.json: FSDP2 over 8,
per-op SAC, local batch 2, 8192 tokens, bf16, fp32 reductions) measured by torch's own FSDP2 memory tracker on fake
tensors, beside the planner's prediction, and torchtitan's published peak.

    python bench/titan_memory.py [--out bench/results/titan_memory_cpu_<date>.json]

The tracker (torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker under FakeTensorMode, a fake process group of
8) counts allocated bytes: the same harness as tests/costmodels/test_fsdp2_memory_tracker.py, at the full 8B shape.
torchtitan logs `max_reserved_gib` (torch.cuda.memory_stats' reserved bytes: the caching allocator's segments), which
holds what the allocator keeps cached beside what is allocated: the gap between the two is what this prints. The
planner's device total holds the sharded gradients' pool beside the allocated peak (costmodels.holding.EngineMemory.
grad_pool: FSDP2 allocates them on its reduce-scatter stream, whose cached blocks the compute stream cannot reuse)
and its fixed reserve.
Takes about 2 minutes on 2 CPU cores (no GPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
SHAPE = dict(layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256)
SEQ, LOCAL_BATCH, RANKS = 8192, 2, 8


def _tracked() -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import tests.costmodels.test_fsdp2_memory_tracker as harness

    harness.SHAPE, harness.SEQ, harness.LOCAL_BATCH, harness.RANKS = SHAPE, SEQ, LOCAL_BATCH, RANKS
    return harness.tracked_peak()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tracker-only", action="store_true", help=argparse.SUPPRESS)  # (the child process)
    args = parser.parse_args()
    if args.tracker_only:
        print(json.dumps(_tracked()))
        return
    child = subprocess.run([sys.executable, __file__, "--tracker-only"], capture_output=True, text=True, cwd=ROOT)
    if child.returncode:
        sys.exit(f"the tracker failed: {child.stderr.strip().splitlines()[-1]}")
    tracked = json.loads(child.stdout.strip().splitlines()[-1])

    sys.path.insert(0, str(ROOT))
    from planner.api import make_plan
    from planner.search import Pins

    runs = json.loads((ROOT.parent / "shared" / "references" / "reference_runs_torchtitan.json").read_text())["runs"]
    row = next(r for r in runs if r["id"] == "torchtitan-2412-llama31-8b-fsdp8")
    plan, _ = make_plan(str(ROOT / "examples" / "hf_llama.py"), target=row["gpu"], gpus=RANKS,
                        global_batch=RANKS * LOCAL_BATCH, model_args={"preset": "llama3-8b", "seq": SEQ},
                        pins=Pins(engine="torchtitan", zero=3, dp=RANKS, tp=1, pp=1, cp=1, b=LOCAL_BATCH, compile=False,
                                  recompute="selective", precision="bf16", grad_fp32=True))
    memory = plan.predictions.memory[0]
    allocated = memory.total - plan.source.reserve_bytes - memory.grads  # (the gradient pool: reserved, not allocated)
    result = {
        "config": {**SHAPE, "seq": SEQ, "local_batch": LOCAL_BATCH, "fsdp_ranks": RANKS, "ac": "selective per-op"},
        "tracker_allocated_bytes": tracked, "planner_allocated_bytes": allocated,
        "planner_parts_bytes": {"weights": memory.weights, "grads": memory.grads, "optimizer": memory.optimizer,
                                "activations": memory.activations, "reserve": plan.source.reserve_bytes},
        "planner_total_bytes": memory.total, "torchtitan_max_reserved_gib": row["peak_memory_gib"], "source": row["id"],
        "machine": f"{platform.machine()} CPU, torch {__import__('torch').__version__}",
        "command": "python bench/titan_memory.py",
    }
    print(f"FSDPMemTracker (allocated)      {tracked['Total'] / GiB:6.1f} GiB  (activations {tracked['Activation'] / GiB:.1f},"
          f" temporaries {tracked['Temp'] / GiB:.1f}, optimizer {tracked['OptState'] / GiB:.1f})")
    print(f"planner (allocated, no reserve) {allocated / GiB:6.1f} GiB  ({allocated / tracked['Total'] - 1:+.1%})")
    print(f"torchtitan max_reserved         {row['peak_memory_gib']:6.1f} GiB  (reserved less the tracker's allocated: "
          f"{row['peak_memory_gib'] - tracked['Total'] / GiB:.1f} GiB)")
    total = memory.total / GiB
    print(f"planner (device total)          {total:6.1f} GiB  ({total / row['peak_memory_gib'] - 1:+.1%}"
          f" against torchtitan's: the allocated, the sharded gradients' pool {memory.grads / GiB:.1f} GiB,"
          f" the reserve {plan.source.reserve_bytes / GiB:.1f} GiB)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
