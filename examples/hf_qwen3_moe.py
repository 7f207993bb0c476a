"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_qwen3_moe.py --gpus 256 --engine megatron [--model-arg preset=qwen3-235b-a22b]
        [--model-arg layers=4] [--model-arg seq=4096] [--model-arg config=path/to/config.json]

Presets: qwen3-30b-a3b, qwen3-235b-a22b. Any other config field can be set too (`--model-arg hidden_size=1024`).
Expert parallelism runs in Megatron-Core or torchtitan: plan with --engine megatron (or torchtitan).
"""
import _hf_models as hf  # beside this file (the model loader puts its folder on sys.path)

build_model, example_inputs, sample_batch, loss_fn = hf.model_file("qwen3_moe", "qwen3-235b-a22b")
