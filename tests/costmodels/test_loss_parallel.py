"""The loss as torchtitan holds it under tensor parallelism (issue 49, mechanism 4): loss parallelism, each rank's
cross-entropy on its vocabulary shard of the logits (torch.distributed.tensor.parallel.loss_parallel, torchtitan's
default through 0.2; its _LossParallelCrossEntropy since). What the planner keeps for the loss's backward at t = 2
is checked against what torch's loss_parallel saves on one rank: a DTensor of logits sharded over the vocabulary on a
fake process group of 2 under FakeTensorMode, its saved tensors counted with autograd's saved-tensor hooks (in a
child process: its fake process group stays out of this one)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner.api import make_plan
from planner.search import Pins

ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=4096, seq=64)
B, T = 2, 2

CHILD = """
import json, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

b, s, vocab, t = map(int, sys.argv[1:])
dist.init_process_group("fake", rank=0, world_size=t, store=FakeStore())
mesh = init_device_mesh("cpu", (t,))
saved = {}

def pack(x):
    local = x.to_local() if isinstance(x, DTensor) else x
    saved[id(x)] = local.numel() * local.element_size()
    return x

with FakeTensorMode():
    logits = distribute_tensor(torch.empty(b, s, vocab, dtype=torch.bfloat16), mesh, [Shard(2)]).requires_grad_()
    labels = torch.randint(0, vocab, (b, s))
    with loss_parallel(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))  # (as the model file's loss_fn)
print(json.dumps(sum(saved.values())))
"""


def test_torchtitan_keeps_a_ranks_vocabulary_shard_of_the_loss_as_torchs_loss_parallel_does():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from passes.pipeline import analyze

    child = subprocess.run([sys.executable, "-c", CHILD, str(B), str(ARGS["seq"]), str(ARGS["vocab_size"]), str(T)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    torch_saved = json.loads(child.stdout.strip().splitlines()[-1])
    profile, _ = analyze(str(ROOT / "examples" / "hf_llama.py"), ARGS)
    last = profile.units[-1]
    whole = last.loss_bytes(B)  # the file's loss on the whole vocabulary: an fp32 log-softmax of the logits
    assert whole == pytest.approx(B * ARGS["seq"] * ARGS["vocab_size"] * 4, rel=0.01)
    split = replace(last, loss_parallel=True)
    assert split.loss_kept(B, T) == pytest.approx(torch_saved, rel=0.01)
    assert split.loss_held(B, T) == last.loss_work(B) / T and last.loss_kept(B, T) == whole


def test_torchtitans_plan_holds_half_the_loss_at_t2(monkeypatch):
    """The engine record says it (Engine.memory.loss_parallel) and make_plan prices it: torchtitan's plan at t = 2,
    priced with the loss whole on each rank instead, holds at least the other half of the kept fp32 log-softmax more.
    The other engines keep their loss whole (the fxplanner runtime gathers the logits; Megatron-Core's own
    vocabulary-parallel cross-entropy is priced with the head)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from planner.engines import ENGINES

    def peak() -> float:
        plan, _ = make_plan(str(ROOT / "examples" / "hf_llama.py"), gpus=T, global_batch=B, target="h100-sxm",
                            model_args=ARGS, pins=Pins(engine="torchtitan", tp=T, b=B, sp=True, recompute="selective"))
        assert (plan.config.tp, plan.config.sp) == (T, True)
        return plan.predictions.memory[0].total

    split = peak()
    titan = ENGINES["torchtitan"]
    monkeypatch.setitem(ENGINES, "torchtitan", replace(titan, memory=replace(titan.memory, loss_parallel=False)))
    whole = peak()
    assert whole - split >= B * ARGS["seq"] * ARGS["vocab_size"] * 4 / T * 0.99
    assert not any(e.memory.loss_parallel for name, e in ENGINES.items() if name != "torchtitan")
