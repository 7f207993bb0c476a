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
    "dp_grouping",
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
    optimal: bool = True
    """False for baselines and for a search stopped by its node budget."""

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
    return Grouping(groups=groups, latency_s=_latency(costs, groups), nodes_explored=0,
                    optimal=False)


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


def dp_grouping(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead) -> Grouping:
    """Exact optimum in O(n^3) time (our addition, used to check Algorithm 1 on long models).

    Transmissions run back to back from time 0, so once k groups cover layers [0, x) the PCIe
    is done at bytes(0, x) / bw + k * pcie_call_s whatever the split. The rest of the timeline
    depends on the split only through when execution ends, and it is nondecreasing in that, so the
    earliest execution end per (x, k) is all that needs keeping.
    """
    costs, n = _costs(layers, pcie_bw, overhead), len(layers)
    if n == 0:
        return Grouping(groups=(), latency_s=0.0, nodes_explored=0)
    inf = math.inf
    exec_end = [[inf] * (n + 1) for _ in range(n + 1)]  # [x][k]
    parent = [[-1] * (n + 1) for _ in range(n + 1)]
    exec_end[0][0], steps = 0.0, 0
    for x in range(n):
        for k in range(x + 1):
            if exec_end[x][k] == inf:
                continue
            sent = costs.bytes_prefix[x] / pcie_bw + k * overhead.pcie_call_s
            for y in range(x + 1, n + 1):
                steps += 1
                end = max(sent + costs.trans(x, y), exec_end[x][k]) + costs.exe(x, y)
                if end < exec_end[y][k + 1]:
                    exec_end[y][k + 1], parent[y][k + 1] = end, x
    k = min(range(n + 1), key=lambda kk: exec_end[n][kk])
    groups, y = [], n
    while y > 0:
        x = parent[y][k]
        groups.append((x, y))
        y, k = x, k - 1
    groups.reverse()
    return Grouping(groups=tuple(groups), latency_s=_latency(costs, groups), nodes_explored=steps)


def optimal_grouping(layers: Sequence[Layer], pcie_bw: float, overhead: TransferOverhead, *,
                     bootstrap_group_size: int = 10, strengthened: bool = False,
                     max_nodes: int | None = 2_000_000) -> Grouping:
    """PipeSwitch Algorithm 1 (FindOptGrouping) with both prunings.

    As the paper does in practice, the search is bootstrapped with a fixed grouping of
    ``bootstrap_group_size`` layers per group. The search is exponential in the worst case (the
    paper says so too): fast when execution hides transmission, slow on long models whose layers
    are alike or transmission-bound, because each recursive call prunes only against its *own*
    best (line 12) and Eq. 2 takes the *min* of two lower bounds.

    ``strengthened=True`` (our addition, not the paper's) takes the max of Eq. 2's two bounds
    (each is a valid bound, so the max is too), adds the last layer's execution to the
    transmission bound, and passes the caller's best time down as a budget (plain branch and
    bound). The result is still optimal and it never explores more nodes.
    After ``max_nodes`` search nodes the best grouping found so far is returned with
    ``optimal=False``.
    """
    costs = _costs(layers, pcie_bw, overhead)
    if costs.n == 0:
        return Grouping(groups=(), latency_s=0.0, nodes_explored=0)
    boot = _fixed(costs, bootstrap_group_size)
    search = _Search(costs=costs, strengthened=strengthened, max_nodes=max_nodes)
    groups, optimal = boot.groups, True
    try:
        groups = search.find(0, 0.0, (boot.groups, boot.latency_s), math.inf)[0]
    except _NodeBudgetExceeded:
        groups, optimal = search.best_top or boot.groups, False
    # Recompute forward in absolute time so the result equals group_latency() bit for bit.
    return Grouping(groups=groups, latency_s=_latency(costs, groups),
                    nodes_explored=search.nodes, optimal=optimal)


class _NodeBudgetExceeded(Exception):
    pass


@dataclass(kw_only=True, slots=True)
class _Search:
    costs: _Costs
    strengthened: bool
    max_nodes: int | None
    nodes: int = 0
    best_top: tuple[Group, ...] | None = None

    def first_group_min_end(self, x: int, delay: float) -> int:
        """Algorithm 1 lines 3-9 (second pruning, Eq. 3): the largest j* with T(x, j*) <=
        B.delay, i.e. layers x..j* can be sent while earlier groups still compute. A first group
        ending before j* only adds overhead without starting computation any earlier, so line 11
        skips the cases i < j*."""
        j_star = x
        for i in range(x, self.costs.n):
            if self.costs.trans(x, i + 1) > delay:
                break
            j_star = i
        return j_star

    def lower_bound(self, x: int, i: int, delay: float) -> float:
        """Algorithm 1 lines 13-17 (first pruning, Eq. 2) for the case "first group is x..i":
        the rest sent as one group either back to back (transmission bound) or executed right
        after the first group (execution bound)."""
        c, n = self.costs, self.costs.n
        first = c.trans(x, i + 1)
        trans_time = first + c.trans(i + 1, n)
        exec_time = max(first, delay) + c.exe(x, i + 1) + c.exe(i + 1, n)
        if not self.strengthened:
            return min(trans_time, exec_time)
        # The last group still has to run after the last byte arrives: at least the last layer.
        return max(trans_time + (c.exe(n - 1, n) if i + 1 < n else 0.0), exec_time)

    def find(self, x: int, delay: float, incumbent: tuple[tuple[Group, ...], float] | None,
             budget: float) -> tuple[tuple[Group, ...] | None, float]:
        """FindOptGrouping(B, x). Times are relative to the moment layer x starts transmitting
        (all earlier groups are sent); ``delay`` is B.delay, how long earlier groups still compute
        after that moment. Returns the best groups for layers x..n-1 and their time to finish, or
        None when every case is pruned against ``budget`` (always inf in the paper's mode)."""
        self.nodes += 1
        if self.max_nodes is not None and self.nodes > self.max_nodes:
            raise _NodeBudgetExceeded
        c, n = self.costs, self.costs.n
        if x == n:
            return (), delay
        opt_groups, opt_time = incumbent if incumbent is not None else (None, math.inf)  # line 2
        for i in range(self.first_group_min_end(x, delay), n):  # line 11
            limit = min(opt_time, budget)
            if (opt_groups is not None or budget < math.inf) and \
                    self.lower_bound(x, i, delay) > limit:  # lines 12-19
                continue
            first = c.trans(x, i + 1)
            rest_delay = max(first, delay) + c.exe(x, i + 1) - first
            sub_budget = limit - first if self.strengthened else math.inf
            rest, rest_time = self.find(i + 1, rest_delay, None, sub_budget)  # lines 21-23
            if rest is not None and first + rest_time < opt_time:  # lines 24-26
                opt_groups, opt_time = ((x, i + 1), *rest), first + rest_time
                if x == 0:
                    self.best_top = opt_groups
        return opt_groups, opt_time  # line 27
