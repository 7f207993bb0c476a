"""Trace and price the 1T-parameter GPT preset on meta tensors; prints time and peak RSS.

    python bench/trace_1t.py [--preset 1t] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import profile_rows  # noqa: E402
from passes.pipeline import analyze  # noqa: E402
from costmodels.hardware import Hardware  # noqa: E402
from planner.config import ParallelConfig  # noqa: E402
from targets.registry import get_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1t")
    ap.add_argument("--json")
    args = ap.parse_args()
    start = time.perf_counter()
    prof, _ = analyze(ROOT / "examples" / "gpt.py", {"preset": args.preset})
    traced = time.perf_counter()
    rows = profile_rows(prof, Hardware(target=get_target("a100-80gb")), ParallelConfig(tp=8, pp=1, dp=1, b=1, m=1))
    end = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"preset": args.preset, "params": prof.total_params, "units": len(prof.units),
           "nodes": sum(len(u.nodes) for u in prof.units), "trace_and_annotate_s": traced - start,
           "price_s": end - traced, "total_s": end - start, "peak_rss_gib": rss / 2**30,
           "passes": dict(prof.pass_times), "fwd_s_per_layer_t8": rows[1]["fwd_s"]}
    print(f"{args.preset}: {prof.total_params / 1e12:.3f}T params, {out['units']} units, {out['nodes']} nodes; "
          f"traced+annotated in {out['trace_and_annotate_s']:.1f}s, priced in {out['price_s']:.2f}s, "
          f"total {out['total_s']:.1f}s, peak RSS {out['peak_rss_gib']:.2f} GiB")
    print("passes: " + ", ".join(f"{k} {v:.2f}s" for k, v in prof.pass_times))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
