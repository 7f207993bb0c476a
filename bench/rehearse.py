"""Rehearse a Llama-3-8B-class pipeline's first, middle and last rank on this machine's one GPU, with fill.

    python bench/rehearse.py [--pp 4] [--layers 16] [--seq 4096] [--steps 6] [--out bench/results/...json]
    python bench/rehearse.py --smoke        # on CPU: a tiny GPT at the cpu-core target, the script end to end

On a GPU it plans examples/hf_llama.py (preset llama3-8b at full width, --layers layers, bf16, t = d = 1, p = --pp,
1F1B: the schedule whose bubbles fill is for) with two fill jobs of PipeFill's and FreeRide's kinds, a BERT-base
inference job (examples/bert.py) and a ResNet-50 training job (examples/vision.py), for the GPU's own target
(H100 -> h100-sxm, H200 -> h200, B200 -> b200). Then `planner rehearse` runs pipeline ranks 0, p/2 and p-1 for real
(planner/runtime/rehearse.py: their stages as the runtime builds them, every receive arriving when the plan's
simulation says, on CUDA a spinning kernel in its place), each first without fill and then with fill offered the
plan's share of each bubble and 50%, 68% and 90% of it. It prints, per rank, stage time per action kind, peak memory,
bubble durations, and per fill fraction the main job's slowdown and the fill recovered, each against the plan; the
figure PipeFill is judged by is a slowdown under 2% with 68% of bubble time filled. It writes
bench/results/rehearse_<gpu>_<date>.json (device, torch, CUDA, the command, the plan's figures, every report).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRACTIONS = (None, 0.5, 0.68, 0.9)  # None: what the plan offers (the bubble less its safety margin)
TARGETS = {"H100": "h100-sxm", "H200": "h200", "B200": "b200"}


def _fill_yaml(smoke: bool) -> str:
    examples = ROOT / "examples"
    if smoke:
        return (f"gpu_sharing: none\njobs:\n  - name: mlp-train\n    model: {examples / 'mlp.py'}\n"
                "    model_args: {features: 32, width: 64, depth: 2}\n    kind: train\n    batch_sizes: [8]\n"
                "    work: {iterations: 100000}\n")
    return (f"jobs:\n  - name: bert-base-infer\n    model: {examples / 'bert.py'}\n    model_args: {{preset: base}}\n"
            "    kind: infer\n    batch_sizes: [8, 32]\n    work: {samples: 10000000}\n"
            f"  - name: resnet50-train\n    model: {examples / 'vision.py'}\n    model_args: {{arch: resnet50}}\n"
            "    kind: train\n    batch_sizes: [32, 64]\n    work: {iterations: 1000000}\n")


def _plan(args: argparse.Namespace, target: str, tmp: Path):
    from planner.api import make_plan
    from planner.fill.spec import load_fill_spec
    from planner.plan import save_plan
    from planner.search import Pins

    fill_file = tmp / "fill.yaml"
    fill_file.write_text(_fill_yaml(args.smoke))
    if args.smoke:
        model, model_args = ROOT / "examples" / "gpt.py", {"preset": "tiny", "layers": args.pp, "hidden": 256,
                                                         "seq": 128, "dropout": 0}
        precision, batch, b = "fp32", 4 * args.pp, 2
    else:
        model, model_args = ROOT / "examples" / "hf_llama.py", {"preset": "llama3-8b", "layers": args.layers,
                                                               "seq": args.seq}
        precision, batch, b = "bf16", 4 * args.pp, 1
    plan, _ = make_plan(str(model), gpus=args.pp, global_batch=batch, target=target, gpus_per_node=args.pp,
                        model_args=model_args, fill=load_fill_spec(fill_file),
                        pins=Pins(tp=1, pp=args.pp, dp=1, cp=1, b=b, v=1, schedule="1f1b", precision=precision))
    path = tmp / "plan.json"
    save_plan(plan, path)
    return plan, path


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _print(rank: int, r: dict) -> None:
    print(f"\npipeline rank {rank} on {r['device']}")
    for k in r["action_kinds"]:
        err = "" if not k["predicted_s"] else f" ({k['measured_s'] / k['predicted_s'] - 1:+.1%})"
        print(f"  stage {k['stage']} {k['kind']:>18}: predicted {_ms(k['predicted_s'])}, measured "
              f"{_ms(k['measured_s'])}{err} (x{k['count']})")
    mem = r["memory"]
    gib = lambda x: "-" if x is None else f"{x / 2**30:.2f} GiB"  # noqa: E731
    print(f"  memory: planned {gib(mem['predicted_bytes'])}, peak allocated {gib(mem['allocated_peak_bytes'])}, "
          f"reserved {gib(mem['reserved_peak_bytes'])}")
    pred = sum(b["predicted_s"] for b in r["bubbles"])
    meas = sum(b["measured_s"] or 0.0 for b in r["bubbles"])
    print(f"  bubbles: {len(r['bubbles'])}, predicted {_ms(pred)} in all, measured {_ms(meas)} (the run "
          "without fill: the replayed pipeline with this rank's own times)")
    for run in r["runs"]:
        w = run["fill_work"]
        fill = "" if w is None else (
            f", fill {w['units_per_step']:.1f} units/step (planned {w['planned_units_per_step']}), "
            f"{_tf(w['tflops'])} TFLOP/s (plan {_tf(w['planned_tflops'])}/GPU), {w['kills']} kill(s), "
            f"{w['errors']} error(s)")
        slow = "" if run["slowdown"] is None else f", slowdown {run['slowdown']:+.2%}"
        print(f"  {run['label']:>28}: step {_ms(run['step_s']['median'])} [{_ms(run['step_s']['min'])}, "
              f"{_ms(run['step_s']['max'])}]{slow}{fill}")


def _tf(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks (4 to 8)")
    ap.add_argument("--layers", type=int, default=16, help="transformer layers of the 8B-class model")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first runs without fill)")
    ap.add_argument("--smoke", action="store_true", help="on CPU: a tiny GPT at the cpu-core target")
    ap.add_argument("--out", help="the JSON to write (default bench/results/rehearse_<gpu>_<date>.json)")
    args = ap.parse_args(argv)
    from planner.runtime.rehearse import RehearseOptions, rehearse

    if args.smoke:
        device, gpu, target = "cpu", "cpu", str(ROOT / "examples" / "targets" / "cpu-core.yaml")
    elif not torch.cuda.is_available():
        print("bench/rehearse.py rehearses on a GPU; none is here (run it with --smoke to check it on CPU)",
              file=sys.stderr)
        return 2
    else:
        device, name = "cuda:0", torch.cuda.get_device_name(0)
        gpu = next((k for k in TARGETS if k in name), None)
        if gpu is None:
            print(f"no built-in target for {name}; known: {', '.join(TARGETS)}", file=sys.stderr)
            return 2
        target = TARGETS[gpu]
    with tempfile.TemporaryDirectory(prefix="fxp-rehearse-") as tmp:
        plan, path = _plan(args, target, Path(tmp))
        fp = plan.fill.predictions if plan.fill else None
        print(f"plan: {plan.config.model_dump()}\n  predicted iteration {_ms(plan.predictions.iteration_s)}, "
              f"bubble fraction {plan.predictions.bubble_fraction:.1%}"
              + (f", fill {fp.fill_tflops_per_gpu:.2f} TFLOP/s/GPU in {fp.bubble_time_used:.0%} of bubble time"
                 if fp else ""))
        date = datetime.date.today().isoformat()
        out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"rehearse_{gpu.lower()}_{date}.json"
        reports = {}
        for rank in sorted({0, args.pp // 2, args.pp - 1}):
            r = rehearse(path, RehearseOptions(rank=rank, steps=args.steps, compare_no_fill=True,
                                               fill_fractions=FRACTIONS, device=device), log=lambda _: None)
            r.pop("metrics")
            reports[str(rank)] = r
            _print(rank, r)
            _write(out, argv, device, date, target, plan, fp, reports)  # after each rank: a cut run keeps it
    print(f"\nwritten {re.sub(str(ROOT) + '/', '', str(out))}")
    return 0


def _write(out: Path, argv: list[str] | None, device: str, date: str, target: str, plan, fp, reports: dict) -> None:
    doc = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "command": " ".join(["python", "bench/rehearse.py",
                                                           *map(shlex.quote, argv or sys.argv[1:])]),
           "date": date, "target": target, "plan": {
               "config": plan.config.model_dump(), "model_args": plan.source.model_args,
               "predicted_iteration_s": plan.predictions.iteration_s,
               "bubble_fraction": plan.predictions.bubble_fraction,
               "fill": fp.model_dump() if fp else None,
               "fill_jobs": [{"name": j.name, "batch_size": j.batch_size, "config": j.config} for j in plan.fill.jobs]
               if plan.fill else []},
           "pipefill_reference": "PipeFill: main-job slowdown under 2% with 68% of bubble time filled",
           "ranks": reports}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
