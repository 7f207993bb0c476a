"""Waterwave's pairing for fill training jobs (seed 004): two jobs share one rank's bubbles and its spare memory,
one job's allocation phase meeting the other's deallocation phase.

- **Memory over an iteration** (Waterwave 3.1). A training job's linearized units (planner/fill/profiles.py) carry
  what each unit uses while it runs (`mem_bytes`, its own live activations included) and what stays live after it
  (`state_bytes`, from the saved-bytes measurement): it rises through the forward and falls through the backward.
- **NodeGroups** (4.3, 4.4). The units are cut into contiguous groups whose (de)allocation reaches the split size;
  a group never mixes allocation with deallocation, so an iteration is a run of allocation groups (ANGs) followed
  by deallocation groups (DNGs). `SPLIT_FRACTION` takes the paper's best split size relative to its GPU's memory.
- **Pairing** (4.4, Algorithm 1). Waterwave schedules the two jobs' groups on two CUDA streams of one process and
  computes from the first job's peak how many of the second job's ANGs may run beside it. A fill job runs in its own
  process (PipeSwitch's standby workers, FreeRide's fault isolation - Waterwave's own Discussion d names the shared
  context as its weakness), and a rank's bubble runs one unit at a time, so here the groups of the pair take turns
  and the exact ledger can be searched instead of estimated: `PairLedger.next` is the rule the planner simulates and
  the runtime obeys (planner/runtime/fill_executor.py). Groups alternate between the jobs; a unit is admitted only if
  (a) it fits now beside the partner's live activations within the pair's budget, and (b) the state after it is
  safe - one of the two can finish its iteration (and so free everything) while the other holds what it has: the
  banker's rule, which never deadlocks and makes the second job wait for the first one's deallocation groups
  exactly when their peaks would otherwise meet. The simulation from both jobs' first unit settles into a period
  (one or more iterations of each); its units, with the partner's live bytes added to each, are packed into the
  rank's bubbles like one job's.
- **The allocator** (4.2). Each job's process has its own caching allocator, Waterwave's per-stream pool of
  unsynchronized free chunks. What a deallocation group freed reaches the partner's process only when handed back
  to the device: on CUDA the task empties its cache after each deallocation group (SyncAndCoalesce's
  synchronization and return), charged `RELEASE_S`.

Sequential turns recover no more FLOPs than running the two jobs one after the other would; what pairing buys is
co-location: two jobs whose peaks do not fit side by side both run on the rank (Waterwave's Table 1 gain is the
batch size two jobs reach together, bench/paper_fill.py compares it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .packing import FillUnit

__all__ = ["SPLIT_FRACTION", "RELEASE_S", "NodeGroup", "node_groups", "PairLedger", "PairSchedule", "split_of",
           "schedule_pair", "pair_units"]

SPLIT_FRACTION = 6 / 32
"""Waterwave 5.4: a 6 GB split size gave the largest batch sizes on its 32 GB V100; here the fraction of the bytes
the pair may use."""
RELEASE_S = 0.5e-3
"""Emptying a task's CUDA cache after a deallocation group (cudaFree synchronizes the device): an assumption until
measured on the target (bench/cuda_fill.py)."""
MAX_STATES = 200_000


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroup:
    first: int
    stop: int
    delta_bytes: int
    """Live bytes after the group minus before: > 0 an allocation group, <= 0 a deallocation group."""

    @property
    def allocates(self) -> bool:
        return self.delta_bytes > 0


def node_groups(units: Sequence[FillUnit], split_bytes: int) -> tuple[NodeGroup, ...]:
    """Contiguous groups of a training job's units, each closed once its (de)allocation reaches `split_bytes`; an
    allocating unit never joins a deallocating group or the reverse (units that change nothing join the current)."""
    out: list[NodeGroup] = []
    first, acc, before = 0, 0, 0
    for i, u in enumerate(units):
        d = u.state_bytes - before
        before = u.state_bytes
        if i > first and d != 0 and acc != 0 and (d > 0) != (acc > 0):
            out.append(NodeGroup(first=first, stop=i, delta_bytes=acc))
            first, acc = i, 0
        acc += d
        if abs(acc) >= max(split_bytes, 1):
            out.append(NodeGroup(first=first, stop=i + 1, delta_bytes=acc))
            first, acc = i + 1, 0
    if first < len(units):
        out.append(NodeGroup(first=first, stop=len(units), delta_bytes=acc))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class PairLedger:
    """The two jobs' memory per unit and their groups: what the rule needs, as plain numbers (the plan carries
    them, so the runtime decides exactly as the planner simulated)."""

    mem: tuple[tuple[int, ...], tuple[int, ...]]
    """Per job, per unit of an iteration: bytes while it runs, its own live activations included."""
    state: tuple[tuple[int, ...], tuple[int, ...]]
    """Per job, per unit: bytes live after it (0 after the iteration's last unit)."""
    stops: tuple[tuple[int, ...], tuple[int, ...]]
    """Per job, the unit indices where its groups end (exclusive)."""
    budget: int
    """Bytes the pair's activations and working memory may use together."""
    rest: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        suffix = []
        for mem in self.mem:
            s = [0] * (len(mem) + 1)
            for k in reversed(range(len(mem))):
                s[k] = max(mem[k], s[k + 1])
            suffix.append(tuple(s))
        object.__setattr__(self, "rest", tuple(suffix))

    @classmethod
    def of(cls, pair: Any) -> "PairLedger":
        """The ledger a plan records (planner.plan.FillPair: mem_bytes, state_bytes, stops, budget_bytes)."""
        return cls(mem=tuple(map(tuple, pair.mem_bytes)), state=tuple(map(tuple, pair.state_bytes)),
                   stops=tuple(map(tuple, pair.stops)), budget=pair.budget_bytes)

    def n(self, j: int) -> int:
        return len(self.mem[j])

    def live(self, j: int, pos: int) -> int:
        k = pos % self.n(j)
        return 0 if k == 0 else self.state[j][k - 1]

    def rest_peak(self, j: int, pos: int) -> int:
        """The most the job needs to finish the iteration it is in (0 between iterations: it can wait)."""
        k = pos % self.n(j)
        return 0 if k == 0 else self.rest[j][k]

    def fits(self, j: int, pos: tuple[int, int]) -> bool:
        """Unit pos[j] of job j may run now: it fits beside the partner's live bytes, and afterwards one of the two
        can still finish its iteration while the other holds (so the pair never deadlocks)."""
        o = 1 - j
        k = pos[j] % self.n(j)
        if self.mem[j][k] + self.live(o, pos[o]) > self.budget:
            return False
        after = self.state[j][k] if k + 1 < self.n(j) else 0
        return (self.rest_peak(j, pos[j] + 1) + self.live(o, pos[o]) <= self.budget
                or self.rest_peak(o, pos[o]) + after <= self.budget)

    def group_done(self, j: int, pos: int) -> bool:
        k = pos % self.n(j)
        return k == 0 or k in self.stops[j]

    def frees(self, j: int, k: int) -> bool:
        """Unit k of job j ends a deallocation group (on CUDA its process then hands what the group freed back to
        the device, for the partner's process)."""
        stop = k + 1
        if stop not in self.stops[j]:
            return False
        start = max((s for s in self.stops[j] if s < stop), default=0)
        return self.live(j, stop) < self.live(j, start)

    def next(self, pos: tuple[int, int], last: int | None, ahead: int = 0) -> int | None:
        """Which job runs its next unit: the partner once the last job finished a group, else the last job again;
        the other one when that does not fit. `ahead`: iterations job 0 has completed beyond job 1; neither starts
        an iteration two ahead of the other. None: neither fits (the budget is too small for the pair)."""
        order = (0, 1) if last is None else ((1 - last, last) if self.group_done(last, pos[last]) else (last, 1 - last))
        for j in order:
            lead = ahead if j == 0 else -ahead
            if pos[j] % self.n(j) == 0 and lead >= 1 and pos[1 - j] % self.n(1 - j) != 0:
                continue
            if lead >= 2:
                continue
            if self.fits(j, pos):
                return j
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class PairSchedule:
    ledger: PairLedger
    prologue: tuple[tuple[int, int], ...]
    """(job, unit within its iteration) run once before the period starts."""
    period: tuple[tuple[int, int], ...]
    """(job, unit) in the order the pair runs them, repeated; one or more whole iterations of each job."""
    iterations: int
    """Iterations of each job per period."""
    peak_bytes: int
    """The most the pair uses at once in the period (a unit running beside its partner's live activations)."""
    held_bytes: int
    """The most the pair's activations hold between two units (and so between bubbles)."""
    side_by_side_bytes: int
    """What the two jobs need when nothing staggers them: the sum of their peaks."""


def split_of(budget: int) -> int:
    """Waterwave's split size for a pair's budget (SPLIT_FRACTION of it)."""
    return int(SPLIT_FRACTION * budget)


def schedule_pair(a: Sequence[FillUnit], b: Sequence[FillUnit], budget: int, split_bytes: int) -> PairSchedule | None:
    """Simulate the rule (PairLedger.next) from both jobs' first unit until its state repeats; None when the pair
    does not fit `budget` (a job alone does not, or the rule finds no admissible unit)."""
    ledger = PairLedger(mem=(tuple(u.mem_bytes for u in a), tuple(u.mem_bytes for u in b)),
                        state=(tuple(u.state_bytes for u in a[:-1]) + (0,), tuple(u.state_bytes for u in b[:-1]) + (0,)),
                        stops=tuple(tuple(g.stop for g in node_groups(units, split_bytes)) for units in (a, b)),
                        budget=budget)
    if not a or not b or max(ledger.mem[0]) > budget or max(ledger.mem[1]) > budget:
        return None
    pos, last, ahead = [0, 0], None, 0
    seen: dict[tuple, int] = {}
    steps: list[tuple[int, int]] = []
    while True:
        key = (pos[0] % ledger.n(0), pos[1] % ledger.n(1), ahead, last)
        if key in seen:
            start = seen[key]
            break
        if len(steps) >= MAX_STATES:
            return None
        seen[key] = len(steps)
        j = ledger.next((pos[0], pos[1]), last, ahead)
        if j is None:
            return None
        k = pos[j] % ledger.n(j)
        steps.append((j, k))
        pos[j] += 1
        last = j
        if pos[j] % ledger.n(j) == 0:
            ahead += 1 if j == 0 else -1
    period = tuple(steps[start:])
    peak, held, p = 0, 0, [0, 0]
    for j, k in steps[:start]:  # positions at the period's start
        p[j] += 1
    for j, k in period:
        peak = max(peak, ledger.mem[j][k] + ledger.live(1 - j, p[1 - j]))
        p[j] += 1
        held = max(held, ledger.live(0, p[0]) + ledger.live(1, p[1]))
    return PairSchedule(ledger=ledger, prologue=tuple(steps[:start]), period=period,
                        iterations=sum(1 for j, k in period if j == 0 and k == ledger.n(0) - 1),
                        peak_bytes=peak, held_bytes=held,
                        side_by_side_bytes=max(ledger.mem[0]) + max(ledger.mem[1]))


def pair_units(sched: PairSchedule, a: Sequence[FillUnit], b: Sequence[FillUnit], *,
               release_s: float = RELEASE_S) -> tuple[FillUnit, ...]:
    """The period as one job's units for the packer: each unit with its partner's live bytes added to what it uses
    (and to what stays live after it), and the cache release after each deallocation group."""
    units = (a, b)
    led = sched.ledger
    p = [0, 0]
    for j, _ in sched.prologue:
        p[j] += 1
    out = []
    for j, k in sched.period:
        u = units[j][k]
        partner = led.live(1 - j, p[1 - j])
        p[j] += 1
        release = release_s if led.frees(j, k) else 0.0
        out.append(FillUnit(name=f"{j}:{u.name}", time_s=u.time_s + release, flops=u.flops,
                            mem_bytes=u.mem_bytes + partner,
                            state_bytes=led.live(0, p[0]) + led.live(1, p[1])))
    return tuple(out)
