"""Llama 3 (8B, 70B, 405B) from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_llama.py --gpus 64 [--model-arg preset=llama3-8b] [--model-arg layers=4]
        [--model-arg seq=2048] [--model-arg config=path/to/config.json]

Presets: llama3-8b, llama3-70b, llama3-405b. Any other config field can be set too (`--model-arg hidden_size=1024`).
"""
import _hf_models as hf  # beside this file (the model loader puts its folder on sys.path)

build_model, example_inputs, sample_batch, loss_fn = hf.model_file("llama", "llama3-8b")
