"""Each tensor-parallel rank holds the parameters its plan priced (issue 47: the pricing split the vocabulary embedding
and the LM head over t while the runtime held them whole, +16% on a plain Llama). Every rank's stages are built by
the runtime's own `prepare` on the meta device inside a fake process group of the plan's world (as `planner rehearse`
builds one), without launching a process, and counted as a launch counts them (Holdings.parameters)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from passes.errors import UserError
from passes.load import load_model_file
from planner.api import make_plan
from planner.runtime.executor import RunOptions, held_parameters, prepare, stage_parameters
from passes.sharding.vocab import VOCAB_STYLES
from planner.search import Pins
from planner.validate import _held

from ._util import GPT, ROOT, gpt_args
from .test_styles import MODELS as STYLES_MODELS, REFUSED, STYLES

HF_LLAMA = dict(layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seq=32)
MODELS = {
    **{name: spec for name, spec in STYLES_MODELS.items() if (name, "tp2") not in REFUSED},  # test_styles' (tp2
    # refused at plan time there: nothing runs unlike it was priced)
    "plain_llama": (ROOT / "tests" / "fixtures" / "llama_unfused.py", {"layers": 4}),  # the issue's: 4 layers, hidden 256, GQA, vocabulary 1024
    "hf_llama_small": (ROOT / "examples" / "hf_llama.py", HF_LLAMA),  # Llama-3's 128,256 tokens, hidden 64
    "hf_olmo2": (STYLES / "hf_causal.py", {"family": "olmo2"}),
    "nanogpt_vocab": (STYLES / "nanogpt.py", {"vocab_size": 1024}),  # head and embedding tied (two modules)
    "albert_vocab": (STYLES / "albert_tied.py", {"vocab": 1024}),  # F.linear(h, word_embeddings.weight)
    "gpt_odd_vocab": (GPT, {**gpt_args(2), "vocab": 1027}),  # tied; 1027 rows padded to 2 x 514
}
SPLIT = {"plain_llama", "hf_llama_small", "hf_olmo2", "nanogpt_vocab", "albert_vocab", "gpt_odd_vocab"}
"""Vocabularies of at least VOCAB_MIN (1024) tokens: the plan splits them (passes/tp.py)."""
def _holdings(plan, path, args) -> list[tuple[int, list[str]]]:
    """(parameters, modules split) of each tensor-parallel rank's stages, built on meta by the runtime."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    out = []
    for rank in range(plan.config.tp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.config.tp)
        try:
            built = prepare(plan, load_model_file(str(path), args), RunOptions(device="meta", fill=False),
                            executor=lambda **parts: parts)
            stages = built["stages"]
            out.append((held_parameters(stage_parameters(stages)), sorted({m for st in stages for m in st.tp_sharded})))
        finally:
            dist.destroy_process_group()
    return out


def _padding(plan, path, args) -> float:
    """What a rank holds beyond V/t rows of each vocabulary weight: a vocabulary t does not divide is padded."""
    model = load_model_file(str(path), args).build("meta")
    t, seen, extra = plan.config.tp, set(), 0.0
    for stage in plan.partition:
        for name, style in stage.tensor_parallel.items():
            w = model.get_submodule(name).weight
            if style in VOCAB_STYLES and id(w) not in seen:  # a tied weight once
                seen.add(id(w))
                extra += (-(-w.shape[0] // t) - w.shape[0] / t) * w.shape[1]
    return extra


@pytest.mark.parametrize("name", list(MODELS))
def test_each_tensor_parallel_rank_holds_the_parameters_its_plan_priced(name):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    path, args = MODELS[name]
    plan, _ = make_plan(str(path), gpus=2, global_batch=4, target="a100-80gb", gpus_per_node=2, model_args=args,
                        pins=Pins(tp=2))
    assert plan.config.tp == 2
    styles = plan.partition[0].tensor_parallel
    assert (name in SPLIT) == any(s in VOCAB_STYLES for s in styles.values()), styles
    planned = _held(plan, 0)["parameters"]
    for params, split in _holdings(plan, path, args):
        assert split == sorted(styles)  # the modules the plan split, and no other
        assert planned <= params <= planned + _padding(plan, path, args), (params, planned)


WHOLE = '''
import torch
import torch.nn.functional as F
from torch import nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1024, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 1024)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + self.mlp(x)) + self.emb.weight.square().mean()  # the whole table, not one row


def build_model():
    return LM()


def example_inputs(batch_size):
    return (torch.randint(0, 1024, (batch_size, 16)),)


def sample_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 1024, (batch_size, 16), generator=g),), torch.randint(0, 1024, (batch_size, 16), generator=g)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
'''


def test_a_use_of_the_split_weight_the_runtime_cannot_split_is_refused_at_plan_time(tmp_path):
    model = tmp_path / "whole_table.py"
    model.write_text(WHOLE)
    with pytest.raises(UserError, match=r"2 tensor-parallel ranks, .*`square` \(it reads a vocabulary weight split over "
                                        r"the tensor-parallel ranks whole\) at .*whole_table.py:16"):
        make_plan(str(model), gpus=2, global_batch=4, target="a100-80gb", gpus_per_node=2, pins=Pins(tp=2, sp=False))
    plan, _ = make_plan(str(model), gpus=2, global_batch=4, target="a100-80gb", gpus_per_node=2)  # unpinned: without
    assert plan.config.tp == 1 and any("tensor parallelism" in why for why in plan.search.rejected)
