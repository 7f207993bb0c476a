"""Mixture of experts with expert parallelism: a Mixtral layer's expert FLOPs, all-to-all bytes and expert parameters
against their closed forms, written here from the layer's shapes; the layer as Megatron-Core and as torchtitan run
it."""
from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from costmodels.compute import _part_time, part_forward_s, unit_time  # noqa: E402
from costmodels.hardware import Hardware  # noqa: E402
from costmodels.memory import expert_count, param_count, stage_memory  # noqa: E402
from passes.pipeline import analyze  # noqa: E402
from planner.config import ConfigError, ParallelConfig  # noqa: E402
from planner.evaluate import Evaluator  # noqa: E402
from targets.registry import get_target  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

H, F, E, K, SEQ = 4096, 14336, 8, 2, 1024  # Mixtral 8x7B's layer, at a short sequence
HW = Hardware(target=get_target("h100-sxm"))


@pytest.fixture(scope="module")
def mixtral():
    prof, _ = analyze(EXAMPLES / "hf_mixtral.py", {"layers": 2, "seq": SEQ})
    return prof


def block(prof):
    return next(u for u in prof.units if u.kind == "block")


def config(**kw) -> ParallelConfig:
    return ParallelConfig(**{"tp": 1, "pp": 1, "dp": 8, "b": 2, "m": 4, **kw})


def test_expert_flops_are_the_routed_top_k_and_parameters_divide_over_ep(mixtral):
    """Each token runs its top-2 experts' three products (gate, up, down: 2 h f FLOPs each), not all eight; the
    layer holds E experts of 3 h f weights, and a rank holds E/ep of them (the rest of the layer whole)."""
    u, b = block(mixtral), 2
    tokens = b * SEQ
    assert (u.experts, u.top_k) == (E, K)
    assert u.moe.mm_flops(b) == 2 * tokens * K * 3 * H * F
    assert u.moe.params == E * 3 * H * F
    whole = param_count(u, config())
    for ep in (2, 4, 8):
        c = config(ep=ep)
        assert expert_count(u, c) == E * 3 * H * F / ep
        assert param_count(u, c) == pytest.approx(whole - E * 3 * H * F * (1 - 1 / ep))


def test_all_to_all_moves_2_tokens_k_h_each_way(mixtral):
    """A dispatch sends each routed copy of a token's hidden state (tokens x k x h elements, bf16) and the combine
    brings them back: 2 tokens k h elements per direction (forward; their gradients the same backward). Each rank
    keeps 1/ep of them; inside a node the rest cross NVLink in (ep - 1) sends."""
    u, b = block(mixtral), 2
    nbytes = b * SEQ * K * H * 2
    assert u.moe_dispatch_bytes(b) == nbytes
    links = HW.links
    for ep in (2, 8):
        one = (ep - 1) / ep * nbytes / links.nvlink_bw + (ep - 1) * links.nvlink_latency_s
        assert unit_time(u, HW, config(ep=ep)).ep_comm_s == pytest.approx(2 * 2 * one)
    assert unit_time(u, HW, config()).ep_comm_s == 0
    # a padded capacity factor of 1.5: the busiest rank exchanges (and computes) 1.5x its balanced share
    one = 7 / 8 * 1.5 * nbytes / links.nvlink_bw + 7 * links.nvlink_latency_s
    loaded = unit_time(u, HW, config(ep=8, expert_load=1.5, moe_capacity=1.5))
    balanced = unit_time(u, HW, config(ep=8))
    assert loaded.ep_comm_s == pytest.approx(4 * one)
    assert loaded.fwd_s - loaded.ep_comm_s / 2 > balanced.fwd_s - balanced.ep_comm_s / 2
    # across nodes (ep = 16 on 8-GPU nodes): the NICs carry the 8 of 16 shares bound for the other node
    far = 8 / 16 * nbytes / links.internode_bw + 8 * links.internode_latency_s
    assert unit_time(u, HW, config(dp=16, ep=16)).ep_comm_s == pytest.approx(4 * max(
        far, 7 / 16 * nbytes / links.nvlink_bw + 7 * links.nvlink_latency_s))


def test_each_local_expert_is_its_own_gemm(mixtral):
    """A rank runs its E/ep experts as a grouped GEMM: each expert's product is 1/(E/ep) of the routed work, and
    its efficiency is that size's -- more experts per rank, smaller GEMMs, a lower rate."""
    u, b = block(mixtral), 2
    f = 2 * b * SEQ * K * 2 * H * F  # gate and up, as one product of the routed tokens
    rates = {ep: HW.matmul_rate(f * ep / E, "bf16") for ep in (1, 8)}
    assert rates[1] < rates[8]
    t1, t8 = (unit_time(u, HW, config(ep=ep)) for ep in (1, 8))
    assert t1.fwd_s > t8.fwd_s - t8.ep_comm_s / 2


def test_expert_state_is_sharded_over_the_expert_data_parallel_ranks(mixtral):
    """Under the distributed optimizer, experts' optimizer state divides over the ranks holding the same experts
    (d*cp/ep of them), the rest over d*cp; gradients are reduced over those same groups."""
    units = mixtral.units
    ev = Evaluator(units=units, hw=HW, global_batch=64, n_gpus=8, tokens_per_sample=SEQ)
    c1, c8 = config(zero=1), config(zero=1, ep=8)
    m1, m8 = stage_memory(units, HW, c1, 0), stage_memory(units, HW, c8, 0)
    experts = sum(u.moe.params for u in units)
    dense = sum(param_count(u, c1) for u in units) - experts
    assert m1.optimizer == pytest.approx((dense + experts) * 12 / 8)
    assert m8.optimizer == pytest.approx(dense * 12 / 8 + experts / 8 * 12)  # expert_dp = 1: not sharded
    e1, e8 = ev.evaluate(c1), ev.evaluate(c8)
    assert e8.allreduce_s[0] < e1.allreduce_s[0]  # experts' gradients are no longer reduced at all


def test_expert_parallelism_beside_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match="needs sequence parallelism"):
        ParallelConfig(tp=2, pp=1, dp=4, b=1, m=1, ep=2)
    with pytest.raises(ConfigError, match="ep=3 does not divide the 8 ranks"):
        ParallelConfig(tp=2, pp=1, dp=4, b=1, m=1, ep=3, sp=True)
    assert ParallelConfig(tp=2, pp=1, dp=4, b=1, m=1, ep=8, sp=True).expert_dp == 1


def test_the_flex_dispatcher_sends_a_token_once_per_node_and_overlap_hides_the_all_to_alls(mixtral):
    """DeepEP / HybridEP send a token once to each other node one of its experts lives on (probability 1 - (1 -
    1/N)^k per node under balanced routing) and fan it out there over NVLink; Megatron's all-to-all sends all k
    copies. With 1F1B overlap, a microbatch's forward all-to-alls hide behind another's backward compute and its
    backward's behind a forward: only what the compute cannot cover stays."""
    u, b = block(mixtral), 2
    tokens, links = b * SEQ, HW.links
    nbytes = tokens * K * H * 2
    plain, flex = (unit_time(u, HW, config(dp=32, ep=32, moe_dispatcher=d)) for d in ("alltoall", "deepep"))
    far = tokens * H * 2 * 3 * (1 - (3 / 4) ** K)  # 4 nodes of 8: each of the 3 others reached with 1 - (3/4)^k
    near = nbytes * 7 / 32 + far
    one = max(near / links.nvlink_bw + 7 * links.nvlink_latency_s, far / links.internode_bw
              + 3 * links.internode_latency_s)
    assert flex.ep_comm_s == pytest.approx(4 * one) and flex.ep_comm_s < plain.ep_comm_s
    over = unit_time(u, HW, config(dp=32, ep=32, moe_a2a_overlap=True))
    compute_f, compute_b = plain.fwd_s - plain.ep_comm_s / 2, plain.bwd_s - plain.ep_comm_s / 2
    a2a = plain.ep_comm_s / 2
    assert over.ep_comm_s == pytest.approx(max(0, a2a - compute_b) + max(0, a2a - compute_f))
    assert over.fwd_s + over.bwd_s < plain.fwd_s + plain.bwd_s
    # DeepEP's kernels take 20 of the H100's 132 SMs from the compute they hide behind, for as long as they run
    deepep = unit_time(u, HW, config(dp=32, ep=32, moe_dispatcher="deepep", moe_a2a_overlap=True))
    a2a, compute_f, compute_b = flex.ep_comm_s / 2, flex.fwd_s - flex.ep_comm_s / 2, flex.bwd_s - flex.ep_comm_s / 2
    hidden = min(a2a, compute_b) + min(a2a, compute_f)
    assert deepep.ep_comm_s == pytest.approx(2 * a2a - hidden + hidden * 20 / 132)


def test_a_dropless_moe_layer_forward_waits_for_the_engines_host(mixtral):
    """Megatron-Core's dropless dispatch drains the stream each MoE layer, so an eager layer's forward takes at least
    the host's time for it (MEGATRON_MOE_HOST_S, planner.api sets it for --engine megatron): a layer shorter than that
    is priced at it, a longer one as before; the backward is not (the host runs ahead); experts padded to a capacity
    (no drain) are not, a dropless router's imbalance is; under the 1F1B all-to-all overlap the host time is set
    against the forward and the backward it runs beside. A dense unit is never floored."""
    from costmodels.compute import MEGATRON_MOE_HOST_S, moe_host_wait_s

    u = block(mixtral)
    host = HW.with_eff(moe_host_s=MEGATRON_MOE_HOST_S)
    for b in (1, 2):  # a short layer (1 x 1024 tokens) and one of twice the work
        c = config(ep=8, b=b)
        gpu, floored = unit_time(u, HW, c), unit_time(u, host, c)
        assert floored.fwd_s == pytest.approx(max(gpu.fwd_s, MEGATRON_MOE_HOST_S))
        assert floored.bwd_s == pytest.approx(gpu.bwd_s)
    c = config(ep=8, b=1)
    short = unit_time(u, HW, c)
    assert short.fwd_s < MEGATRON_MOE_HOST_S < short.fwd_s + short.bwd_s  # the floor binds alone, not on the pair
    padded = config(ep=8, b=1, expert_load=1.25, moe_capacity=1.25)
    assert unit_time(u, host, padded).fwd_s == pytest.approx(unit_time(u, HW, padded).fwd_s)
    unbalanced = config(ep=8, b=1, expert_load=1.25)  # dropless, the router loading the busiest rank 1.25x: it drains
    assert unit_time(u, host, unbalanced).fwd_s == pytest.approx(
        max(unit_time(u, HW, unbalanced).fwd_s, MEGATRON_MOE_HOST_S))
    with pytest.raises(ConfigError, match="moe_capacity 1.5 pads every expert to that share"):
        config(ep=8, moe_capacity=1.5)
    over = config(ep=8, b=1, moe_dispatcher="deepep", moe_a2a_overlap=True)
    assert unit_time(u, host, over).fwd_s == pytest.approx(unit_time(u, HW, over).fwd_s)
    dense = next(x for x in mixtral.units if not x.experts)
    assert unit_time(dense, host, c).fwd_s == unit_time(dense, HW, c).fwd_s
    assert moe_host_wait_s(u, host, c) == pytest.approx(MEGATRON_MOE_HOST_S - short.fwd_s)
    assert moe_host_wait_s(u, HW, c) == 0 == moe_host_wait_s(dense, host, c)


def test_torchtitan_runs_a_ranks_experts_as_one_grouped_kernel_and_its_router_gate_in_fp32(mixtral):
    """torchtitan's GroupedExperts runs each expert product as one torch._grouped_mm over all the rank's experts: it
    reaches the rate of one product of their total size, where Transformer Engine's GroupedLinear runs each expert's
    own GEMM at its size (measured on an H200, bench/results/README_cuda_2026-11-28.md). Its router's gate, an
    (h, E) linear, runs under autocast to fp32, forward and backward at the fp32 rate."""
    u, b = block(mixtral), 2
    titan = HW.with_eff(grouped_mm=True)
    assert u.router.mm_flops(b) == 2 * b * SEQ * H * E and u.router.params == H * E
    one_kernel = _part_time(u.moe, b, 1, titan, "bf16", groups=E)
    assert one_kernel == pytest.approx(_part_time(u.moe, b, 1, HW, "bf16"))  # the rate of the whole
    per_expert = _part_time(u.moe, b, 1, HW, "bf16", groups=E)
    assert all(g < p for g, p in zip(one_kernel, per_expert))
    gate = [f - h for f, h in zip(_part_time(u.router, b, 1, HW, "fp32"), _part_time(u.router, b, 1, HW, "bf16"))]
    assert gate[0] > 0
    c = config(ep=1)
    te, tt = unit_time(u, HW, c), unit_time(u, titan, c)
    assert tt.fwd_s == pytest.approx(te.fwd_s - per_expert[0] + one_kernel[0] + gate[0])
    assert tt.bwd_s == pytest.approx(te.bwd_s - per_expert[1] + one_kernel[1] + gate[1])
    # one local expert (ep = 8): one GEMM either way, the same price but for the gate
    c8 = config(ep=8)
    assert unit_time(u, titan, c8).fwd_s == pytest.approx(unit_time(u, HW, c8).fwd_s + gate[0])


def test_torchtitans_per_op_checkpoint_reruns_the_experts_the_router_gate_and_the_eager_all_to_alls(mixtral):
    """torchtitan's SelectiveAC saves no torch._grouped_mm output (its save list does not hold the op) and forces the
    router gate's shape to recompute, uncounted: a Mixtral block keeps wq's and wv's outputs and reruns wk, wo, every
    expert product and the gate. Eager, its token dispatcher's all-to-alls (spmd_types' list all_to_all) are not in
    the save list either, so the backward reruns the dispatch and the combine; compiled, the dispatcher issues
    _c10d_functional.all_to_all_single, which the list saves."""
    u, b = block(mixtral), 2
    tokens, kv = b * SEQ, 1024  # Mixtral's 8 kv heads of 128
    op = u.op_checkpoint
    assert op.redo_sharded.mm_flops(b) == 2 * tokens * H * (kv + H)  # wk, wo
    assert op.redo.mm_flops(b) == u.moe.mm_flops(b) + u.router.mm_flops(b)
    titan, hw = replace(u, checkpoint="op"), HW.with_eff(grouped_mm=True)
    c, kept = config(ep=8, recompute="selective"), config(ep=8)
    rerun = part_forward_s(op.redo_sharded, b, 1, hw, "bf16") + part_forward_s(op.redo, b, 1, hw, "bf16")
    plain, eager = unit_time(titan, hw, kept), unit_time(titan, hw, c)
    a2a = plain.ep_comm_s / 2  # the forward's dispatch and combine
    assert a2a > 0
    assert eager.bwd_s == pytest.approx(plain.bwd_s + rerun + a2a)
    on, off = (unit_time(titan, hw, config(ep=8, compile=True, recompute=r)) for r in ("selective", "none"))
    compiled = part_forward_s(op.redo_sharded, b, 1, hw, "bf16", compiled=True) + \
        part_forward_s(op.redo, b, 1, hw, "bf16", compiled=True)
    assert on.bwd_s == pytest.approx(off.bwd_s + compiled)  # no all-to-all again
    full = unit_time(titan, hw, config(ep=8, recompute="full"))
    assert full.bwd_s == pytest.approx(plain.bwd_s + plain.fwd_s)  # the whole forward again, all-to-alls and all
