"""Communication cost models: golden values of the formulas and their invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodels.comm import (
    allgather_time,
    allreduce_time,
    hierarchical_allreduce_time,
    p2p_time,
    pcie_time,
    reduce_scatter_time,
    ring_allreduce_time,
    tp_block_comm_bytes,
    tp_block_comm_time,
)
from targets.registry import get_target
from targets.specs import ClusterSpec

DGX_A100 = get_target("a100-80gb").cluster

nbytes_st = st.floats(min_value=0, max_value=1e12, allow_nan=False)
bw_st = st.floats(min_value=1e6, max_value=1e13)
lat_st = st.floats(min_value=0, max_value=1e-3)


def test_p2p_is_alpha_plus_bytes_over_beta():
    assert p2p_time(1e9, 25e9, 5e-6) == pytest.approx(5e-6 + 0.04)
    assert p2p_time(0, 25e9, 5e-6) == pytest.approx(5e-6)


@pytest.mark.parametrize(
    ("nbytes", "n", "bw", "latency", "expected"),
    [
        # 2(n-1)/n * nbytes/bw + 2(n-1) * latency
        (1e9, 8, 300e9, 3.4e-6, 2 * 7 / 8 * 1e9 / 300e9 + 14 * 3.4e-6),  # 5.8810 ms
        (1e9, 2, 100e9, 0.0, 0.01),
        (4e9, 4, 25e9, 1e-5, 1.5 * 4e9 / 25e9 + 6e-5),  # 0.24006 s
        (123.0, 1, 1e9, 1.0, 0.0),  # one rank: nothing to do
    ],
)
def test_ring_allreduce_golden(nbytes, n, bw, latency, expected):
    assert ring_allreduce_time(nbytes, n, bw, latency) == pytest.approx(expected, rel=1e-12)


def test_ring_allreduce_golden_literal():
    # 1 GB over 8 ranks at 300 GB/s with 3.4 us per step: 1.75/300 s + 14 * 3.4 us
    assert ring_allreduce_time(1e9, 8, 300e9, 3.4e-6) == pytest.approx(0.0058809333, rel=1e-8)


@given(nbytes=nbytes_st, n=st.integers(1, 1024), bw=bw_st, lat=lat_st)
def test_reduce_scatter_plus_allgather_is_allreduce(nbytes, n, bw, lat):
    halves = reduce_scatter_time(nbytes, n, bw, lat) + allgather_time(nbytes, n, bw, lat)
    assert halves == pytest.approx(ring_allreduce_time(nbytes, n, bw, lat), rel=1e-12, abs=1e-18)


@given(a=nbytes_st, b=nbytes_st, n=st.integers(1, 1024), bw=bw_st, lat=lat_st)
def test_collectives_monotonic_in_bytes(a, b, n, bw, lat):
    lo, hi = sorted((a, b))
    for fn in (ring_allreduce_time, reduce_scatter_time, allgather_time):
        assert fn(lo, n, bw, lat) <= fn(hi, n, bw, lat)
    assert p2p_time(lo, bw, lat) <= p2p_time(hi, bw, lat)
    assert allreduce_time(lo, 8, max(1, n // 8), DGX_A100) <= allreduce_time(hi, 8, max(1, n // 8), DGX_A100)


@given(nbytes=nbytes_st, n=st.integers(2, 256))
def test_ring_allreduce_monotonic_in_ranks(nbytes, n):
    assert ring_allreduce_time(nbytes, n, 25e9, 1e-5) <= ring_allreduce_time(nbytes, n + 1, 25e9, 1e-5)


@given(
    nbytes=nbytes_st,
    k=st.integers(1, 16),
    nodes=st.integers(2, 64),
    inter_bw=bw_st,
    speedup=st.floats(1.0, 100.0),
    inter_lat=lat_st,
    lat_ratio=st.floats(0.0, 1.0),
)
def test_hierarchical_not_slower_than_flat_ring_across_nodes(nbytes, k, nodes, inter_bw, speedup, inter_lat,
                                                             lat_ratio):
    cluster = ClusterSpec(gpus_per_node=16, nvlink_bw=inter_bw * speedup, nvlink_latency_s=inter_lat * lat_ratio,
                          internode_bw=inter_bw, internode_latency_s=inter_lat)
    n = k * nodes
    flat = ring_allreduce_time(nbytes, n, cluster.internode_bw, cluster.internode_latency_s)
    hier = hierarchical_allreduce_time(nbytes, n, k, cluster)
    assert hier <= flat * (1 + 1e-12) + 1e-18


def test_hierarchical_golden_on_dgx_a100():
    # 2 nodes x 8 GPUs, 1 GB: RS and AG over NVLink (7/8 GB each at 300 GB/s, 7 steps each),
    # then a 2-rank all-reduce of 1/8 GB at 25 GB/s (2 steps).
    c = DGX_A100
    expected = (2 * (7 / 8 * 1e9 / 300e9 + 7 * c.nvlink_latency_s)
                + (2 * 1 / 2 * (1e9 / 8) / 25e9 + 2 * c.internode_latency_s))
    assert hierarchical_allreduce_time(1e9, 16, 8, c) == pytest.approx(expected, rel=1e-12)
    assert allreduce_time(1e9, 8, 2, c) == pytest.approx(expected, rel=1e-12)


def test_hierarchical_degenerate_cases():
    c = DGX_A100
    # one node: just a NVLink ring; one rank per node: just an inter-node ring
    assert hierarchical_allreduce_time(1e8, 8, 8, c) == pytest.approx(
        ring_allreduce_time(1e8, 8, c.nvlink_bw, c.nvlink_latency_s))
    assert hierarchical_allreduce_time(1e8, 4, 1, c) == pytest.approx(
        ring_allreduce_time(1e8, 4, c.internode_bw, c.internode_latency_s))


def test_allreduce_within_a_node_uses_nvlink():
    c = DGX_A100
    assert allreduce_time(1e9, 4, 1, c) == ring_allreduce_time(1e9, 4, c.nvlink_bw, c.nvlink_latency_s)
    assert allreduce_time(1e9, 1, 1, c) == 0.0
    assert allreduce_time(1e9, 8, 2, c) > allreduce_time(1e9, 8, 1, c)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: ring_allreduce_time(1e9, 0, 1e9, 0), "got 0"),
        (lambda: ring_allreduce_time(-1, 2, 1e9, 0), "got -1"),
        (lambda: ring_allreduce_time(1, 2, 0, 0), "got 0"),
        (lambda: hierarchical_allreduce_time(1e9, 12, 8, DGX_A100), "12 is not divisible by 8"),
        (lambda: hierarchical_allreduce_time(1e9, 32, 16, DGX_A100), "16 ranks per node exceeds"),
        (lambda: allreduce_time(1e9, 16, 1, DGX_A100), "16 ranks per node exceeds"),
        (lambda: tp_block_comm_time(1, 2048, 4096, 12, DGX_A100), "t=12"),
        (lambda: tp_block_comm_bytes(0, 2048, 4096, 8), "b must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_say_what_is_wrong(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_pcie_time_uses_gpu_pcie_bandwidth():
    gpu = get_target("a100-80gb").gpu
    assert pcie_time(64e9, gpu) == pytest.approx(64e9 / gpu.pcie_bw)
    assert pcie_time(0, gpu) == 0.0


@given(b=st.integers(1, 64), s=st.integers(1, 32768), h=st.integers(1, 65536), t=st.integers(1, 64),
       dtype_bytes=st.sampled_from([1, 2, 4]))
def test_tp_bytes_match_thesis_8bsh(b, s, h, t, dtype_bytes):
    vol = tp_block_comm_bytes(b, s, h, t, dtype_bytes)
    assert vol.elements_sent_per_gpu == pytest.approx(8 * b * s * h * (t - 1) / t)
    assert vol.bytes_sent_per_gpu == pytest.approx(8 * b * s * h * (t - 1) / t * dtype_bytes)
    assert vol.allreduce_bytes == b * s * h * dtype_bytes
    # the total is exactly what 4 ring all-reduces of that message send from each rank
    per_ring = 2 * (t - 1) / t * vol.allreduce_bytes
    assert vol.bytes_sent_per_gpu == pytest.approx((vol.allreduces_fwd + vol.allreduces_bwd) * per_ring)


def test_tp_bytes_golden_gpt3_layer():
    # b=1, s=2048, h=12288 (GPT-3 175B), t=8, bf16: 8*1*2048*12288*7/8 = 176,160,768 elements
    vol = tp_block_comm_bytes(1, 2048, 12288, 8)
    assert vol.elements_sent_per_gpu == 176_160_768
    assert vol.bytes_sent_per_gpu == 352_321_536
    assert vol.allreduce_bytes == 2048 * 12288 * 2
    assert (vol.allreduces_fwd, vol.allreduces_bwd) == (2, 2)
    assert tp_block_comm_bytes(1, 2048, 12288, 1).bytes_sent_per_gpu == 0


def test_tp_time_in_node_and_across_nodes():
    c = DGX_A100
    msg = 4 * 2048 * 8192 * 2
    inside = tp_block_comm_time(4, 2048, 8192, 8, c)
    assert inside.fwd_s == pytest.approx(2 * ring_allreduce_time(msg, 8, c.nvlink_bw, c.nvlink_latency_s))
    assert inside.bwd_s == inside.fwd_s
    assert inside.total_s == pytest.approx(2 * inside.fwd_s)
    across = tp_block_comm_time(4, 2048, 8192, 16, c)
    assert across.fwd_s == pytest.approx(2 * hierarchical_allreduce_time(msg, 16, 8, c))
    assert across.fwd_s > inside.fwd_s
    assert tp_block_comm_time(4, 2048, 8192, 1, c).total_s == 0.0
