"""Trace and price big models on meta tensors, each in a fresh process: seconds and peak RSS.

    python bench/trace_speed.py [--json out.json] [--cold]

Cases: the 1T GPT preset (128 layers, h 25600) and Llama-3-405B (126 layers, h 16384, GQA; built
from its transformers config, needs the `hf` extra), then the whole `planner plan` of the 22B GPT
(48 layers, h 6144) on 64 GPUs. Each case runs in its own interpreter, so the RSS is that case's
alone (it includes importing torch, and transformers for the HF model); "trace+price" is the
`analyze` call (capture, measure, costs, units, check) without the imports.

Then the cold start of the `planner` command (--cold: only these), each a fresh process, the median of 3: `planner
--help`, an argument error (`plan ... --gpus 0`: answered before torch is imported) and the whole plan of Llama-3-405B
on 1024 H100s. Wall seconds, and the CPU seconds of the process (the wall time of a loaded machine is not the
command's).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ANALYZE = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from passes.pipeline import analyze
start = time.perf_counter()
prof, _ = analyze({path!r}, {kwargs!r})
took = time.perf_counter() - start
print(json.dumps({{"seconds": took, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   "params": prof.total_params, "units": len(prof.units), "frontend": prof.frontend,
                   "passes": dict(prof.pass_times)}}))
"""

CASES = [
    ("GPT 1T preset", ROOT / "examples" / "gpt.py", {"preset": "1t"}),
    ("Llama-3-405B (HF)", ROOT / "examples" / "hf_llama.py", {"preset": "llama3-405b"}),
]


def analyze_case(path: Path, kwargs: dict) -> dict:
    code = _ANALYZE.format(root=str(ROOT), path=str(path), kwargs=kwargs)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def plan_case(tmp: Path) -> dict:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "planner", "plan", str(ROOT / "examples" / "gpt.py"), "--gpus", "64",
                          "--model-arg", "layers=48", "--model-arg", "hidden=6144", "--model-arg", "heads=48",
                          "-o", str(tmp / "plan22b.json")], capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - start
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"seconds": took}


COLD = [
    ("planner --help", ["--help"], 0),
    ("argument error (plan --gpus 0)", ["plan", "examples/gpt.py", "--gpus", "0"], 2),
    ("plan Llama-3-405B on 1024 x h100-sxm", ["plan", "examples/hf_llama.py", "--model-arg", "preset=llama3-405b",
                                            "--gpus", "1024", "--target", "h100-sxm", "-o", "{tmp}/plan405b.json"], 0),
]


def cold_case(argv: list[str], code: int, repeats: int = 3) -> dict:
    """`planner ARGV` in a fresh interpreter `repeats` times: the median wall and CPU seconds."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if run.returncode != code:
            return {"error": f"exit {run.returncode}: " + (run.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"seconds": statistics.median(walls), "cpu_seconds": statistics.median(cpus), "runs": walls}


def cold_starts(results: dict) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, argv, code in COLD:
            r = results[f"cold: {name}"] = cold_case([a.format(tmp=tmp) for a in argv], code)
            print(f"cold {name}: " + (r["error"] if "error" in r else
                  f"{r['seconds']:.2f}s wall, {r['cpu_seconds']:.2f}s CPU (median of 3)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--cold", action="store_true", help="only the cold starts of the planner command")
    args = ap.parse_args()
    results = {}
    if args.cold:
        cold_starts(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    for name, path, kwargs in CASES:
        r = results[name] = analyze_case(path, kwargs)
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        print(f"{name}: {r['params'] / 1e9:,.1f}B params, {r['units']} units ({r['frontend']}); trace+price "
              f"{r['seconds']:.2f}s, peak RSS {r['rss_gib']:.2f} GiB (process)")
        print("  passes: " + ", ".join(f"{k} {v:.2f}s" for k, v in r["passes"].items()))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        r = results["planner plan GPT-22B on 64 GPUs"] = plan_case(Path(tmp))
    print(f"planner plan GPT-22B (48 layers, h 6144) on 64 GPUs: "
          + (r["error"] if "error" in r else f"{r['seconds']:.2f}s wall, whole command"))
    cold_starts(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
