"""Plan the Hugging Face example models at their published sizes and print one table.

    python bench/hf_models.py [--gpus 64] [--target a100-80gb] [--json out.json]

Per model: how it was captured, parameters, a block's forward FLOPs against the closed form
(Llama family: 2s(2h^2 + 2h h_kv + 3h ffn) + 4s^2 h; GPT-2 and BERT: 24sh^2 + 4s^2 h; Mixtral: the
Llama form with top-2 of the experts and the router), the chosen plan and its MFU (PaLM).
Needs `pip install -e ".[hf]"`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import make_plan  # noqa: E402
from examples._hf_models import FAMILIES, PRESETS  # noqa: E402
from passes.pipeline import analyze  # noqa: E402

MODELS = [("llama", "llama3-8b"), ("llama", "llama3-70b"), ("mistral", "mistral-7b"), ("qwen2", "qwen2-7b"),
          ("gpt2", "gpt2-xl"), ("bert", "bert-large"), ("mixtral", "mixtral-8x7b")]


def closed_form(family: str, c: dict, s: int) -> float:
    if family in ("gpt2", "bert"):
        h = c.get("n_embd", c.get("hidden_size"))
        return 24 * s * h * h + 4 * s * s * h
    h, ffn = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    experts = c.get("num_experts_per_tok", 1)
    router = h * c.get("num_local_experts", 0)
    return 2 * s * (2 * h * h + 2 * h * kv + experts * 3 * h * ffn + router) + 4 * s * s * h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--target", default="a100-80gb")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print(f"{'model':14s} {'capture':7s} {'params':>9s} {'block FLOPs vs closed form':>27s}  {'plan on ' + str(args.gpus) + ' x ' + args.target:48s} {'MFU':>6s}")
    for family, preset in MODELS:
        path = ROOT / "examples" / f"hf_{family}.py"
        start = time.perf_counter()
        prof, _ = analyze(path, {"preset": preset})
        seq = prof.tokens_per_sample or FAMILIES[family][3]
        block = next(u for u in prof.units if u.kind == "block")
        flops = block.sharded.model_flops(1) + block.replicated.model_flops(1)
        ref = closed_form(family, PRESETS[preset][1], seq)
        try:
            plan, _ = make_plan(str(path), gpus=args.gpus, global_batch=512, target=args.target,
                                model_args={"preset": preset})
            cfg, mfu = str(plan.config.to_config()), plan.predictions.mfu
        except Exception as exc:  # noqa: BLE001 - a model that fits no configuration is a row too
            cfg, mfu = f"({str(exc).splitlines()[0][:60]})", float("nan")
        row = {"model": preset, "frontend": prof.frontend, "params": prof.total_params, "seq": seq,
               "block_flops": flops, "closed_form": ref, "error": flops / ref - 1, "plan": cfg, "mfu": mfu,
               "notes": list(prof.notes), "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"{preset:14s} {prof.frontend:7s} {prof.total_params / 1e9:8.2f}B {flops:11.4g} vs {ref:11.4g} "
              f"{row['error']:+6.2%}  {cfg:48s} {mfu:6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
