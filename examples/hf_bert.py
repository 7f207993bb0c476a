"""BERT-large, masked LM from its transformers config, on meta tensors (no download; needs `pip install -e ".[hf]"`).

    planner plan examples/hf_bert.py --gpus 64 [--model-arg preset=bert-large] [--model-arg layers=4]
        [--model-arg seq=2048] [--model-arg config=path/to/config.json]

Presets: bert-large. Any other config field can be set too (`--model-arg hidden_size=1024`).
"""
from planner import hf

FAMILY, PRESET = "bert", "bert-large"


def build_model(preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.build(FAMILY, preset, config, layers, seq, **overrides)


def example_inputs(batch_size, preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.example_inputs(FAMILY, batch_size, seq)


def sample_batch(batch_size, step, preset=PRESET, config=None, layers=None, seq=None, **overrides):
    return hf.sample_batch(FAMILY, batch_size, step, preset, config, seq, **overrides)


loss_fn = hf.loss_fn
