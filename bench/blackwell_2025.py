"""The 2025 Blackwell runs beside dgxc-llama31-405b-fp8-gb200-128 (bench/reference_runs_2026.json, priced 21% fast): the
same NVIDIA performance tables' other B200 and GB200 rows, priced as bench/reference_runs.py prices a row, with and
without Transformer Engine's tensor-parallel overlap. Evidence for whoever takes up that row, not reference rows:
nothing here is fitted or asserted.

    python bench/blackwell_2025.py

Rows (tokens/s/GPU as published; FP8 = per-tensor current scaling, "tensorwise", with FP8 parameter gathers as
NeMo's bf16_with_fp8_current_scaling_mixed sets them; distributed optimizer, overlapped gradient reduce, bf16 gradients
as the performance recipes set them):
- NeMo docs, performance summary for the 25.04 container, DGX-GB200 table (docs.nvidia.com/nemo-framework/user-guide/
  latest/performance/archive/25.04-performance-summary.html): GPT3-175B 128 GPUs GBS 256 MBS 2 TP 4 PP 4 VP 12: 1804;
  LLAMA3-8B 8 GPUs GBS 128 MBS 2: 33099; LLAMA3-405B 128 GPUs GBS 64 TP 4 PP 8 CP 2 VP 8: 665. The 25.02 DGX-B200 table
  (the same page's predecessor): GPT3-175B 512 GPUs GBS 2048 MBS 2 TP 4 PP 4 VP 6: 1600; LLAMA3-8B: 26006; LLAMA3-70B
  64 GPUs GBS 128 TP 2 PP 4 CP 2 VP 5: 3062; LLAMA3-405B as above: 625.
- NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md@067f987df03b8355b03192d88d70f1709fedf51a, 25.11,
  DGX-B200: LLAMA3_8B FP8-CS 30624; LLAMA3.1_405B (as above) FP8-CS 661.
NeMo 25.04's recommended GB200 configurations (scripts/performance/recommended_model_configs/model_configs_gb200.csv)
ran GPT3-175B and LLAMA3-8B with CUDA graphs, LLAMA3-405B without.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from reference_runs import REFS, price_row  # noqa: E402

CS = {"fp8": "tensorwise", "fp8_params": True, "grad_reduce_in_fp32": False}
GPT3 = {"global_batch": 256, "tp": 4, "pp": 4, "dp": 8, "microbatch": 2, "vp": 12, **CS}
L8 = {"global_batch": 128, "tp": 1, "pp": 1, "dp": 8, "cp": 1, "microbatch": 2, "vp": None,
      "sequence_parallel": False, **CS}
ROWS = [  # (label, base row, tokens/s/GPU, changes)
    ("GB200 25.04 GPT3-175B", "dgxc-gpt3-175b-128", 1804, {"gpu": "gb200", **GPT3}),
    ("GB200 25.04 Llama3-8B", "dgxc-llama31-8b-fp8-8", 33099, {"gpu": "gb200", **L8}),
    ("GB200 25.04 Llama3.1-405B", "dgxc-llama31-405b-fp8-gb200-128", 665, CS),
    ("B200 25.02 GPT3-175B", "dgxc-gpt3-175b-128", 1600,
     {"gpu": "b200", **GPT3, "gpus": 512, "global_batch": 2048, "dp": 32, "vp": 6}),
    ("B200 25.02 Llama3-8B", "dgxc-llama31-8b-fp8-8", 26006, {"gpu": "b200", **L8}),
    ("B200 25.02 Llama3-70B", "dgxc-llama31-70b-fp8-64", 3062,
     {"gpu": "b200", "global_batch": 128, "tp": 2, "pp": 4, "dp": 4, "cp": 2, "vp": 5, **CS}),
    ("B200 25.02 Llama3.1-405B", "dgxc-llama31-405b-fp8-gb200-128", 625, {"gpu": "b200", **CS}),
    ("B200 25.11 Llama3-8B", "dgxc-llama31-8b-fp8-8", 30624, {"gpu": "b200", **L8}),
    ("B200 25.11 Llama3.1-405B", "dgxc-llama31-405b-fp8-gb200-128", 661, {"gpu": "b200", **CS}),
]


def main() -> None:
    runs = {r["id"]: r for f in (REFS / "reference_runs.json", ROOT / "bench" / "reference_runs_2026.json")
            for r in json.loads(f.read_text())["runs"]}
    print(f"{'run':28s} {'measured':>9s} {'priced':>9s} {'error':>7s} {'no TP overlap':>14s}  configuration")
    for label, base, tokens, changes in ROWS:
        row = {**copy.deepcopy(runs[base]), **changes}
        measured = row["global_batch"] * row["model_args"]["seq"] / (tokens * row["gpus"])
        plan, _ = price_row(row)
        bare, _ = price_row({**row, "tp_comm_overlap": False})
        t, t0 = plan.predictions.iteration_s, bare.predictions.iteration_s
        print(f"{label:28s} {measured:8.3f}s {t:8.3f}s {t / measured - 1:+7.1%} {t0 / measured - 1:+14.1%}  "
              f"{plan.config.to_config()}")


if __name__ == "__main__":
    main()
