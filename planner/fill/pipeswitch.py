"""PipeSwitch pipelined model transmission with optimal model-aware grouping (§4.2, Algorithm 1).

A model's layers are copied host->device in groups; group g+1 is transmitted while group g
executes, and a group executes once it is fully transmitted and the previous group has finished.
Per the paper, each group pays two overheads: one PCIe call, "included in T(i, j)", and one
synchronization between transmission and computation, which we add to E(i, j)::

    T(group) = param_bytes / pcie_bw + pcie_call_s
    E(group) = sum(exec_time_s) + sync_s

Groups are half-open layer ranges ``(start, stop)`` covering ``range(len(layers))`` in order.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = [
    "Grouping",
    "Layer",
    "TransferOverhead",
    "exhaustive_grouping",
    "group_latency",
    "optimal_grouping",
    "per_layer_grouping",
    "single_group",
]

Group = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    name: str
    param_bytes: int
    exec_time_s: float

    def __post_init__(self) -> None:
        if self.param_bytes < 0 or self.exec_time_s < 0:
            raise ValueError(f"layer {self.name!r}: param_bytes={self.param_bytes} and "
                             f"exec_time_s={self.exec_time_s} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferOverhead:
    """Costs paid once per group (both >= 0; the paper's prunings rely on that)."""

    pcie_call_s: float = 0.0
    """Fixed cost of invoking one PCIe transfer."""
    sync_s: float = 0.0
    """Synchronization so the computation knows its group has arrived."""

    def __post_init__(self) -> None:
        if self.pcie_call_s < 0 or self.sync_s < 0:
            raise ValueError(f"pcie_call_s={self.pcie_call_s} and sync_s={self.sync_s} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class Grouping:
    """A grouping and its latency; unpacks as ``groups, latency_s, nodes_explored``."""

    groups: tuple[Group, ...]
    latency_s: float
    nodes_explored: int
    """Search nodes (calls of FindOptGrouping, or strategies enumerated); 0 for fixed baselines."""

    def __iter__(self) -> Iterator[object]:
        return iter((self.groups, self.latency_s, self.nodes_explored))


@dataclass(frozen=True, slots=True)
class _Costs:
    bytes_prefix: tuple[int, ...]
    exec_prefix: tuple[float, ...]
    pcie_bw: float
    overhead: TransferOverhead

    @property
    def n(self) -> int:
        return len(self.bytes_prefix) - 1

    def trans(self, start: int, stop: int) -> float:
        """T(start, stop-1) in the paper's inclusive notation; 0 for an empty range."""
        if stop <= start:
            return 0.0
        sent = self.bytes_prefix[stop] - self.bytes_prefix[start]
        return sent / self.pcie_bw + self.overhead.pcie_call_s

    def exe(self, start: int, stop: int) -> float:
        if stop <= start:
            return 0.0
        return self.exec_prefix[stop] - self.exec_prefix[start] + self.overhead.sync_s


def _costs(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead) -> _Costs:
    if not pcie_bw > 0:
        raise ValueError(f"pcie_bw={pcie_bw} bytes/s must be > 0")
    return _Costs(
        bytes_prefix=tuple(itertools.accumulate((layer.param_bytes for layer in layers), initial=0)),
        exec_prefix=tuple(itertools.accumulate((layer.exec_time_s for layer in layers), initial=0.0)),
        pcie_bw=pcie_bw, overhead=overhead,
    )


def _latency(costs: _Costs, groups: Sequence[Group]) -> float:
    trans_end = exec_end = 0.0
    for start, stop in groups:
        trans_end += costs.trans(start, stop)
        exec_end = max(trans_end, exec_end) + costs.exe(start, stop)
    return exec_end


def _check_groups(groups: Sequence[Group], n: int) -> None:
    expected = 0
    for start, stop in groups:
        if start != expected or stop <= start:
            raise ValueError(f"group ({start}, {stop}) must start at layer {expected} and be non-empty")
        expected = stop
    if expected != n:
        raise ValueError(f"groups cover layers [0, {expected}) but the model has {n} layers")


def group_latency(layers: Sequence[Layer], groups: Sequence[Group], pcie_bw: float,
                  overhead: TransferOverhead) -> float:
    """Time from the first transmission to the end of the last group's execution."""
    _check_groups(groups, len(layers))
    return _latency(_costs(layers, pcie_bw, overhead), groups)


def _fixed(costs: _Costs, size: int) -> Grouping:
    groups = tuple((s, min(s + size, costs.n)) for s in range(0, costs.n, size))
    return Grouping(groups=groups, latency_s=_latency(costs, groups), nodes_explored=0)


def per_layer_grouping(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead) -> Grouping:
    """Baseline: one group per layer (maximal overlap, maximal overhead)."""
    return _fixed(_costs(layers, pcie_bw, overhead), 1)


def single_group(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead) -> Grouping:
    """Baseline: transmit the whole model, then execute it (no overlap, one overhead)."""
    return _fixed(_costs(layers, pcie_bw, overhead), max(1, len(layers)))


def exhaustive_grouping(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead,
                        *, max_layers: int = 20) -> Grouping:
    """Try all 2^(n-1) groupings (reference for tests; refuses more than ``max_layers``)."""
    costs, n = _costs(layers, pcie_bw, overhead), len(layers)
    if n > max_layers:
        raise ValueError(f"{n} layers means 2^{n - 1} groupings; max_layers={max_layers}")
    if n == 0:
        return Grouping(groups=(), latency_s=0.0, nodes_explored=0)
    best, count = None, 0
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        groups = tuple(zip(bounds, bounds[1:]))
        count += 1
        latency = _latency(costs, groups)
        if best is None or latency < best[1]:
            best = (groups, latency)
    return Grouping(groups=best[0], latency_s=best[1], nodes_explored=count)


def optimal_grouping(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead,
                     *, bootstrap_group_size: int = 10) -> Grouping:
    """PipeSwitch Algorithm 1 (FindOptGrouping) with both prunings.

    As the paper does in practice, the search is bootstrapped with a fixed grouping of
    ``bootstrap_group_size`` layers per group. Recursion depth is one level per group.
    """
    costs = _costs(layers, pcie_bw, overhead)
    if costs.n == 0:
        return Grouping(groups=(), latency_s=0.0, nodes_explored=0)
    boot = _fixed(costs, bootstrap_group_size)
    nodes = [0]
    groups, _ = _find_opt(costs, 0, 0.0, (boot.groups, boot.latency_s), nodes)
    # Recompute forward in absolute time so the result equals group_latency() bit for bit.
    return Grouping(groups=groups, latency_s=_latency(costs, groups), nodes_explored=nodes[0])


def _first_group_min_end(costs: _Costs, x: int, delay: float) -> int:
    """Algorithm 1 lines 3-9 (second pruning, Eq. 3): the largest j* such that layers x..j* can be
    sent while earlier groups still compute (T(x, j*) <= B.delay). A first group ending before j*
    only adds overhead without starting computation any earlier, so the cases i < j* are skipped."""
    j_star = x
    for i in range(x, costs.n):
        if costs.trans(x, i + 1) <= delay:
            j_star = i
        else:
            break
    return j_star


def _find_opt(costs: _Costs, x: int, delay: float, incumbent: tuple[tuple[Group, ...], float] | None,
              nodes: list[int]) -> tuple[tuple[Group, ...], float]:
    """FindOptGrouping(B, x). Times are relative to the moment layer x starts transmitting (all
    earlier groups are on the device); ``delay`` is B.delay, how long earlier groups still compute
    after that moment. Returns the best groups for layers x..n-1 and their time to finish."""
    nodes[0] += 1
    n = costs.n
    if x == n:
        return (), delay
    opt_groups, opt_time = incumbent if incumbent is not None else (None, math.inf)  # line 2
    for i in range(_first_group_min_end(costs, x, delay), n):  # line 11
        first = costs.trans(x, i + 1)
        if opt_groups is not None:  # lines 12-19: first pruning (Eq. 2), lower bound of case i
            trans_time = first + costs.trans(i + 1, n)
            exec_time = max(first, delay) + costs.exe(x, i + 1) + costs.exe(i + 1, n)
            if min(trans_time, exec_time) > opt_time:
                continue
        rest_delay = max(first, delay) + costs.exe(x, i + 1) - first  # lines 21-23
        rest, rest_time = _find_opt(costs, i + 1, rest_delay, None, nodes)
        if first + rest_time < opt_time:  # lines 24-26
            opt_groups, opt_time = ((x, i + 1), *rest), first + rest_time
    return opt_groups, opt_time
