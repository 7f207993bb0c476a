"""Context parallelism (ring attention, as Megatron-Core and Transformer Engine run it): each of cp ranks
holds 1/cp of every sequence, passes keys and values around the ring, and reduces gradients with the
data-parallel ranks."""
from __future__ import annotations

import pytest

from costmodels.compute import cp_ring_s
from costmodels.hardware import Hardware
from costmodels.memory import rank_param_count, stage_memory
from passes.pipeline import analyze
from planner.config import ParallelConfig
from planner.evaluate import Evaluator
from planner.search import Pins, search
from targets.registry import get_target
from tests.conftest import EXAMPLES

H, A, L, S = 4096, 32, 36, 2048  # examples/gpt.py preset 7.5b


@pytest.fixture(scope="module")
def prof():
    p, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b"})
    return p


def _ev(prof, n=64, B=256, target="h100-sxm", gpus_per_node=None):
    return Evaluator(units=prof.units, hw=Hardware(target=get_target(target, gpus_per_node)), global_batch=B,
                     n_gpus=n, tokens_per_sample=prof.tokens_per_sample)


def _cfg(**kw):
    base = dict(tp=1, pp=1, dp=8, cp=1, b=1, m=32, recompute="none", schedule="1f1b")
    return ParallelConfig(**{**base, **kw})


def test_keys_and_values_the_ring_passes_are_2sbh_per_layer(prof):
    block = next(u for u in prof.units if u.kind == "block")
    assert block.attn_kv_bytes(1) == 2 * S * H * 2  # K and V, bf16, one sample
    assert all(u.attn_kv_bytes(1) == 0 for u in prof.units if u.kind != "block")


def test_each_context_parallel_rank_keeps_one_cp_th_of_the_activations_and_work(prof):
    flash, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b", "flash": True})
    f1, b1, _, a1, _, _ = _ev(flash).unit_costs(_cfg(cp=1))
    f2, b2, _, a2, _, _ = _ev(flash).unit_costs(_cfg(cp=2, dp=4))
    blocks = [i for i, u in enumerate(flash.units) if u.kind == "block"]
    for i, (x1, x2) in enumerate(zip(a1, a2)):  # (the embedding's position ids are a constant: not split)
        assert x2 == pytest.approx(x1 / 2, rel=1e-6 if i in blocks else 1e-2)
    for i in blocks:  # half the tokens: about half the time (smaller GEMMs run a little less efficiently)
        assert 0.45 * f1[i] < f2[i] < 0.6 * f1[i] and 0.45 * b1[i] < b2[i] < 0.6 * b1[i]


def test_context_parallel_attention_is_priced_as_the_fused_ring_kernel_whatever_the_model_writes(prof):
    """Megatron-Core runs context parallelism only in Transformer Engine's fused ring attention (the runtime's
    attention keeps the same): a written-out attention's s x s scores are not kept, as they are without cp."""
    flash, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b", "flash": True})
    written = _ev(prof).unit_costs(_cfg(cp=2, dp=4))[3]
    assert written == pytest.approx(_ev(flash).unit_costs(_cfg(cp=2, dp=4))[3], rel=1e-12)
    block = next(i for i, u in enumerate(prof.units) if u.kind == "block")
    scores = A * S * S * 2  # one sample's softmax output, bf16
    assert _ev(prof).unit_costs(_cfg(cp=1))[3][block] > 2 * written[block] + scores / 2


def test_the_ring_hides_behind_long_attention_inside_a_node_and_shows_otherwise(prof):
    long, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b", "seq": 8192})
    block = next(u for u in long.units if u.kind == "block")
    node, half_node = Hardware(target=get_target("h100-sxm")), Hardware(target=get_target("h100-sxm", 1))
    # 4096-token chunks: a step's attention (4096^2 x 4h FLOPs) outlasts its 64 MiB of keys and values on NVLink
    assert cp_ring_s(block, node, _cfg(cp=2, dp=4)) == (0.0, 0.0)
    across = cp_ring_s(block, half_node, _cfg(cp=2, dp=4))  # one GPU per node: the ring crosses InfiniBand
    assert across[0] > 0 and across[1] > across[0]  # the backward also sends the key/value gradients
    short = next(u for u in prof.units if u.kind == "block")  # 2048 tokens over 8: 256-token chunks are too short
    assert cp_ring_s(short, node, _cfg(cp=8, dp=1))[0] > 0
    assert cp_ring_s(short, node, _cfg()) == (0.0, 0.0)


def test_gradients_are_reduced_over_data_and_context_parallel_ranks(prof):
    ev = _ev(prof, n=64, B=256)
    with_cp = ev.evaluate(_cfg(tp=2, pp=2, dp=8, cp=2, m=32, recompute="full"))
    without = ev.evaluate(_cfg(tp=2, pp=2, dp=16, cp=1, m=16, recompute="full"))
    assert with_cp.allreduce_s == pytest.approx(without.allreduce_s)


def test_sharded_optimizer_state_is_divided_over_dp_times_cp(prof):
    hw = Hardware(target=get_target("h100-sxm"))
    full = stage_memory(list(prof.units), hw, _cfg(dp=4, cp=2), 0)
    sharded = stage_memory(list(prof.units), hw, _cfg(dp=4, cp=2, zero=1), 0)
    assert sharded.optimizer == pytest.approx(full.optimizer / 8)
    assert (sharded.weights, sharded.grads) == (full.weights, full.grads)


def test_the_search_places_context_parallelism_and_says_why_not(prof):
    ev = _ev(prof, n=8, B=64)
    r = search(ev, Pins(cp=2, tp=1))
    c = r.best.config
    assert c.cp == 2 and c.tp * c.cp * c.dp * c.pp == 8
    free = search(ev)
    assert all(e.config.tp * e.config.cp <= 8 for e in (free.best, *free.runners_up))
    odd = Evaluator(units=prof.units, hw=ev.hw, global_batch=64, n_gpus=8, tokens_per_sample=2050)
    with pytest.raises(Exception, match="2\\*cp equal chunks"):
        search(odd, Pins(cp=4))
    images = Evaluator(units=prof.units, hw=ev.hw, global_batch=64, n_gpus=8, tokens_per_sample=0)
    with pytest.raises(Exception, match="token ids"):
        search(images, Pins(cp=2))


def test_a_sharded_optimizer_steps_only_its_shard(prof):
    ev = _ev(prof, n=64, B=256)
    plain = ev.evaluate(_cfg(tp=2, pp=2, dp=8, cp=2, m=32, recompute="full"))
    sharded = ev.evaluate(_cfg(tp=2, pp=2, dp=8, cp=2, m=32, recompute="full", zero=1))
    assert sharded.optimizer_s == pytest.approx([o / 16 for o in plain.optimizer_s])  # over d*cp = 16
    # a reduce-scatter and an all-gather move the all-reduce's bytes; only one more collective's latency (~0.1 ms)
    assert sharded.allreduce_s == pytest.approx(plain.allreduce_s, abs=2e-4)


def test_fp32_gradients_cost_megatrons_18_bytes_per_parameter_and_twice_the_reduction(prof):
    hw = Hardware(target=get_target("h100-sxm"))
    units = list(prof.units)
    params = rank_param_count(units, _cfg())  # the tied embedding / LM head once
    assert params < sum(u.params for u in units)
    for zero, opt in ((0, 12.0), (1, 12.0 / 8)):
        bf16 = stage_memory(units, hw, _cfg(dp=8, zero=zero), 0)
        fp32 = stage_memory(units, hw, _cfg(dp=8, zero=zero, grad_fp32=True), 0)
        assert (fp32.weights + fp32.grads + fp32.optimizer) / params == pytest.approx(2 + 4 + opt)
        assert fp32.grads == 2 * bf16.grads and fp32.weights == bf16.weights
    ev = _ev(prof, n=64, B=256)
    base = dict(tp=2, pp=2, dp=16, m=16, recompute="full")
    plain, wide = (ev.evaluate(_cfg(**base, grad_fp32=g)) for g in (False, True))
    assert wide.allreduce_s[0] > 1.8 * plain.allreduce_s[0]  # twice the bytes (less the latency terms)
    sharded = ev.evaluate(_cfg(**base, grad_fp32=True, zero=1))  # reduce-scatter fp32, all-gather bf16
    assert plain.allreduce_s[0] < sharded.allreduce_s[0] < wide.allreduce_s[0]
