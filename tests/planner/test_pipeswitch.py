"""PipeSwitch pipelined model transmission: latency model and Algorithm 1's optimal grouping."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.fill.pipeswitch import (
    Layer,
    TransferOverhead,
    dp_grouping,
    exhaustive_grouping,
    group_latency,
    optimal_grouping,
    per_layer_grouping,
    single_group,
)

PCIE_BW = 12e9  # bytes/s, PCIe 3.0 x16 as in the paper's V100 testbed
MS = 1e-3


def layers_st(max_size: int) -> st.SearchStrategy[list[Layer]]:
    layer = st.builds(
        Layer, name=st.just("l"), param_bytes=st.integers(0, 60_000_000),
        exec_time_s=st.floats(0, 4 * MS, allow_nan=False),
    )
    return st.lists(layer, min_size=1, max_size=max_size)


overhead_st = st.builds(
    TransferOverhead,
    pcie_call_s=st.floats(0, 0.5 * MS, allow_nan=False),
    sync_s=st.floats(0, 0.5 * MS, allow_nan=False),
)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def cnn_like(n: int, seed: int) -> tuple[list[Layer], TransferOverhead]:
    """Profiles shaped like the paper's CNNs: per layer, execution mostly hides transmission."""
    rng = random.Random(seed)
    layers = [Layer(name=f"l{i}", param_bytes=rng.randint(0, 8_000_000),
                    exec_time_s=rng.uniform(0.05 * MS, 2 * MS)) for i in range(n)]
    return layers, TransferOverhead(pcie_call_s=rng.uniform(0.01 * MS, 0.2 * MS),
                                    sync_s=rng.uniform(0.01 * MS, 0.1 * MS))


def test_group_latency_overlaps_transmission_with_execution():
    # T = bytes/bw + 1 ms call; E = exec + 0.5 ms sync.
    layers = [Layer(name="a", param_bytes=12_000_000, exec_time_s=3 * MS),   # T=2, E=3.5
              Layer(name="b", param_bytes=24_000_000, exec_time_s=1 * MS)]   # T=3, E=1.5
    ov = TransferOverhead(pcie_call_s=1 * MS, sync_s=0.5 * MS)
    # a: sent at 2, runs 2..5.5; b: sent at 5, runs 5.5..7
    assert group_latency(layers, [(0, 1), (1, 2)], PCIE_BW, ov) == pytest.approx(7 * MS)
    # one group: sent at 4 (36 MB = 3 ms + 1 ms call), runs 4..8.5
    assert group_latency(layers, [(0, 2)], PCIE_BW, ov) == pytest.approx(8.5 * MS)


def test_group_latency_rejects_groups_that_do_not_cover_the_model():
    layers = [Layer(name=f"l{i}", param_bytes=1, exec_time_s=MS) for i in range(3)]
    for bad in ([(0, 2)], [(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0, 0), (0, 3)]):
        with pytest.raises(ValueError):
            group_latency(layers, bad, PCIE_BW, TransferOverhead())


@settings(max_examples=100, deadline=None)
@given(layers=layers_st(10), overhead=overhead_st)
def test_optimal_grouping_matches_exhaustive(layers, overhead):
    best = exhaustive_grouping(layers, PCIE_BW, overhead)
    assert best.nodes_explored == 2 ** (len(layers) - 1)
    assert close(dp_grouping(layers, PCIE_BW, overhead).latency_s, best.latency_s)
    for strengthened in (False, True):
        found = optimal_grouping(layers, PCIE_BW, overhead, strengthened=strengthened)
        assert found.optimal and close(found.latency_s, best.latency_s)
        assert close(group_latency(layers, found.groups, PCIE_BW, overhead), found.latency_s)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_optimal_grouping_prunes_on_40_layer_models(seed):
    layers, overhead = cnn_like(40, seed)
    found = optimal_grouping(layers, PCIE_BW, overhead)
    fast = optimal_grouping(layers, PCIE_BW, overhead, strengthened=True)
    assert found.optimal and found.nodes_explored < 2 ** 39
    assert close(found.latency_s, dp_grouping(layers, PCIE_BW, overhead).latency_s)
    assert fast.nodes_explored <= found.nodes_explored and close(fast.latency_s, found.latency_s)
    assert found.latency_s <= per_layer_grouping(layers, PCIE_BW, overhead).latency_s + 1e-12
    assert found.latency_s <= single_group(layers, PCIE_BW, overhead).latency_s + 1e-12


@settings(max_examples=50, deadline=None)
@given(layers=layers_st(14), overhead=overhead_st)
def test_optimal_is_no_worse_than_the_baselines(layers, overhead):
    found = optimal_grouping(layers, PCIE_BW, overhead, strengthened=True)
    assert close(found.latency_s, dp_grouping(layers, PCIE_BW, overhead).latency_s)
    assert found.latency_s <= per_layer_grouping(layers, PCIE_BW, overhead).latency_s + 1e-12
    assert found.latency_s <= single_group(layers, PCIE_BW, overhead).latency_s + 1e-12


def test_paper_tradeoff_small_layers_favor_grouping():
    # Alike, transmission-bound layers with a large per-call overhead: per-layer pipelining pays
    # the overhead 30 times, one group cannot overlap; the optimum sits in between and grows its
    # groups as execution backs up (3, 3, 4, 5, 8, 7 layers).
    layers = [Layer(name=f"l{i}", param_bytes=1_200_000, exec_time_s=0.2 * MS) for i in range(30)]
    ov = TransferOverhead(pcie_call_s=0.3 * MS, sync_s=0.05 * MS)
    groups, latency, nodes = optimal_grouping(layers, PCIE_BW, ov, strengthened=True)
    assert len(groups) == 6 and nodes < 1000
    assert close(latency, dp_grouping(layers, PCIE_BW, ov).latency_s)
    assert latency < per_layer_grouping(layers, PCIE_BW, ov).latency_s
    assert latency < single_group(layers, PCIE_BW, ov).latency_s
    # The paper's own pruning runs out of a 20k-node budget here and keeps the bootstrap (groups
    # of ten), which is worse.
    paper = optimal_grouping(layers, PCIE_BW, ov, max_nodes=20_000)
    assert not paper.optimal and paper.latency_s > latency


def test_node_budget_returns_a_valid_grouping_marked_not_optimal():
    rng = random.Random(1)
    layers = [Layer(name=f"l{i}", param_bytes=rng.randint(0, 50_000_000),
                    exec_time_s=rng.uniform(0, 3 * MS)) for i in range(40)]
    ov = TransferOverhead(pcie_call_s=0.2 * MS, sync_s=0.1 * MS)
    found = optimal_grouping(layers, PCIE_BW, ov, max_nodes=1000)
    assert not found.optimal and found.nodes_explored == 1001
    boot = group_latency(layers, [(s, min(s + 10, 40)) for s in range(0, 40, 10)], PCIE_BW, ov)
    assert found.latency_s <= boot
    assert close(group_latency(layers, found.groups, PCIE_BW, ov), found.latency_s)


def test_empty_model_and_bad_inputs():
    assert optimal_grouping([], PCIE_BW, TransferOverhead()).groups == ()
    with pytest.raises(ValueError, match="pcie_bw=0"):
        single_group([Layer(name="a", param_bytes=1, exec_time_s=MS)], 0, TransferOverhead())
    with pytest.raises(ValueError, match="sync_s=-1"):
        TransferOverhead(sync_s=-1)
    with pytest.raises(ValueError, match="max_layers"):
        exhaustive_grouping([Layer(name="a", param_bytes=1, exec_time_s=MS)] * 25, PCIE_BW,
                            TransferOverhead())
