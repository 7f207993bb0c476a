"""Pack fill jobs into a main plan's bubbles: per pipeline rank, the job configuration and
residency that recover the most useful FLOPs per iteration.

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
pipelined transmission, whose non-overlapped part is charged to every chunk as launch overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from costmodels.hardware import Hardware

from .packing import BubbleSlot, FillUnit, Packing, cpsat_pack, greedy_pack
from .physics import DEFAULT_SAFETY_MARGIN, FILL_CONTEXT_BYTES, chunk_overhead_s, unit_overhead_s
from .pipeswitch import TransferOverhead, dp_grouping
from .profiles import FillProfile

__all__ = ["RankFill", "FillAssignment", "Packer", "PACKERS", "assign_fill", "best_fill", "load_overhead_s",
           "held_bytes", "plan_hold_free"]

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
class RankFill:
    rank: int
    profile: FillProfile
    resident: bool
    packing: Packing


@dataclass(frozen=True, kw_only=True, slots=True)
class FillAssignment:
    per_rank: tuple[RankFill | None, ...]
    iteration_s: float
    fill_flops_per_gpu_s: float  # averaged over pipeline ranks
    bubble_time_used: float  # fraction of all bubble time
    unplaceable: dict[str, str] = field(default_factory=dict)
    not_chosen: dict[str, str] = field(default_factory=dict)  # jobs that fit, outscored on every rank


def load_overhead_s(profile: FillProfile, hw: Hardware) -> float:
    """Transmission time PipeSwitch's optimal grouping cannot hide behind execution."""
    g = dp_grouping(list(profile.layers), hw.gpu.pcie_bw, TransferOverhead(pcie_call_s=PCIE_CALL_S, sync_s=SYNC_S))
    return max(g.latency_s - sum(layer.exec_time_s for layer in profile.layers), 0.0)


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
            yield _Option(profile=replace(prof, units=units), resident=False,
                          overhead_s=overhead + load_overhead_s(prof, hw), resident_bytes=FILL_CONTEXT_BYTES)


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
            best = RankFill(rank=rank, profile=opt.profile, resident=opt.resident, packing=pk)
    if best is not None:
        best = replace(best, packing=PACKERS[solver].repack(best.profile.units, cycle, greedy=best.packing,
                                                            time_limit_s=time_limit_s))
    return best


def assign_fill(cycles: list[list[BubbleSlot]], iteration_s: float, jobs: dict[str, list[FillProfile]],
                hw: Hardware, *, safety_margin: float = DEFAULT_SAFETY_MARGIN, solver: str = "greedy",
                time_limit_s: float = 1.0, hold_free: Sequence[int] | None = None) -> FillAssignment:
    """cycles[r] is pipeline rank r's bubbles in one iteration (with the free memory of each), hold_free[r] the
    bytes free beside the main job's peak on rank r; each rank runs the job that recovers the most FLOPs there."""
    per_rank: list[RankFill | None] = []
    feasible: set[str] = set()  # jobs that fit some bubble somewhere, chosen or not
    closest: dict[str, tuple[float, int, RankFill]] = {}  # job -> (its share of the winner, rank, winner)
    for r, cycle in enumerate(cycles):
        hold = hold_free[r] if hold_free is not None else None
        options = [best_fill(r, cycle, profiles, hw, safety_margin=safety_margin, hold_free=hold)
                   for profiles in jobs.values() if cycle]
        feasible.update(o.profile.job for o in options if o is not None)
        best = max((o for o in options if o is not None), key=lambda o: o.packing.flops_per_cycle, default=None)
        for o in options:
            if o is not None and best is not None and o.profile.job != best.profile.job:
                share = o.packing.flops_per_cycle / max(best.packing.flops_per_cycle, 1e-30)
                closest[o.profile.job] = max(closest.get(o.profile.job, (-1.0, r, best)), (share, r, best),
                                             key=lambda x: x[0])
        if best is not None and solver != "greedy":
            best = best_fill(r, cycle, jobs[best.profile.job], hw, safety_margin=safety_margin,
                             solver=solver, time_limit_s=time_limit_s, hold_free=hold)
        per_rank.append(best)
    total_bubble = sum(s.duration_s for c in cycles for s in c)
    used = sum(sum(ch.time_s for ch in rf.packing.chunks) / rf.packing.params.cycles for rf in per_rank if rf)
    flops = sum(rf.packing.flops_per_cycle for rf in per_rank if rf)
    unplaceable = {name: _why_not(profs, cycles, safety_margin) for name, profs in jobs.items() if name not in feasible}
    chosen = {rf.profile.job for rf in per_rank if rf}
    not_chosen = {name: (f"it fits, but each rank runs the one job that recovers the most; its best is rank {r}, "
                         f"where it would recover {share:.0%} of what {win.profile.job} does")
                  for name, (share, r, win) in closest.items() if name not in chosen}
    return FillAssignment(per_rank=tuple(per_rank), iteration_s=iteration_s,
                          fill_flops_per_gpu_s=flops / (len(cycles) * iteration_s) if cycles else 0.0,
                          bubble_time_used=used / total_bubble if total_bubble else 0.0, unplaceable=unplaceable,
                          not_chosen=not_chosen)
