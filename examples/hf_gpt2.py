"""GPT-2 XL (1.5B) from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_gpt2.py --gpus 64 [--model-arg preset=gpt2-xl] [--model-arg layers=4]
        [--model-arg seq=2048] [--model-arg config=path/to/config.json]

Presets: gpt2-xl. Any other config field can be set too (`--model-arg hidden_size=1024`).
"""
from planner import hf

FAMILY, PRESET = "gpt2", "gpt2-xl"


def build_model(preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.build(FAMILY, preset, config, layers, seq, **overrides)


def example_inputs(batch_size, preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.example_inputs(FAMILY, batch_size, seq)


def sample_batch(batch_size, step, preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.sample_batch(FAMILY, batch_size, step, preset, config, seq, **overrides)


loss_fn = hf.loss_fn
