"""Price one training configuration: partition the units, time the pipeline, check memory.

`Evaluator` caches per-unit costs by what they depend on (`ParallelConfig.unit_key`) so the search can price thousands of
configurations; `evaluate` returns a plain `Evaluation` with an analytic iteration time, and
`simulate_config` runs the discrete-event simulation of the same configuration for exact
timelines and bubbles.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from itertools import accumulate

from costmodels.comm import allreduce_time, exposed_reduction_s, megatron_bucket_params, p2p_time
from costmodels.compute import unit_time
from costmodels.hardware import Hardware
from costmodels.memory import (DEFAULT_MEMORY, EngineMemory, StageMemory, UnitBytes, activation_bytes, expert_count,
                               fp8_param_count, fp8_weight_bytes, held_bytes, in_flight_bytes, param_count, stage_memory,
                               static_bytes, static_of, sweeps_grads, unit_bytes)
from costmodels.recompute import recompute_mode
from passes.errors import UserError
from passes.units import Unit

from .config import ParallelConfig
from .layout import EVEN, layout_bounds
from .partition import (NoFeasiblePartition, PartitionInput, chunk_shares, partition, rank_load, rebalance,
                        recomputed)
from .schedule_ir import Schedule, lower_timed
from .simulate import SimCosts, SimResult, simulate, simulate_time

__all__ = ["Evaluation", "Evaluator", "Rejected"]


class Rejected(Exception):
    """`lower_s`: where known, no configuration that only adds work to this one (more recomputation, more sharding)
    runs an iteration sooner: this one's pipeline time, had it fitted."""

    def __init__(self, reason: str, detail: str = "", need_bytes: float = 0.0, lower_s: float = 0.0,
                 bounds: tuple[int, ...] = ()) -> None:
        super().__init__(detail or reason)
        self.reason, self.need_bytes, self.lower_s, self.bounds = reason, need_bytes, lower_s, bounds


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    config: ParallelConfig
    bounds: tuple[int, ...]  # virtual stage j holds units bounds[j]..bounds[j+1]-1
    forward_s: tuple[float, ...]  # per virtual stage, per microbatch
    backward_s: tuple[float, ...]
    activation_bytes: tuple[float, ...]  # per virtual stage, per microbatch
    rank_memory: tuple[StageMemory, ...]
    p2p_s: float
    allreduce_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    tp_comm_s: float  # per microbatch, all units, forward + backward
    iteration_s: float
    samples_per_s: float
    model_flops: float  # per iteration, as PaLM and Megatron count them (no recomputation)
    tflops_per_gpu: float  # thesis eq. 4.2: a fixed F (recomputation assumed) over the iteration time
    mfu: float  # model FLOPs per second per GPU over the dense peak its GEMMs run at (PaLM; FP8's under an FP8 recipe)
    hfu: float  # FLOPs executed (recomputation as planned, causal attention as run) per second per GPU over peak
    hardware_tflops_per_gpu: float  # FLOPs actually executed (recomputation only where planned)
    bubble_fraction: float
    simulated: bool = False
    weight_s: tuple[float, ...] = ()  # per virtual stage: of backward_s, a split backward's W step
    weight_bytes: tuple[float, ...] = ()  # per virtual stage: of activation_bytes, what waits from I to W

    def lower_bound_s(self) -> float:
        """No simulation of this schedule ends sooner: a rank runs its own work one action at a time; before
        rank r's first forward, microbatch 0 has gone through the forwards of stages 0..r-1, and after r's
        last backward (chunk 0; its last I under a split backward, whose W steps may all come later) that
        microbatch's input gradient still runs through stages r-1..0, and rank 0's W, after which rank 0
        reduces its gradients and steps (p2p time left out: it only adds)."""
        c, p = self.config, self.config.pp
        place = c.placement
        w_s = self.weight_s or (0.0,) * c.stages
        work = [sum(self.forward_s[j] + self.backward_s[j] for j in place.stages(r)) * c.m for r in range(p)]
        best = max(w + a + o for w, a, o in zip(work, self.allreduce_s, self.optimizer_s))
        ahead, tail = 0.0, w_s[0] + self.allreduce_s[0] + self.optimizer_s[0]
        for r in range(1, p):
            ahead += self.forward_s[r - 1] + self.backward_s[r - 1] - w_s[r - 1]
            before_last = work[r] - c.m * sum(w_s[j] for j in place.stages(r))
            best = max(best, ahead + before_last + tail)
        return best

    def sim_costs(self, capacity: float) -> SimCosts:
        return SimCosts(forward_s=self.forward_s, backward_s=self.backward_s, p2p_s=self.p2p_s,
                        allreduce_s=self.allreduce_s, optimizer_s=self.optimizer_s,
                        static_bytes=tuple(int(m.static) for m in self.rank_memory),
                        activation_bytes=tuple(int(a) for a in self.activation_bytes),
                        capacity_bytes=int(capacity), weight_s=self.weight_s,
                        weight_bytes=tuple(int(w) for w in self.weight_bytes))


def least_room(need: Sequence[float], blocks: int) -> float:
    """The least R with sum_j floor(R / need[j]) >= blocks: the fullest of len(need) bins, bin j taking need[j] per
    item, when `blocks` items are spread to make it least (0 without items, or where an item needs nothing)."""
    if not blocks or min(need, default=0.0) <= 0:
        return 0.0
    tol = 1 + 1e-12  # an exact multiple of need[j] counts as reached

    def held(r: float) -> int:
        return sum(int(r / n * tol) for n in need)

    room = blocks / sum(1 / n for n in need)  # no less: sum_j R / need[j] >= sum_j floor(R / need[j]) >= blocks
    while held(room) < blocks:  # the next multiple of some need[j] holds one more; floor loses < 1 a bin, so at most
        room = min((int(room / n * tol) + 1) * n for n in need)  # len(need) steps
    return room


@dataclass(kw_only=True)
class Evaluator:
    units: tuple[Unit, ...]
    hw: Hardware
    global_batch: int
    n_gpus: int
    tokens_per_sample: int = 0  # sequence length of token-id input (context parallelism splits it); 0: none
    layout: str = ""  # a stated partition (planner.layout: Megatron-Core's layout string, or "even"); "": searched
    refused: dict[str, str] = field(default_factory=dict)  # tensor- and context-parallel splits the engine refuses
    # (ModelProfile.tp_refusals: "t", "t+sp" or "cp" -> the op and its source line); the search leaves them out
    memory: EngineMemory = DEFAULT_MEMORY  # how the engine holds parameters and gradients (Engine.memory)
    _cache: dict = field(default_factory=dict)

    @property
    def capacity(self) -> float:
        return self.hw.capacity

    @cached_property
    def twin_counts(self) -> dict[int, int]:
        """{the first unit of each kind: how many units are of its kind} (Evaluator._twins)."""
        return dict(Counter(self._twins))

    @cached_property
    def _twins(self) -> tuple[int, ...]:
        """For each unit, the first unit with the same costs (repeated blocks are priced once)."""
        first: dict[Unit, int] = {}
        return tuple(first.setdefault(replace(u, index=0, name="", nodes=(), tp_layout=()), i) for i, u in enumerate(self.units))

    def distinct_costs(self, c: ParallelConfig) -> dict[int, tuple[float, ...]]:
        """{unit: (fwd_s less its share of the weights' FP8 casts, bwd_s, tp_comm_s, activation bytes, weight-gradient
        s, bytes held from I to W, the casts' s)} for the first unit of each kind (Evaluator._twins), cached by what
        they depend on."""
        key = ("distinct", c.unit_key())
        if key not in self._cache:
            rows = {}
            for i in sorted(set(self._twins)):
                u = self.units[i]
                ut = unit_time(u, self.hw, c)
                rows[i] = (ut.fwd_s - ut.weight_cast_s / c.m, ut.bwd_s, ut.tp_comm_s, activation_bytes(u, c),
                           ut.bwd_weight_s, held_bytes(u, c), ut.weight_cast_s)
            self._cache[key] = rows
        return self._cache[key]

    def unit_costs(self, c: ParallelConfig) -> tuple[tuple[float, ...], ...]:
        """(fwd_s, bwd_s, tp_comm_s, activation bytes, weight-gradient s, bytes held from I to W) per unit,
        cached by what they depend on."""
        key = c.unit_key()
        if key not in self._cache:
            rows = self.distinct_costs(c)
            self._cache[key] = tuple(zip(*(rows[i] for i in self._twins)))
        *costs, casts = self._cache[key]
        if not any(casts):
            return tuple(costs)
        if (key, c.m) not in self._cache:
            self._cache[key, c.m] = (tuple(f + w / c.m for f, w in zip(costs[0], casts)), *costs[1:])
        return self._cache[key, c.m]

    def unit_bytes(self, c: ParallelConfig) -> UnitBytes:
        """costmodels.memory.unit_bytes of every unit under c, from the first unit of each kind (Evaluator._twins),
        cached by c (less its partial recomputation's count, which no unit's own bytes depend on)."""
        c = c.fallback(recompute=c.recompute) if c.recompute_layers else c
        key = ("unit bytes", c)
        if key not in self._cache:
            kinds = sorted(set(self._twins))
            rows = unit_bytes([self.units[i] for i in kinds], c, self.memory)
            where = [kinds.index(i) for i in self._twins]
            self._cache[key] = UnitBytes(*(tuple(col[k] for k in where) for col in
                                           (getattr(rows, f.name) for f in fields(UnitBytes))))
        return self._cache[key]

    def model_flops(self) -> float:
        """Model FLOPs of one iteration for MFU (PaLM, appendix B): 3x the forward matrix products."""
        return sum(u.model_flops(1) for u in self.units) * self.global_batch

    def thesis_flops(self) -> float:
        """FLOPs of one iteration as the thesis counts them (eq. 4.2): forward + backward of every
        unit plus one more forward of every block (activation recomputation assumed)."""
        return self.executed_flops("full")

    def executed_flops(self, recompute: str) -> float:
        """FLOPs one iteration executes: forward + backward, plus what the recomputation redoes."""
        key = ("flops", recompute)
        if key not in self._cache:
            extra = recompute_mode(recompute).extra_flops
            self._cache[key] = sum(u.fwd_flops(1) + u.bwd_flops(1) + extra(u) for u in self.units) * self.global_batch
        return self._cache[key]

    def _totals(self, c: ParallelConfig) -> tuple[float, float, float]:
        """Parameters (dense, experts') and FP8 weight-copy bytes one rank of each stage holds, summed over stages."""
        key = ("counts", c.tp, c.ep, c.fp8)
        if key not in self._cache:
            experts = sum(expert_count(u, c) for u in self.units)
            self._cache[key] = (sum(param_count(u, c) for u in self.units) - experts, experts,
                                sum(fp8_weight_bytes(u, c) for u in self.units))
        return self._cache[key]

    def memory_lower_bound(self, c: ParallelConfig) -> float:
        """No rank can need less than the average rank (the last rank holds the fewest activations)."""
        dense, experts, copies = self._totals(c)
        # partial recomputation keeps at least what recomputing every block keeps
        partial = c.recompute_mode.partial
        key = ("acts", c.unit_key("full" if partial else None))
        if key not in self._cache:  # activation bytes only (unit_costs' fourth column): most configurations this
            # bound rejects are never timed
            leanest = c.fallback(recompute="full") if partial else c
            acts = {i: activation_bytes(self.units[i], leanest) for i in set(self._twins)}
            self._cache[key] = sum(acts[i] for i in self._twins)
        static = static_of(dense + experts, experts, c, self.memory) + copies
        return (static + c.inflight(c.pp - 1) * self._cache[key]) / c.pp + self.hw.reserve_bytes

    def _block_bytes(self, c: ParallelConfig) -> tuple[float, float, int]:
        """(The fewest static bytes any block keeps on a rank, the fewest activation bytes any keeps per microbatch
        (partial recomputation: no fewer than recomputing it), the blocks); (0, 0, 0) without blocks."""
        partial = c.recompute_mode.partial
        key = ("block bytes", c.unit_key("full" if partial else None), c.dp, c.dp_replicate, c.zero, c.grad_fp32,
               c.fp8_params, sweeps_grads(c, self.memory))
        if key not in self._cache:
            kinds, counts = [i for i in set(self._twins) if self.units[i].kind == "block"], self.twin_counts
            leanest = c.fallback(recompute="full") if partial else c
            self._cache[key] = (min(static_bytes(self.units[i], c, self.memory) for i in kinds),
                                min(activation_bytes(self.units[i], leanest) for i in kinds),
                                sum(counts[i] for i in kinds)) if kinds else (0.0, 0.0, 0)
        return self._cache[key]

    def least_rank_room(self, c: ParallelConfig) -> float:
        """One chunk a rank: no partition's fullest rank needs fewer bytes (beyond the allocator's reserve) than R,
        the least with sum_j floor(R / (static + inflight(j) x activations)) >= the blocks, each block at the fewest
        bytes any needs (_block_bytes): rank j holding n_j blocks needs at least n_j times its divisor. 0 for v > 1
        or p = 1."""
        need, blocks = self._block_need(c)
        key = ("rank room", need, blocks)
        if key not in self._cache:
            self._cache[key] = least_room(need, blocks)
        return self._cache[key]

    def _block_need(self, c: ParallelConfig) -> tuple[tuple[float, ...], int]:
        """(Per rank j, the fewest bytes a block it holds needs: static + inflight(j) x activations at the fewest any
        block keeps (_block_bytes), the blocks); ((), 0) for v > 1 or p = 1."""
        if c.v != 1 or c.pp == 1:
            return (), 0
        static, act, blocks = self._block_bytes(c)
        key = ("block need", static, act, blocks, c.schedule, c.pp, c.m)  # (inflight: the schedule's, at p, v, m)
        if key not in self._cache:
            self._cache[key] = tuple(static + c.inflight(j) * act for j in range(c.pp)), blocks
        return self._cache[key]

    def least_slowest_stage_s(self, c: ParallelConfig) -> float:
        """One chunk a rank: no partition's slowest stage is faster than the blocks memory makes some rank take. Rank j
        holds at most U_j = room / (static + inflight(j) x activations) blocks at the fewest bytes any block needs
        (room: the capacity less the allocator's reserve, nothing else), so some rank holds L, the least with
        sum(min(U_j, L)) >= the blocks, each taking at least the fastest block's time. 0 where memory binds no rank
        (or no spread fits, which evaluation rejects: _partition)."""
        need, blocks = self._block_need(c)
        if not blocks:
            return 0.0
        key = ("block floor", c.unit_key(), need)  # the blocks' times (distinct_costs), what ranks hold
        if key not in self._cache:
            rows, room = self.distinct_costs(c), self.capacity - self.hw.reserve_bytes
            held = [int(room // n) if n > 0 else blocks for n in need]
            floor = 0.0
            if sum(held) >= blocks:
                least = -(-blocks // c.pp)
                while sum(min(h, least) for h in held) < blocks:
                    least += 1
                floor = least * min(r[0] + r[1] for i, r in rows.items() if self.units[i].kind == "block")
            self._cache[key] = floor
        return self._cache[key]

    def evaluate(self, c: ParallelConfig) -> Evaluation:
        if c.stages > len(self.units):
            raise Rejected("units", f"{c.stages} stages but only {len(self.units)} units")
        if not c.recompute_mode.partial or c.recompute_layers:
            return self._evaluate(c)
        # partial recomputation with no count pinned: the least number of blocks per chunk that fits (memory falls
        # and time grows with it); none at all is mode "none", priced apart
        none = c.fallback(recompute="none")
        try:
            self._evaluate(none)
            raise Rejected("partial recomputation where nothing needs recomputing")
        except Rejected as r:
            if r.reason != "memory":
                raise
            short, bounds = max(r.need_bytes - self.capacity, 0.0), r.bounds or self._fastest_bounds(none)
        # the least count that fits the partition recomputing nothing took (or would take, memory aside: time-optimal
        # for it; the recomputation adds about the same to every stage), priced on that partition
        try:
            return self._price(replace(c, recompute_layers=self.least_recompute_on(c, bounds)), bounds)
        except Rejected:
            pass  # not even recomputing its share of the blocks fits that partition: look for another
        # then, from a first guess from the shortfall, the least count whose own partition fits
        most, n = self._most_recomputed(c), self.recompute_guess(c, short)
        tried: dict[int, Evaluation | Rejected] = {}

        def attempt(k: int) -> Evaluation | Rejected:
            if k not in tried:
                try:
                    tried[k] = self._evaluate(replace(c, recompute_layers=k))
                except Rejected as r:
                    tried[k] = r
            return tried[k]

        step = 1
        while isinstance(attempt(n), Rejected):  # up, doubling the step, until one fits
            if n == most:
                raise tried[n]
            n, step = min(n + step, most), step * 2
        lo = max((k for k, e in tried.items() if isinstance(e, Rejected)), default=0) + 1
        if lo < n and isinstance(attempt(n - 1), Rejected):  # the guess was the least (the usual case)
            lo = n
        while lo < n:  # the least count that fits, between the last that did not and the first that did
            mid = (lo + n) // 2
            if isinstance(attempt(mid), Rejected):
                lo = mid + 1
            else:
                n = mid
        return tried[n]

    def memory_shaped(self, e: Evaluation) -> bool:
        """Memory shaped the evaluation's partition: a rank is within 1% of capacity and the slowest rank is more than
        1% slower than a perfectly balanced one."""
        c = e.config
        fwd, bwd, *_ = self.unit_costs(c)
        work = [0.0, *accumulate(f + b for f, b in zip(fwd, bwd))]
        slowest = max(sum(work[e.bounds[j + 1]] - work[e.bounds[j]] for j in c.placement.stages(r))
                      for r in range(c.pp))
        return (max(m.total for m in e.rank_memory) >= 0.99 * self.capacity
                and slowest > 1.01 * self._balanced_s(fwd, bwd, c.pp))

    @staticmethod
    def _balanced_s(fwd, bwd, p: int) -> float:
        """No rank of p is faster than this: the average, or the slowest unit."""
        work = [f + b for f, b in zip(fwd, bwd)]
        return max(sum(work) / p, max(work))

    def _fastest_bounds(self, c: ParallelConfig) -> tuple[int, ...]:
        """The partition with the fastest slowest stage, memory aside (cached by what it depends on: the units' times
        and the stages)."""
        key = ("fastest", c.unit_key(), c.m, c.stages)
        if key not in self._cache:
            fwd, bwd, _, _, _, _ = self.unit_costs(c)
            n, k = len(fwd), c.stages
            zeros = (0.0,) * n
            self._cache[key] = partition(PartitionInput(
                time_s=tuple(f + b for f, b in zip(fwd, bwd)), static_bytes=zeros, activation_bytes=zeros,
                inflight=(0.0,) * k, cap_bytes=(1.0,) * k)).bounds
        return self._cache[key]

    def _most_recomputed(self, c: ParallelConfig) -> int:
        """The most blocks per chunk partial recomputation tries: twice a chunk's share (beyond, it is about "full",
        priced on its own)."""
        return min(len(self._blocks), 2 * math.ceil(len(self._blocks) / c.stages))

    def recompute_guess(self, c: ParallelConfig, short: float, bounds: tuple[int, ...] = ()) -> int:
        """A first count of blocks per chunk for partial recomputation `c` whose sibling recomputing nothing was
        `short` bytes over: the least that fits `bounds` (that sibling's partition), or, without one, the shortfall
        over what one block frees at the busiest microbatch count (each frees its plain less its full bytes)."""
        if bounds:
            return self.least_recompute_on(c, bounds)
        return self.least_recompute_for(c, short)

    def least_recompute_for(self, c: ParallelConfig, short: float) -> int:
        """No fewer blocks per chunk than this free `short` bytes on a rank: each block a chunk redoes frees at most
        the most any block frees (its plain less its full bytes) per microbatch its chunk holds, and a rank's v
        chunks hold at most v x inflight(0) (ParallelConfig.inflight counts whole stages)."""
        kept = self.unit_costs(c.fallback(recompute="none"))[3]
        least = self.unit_costs(c.fallback(recompute="full"))[3]
        frees = max((kept[i] - least[i] for i in self._blocks), default=0.0) * c.inflight(0) * c.v
        return min(max(1, math.ceil(short / frees)) if frees else 1, self._most_recomputed(c))

    def least_recompute_on(self, c: ParallelConfig, bounds: tuple[int, ...]) -> int:
        """The least count of blocks per chunk partial recomputation `c` needs to fit the partition `bounds` (its
        rank memory only, no partition of its own; at most _most_recomputed)."""
        most = self._most_recomputed(c)
        stages = [range(a, b) for a, b in zip(bounds, bounds[1:])]

        def fits(k: int) -> bool:
            ck = replace(c, recompute_layers=k)
            redo = {i for r in self._recomputed(ck, bounds) for i in r}
            return max(m.total for m in self._rank_memory(ck, stages, redo)) <= self.capacity

        lo, hi = 1, most  # a rank's memory never grows with the count (each block redone keeps fewer bytes): the
        while lo < hi:  # least that fits by bisection, else the most
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    @cached_property
    def _blocks(self) -> tuple[int, ...]:
        return tuple(i for i, u in enumerate(self.units) if u.kind == "block")

    def _recomputed(self, c: ParallelConfig, bounds: tuple[int, ...]) -> list[Sequence[int]]:
        """Per virtual stage, the units partial recomputation redoes in full: its first c.recompute_layers blocks
        (none under other modes)."""
        n = c.recompute_layers if c.recompute_mode.partial else 0
        return [recomputed(self._blocks, n, a, b) for a, b in zip(bounds, bounds[1:])]

    def _recompute_input(self, c: ParallelConfig, act) -> dict:
        """The PartitionInput fields of partial recomputation: a recomputed block's backward takes what mode "full"
        adds to it, and it keeps what "full" keeps, not all of `act`."""
        if not c.recompute_mode.partial:
            return {}
        _, bwd, _, _, _, _ = self.unit_costs(c.fallback(recompute="none"))
        _, redo, _, kept, _, _ = self.unit_costs(c.fallback(recompute="full"))
        return {"recompute_first": c.recompute_layers, "recomputable": self._blocks,
                "recompute_time_s": tuple(r - b for r, b in zip(redo, bwd)),
                "recompute_saves": tuple(a - k for a, k in zip(act, kept))}

    def _evaluate(self, c: ParallelConfig) -> Evaluation:
        key = ("rejected", c)  # a configuration that did not fit is asked again by its partial-recomputation sibling
        if key in self._cache:
            raise self._cache[key]
        try:
            return self._price(c)
        except Rejected as r:
            if r.reason == "memory":
                self._cache[key] = r
            raise

    def _price(self, c: ParallelConfig, bounds: tuple[int, ...] = ()) -> Evaluation:
        """`bounds`: this partition, not the best one under the memory caps."""
        fwd, bwd, tpc, act, wgt, wkeep = self.unit_costs(c)
        bounds = bounds or self._stated_bounds(c) or self._partition(c, fwd, bwd, act, wkeep).bounds
        stages = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        redo = self._recomputed(c, bounds)
        extra = self.hw.eff.action_overhead_s
        split = c.schedule_kind.split_backward  # I and W are two actions, each with its overhead
        f_s = tuple(sum(fwd[i] for i in st) + extra for st in stages)
        b_s = tuple(sum(bwd[i] for i in st) + extra * (1 + split) for st in stages)
        w_s = tuple(sum(wgt[i] for i in st) + extra for st in stages) if split else ()
        a_s = tuple(sum(act[i] for i in st) for st in stages)
        if any(redo):
            more = self._recompute_input(c, act)
            b_s = tuple(b + sum(more["recompute_time_s"][i] for i in r) for b, r in zip(b_s, redo))
            a_s = tuple(a - sum(more["recompute_saves"][i] for i in r) for a, r in zip(a_s, redo))
        wb_s = tuple(sum(wkeep[i] for i in st) for st in stages) if split else ()
        mems = self._rank_memory(c, stages, {i for r in redo for i in r})
        worst = max(m.total for m in mems)
        p2p = self._p2p_s(c, bounds)
        pipeline = c.schedule_kind.analytic_s(f_s, b_s, c.pp, c.v, c.m, p2p, w_s)
        if worst > self.capacity:
            raise Rejected("memory", f"needs {worst / 2**30:.1f} GiB", worst, lower_s=pipeline, bounds=bounds)
        ar, opt = self._allreduce_opt(c, bounds, f_s, b_s)
        it = pipeline + max(a + o for a, o in zip(ar, opt))
        return self._finish(c, bounds, f_s, b_s, a_s, mems, p2p, ar, opt, sum(tpc), it, None, w_s, wb_s)

    def _finish(self, c, bounds, f_s, b_s, a_s, mems, p2p, ar, opt, tpc, it, bubble, w_s=(), wb_s=()) -> Evaluation:
        flops, peak = self.model_flops(), self.hw.gpu.peak(c.peak_dtype)
        per_gpu = self.thesis_flops() / (self.n_gpus * it)
        redone = sum(self.units[i].fwd_flops(1) for r in self._recomputed(c, bounds) for i in r) * self.global_batch
        executed = (self.executed_flops(c.recompute) + redone) / (self.n_gpus * it)
        place = c.placement
        busy = [sum(f_s[j] + b_s[j] for j in place.stages(r)) * c.m + ar[r] + opt[r] for r in range(c.pp)]
        frac = bubble if bubble is not None else max(0.0, 1 - sum(busy) / (c.pp * it))
        return Evaluation(config=c, bounds=tuple(bounds), forward_s=f_s, backward_s=b_s, activation_bytes=a_s,
                          rank_memory=tuple(mems), p2p_s=p2p, allreduce_s=ar, optimizer_s=opt, tp_comm_s=tpc,
                          iteration_s=it, samples_per_s=self.global_batch / it, model_flops=flops,
                          tflops_per_gpu=per_gpu / 1e12, mfu=flops / (self.n_gpus * it) / peak, hfu=executed / peak,
                          hardware_tflops_per_gpu=executed / 1e12,
                          bubble_fraction=frac, simulated=bubble is not None, weight_s=w_s, weight_bytes=wb_s)

    def _stated_bounds(self, c: ParallelConfig) -> tuple[int, ...]:
        """The partition the layout states (planner.layout), or () when none is stated."""
        if not self.layout or c.stages == 1:
            return ()
        try:
            return layout_bounds(self.layout, [u.kind for u in self.units], c.stages)
        except UserError as exc:
            if self.layout != EVEN:
                raise
            raise Rejected("layers not divisible by the virtual stages (Megatron's even layout)", str(exc)) from exc

    def _partition(self, c: ParallelConfig, fwd, bwd, act, wkeep):
        if (spread := self.least_rank_room(c) + self.hw.reserve_bytes) > self.capacity:  # what partition would
            # find after its search: no spread of the blocks fits their ranks
            raise Rejected("memory", "no partition fits", spread)
        k = c.stages
        table = self.unit_bytes(c)
        static = list(table.static)
        work = max(max(act, default=0.0) if c.recompute_mode.working_set else max(table.rebuilt, default=0.0),
                   max(table.loss, default=0.0))  # a unit's backward, or the loss's before the last unit's
        place = c.placement
        rank_of, ranks = place.rank_of, [place.stages(r) for r in range(c.pp)]
        peaks = [c.chunk_peaks(r) for r in range(c.pp)]
        # each chunk at the most microbatches it ever holds, and a share of its rank's memory in proportion to them
        most = [[max(x) for x in zip(*pk)] for pk in peaks]
        fl = [most[rank_of[j]][ranks[rank_of[j]].index(j)] for j in range(k)]
        pending = [c.w_pending(rank_of[j]) for j in range(k)]
        # ZeRO-2/3's whole units (at most the model's largest)
        room = self.capacity - self.hw.reserve_bytes - work - sum(in_flight_bytes(self.units, c, table, self.memory))
        caps = tuple(room * fl[j] / sum(most[rank_of[j]]) if fl[j] else room / c.v for j in range(k))
        inp = PartitionInput(time_s=tuple(f + b for f, b in zip(fwd, bwd)), static_bytes=tuple(static),
                             activation_bytes=tuple(act), inflight=tuple(fl), cap_bytes=caps,
                             weight_bytes=tuple(wkeep) if any(pending) else (), w_pending=tuple(pending),
                             **self._recompute_input(c, act))
        if c.v == 1:
            try:
                return partition(inp)
            except NoFeasiblePartition:
                pass
        else:  # a rank's chunks share its memory: first each chunk the whole rank's (the fastest chunks, memory
            # aside: where their ranks hold them, nothing does better); else each chunk its share of the rank's in
            # proportion to its microbatches at the most, and, unless that fits as fast as memory aside, also spread
            # as typical units would be (partition.chunk_shares). The one whose slowest rank is fastest, else the one
            # least over, repaired (partition.rebalance)
            load, done = rank_load(inp, ranks, peaks, room), []

            def tries():
                yield replace(inp, cap_bytes=(room,) * k)
                yield inp
                n = len(self.units)
                if shares := chunk_shares(n, sorted(static)[n // 2], sorted(act)[n // 2], ranks, peaks, room):
                    yield replace(inp, time_share=shares[0], cap_bytes=shares[1], inflight=shares[2])

            for attempt in tries():
                try:
                    part = partition(attempt)
                except NoFeasiblePartition:
                    continue
                times, over = zip(*(load(part.bounds, r) for r in range(c.pp)))
                done.append((sum(over), max(times), part))
                if not done[-1][0] and (len(done) == 1 or done[-1][1] <= 1.001 * self._balanced_s(fwd, bwd, c.pp)):
                    break  # the fastest chunks with memory aside fit their ranks: nothing does better
            if done:  # the least over, repaired; and the fastest (the whole room's, memory aside), repaired: the
                # tie it broke among equally fast chunks may have loaded one rank over, which moving a unit mends
                # (Llama 3.1 405B at p8 v8: Megatron's Et|(tt|)*62tL, not a 3-unit first chunk)
                picks = {id(x[2]): x[2] for x in (min(done, key=lambda x: x[:2]), done[0])}.values()
                repaired = [rebalance(inp, part, ranks, peaks, room) for part in picks]

                def rank_key(part):  # bytes over, then the schedule's time: m x the slowest rank's work, and a
                    # fill and drain of p - 1 of the slowest chunks (the analytic one's slowest / v, where they differ)
                    times, over = zip(*(load(part.bounds, r) for r in range(c.pp)))
                    return sum(over), c.m * max(times) + (c.pp - 1) * max(part.stage_time_s)
                return min(repaired, key=rank_key)
        need = self.memory_lower_bound(c)
        raise Rejected("memory", "no partition fits", max(need, self.capacity * 1.0001))

    def _rank_memory(self, c: ParallelConfig, stages: list[range], full: set[int] = frozenset()) -> list[StageMemory]:
        place, table = c.placement, self.unit_bytes(c)
        mems = []
        for r in range(c.pp):
            at = [i for j in place.stages(r) for i in stages[j]]
            mems.append(stage_memory([self.units[i] for i in at], self.hw, c, r, full,
                                     chunks=[len(stages[j]) for j in place.stages(r)], table=table, at=at,
                                     held=self.memory))
        return mems

    def _p2p_s(self, c: ParallelConfig, bounds: tuple[int, ...]) -> float:
        """Largest activation crossing a stage boundary, split over t (scatter/gather, thesis 4.4.1) and over
        the context-parallel ranks (each sends its part of the sequence)."""
        if c.pp == 1:
            return 0.0
        nbytes = max(self.units[i - 1].output_bytes(c.local_b) for i in bounds[1:-1]) / c.tp
        cl = self.hw.cluster
        # Megatron orders ranks tp, cp, dp, then pp: adjacent stages are t*cp*d ranks apart.
        same_node = c.gpus_per_stage < cl.gpus_per_node
        bw = (cl.nvlink_bw if same_node else cl.internode_bw) * self.hw.eff.link
        lat = cl.nvlink_latency_s if same_node else cl.internode_latency_s
        return p2p_time(nbytes, bw, lat)

    def _stage_params(self, c: ParallelConfig, bounds: tuple[int, ...], count=param_count) -> list[float]:
        """Parameters one rank holds of each virtual stage (`count`: of each unit, e.g. only its experts')."""
        key = ("params", count.__name__, c.tp, c.ep)
        if key not in self._cache:
            acc = [0.0]
            for u in self.units:
                acc.append(acc[-1] + count(u, c))
            self._cache[key] = acc
        acc = self._cache[key]
        return [acc[b] - acc[a] for a, b in zip(bounds, bounds[1:])]

    def _dp_collective_s(self, c: ParallelConfig, dense: float, experts: float, nbytes: float,
                         replicas: bool = False) -> float:
        """An all-reduce of `nbytes` per parameter (half of it: a reduce-scatter or an all-gather) of a rank's `dense`
        parameters over the data- and context-parallel ranks, then of its `experts` over the expert-data-parallel
        ones (every ep-th rank of those holding different tokens; the tensor-parallel ones count under sp). Under
        hybrid sharding (dp_replicate R > 1) the group is one replica's shard group (d/R x cp ranks, tp apart), and
        with `replicas` (a gradient's reduce-scatter) each rank's reduced shard, 2 * nbytes per parameter over the
        shard group's ranks, is then all-reduced over the R replicas, the shard group's size times tp apart: torch
        FSDP2's HSDP reduces within the shard group, then all-reduces the reduce-scatter's output over the replicate
        group (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce, all_reduce_group), ranks
        ordered dp_replicate, dp_shard, cp, tp (torchtitan/distributed/parallel_dims.py); Megatron-FSDP's
        --num-distributed-optimizer-instances lays its groups out the same way."""
        node, r = self.hw.cluster.gpus_per_node, c.dp_replicate

        def reduce_s(n: float, ranks: int, stride: int, per: float = nbytes) -> float:
            per_node = max(1, min(ranks, node // stride))
            return allreduce_time(n * per, per_node, ranks // per_node, self.hw.links) if ranks > 1 and n else 0.0

        shard, expert_shard = c.shard_ranks, c.expert_dp // r
        cost = reduce_s(dense, shard, c.tp) + reduce_s(experts, expert_shard, c.ep * c.tp // c.sp_degree)
        if replicas and r > 1:  # the shards' all-reduce over the replicas, one replica's whole stage apart
            apart = c.tp * shard
            cost += reduce_s(dense / shard, r, apart, 2 * nbytes) + reduce_s(experts / expert_shard, r, apart,
                                                                            2 * nbytes)
        return cost

    def dp_comm_floor(self, c: ParallelConfig) -> float:
        """Under ZeRO-2/3 no iteration is shorter than the average rank's data-parallel communication, which its
        stream runs whole, hidden or not: every microbatch's reduce-scatter, ZeRO-3's all-gathers before each
        forward and backward (the search's bound; 0 below ZeRO-2)."""
        if c.zero < 2:
            return 0.0
        dense, experts, _ = (x / c.pp for x in self._totals(c))
        num = c.numerics
        return (c.m * self._dp_collective_s(c, dense, experts, num.grad_bytes / 2, replicas=True)  # (gathers: at the
                # fewest bytes any unit's take, ParallelConfig.gathered_bytes)
                + (2 * c.m if c.zero == 3 else 1) * self._dp_collective_s(c, dense, experts,
                                                                         c.gathered_bytes(True) / 2))

    def _allreduce_opt(self, c: ParallelConfig, bounds: tuple[int, ...], f_s: tuple[float, ...],
                       b_s: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per rank: the data-parallel gradient reduction (the part left exposed under overlap) and the
        optimizer step."""
        ar, opt, num = [], [], c.numerics
        group = c.dp * c.cp  # gradients are reduced over the data- and context-parallel ranks (Megatron)
        params = self._stage_params(c, bounds)
        experts = self._stage_params(c, bounds, expert_count)
        fp8 = self._stage_params(c, bounds, fp8_param_count)
        hbm = self.hw.gpu.hbm_bw * self.hw.eff.hbm

        def both_s(j: int, nbytes: float, replicas: bool = False) -> float:  # the dense parameters' reduction,
            # then the experts'
            return self._dp_collective_s(c, params[j] - experts[j], experts[j], nbytes, replicas)

        place = c.placement
        for r in range(c.pp):
            chunks = place.stages(r)
            total, local = sum(params[j] for j in chunks), sum(experts[j] for j in chunks)
            if c.zero:  # a reduce-scatter of the gradients and an all-gather of the weights, each half an all-reduce
                grads = [both_s(j, num.grad_bytes / 2, replicas=True) for j in chunks]  # (and under hybrid
                # sharding the shards' all-reduce over the replicas)
                gather = [both_s(j, (num.weight_bytes * (params[j] - fp8[j]) + c.gathered_bytes(True) * fp8[j])
                                 / params[j] / 2 if params[j] else 0.0) for j in chunks]  # (FP8 units' gathered in
                # FP8 where the recipe does: ParallelConfig.gathered_bytes)
            else:
                grads, gather = [both_s(j, num.grad_bytes) for j in chunks], [0.0] * c.v
            # ZeRO-2/3: every microbatch's gradients reduce-scattered during its backward (sharded gradients cannot
            # wait for the last microbatch), ZeRO-3's parameters all-gathered before each unit's forward and again
            # before its backward instead of once after the step
            load = (c.m * sum(grads) + (2 * c.m if c.zero == 3 else 1) * sum(gather)) if c.zero >= 2 \
                else sum(grads) + sum(gather)
            if c.overlap_grad_reduce:
                bucket = [min(1.0, megatron_bucket_params(group) / params[j]) if params[j] else 1.0 for j in chunks]
                fwd = [f_s[j] for j in chunks]
                bwd = [b_s[j] for j in chunks]
                tail = exposed_reduction_s(grads, [0.0] * len(chunks) if c.zero == 3 else gather, fwd, bwd, bucket,
                                           first_group=min(c.pp, c.m), last_group=(c.m - 1) % c.pp + 1)
                # the last tail, and the communication stream's load beyond what the rank's own compute and that
                # tail cover: the stream runs its whole load, hidden or not (dp_comm_floor), so no iteration is
                # shorter than it
                busy = c.m * (sum(fwd) + sum(bwd))
                ar.append(tail + max(0.0, load - tail - busy) if c.zero >= 2 else tail)
            else:
                ar.append(load)
            # Adam reads and writes weights, grads, master weights and both moments once, on the 1/(d*cp) of the
            # parameters a rank owns under a sharded optimizer
            opt.append(2 * c.optimizer_owned(total, local) * num.bytes_per_param() / hbm)
        return tuple(ar), tuple(opt)

    def schedule(self, c: ParallelConfig) -> Schedule:
        """c's schedule (its kind's program at c's p, m and v), generated once per shape: the search simulates
        configurations of one shape (t, d, recomputation, ... apart) again and again, and the plan takes the best's."""
        key = ("schedule", c.schedule_kind.name, c.pp, c.m, c.v)
        if key not in self._cache:
            self._cache[key] = c.schedule_kind.generate(c.pp, c.m, c.v)
        return self._cache[key]

    def _timed(self, c: ParallelConfig) -> Schedule:
        """c's schedule, or where it was not generated its timed actions alone (schedule.lower_timed: what
        simulate_time reads), once per shape."""
        kind = c.schedule_kind
        shape = (kind.name, c.pp, c.m, c.v)
        if ("schedule", *shape) in self._cache:
            return self._cache["schedule", *shape]
        if ("timed", *shape) not in self._cache:
            self._cache["timed", *shape] = lower_timed(kind.name, c.pp, c.m, c.v, kind.compute(c.pp, c.m, c.v))
        return self._cache["timed", *shape]

    def simulate_config(self, ev: Evaluation) -> tuple[Evaluation, SimResult]:
        c = ev.config
        result = simulate(self.schedule(c), ev.sim_costs(self.capacity))
        return self._simulated(ev, result.iteration_s, result.bubble_fraction), result

    def simulated(self, ev: Evaluation) -> Evaluation:
        """simulate_config's Evaluation alone (simulate.simulate_time: no timelines), cached by what the simulated
        times depend on: the schedule's shape and the stages' and ranks' seconds (configurations apart in what only
        their memory sees, as ZeRO-1 and ZeRO-2 may be, run the same iteration)."""
        c = ev.config
        key = ("simulated", c.schedule, c.pp, c.m, c.v, ev.forward_s, ev.backward_s, ev.weight_s, ev.p2p_s,
               ev.allreduce_s, ev.optimizer_s)
        costs = ev.sim_costs(self.capacity)  # (checked whether or not the times are new)
        if key not in self._cache:
            self._cache[key] = simulate_time(self._timed(c), costs)
        return self._simulated(ev, *self._cache[key])

    def _simulated(self, ev: Evaluation, iteration_s: float, bubble_fraction: float) -> Evaluation:
        return self._finish(ev.config, ev.bounds, ev.forward_s, ev.backward_s, ev.activation_bytes,
                            list(ev.rank_memory), ev.p2p_s, ev.allreduce_s, ev.optimizer_s, ev.tp_comm_s, iteration_s,
                            bubble_fraction, ev.weight_s, ev.weight_bytes)
