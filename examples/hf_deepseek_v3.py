"""DeepSeek-V3 (671B, 37B active; multi-head latent attention) from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_deepseek_v3.py --gpus 256 --engine megatron [--model-arg preset=deepseek-v3]
        [--model-arg layers=4] [--model-arg seq=4096] [--model-arg config=path/to/config.json] [--model-arg mtp=1]

Presets: deepseek-v3. Any other config field can be set too (`--model-arg hidden_size=1024`). `mtp=1` adds the
multi-token-prediction layer DeepSeek-V3 trains with (transformers leaves it out; _hf_models.MultiTokenPrediction).
Expert parallelism runs in Megatron-Core or torchtitan: plan with --engine megatron (or torchtitan).
"""
import _hf_models as hf  # beside this file (the model loader puts its folder on sys.path)

build_model, example_inputs, sample_batch, loss_fn = hf.model_file("deepseek_v3", "deepseek-v3")
