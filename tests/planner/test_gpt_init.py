"""Issue 51 (13): examples/gpt.py initializes as the models it imitates (Megatron-LM, GPT-2): N(0, 0.02) embeddings
and linears, zero biases, residual output projections at 0.02 / sqrt(2 layers), so training starts at ln(vocab)."""
from __future__ import annotations

import math

import pytest
import torch

from passes.load import load_model_file
from tests.conftest import EXAMPLES


def _first_loss(args: dict) -> float:
    mf = load_model_file(EXAMPLES / "gpt.py", {**args, "dropout": 0})
    torch.manual_seed(0)
    net = mf.build("cpu", torch.float32)
    (tokens,), targets = mf.call("sample_batch", 4, 0)
    with torch.no_grad():
        return mf.module.loss_fn(net(tokens), targets).item()


@pytest.mark.parametrize("args,vocab", [({"preset": "tiny"}, 128),
                                        ({"preset": "tiny", "hidden": 256, "vocab": 4096}, 4096)])
def test_the_first_loss_is_near_ln_vocab(args, vocab):
    assert abs(_first_loss(args) - math.log(vocab)) < 1.0
    assert _first_loss({**args, "init": "pytorch"}) > math.log(vocab) + 10  # N(0, 1) embeddings: what it was


def test_the_init_is_megatrons():
    mf = load_model_file(EXAMPLES / "gpt.py", {"preset": "tiny", "layers": 8, "hidden": 256, "vocab": 4096})
    torch.manual_seed(0)
    net = mf.build("cpu", torch.float32)
    params = dict(net.named_parameters())
    assert params["embedding.tok.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["embedding.pos.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.0.mlp.fc1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    for out in ("layers.0.attn.proj.weight", "layers.7.mlp.fc2.weight"):  # scaled by 1 / sqrt(2 layers)
        assert params[out].std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert all(not p.any() for n, p in params.items() if n.endswith("bias") and ".ln" not in n)
    assert all((p == 1).all() for n, p in params.items() if ".ln" in n and n.endswith("weight"))
