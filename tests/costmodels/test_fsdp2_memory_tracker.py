"""The planner's peak memory under --engine torchtitan against torch's own FSDP2 memory tracker (issue 49).

A small Llama (examples/hf_llama.py: 4 blocks, hidden 1024, GQA 16/8 heads, vocabulary 32000, 2048 tokens, local batch
2) trained as torchtitan 0.3 trains it: FSDP2 over 8 ranks (torchtitan/distributed/fsdp.py apply_fsdp_to_decoder: the
embedding, [norm, lm_head] kept unsharded after the forward, each block, the root; bf16 parameters, fp32 reductions),
its per-op selective activation checkpointing (torchtitan/distributed/activation_checkpoint.py SelectiveAC, with
aten._scaled_dot_product_flash_attention_for_cpu added to its save list: on CPU that is the SDPA kernel which on CUDA
is _scaled_dot_product_flash_attention, which torch's default op list saves), AdamW, and its step (torchtitan/train.py:
zero_grad, forward, the logits dropped before loss.backward(), optimizer step). torch.distributed._tools.
fsdp2_mem_tracker.FSDPMemTracker measures it under FakeTensorMode over a fake process group of 8
(torch.testing._internal.distributed.fake_pg.FakeStore, backend "fake"): the peak of the second step, in allocated
bytes. The planner's prediction for the same configuration (planner.api.make_plan, Pins(engine="torchtitan", zero=3,
dp=8, recompute="selective", compile=False: the tracker runs the blocks eager)) is compared less its fixed reserve
(Hardware.reserve_bytes: the CUDA context, the allocator's fragmentation, communication buffers, none of which the
tracker sees) and less the sharded gradients' pool (reserved, not allocated, at the peak): within 10%.

The tracker runs in a child process (its fake process group and fake tensors stay out of this one).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "hf_llama.py"
SHAPE = dict(layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=8,
             vocab_size=32000)
SEQ, LOCAL_BATCH, RANKS = 2048, 2, 8


def tracked_peak() -> dict[str, float]:
    """FSDPMemTracker's peak of the second step, in bytes by its categories (and "Total")."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    import _hf_models as hf

    class CpuSelectiveAC(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    dist.init_process_group("fake", rank=0, world_size=RANKS, store=FakeStore())
    mesh = init_device_mesh("cpu", (RANKS,))  # (outside fake mode: the mesh reads its rank map)
    with FakeTensorMode():
        model = hf.build("llama", "llama3-8b", **SHAPE)
        layers, sac = model.model.layers, CpuSelectiveAC(CpuSelectiveAC.Config())
        for i, block in enumerate(list(layers)):
            layers.register_module(str(i), sac._wrap_block(block, base_fqn=f"layers.{i}"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        for block in layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, SHAPE["vocab_size"], (LOCAL_BATCH, SEQ))
        labels = torch.randint(0, SHAPE["vocab_size"], (LOCAL_BATCH, SEQ))
        tracker = FSDPMemTracker(model, optim)
        tracker.track_inputs((ids,))
        with tracker:
            for step in range(2):
                optim.zero_grad()
                pred = model(ids).logits
                loss = hf.loss_fn(pred, labels)
                del pred
                loss.backward()
                optim.step()
                if step == 0:
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    dist.destroy_process_group()
    return {str(getattr(k, "value", k)): float(v) for k, v in peak.items()}


def test_torchtitan_fsdp2_sac_peak_matches_fsdp_mem_tracker():
    pytest.importorskip("torchtitan")
    pytest.importorskip("transformers")
    from planner.api import make_plan
    from planner.search import Pins

    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    tracked = json.loads(child.stdout.strip().splitlines()[-1])
    plan, _ = make_plan(str(MODEL), target="h100-96gb-hbm2e-500w", gpus=RANKS, global_batch=RANKS * LOCAL_BATCH,
                        model_args={"preset": "llama3-8b", "seq": SEQ, **SHAPE},
                        pins=Pins(engine="torchtitan", zero=3, dp=RANKS, tp=1, pp=1, cp=1, b=LOCAL_BATCH, compile=False,
                                  recompute="selective", precision="bf16", grad_fp32=True))
    memory = plan.predictions.memory[0]
    # the tracker counts allocated bytes: the planner's less its fixed reserve and the sharded gradients' own pool
    # (EngineMemory.grad_pool: reserved beside the compute stream's peak; none of it allocated there, the tracker
    # says, with one microbatch the peak being the loss's backward)
    predicted = memory.total - plan.source.reserve_bytes - memory.grads
    assert predicted == pytest.approx(tracked["Total"], rel=0.10), (predicted / 2**20, tracked)
    assert tracked["Sharded Grad"] + tracked["Unsharded Grad"] == 0
    # and the parts as the tracker holds them: the sharded parameter is the fp32 master, the optimizer Adam's two
    # moments; the gradient pool one fp32 gradient (the reduce dtype) per sharded parameter, half the moments
    assert memory.optimizer == pytest.approx(tracked["OptState"], rel=0.01)
    assert memory.grads == pytest.approx(tracked["OptState"] / 2, rel=0.01)


if __name__ == "__main__":
    print(json.dumps(tracked_peak()))
