"""Price one training configuration: partition the units, time the pipeline, check memory.

`Evaluator` caches per-unit costs by (b, t, recompute) so the search can price thousands of
configurations; `evaluate` returns a plain `Evaluation` with an analytic iteration time, and
`simulate_config` runs the discrete-event simulation of the same configuration for exact
timelines and bubbles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from costmodels.comm import allreduce_time, p2p_time
from costmodels.compute import Efficiency, achieved_links, unit_time
from costmodels.memory import MemoryConfig, StageMemory, inflight, stage_memory, unit_activation_bytes, unit_param_count
from passes.units import Unit
from targets.specs import Target

from .partition import NoFeasiblePartition, PartitionInput, partition
from .schedule import generate
from .simulate import SimCosts, SimResult, simulate

__all__ = ["Config", "Evaluation", "Evaluator", "Rejected"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    t: int
    p: int
    d: int
    b: int
    v: int
    m: int
    recompute: str
    schedule: str

    def __str__(self) -> str:
        return (f"t={self.t} p={self.p} d={self.d} b={self.b} m={self.m} v={self.v} "
                f"{self.schedule} recompute={self.recompute}")


class Rejected(Exception):
    def __init__(self, reason: str, detail: str = "", need_bytes: float = 0.0) -> None:
        super().__init__(detail or reason)
        self.reason, self.need_bytes = reason, need_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    config: Config
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
    model_flops: float  # per iteration, thesis eq. 4.2 convention
    tflops_per_gpu: float  # thesis eq. 4.2: a fixed F (recomputation assumed) over the iteration time
    mfu: float
    hardware_tflops_per_gpu: float  # FLOPs actually executed (recomputation only where planned)
    bubble_fraction: float
    simulated: bool = False

    def sim_costs(self, capacity: float) -> SimCosts:
        return SimCosts(forward_s=self.forward_s, backward_s=self.backward_s, p2p_s=self.p2p_s,
                        allreduce_s=self.allreduce_s, optimizer_s=self.optimizer_s,
                        static_bytes=tuple(int(m.static) for m in self.rank_memory),
                        activation_bytes=tuple(int(a) for a in self.activation_bytes),
                        capacity_bytes=int(capacity))


@dataclass(kw_only=True)
class Evaluator:
    units: tuple[Unit, ...]
    target: Target
    global_batch: int
    n_gpus: int
    dtype: str = "bf16"
    eff: Efficiency = Efficiency()
    mem: MemoryConfig = MemoryConfig()
    _cache: dict = field(default_factory=dict)

    @property
    def capacity(self) -> float:
        return float(self.target.gpu.hbm_bytes)

    def unit_costs(self, b: int, t: int, rc: str) -> tuple[tuple[float, ...], ...]:
        """(fwd_s, bwd_s, tp_comm_s, activation bytes) per unit, cached."""
        key = (b, t, rc)
        if key not in self._cache:
            rows = []
            for u in self.units:
                ut = unit_time(u, b, t, self.target, recompute=rc, eff=self.eff, dtype=self.dtype)
                rows.append((ut.fwd_s, ut.bwd_s, ut.tp_comm_s, unit_activation_bytes(u, b, t, rc)))
            self._cache[key] = tuple(zip(*rows))
        return self._cache[key]

    def model_flops(self) -> float:
        """FLOPs of one iteration as the thesis counts them (eq. 4.2): forward + backward of every
        unit plus one more forward of every block (activation recomputation assumed)."""
        return self.executed_flops("full")

    def executed_flops(self, recompute: str) -> float:
        """FLOPs one iteration executes: forward + backward, plus what the recomputation redoes."""
        key = ("flops", recompute)
        if key not in self._cache:
            extra = {"none": lambda u: 0.0, "full": lambda u: u.fwd_flops(1) if u.kind == "block" else 0.0,
                     "selective": lambda u: u.sharded.selective_flops(1) + u.replicated.selective_flops(1)}[recompute]
            self._cache[key] = sum(u.fwd_flops(1) + u.bwd_flops(1) + extra(u) for u in self.units) * self.global_batch
        return self._cache[key]

    def memory_lower_bound(self, c: Config) -> float:
        """No rank can need less than the average rank (the last rank holds the fewest activations)."""
        _, _, _, act = self.unit_costs(c.b, c.t, c.recompute)
        static = sum(unit_param_count(u, c.t) for u in self.units) * self._bytes_per_param(c.d)
        last = inflight(c.schedule, c.p, c.v, c.m, c.p - 1)
        return (static + last * sum(act)) / c.p + self.mem.reserve_bytes

    def _bytes_per_param(self, d: int) -> float:
        m = self.mem
        return m.weight_bytes + m.grad_bytes + m.optimizer_bytes / (d if m.shard_optimizer else 1)

    def evaluate(self, c: Config) -> Evaluation:
        fwd, bwd, tpc, act = self.unit_costs(c.b, c.t, c.recompute)
        k = c.p * c.v
        if k > len(self.units):
            raise Rejected("units", f"{k} stages but only {len(self.units)} units")
        part = self._partition(c, fwd, bwd, act)
        stages = [range(a, b) for a, b in zip(part.bounds, part.bounds[1:])]
        extra = self.eff.action_overhead_s
        f_s = tuple(sum(fwd[i] for i in st) + extra for st in stages)
        b_s = tuple(sum(bwd[i] for i in st) + extra for st in stages)
        a_s = tuple(sum(act[i] for i in st) for st in stages)
        mems = self._rank_memory(c, stages)
        worst = max(m.total for m in mems)
        if worst > self.capacity:
            raise Rejected("memory", f"needs {worst / 2**30:.1f} GiB", worst)
        p2p = self._p2p_s(c, part.bounds)
        ar, opt = self._allreduce_opt(c, mems)
        it = self._analytic_iteration(c, f_s, b_s, p2p) + max(a + o for a, o in zip(ar, opt))
        return self._finish(c, part.bounds, f_s, b_s, a_s, mems, p2p, ar, opt, sum(tpc), it, None)

    def _finish(self, c, bounds, f_s, b_s, a_s, mems, p2p, ar, opt, tpc, it, bubble) -> Evaluation:
        flops = self.model_flops()
        per_gpu = flops / (self.n_gpus * it)
        busy = [sum(f_s[j] + b_s[j] for j in range(r, c.p * c.v, c.p)) * c.m + ar[r] + opt[r] for r in range(c.p)]
        frac = bubble if bubble is not None else max(0.0, 1 - sum(busy) / (c.p * it))
        return Evaluation(config=c, bounds=tuple(bounds), forward_s=f_s, backward_s=b_s, activation_bytes=a_s,
                          rank_memory=tuple(mems), p2p_s=p2p, allreduce_s=ar, optimizer_s=opt, tp_comm_s=tpc,
                          iteration_s=it, samples_per_s=self.global_batch / it, model_flops=flops,
                          tflops_per_gpu=per_gpu / 1e12, mfu=per_gpu / self.target.gpu.peak(self.dtype),
                          hardware_tflops_per_gpu=self.executed_flops(c.recompute) / (self.n_gpus * it) / 1e12,
                          bubble_fraction=frac, simulated=bubble is not None)

    def _partition(self, c: Config, fwd, bwd, act):
        k = c.p * c.v
        static = [unit_param_count(u, c.t) * self._bytes_per_param(c.d) for u in self.units]
        work = max(act, default=0.0) if c.recompute == "full" else 0.0
        fl = [inflight(c.schedule, c.p, c.v, c.m, j % c.p) for j in range(k)]
        room = (self.capacity - self.mem.reserve_bytes - work) / c.v
        inp = PartitionInput(time_s=tuple(f + b for f, b in zip(fwd, bwd)), static_bytes=tuple(static),
                             activation_bytes=tuple(act), inflight=tuple(fl), cap_bytes=(room,) * k)
        try:
            return partition(inp)
        except NoFeasiblePartition:
            need = self.memory_lower_bound(c)
            raise Rejected("memory", "no partition fits", max(need, self.capacity * 1.0001)) from None

    def _rank_memory(self, c: Config, stages: list[range]) -> list[StageMemory]:
        out = []
        for r in range(c.p):
            units = [self.units[i] for j in range(r, c.p * c.v, c.p) for i in stages[j]]
            out.append(stage_memory(units, b=c.b, t=c.t, d=c.d, recompute=c.recompute,
                                    inflight_mb=inflight(c.schedule, c.p, c.v, c.m, r), cfg=self.mem))
        return out

    def _p2p_s(self, c: Config, bounds: tuple[int, ...]) -> float:
        """Largest activation crossing a stage boundary, split over t (scatter/gather, thesis 4.4.1)."""
        if c.p == 1:
            return 0.0
        nbytes = max(self.units[i - 1].output_bytes(c.b) for i in bounds[1:-1]) / c.t
        cl = self.target.cluster
        # Megatron orders ranks tp, then dp, then pp: adjacent stages are t*d ranks apart.
        same_node = c.t * c.d < cl.gpus_per_node
        bw = (cl.nvlink_bw if same_node else cl.internode_bw) * self.eff.link
        lat = cl.nvlink_latency_s if same_node else cl.internode_latency_s
        return p2p_time(nbytes, bw, lat)

    def _allreduce_opt(self, c: Config, mems: list[StageMemory]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        cl, ar, opt = self.target.cluster, [], []
        per_node = max(1, min(c.d, cl.gpus_per_node // c.t))
        scaled = achieved_links(cl, self.eff.link)
        for mem in mems:
            params = mem.weights / self.mem.weight_bytes
            ar.append(allreduce_time(params * self.mem.grad_bytes, per_node, c.d // per_node, scaled) if c.d > 1 else 0.0)
            # Adam reads and writes weights, grads, master weights and both moments once
            opt.append(2 * params * self._bytes_per_param(c.d) / (self.target.gpu.hbm_bw * self.eff.hbm))
        return tuple(ar), tuple(opt)

    def _analytic_iteration(self, c: Config, f_s, b_s, p2p: float) -> float:
        """Pipeline time of m microbatches (exact for uniform stages; the simulator refines it)."""
        k = c.p * c.v
        if c.schedule == "interleaved":
            per_rank = [sum(f_s[j] + b_s[j] for j in range(r, k, c.p)) for r in range(c.p)]
            slowest = max(per_rank)
            return c.m * slowest + (c.p - 1) * slowest / c.v + 2 * (k - 1) * p2p
        stage = [f + b for f, b in zip(f_s, b_s)]
        return sum(stage) + (c.m - 1) * max(stage) + 2 * (c.p - 1) * p2p

    def simulate_config(self, ev: Evaluation) -> tuple[Evaluation, SimResult]:
        c = ev.config
        sched = generate(c.schedule, c.p, c.m, c.v)
        result = simulate(sched, ev.sim_costs(self.capacity))
        out = self._finish(c, ev.bounds, ev.forward_s, ev.backward_s, ev.activation_bytes, list(ev.rank_memory),
                           ev.p2p_s, ev.allreduce_s, ev.optimizer_s, ev.tp_comm_s, result.iteration_s,
                           result.bubble_fraction)
        return out, result

