"""gpt-oss (120b, 20b) from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_gpt_oss.py --gpus 256 --engine megatron [--model-arg preset=gpt-oss-120b]
        [--model-arg layers=4] [--model-arg seq=4096] [--model-arg config=path/to/config.json]

Presets: gpt-oss-120b, gpt-oss-20b. Any other config field can be set too (`--model-arg hidden_size=1024`).
Expert parallelism runs in Megatron-Core or torchtitan: plan with --engine megatron (or torchtitan).
"""
import _hf_models as hf  # beside this file (the model loader puts its folder on sys.path)

build_model, example_inputs, sample_batch, loss_fn = hf.model_file("gpt_oss", "gpt-oss-120b")
