"""Pack fill jobs into a main plan's bubbles and divide their work: which ranks run which jobs, at which
configuration and residency, each rank's share of each job, and the turns its executor runs them in.

The default solver is PipeFill's greedy: with costs that do not depend on where a chunk ends (our
model: activations stay on the device between bubbles, inside the chunk's memory), greedy is never
behind any valid packing after any bubble, hence optimal (see planner/fill/packing.py). Packers are a
registry (`PACKERS`): every option is screened with greedy, then the chosen one is re-packed by the
requested packer; "cpsat" re-solves it with CP-SAT (never worse; it only wins when chunk boundaries cost).

Each chunk and each unit is charged what the runtime spends around the compute (planner/fill/physics.py:
admission slack, the per-step allowance, a request/reply per unit). Memory comes from the main job's ledger:
what a job holds between bubbles (its process's CUDA context, its weights and optimizer state when resident,
the activations of an iteration it is in the middle of) must fit beside the main job's peak on the rank
(`hold_free`); what a chunk uses while it runs must fit beside the main job's memory during that bubble. A job
stays resident when that holds; otherwise (inference jobs) its weights are loaded per bubble with PipeSwitch's
pipelined transmission, whose non-overlapped part is charged to every chunk as launch overhead. Two training jobs
that do not fit a rank side by side (or that the spec asks to pair) run paired as Waterwave pairs jobs
(planner/fill/waterwave.py): together, their node groups taking turns within the memory the rank leaves them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from costmodels.hardware import Hardware

from .packing import BubbleSlot, FillUnit, Packing, cpsat_pack, greedy_pack
from .physics import DEFAULT_SAFETY_MARGIN, FILL_CONTEXT_BYTES, chunk_overhead_s, unit_overhead_s
from .pipeswitch import TransferOverhead, dp_grouping
from .profiles import FillProfile
from .job_scheduler import JobView, next_on_rank, resolve_policy
from .waterwave import PairSchedule, pair_units, schedule_pair, split_of

__all__ = ["RankFill", "Pairing", "Turn", "FillAssignment", "data_parallel", "Packer", "PACKERS", "assign_fill", "best_fill", "load_grouping",
           "held_bytes", "plan_cycles", "plan_hold_free"]

PCIE_CALL_S = 10e-6  # per transfer (PipeSwitch 4.2's fixed cost; assumption for the target)
SYNC_S = 20e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Packer:
    name: str
    help: str
    repack: Callable[..., Packing]
    """(units, cycle, *, greedy: Packing, time_limit_s) -> the packing of the chosen option, starting
    from greedy's (its parameters: safety margin, launch overhead, resident bytes, cycles)."""


def _cpsat(units: Sequence[FillUnit], cycle: list[BubbleSlot], *, greedy: Packing, time_limit_s: float) -> Packing:
    p = greedy.params
    return cpsat_pack(units, cycle, safety_margin=p.safety_margin, launch_overhead_s=p.launch_overhead_s,
                      resident_bytes=p.resident_bytes, cycles=p.cycles, time_limit_s=time_limit_s, hint=greedy,
                      unit_overhead_s=p.unit_overhead_s)


PACKERS: dict[str, Packer] = {
    "greedy": Packer(name="greedy", help="PipeFill Algorithm 1 (optimal when chunk boundaries cost nothing)",
                     repack=lambda units, cycle, *, greedy, time_limit_s: greedy),
    "cpsat": Packer(name="cpsat", help="CP-SAT from the greedy packing (never worse)", repack=_cpsat),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Pairing:
    """Two training jobs of one rank paired by Waterwave's rule (planner/fill/waterwave.py): they run together, their
    groups taking turns, in the memory neither leaves the other when they run side by side."""

    rank: int
    jobs: tuple[str, str]
    schedule: PairSchedule
    units: tuple[FillUnit, ...]
    """The schedule's period as one job's units (what the packing packed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFill:
    rank: int
    profile: FillProfile
    resident: bool
    packing: Packing
    """A paired job's is the pair's: both jobs' units of the schedule's period, packed together."""
    load_groups: tuple[tuple[int, int], ...] = ()
    """Not resident: PipeSwitch's transfer groups, half-open ranges of its forward units, loaded in order per bubble."""
    pair: Pairing | None = None

    @property
    def units(self) -> tuple[FillUnit, ...]:
        """What its packing packs: its own units, or its pair's."""
        return self.pair.units if self.pair is not None else self.profile.units

    @property
    def packed_as(self) -> str:
        """The job its packing is for: its own, or its pair's ("a+b")."""
        return "+".join(self.pair.jobs) if self.pair is not None else self.profile.job


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One job's turn on one pipeline rank: the rank's share of the job's batches, which the rank's GPUs divide
    (an inference job's batches among them, a training job's steps data parallel over them)."""

    fill: RankFill
    first_batch: int
    batches: int
    start_s: float
    end_s: float

    @property
    def rank(self) -> int:
        return self.fill.rank

    @property
    def job(self) -> str:
        return self.fill.profile.job


@dataclass(frozen=True, kw_only=True, slots=True)
class FillAssignment:
    per_rank: tuple[tuple[RankFill, ...], ...]
    """Each pipeline rank's fill jobs (the queue its executor runs, one job at a time), in predicted turn order."""
    turns: tuple[Turn, ...]
    iteration_s: float
    fill_flops_per_gpu_s: float
    """Fill FLOP/s per GPU while a rank has fill work (each rank's turns weighted by their length), averaged
    over the pipeline ranks; each sample counted once."""
    bubble_time_used: float  # fraction of all bubble time, weighted the same way
    replicas: int = 1
    """GPUs per pipeline rank (d x cp x t): they divide each of the rank's jobs."""
    unplaceable: dict[str, str] = field(default_factory=dict)
    not_chosen: dict[str, str] = field(default_factory=dict)  # jobs that fit alone but beside no rank's others
    notes: dict[str, str] = field(default_factory=dict)  # pairings asked for (pair_with) but not made

    def per_cycle(self, value: Callable[[RankFill], float]) -> float:
        """`value` of a job's packing per bubble cycle, weighted by the turns' lengths on each rank (a rank counts
        while it has fill work), averaged over the pipeline ranks."""
        if not self.per_rank:
            return 0.0
        total = 0.0
        for r in range(len(self.per_rank)):
            # a pair's two turns are one packing that runs until the longer ends (its value is both jobs'): once
            longest: dict[str, Turn] = {}
            for t in self.turns:
                if t.rank == r and t.end_s > t.start_s:
                    k = t.fill.packed_as if t.fill.pair is not None else t.job
                    if k not in longest or t.end_s - t.start_s > longest[k].end_s - longest[k].start_s:
                        longest[k] = t
            turns = list(longest.values())
            busy = sum(t.end_s - t.start_s for t in turns)
            if busy > 0:
                total += sum(value(t.fill) * (t.end_s - t.start_s) for t in turns) / busy
        return total / len(self.per_rank)


def load_grouping(profile: FillProfile, hw: Hardware):
    """PipeSwitch's optimal grouping of the job's layers (its forward units) for pipelined transmission."""
    return dp_grouping(list(profile.layers), hw.gpu.pcie_bw, TransferOverhead(pcie_call_s=PCIE_CALL_S, sync_s=SYNC_S))


def plan_cycles(plan) -> list[list[BubbleSlot]]:
    """Per pipeline rank of a plan, its bubbles (duration and free bytes) in one iteration; where the plan offloads the
    main job's optimizer state for the bubbles (PipeFill 4.2), its bytes are free in them too, as the planner packed."""
    fp = plan.fill.predictions if plan.fill is not None else None
    extra = fp.offload_bytes if fp is not None and fp.offload_optimizer else []
    return [[BubbleSlot(id=b.id, duration_s=b.duration_s,
                        free_bytes=b.free_bytes + (extra[r] if r < len(extra) else 0)) for b in plan.bubbles
             if b.rank == r] for r in range(plan.config.pp)]


def plan_hold_free(plan) -> list[int]:
    """Per pipeline rank of a plan, the device bytes free beside the main job at its predicted peak."""
    peak = {m.rank: m.capacity - m.total for m in plan.predictions.memory}
    return [max(0, int(peak.get(r, 0))) for r in range(plan.config.pp)]


def held_bytes(prof: FillProfile) -> int:
    """Device bytes a resident job holds between bubbles: its process's CUDA context, its resident state, and
    the most activations an iteration it stopped in the middle of keeps for its backward."""
    return FILL_CONTEXT_BYTES + prof.resident_bytes + max((u.state_bytes for u in prof.units), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Option:
    profile: FillProfile
    resident: bool
    overhead_s: float  # per chunk
    resident_bytes: int  # counted beside every unit inside a bubble
    load_groups: tuple[tuple[int, int], ...] = ()


def _options(profiles: list[FillProfile], hold_free: int, hw: Hardware):
    """The (configuration, residency) choices of one rank whose between-bubble memory fits beside the main job."""
    for prof in profiles:
        overhead = chunk_overhead_s([u.time_s for u in prof.units])
        if held_bytes(prof) <= hold_free:
            yield _Option(profile=prof, resident=True, overhead_s=overhead,
                          resident_bytes=prof.resident_bytes + FILL_CONTEXT_BYTES)
        elif prof.kind == "infer" and FILL_CONTEXT_BYTES <= hold_free:
            # weights streamed in per bubble; they take memory only while the chunk runs
            units = tuple(replace(u, mem_bytes=u.mem_bytes + prof.resident_bytes) for u in prof.units)
            g = load_grouping(prof, hw)  # the transmission its grouping cannot hide behind execution is charged
            hidden = sum(layer.exec_time_s for layer in prof.layers)
            yield _Option(profile=replace(prof, units=units), resident=False,
                          overhead_s=overhead + max(g.latency_s - hidden, 0.0), resident_bytes=FILL_CONTEXT_BYTES,
                          load_groups=tuple(g.groups))


def _stuck_unit(opt: _Option, cycle: list[BubbleSlot], margin: float, per_unit: float):
    """The first unit that fits no bubble of the cycle (the job would stall there forever), or None."""
    for u in opt.profile.units:
        if not any(opt.overhead_s + u.time_s + per_unit <= s.duration_s * (1 - margin)
                   and u.mem_bytes + opt.resident_bytes <= s.free_bytes for s in cycle):
            return u
    return None


def _why_not(profiles: list[FillProfile], cycles: list[list[BubbleSlot]], margin: float) -> str:
    if not any(cycles):
        return "the main plan leaves no bubbles"
    slots = [s for c in cycles for s in c]
    longest = max(s.duration_s for s in slots) * (1 - margin)
    most = max(s.free_bytes for s in slots)
    leanest = min(profiles, key=lambda p: max(u.time_s for u in p.units))
    u = max(leanest.units, key=lambda u: u.time_s)
    if u.time_s > longest:
        return (f"its unit {u.name} takes {u.time_s * 1e3:.1f} ms even at batch {leanest.batch_size}, longer than "
                f"every usable bubble ({longest * 1e3:.1f} ms)")
    need = min(max(u.mem_bytes for u in p.units) + p.resident_bytes + FILL_CONTEXT_BYTES for p in profiles)
    if need > most:
        return (f"it needs {need / 2**30:.2f} GiB (its process's CUDA context included), more than any bubble has "
                f"free ({most / 2**30:.2f} GiB)")
    return "no configuration fits both the time and the memory of any bubble"


def best_fill(rank: int, cycle: list[BubbleSlot], profiles: list[FillProfile], hw: Hardware, *,
              safety_margin: float = DEFAULT_SAFETY_MARGIN, solver: str = "greedy", time_limit_s: float = 1.0,
              hold_free: int | None = None) -> RankFill | None:
    """The configuration and residency of one job that recovers the most FLOPs on one rank's cycle.
    `hold_free`: device bytes free beside the main job at its peak on this rank (default: the least any
    bubble has)."""
    if hold_free is None:
        hold_free = min((s.free_bytes for s in cycle), default=0)
    per_unit = unit_overhead_s(hw.eff.launch_s)
    best: RankFill | None = None
    for opt in _options(profiles, hold_free, hw):
        if _stuck_unit(opt, cycle, safety_margin, per_unit) is not None:
            continue
        pk = greedy_pack(opt.profile.units, cycle, safety_margin=safety_margin, launch_overhead_s=opt.overhead_s,
                         resident_bytes=opt.resident_bytes, cycles=2, unit_overhead_s=per_unit)
        if pk.units_completed and (best is None or pk.flops_per_cycle > best.packing.flops_per_cycle):
            best = RankFill(rank=rank, profile=opt.profile, resident=opt.resident, packing=pk,
                            load_groups=opt.load_groups)
    if best is not None:
        best = replace(best, packing=PACKERS[solver].repack(best.profile.units, cycle, greedy=best.packing,
                                                            time_limit_s=time_limit_s))
    return best


def data_parallel(prof: FillProfile, hw: Hardware) -> FillProfile:
    """A training job run data parallel over a stage's GPUs (planner/runtime/fill_task.py): its gradients go to
    host memory in fp32 after the last backward unit and, averaged over gloo between bubbles, come back for the
    optimizer step (under offload they stay on the host, and the offloaded step's price already brings them
    down). Both copies are charged to the optimizer unit; the host all-reduce runs outside the bubbles."""
    extra = 0.0 if prof.config == "offload" else 2 * prof.params * 4 / hw.gpu.pcie_bw
    units = tuple(replace(u, time_s=u.time_s + extra) if u.name == "OPT" else u for u in prof.units)
    return replace(prof, units=units)


def _held(rf: RankFill) -> int:
    """Bytes the job keeps on the device between bubbles (and so during the other jobs' chunks); a pair's staggered
    activations are counted once, with its first job."""
    if rf.pair is not None:
        first = rf.profile.job == rf.pair.jobs[0]
        return FILL_CONTEXT_BYTES + rf.profile.resident_bytes + (rf.pair.schedule.held_bytes if first else 0)
    return held_bytes(rf.profile) if rf.resident else FILL_CONTEXT_BYTES


def _beside(rank: int, cycle: list[BubbleSlot], profiles: list[FillProfile], queue: list[RankFill], hw: Hardware, *,
            margin: float, hold_free: int) -> RankFill | None:
    """The job's best packing on a rank where the jobs of `queue` already hold their bytes; None if it does not fit,
    or if the bytes it holds would leave a queued job's chunk without room."""
    held = sum(_held(q) for q in queue)
    shrunk = [replace(s, free_bytes=max(0, s.free_bytes - held)) for s in cycle]
    rf = best_fill(rank, shrunk, profiles, hw, safety_margin=margin, hold_free=max(0, hold_free - held))
    if rf is None:
        return None
    free = {s.id: s.free_bytes for s in cycle}
    for q in queue:
        others = held - _held(q) + _held(rf)
        if any(ch.mem_bytes + others > free[ch.bubble_id] for ch in q.packing.chunks):
            return None
    return rf


def _pair(rank: int, cycle: list[BubbleSlot], profiles: list[FillProfile], queue: list[RankFill], hw: Hardware, *,
          margin: float, hold_free: int, partner: str | None = None) -> tuple[RankFill, RankFill] | None:
    """Waterwave: the training job paired with a training job already on the rank (that one's configuration kept;
    only `partner` if given), where their staggered memory fits what the rank's other jobs leave; (partner, job) of
    the pair that recovers most, or None."""
    best: tuple[RankFill, RankFill] | None = None
    for q in queue:
        if q.profile.kind != "train" or q.pair is not None or not q.resident or partner not in (None, q.profile.job):
            continue
        others = [o for o in queue if o is not q]
        held = sum(_held(o) for o in others)
        free = {s.id: s.free_bytes for s in cycle}
        room = min([hold_free - held] + [free[ch.bubble_id] - ch.mem_bytes - (held - _held(o))  # the others' chunks
                                         for o in others for ch in o.packing.chunks])           # run beside its hold
        for prof in profiles:
            resident = q.profile.resident_bytes + prof.resident_bytes + FILL_CONTEXT_BYTES  # + the packer's context
            between = room - resident - FILL_CONTEXT_BYTES  # for what the pair holds between its units
            inside = max(s.free_bytes for s in cycle) - held - resident - FILL_CONTEXT_BYTES
            # the bubbles' room if what the pair then holds between them fits, else the holds'
            tries = (schedule_pair(q.profile.units, prof.units, budget, split_of(budget))
                     for budget in dict.fromkeys((inside, between)) if budget > 0 and prof.kind == "train")
            sched = next((s for s in tries if s is not None and s.held_bytes <= between), None)
            if sched is None:
                continue
            units = pair_units(sched, q.profile.units, prof.units)
            both = replace(prof, job=f"{q.profile.job}+{prof.job}", units=units, resident_bytes=resident, layers=())
            rf = _beside(rank, cycle, [both], others, hw, margin=margin, hold_free=hold_free)
            if rf is None or (best is not None and rf.packing.flops_per_cycle <= best[0].packing.flops_per_cycle):
                continue
            pairing = Pairing(rank=rank, jobs=(q.profile.job, prof.job), schedule=sched, units=units)
            best = (replace(q, packing=rf.packing, pair=pairing),
                    RankFill(rank=rank, profile=prof, resident=True, packing=rf.packing, pair=pairing))
    return best


def _rate(rf: RankFill, iteration_s: float) -> float:
    """Batches per second one GPU of the rank completes of this job (a paired job: each period of the pair runs
    its schedule's iterations of both)."""
    per = rf.pair.schedule.iterations if rf.pair is not None else 1
    return rf.packing.iterations_per_cycle * per / iteration_s


def _split(total: int, weights: list[float]) -> list[int]:
    """`total` divided in proportion to `weights` (largest remainders), summing to `total` exactly."""
    exact = [total * w / sum(weights) for w in weights]
    out = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: out[i] - exact[i])[:total - sum(out)]:
        out[i] += 1
    return out


def _asked(name: str, profiles: list[FillProfile], queues: list[list[RankFill]]) -> RankFill | None:
    """The placed, unpaired training job this one is asked to run beside (pair_with, either way), or None."""
    want = profiles[0].pair_with if profiles else None
    return next((q for queue in queues for q in queue if q.profile.kind == "train" and q.pair is None
                 and (q.profile.job == want or q.profile.pair_with == name)), None)


def _place(cycles: list[list[BubbleSlot]], jobs: dict[str, list[FillProfile]], hw: Hardware, *, margin: float,
           hold: list[int], replicas: int, iteration_s: float
           ) -> tuple[list[list[RankFill]], dict[str, str], set, dict[str, str]]:
    """Which ranks run which jobs. An inference job runs on every rank it fits (one batch size and configuration
    on all of them, so its batches mean the same samples everywhere); a training job on the one rank that would
    finish it first, data parallel over that rank's GPUs. Jobs are placed in order of what they recover; a job
    joins a rank only if the bytes every job there holds between bubbles fit together, or, two training jobs,
    paired (Waterwave) where their staggered memory fits - always for jobs asked to pair (pair_with). Returns the
    queues, the jobs not chosen, the feasible jobs and notes on pairings asked for but not made."""
    p = len(cycles)

    def alone(profiles: list[FillProfile]) -> list[RankFill | None]:
        return [best_fill(r, c, profiles, hw, safety_margin=margin, hold_free=hold[r]) if c else None
                for r, c in enumerate(cycles)]

    best: dict[str, list[RankFill | None]] = {}
    jobs = {name: [data_parallel(prof, hw) for prof in profiles] if profiles and profiles[0].kind == "train"
            and replicas > 1 else profiles for name, profiles in jobs.items()}
    for name, profiles in jobs.items():
        if profiles and profiles[0].kind == "infer":
            per = [alone([prof]) for prof in profiles]
            best[name] = max(per, key=lambda o: sum(rf.packing.flops_per_cycle for rf in o if rf), default=[None] * p)
        else:
            best[name] = alone(profiles)
    feasible = {name for name, o in best.items() if any(o)}
    queues: list[list[RankFill]] = [[] for _ in cycles]
    load = [0.0] * p  # seconds of training work placed on each rank
    not_chosen: dict[str, str] = {}
    notes: dict[str, str] = {}
    for name in sorted(feasible, key=lambda n: -max(rf.packing.flops_per_cycle for rf in best[n] if rf)):
        fits = []
        partners: dict[int, RankFill] = {}  # rank -> the queued job a pairing there replaces
        asked = _asked(name, jobs[name], queues)
        if asked is not None:
            r = asked.rank
            pair = _pair(r, cycles[r], jobs[name], queues[r], hw, margin=margin, hold_free=hold[r],
                         partner=asked.profile.job)
            if pair is not None:
                partners[r], rf = pair
                fits.append(rf)
            else:
                notes[name] = (f"asked to run paired with {asked.profile.job}, but the two do not fit rank {r}'s memory "
                               f"together even staggered (or its bubbles are too short); placed on its own")
        for r, rf in enumerate(best[name] if not fits else ()):
            if rf is not None and queues[r]:
                alone_rf, rf = rf, _beside(r, cycles[r], [rf.profile], queues[r], hw, margin=margin, hold_free=hold[r])
                if rf is None and alone_rf.profile.kind == "train":
                    pair = _pair(r, cycles[r], jobs[name], queues[r], hw, margin=margin, hold_free=hold[r])
                    if pair is not None:
                        partners[r], rf = pair
            if rf is not None:
                fits.append(rf)
        if not fits:
            r = next(r for r, rf in enumerate(best[name]) if rf)
            not_chosen[name] = (f"it fits alone, but not beside the jobs already on each rank it fits (rank {r}: "
                                f"{', '.join(q.profile.job for q in queues[r])} hold their memory between bubbles)")
            continue
        if fits[0].profile.kind == "train":
            steps = -(-fits[0].profile.batches // replicas)
            fits = [min(fits, key=lambda rf: (load[rf.rank] + steps / _rate(rf, iteration_s), rf.rank))]
            load[fits[0].rank] += steps / _rate(fits[0], iteration_s)
        for rf in fits:
            if rf.rank in partners:
                q = queues[rf.rank]
                q[next(i for i, o in enumerate(q) if o.profile.job == partners[rf.rank].profile.job)] = partners[rf.rank]
            queues[rf.rank].append(rf)
    return queues, not_chosen, feasible, notes


def _turns(queues: list[list[RankFill]], replicas: int, iteration_s: float, policy: str) -> list[Turn]:
    """Each rank's share of its jobs' batches, and the order its executor runs them in (the policy, with the
    same function the runtime uses: scheduler.next_on_rank)."""
    p = len(queues)
    shares: dict[tuple[str, int], tuple[int, int]] = {}  # (job, rank) -> (first batch, batches)
    for name in dict.fromkeys(rf.profile.job for q in queues for rf in q):
        here = [rf for q in queues for rf in q if rf.profile.job == name]
        total = here[0].profile.batches
        if here[0].profile.kind == "train":  # data parallel: every step, each replica one batch
            shares[(name, here[0].rank)] = (0, replicas * -(-total // replicas))
            continue
        first = 0
        for rf, n in zip(here, _split(total, [_rate(rf, iteration_s) for rf in here])):
            shares[(name, rf.rank)] = (first, n)
            first += n
    score = resolve_policy(policy)
    out: list[Turn] = []
    for r, queue in enumerate(queues):
        rfs = {rf.profile.job: rf for rf in queue if shares[(rf.profile.job, r)][1] > 0}
        proc = {n: -(-shares[(n, r)][1] // replicas) / _rate(rf, iteration_s) for n, rf in rfs.items()}
        infos = [JobView(name=n, kind=rf.profile.kind, arrival_s=rf.profile.arrival_s,
                         deadline_s=rf.profile.deadline_s, priority=rf.profile.priority, work=shares[(n, r)][1],
                         proc_times=tuple(proc[n] if i == r else math.inf for i in range(p)), index=k)
                 for k, (n, rf) in enumerate(rfs.items())]
        now = 0.0
        while infos:
            arrived = [i for i in infos if i.arrival_s <= now]
            if not arrived:
                now = min(i.arrival_s for i in infos)
                continue
            job = next_on_rank(arrived, r, p, now, score)
            pair = rfs[job.name].pair
            together = [job] + [i for i in arrived if pair is not None and i is not job and i.name in pair.jobs]
            for i in together:  # a pair's jobs start together (Waterwave)
                first, n = shares[(i.name, r)]
                out.append(Turn(fill=rfs[i.name], first_batch=first, batches=n, start_s=now, end_s=now + proc[i.name]))
                infos.remove(i)
            now += max(proc[i.name] for i in together)
    return out


def assign_fill(cycles: list[list[BubbleSlot]], iteration_s: float, jobs: dict[str, list[FillProfile]],
                hw: Hardware, *, safety_margin: float = DEFAULT_SAFETY_MARGIN, solver: str = "greedy",
                time_limit_s: float = 1.0, hold_free: Sequence[int] | None = None, replicas: int = 1,
                policy: str = "sjf") -> FillAssignment:
    """cycles[r] is pipeline rank r's bubbles in one iteration (with the free memory of each), hold_free[r] the
    bytes free beside the main job's peak on rank r, `replicas` the GPUs of each pipeline rank. Every job that fits
    is placed (see _place), its work divided among the GPUs that run it, and each rank runs its jobs one at a time
    in the order `policy` gives (see _turns)."""
    hold = [hold_free[r] if hold_free is not None else min((s.free_bytes for s in c), default=0)
            for r, c in enumerate(cycles)]
    queues, not_chosen, feasible, notes = _place(cycles, jobs, hw, margin=safety_margin, hold=hold, replicas=replicas,
                                          iteration_s=iteration_s)
    if solver != "greedy":  # a pair's jobs share one packing: re-packed once
        repacked: dict[tuple[int, str], Packing] = {}
        for q in queues:
            for rf in q:
                if (rf.rank, rf.packed_as) not in repacked:
                    repacked[(rf.rank, rf.packed_as)] = PACKERS[solver].repack(
                        rf.units, cycles[rf.rank], greedy=rf.packing, time_limit_s=time_limit_s)
        queues = [[replace(rf, packing=repacked[(rf.rank, rf.packed_as)]) for rf in q] for q in queues]
    turns = tuple(_turns(queues, replicas, iteration_s, policy))
    order = {(t.rank, t.job): i for i, t in enumerate(turns)}
    per_rank = tuple(tuple(sorted((rf for rf in q if (rf.rank, rf.profile.job) in order),
                                  key=lambda rf: order[(rf.rank, rf.profile.job)])) for q in queues)
    unplaceable = {name: _why_not(profs, cycles, safety_margin) for name, profs in jobs.items() if name not in feasible}
    fa = FillAssignment(per_rank=per_rank, turns=turns, iteration_s=iteration_s, fill_flops_per_gpu_s=0.0,
                        bubble_time_used=0.0, replicas=replicas, unplaceable=unplaceable, not_chosen=not_chosen,
                        notes=notes)
    total_bubble = sum(s.duration_s for c in cycles for s in c) / max(len(cycles), 1)
    used = fa.per_cycle(lambda rf: sum(ch.time_s for ch in rf.packing.chunks) / rf.packing.params.cycles)
    return replace(fa, fill_flops_per_gpu_s=fa.per_cycle(lambda rf: rf.packing.flops_per_cycle) / iteration_s,
                   bubble_time_used=used / total_bubble if total_bubble else 0.0)
