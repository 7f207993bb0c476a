"""Per-rank pipeline programs: IR, placement, lowering, validator and a text grid.

A schedule kind (planner.schedules) emits a *compute-only* program: per pipeline rank, its forwards (F),
backwards (B) or backwards split into input-gradient (I) and weight-gradient (W) steps, in order. Lowering
passes turn it into what runs: ``add_send_recv`` puts each cross-rank transfer next to its compute,
``add_reduce_grad`` ends every rank with the gradient reduction and the optimizer step, and the simulator's
``with_bubbles`` marks idle time as ``BUBBLE<id>`` (later passes may add unshard/reshard). Actions print and
parse like torch.distributed.pipelining's ``_Action`` (``1F0``, ``0I3``, ``0W3``, ``2SEND_F1``,
``3RECV_B0``), plus ``ALLREDUCE``, ``OPT`` and ``BUBBLE<id>``. Everything here is a pure function of plain
data.

`Placement` is the only place a stage's rank is derived: "loop" (Megatron interleaving, torch's
``generate_stage_to_rank_mapping(style="loop")``: stage k on rank k % p) or "v" (ZB-V, DualPipe-V: the
chunks go down the ranks and back up, so rank r holds stages r and 2p-1-r).

Communication naming follows torch: ``kSEND_Fm`` is sent by stage k (to k+1) and received there as
``(k+1)RECV_Fm``; ``kSEND_Bm`` is sent by stage k (to k-1) and received as ``(k-1)RECV_Bm``. Neighbour
stages on the same rank pass values without a transfer (no SEND/RECV between them).
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Iterable, Iterator

__all__ = [
    "Action",
    "COMPUTE_OPS",
    "Op",
    "PLACEMENTS",
    "Placement",
    "placement_of",
    "Schedule",
    "ScheduleError",
    "add_reduce_grad",
    "add_send_recv",
    "check_shape",
    "gc_paused",
    "generate",
    "grid",
    "lower",
    "lower_timed",
    "one_f_one_b_order",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule breaks a dependency, misses an action, or cannot run to completion."""


class Op(str, Enum):
    """What an action does; the value is its text inside an action string."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch's name: the input-gradient half of a backward
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    OPT = "OPT"
    BUBBLE = "BUBBLE"


# Enum attribute access (Op.F) is slow on CPython 3.11; hot paths use these module constants.
_F, _B, _I, _W = Op.F, Op.B, Op.I, Op.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B
_ALLREDUCE, _OPT, _BUBBLE = Op.ALLREDUCE, Op.OPT, Op.BUBBLE
COMPUTE_OPS = frozenset({_F, _B, _I, _W})
STAGE_OPS = COMPUTE_OPS | {_SEND_F, _RECV_F, _SEND_B, _RECV_B}
_OP_TEXT = {op: op.value for op in Op}
# Numbers without leading zeros and ASCII digits only, so that parse is the exact inverse of str.
_NUM = "(0|[1-9][0-9]*)"
_ACTION_RE = re.compile(
    rf"{_NUM}(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B){_NUM}|(ALLREDUCE)|(OPT)|BUBBLE{_NUM}", re.ASCII
)


def _is_index(x: object) -> bool:
    return type(x) is int and x >= 0  # bool (an int subclass) is not an index


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One step of a rank's schedule."""

    stage: int | None
    """Global virtual stage 0..p*v-1; None for ALLREDUCE, OPT and BUBBLE."""
    op: Op
    mb: int | None
    """Microbatch index; for BUBBLE the bubble id; None for ALLREDUCE and OPT."""

    def __post_init__(self) -> None:
        op = self.op
        if type(op) is not Op:
            raise TypeError(f"Action.op must be an Op, got {op!r}")
        if op in STAGE_OPS:
            if not (_is_index(self.stage) and _is_index(self.mb)):
                raise ValueError(
                    f"{self.op.value} needs stage and mb >= 0, got stage={self.stage!r} mb={self.mb!r}"
                )
        elif self.stage is not None:
            raise ValueError(f"{op.value} takes no stage, got stage={self.stage!r}")
        elif op is _BUBBLE and not _is_index(self.mb):
            raise ValueError(f"BUBBLE needs an id >= 0, got mb={self.mb!r}")
        elif op is not _BUBBLE and self.mb is not None:
            raise ValueError(f"{self.op.value} takes no mb, got mb={self.mb!r}")

    def __str__(self) -> str:
        if self.stage is not None:
            return f"{self.stage}{_OP_TEXT[self.op]}{self.mb}"
        if self.mb is not None:
            return f"BUBBLE{self.mb}"
        return _OP_TEXT[self.op]

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str()``: ``Action.parse(str(a)) == a``."""
        match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"not an action: {text!r} (expected e.g. '1F0', '0B3', '0I3', '0W3', '2SEND_F1', '3RECV_B0', "
                "'ALLREDUCE', 'OPT', 'BUBBLE4')"
            )
        stage, op, mb, allreduce, opt, bubble = match.groups()
        if op is not None:
            return cls(stage=int(stage), op=Op(op), mb=int(mb))
        if allreduce is not None:
            return cls(stage=None, op=_ALLREDUCE, mb=None)
        if opt is not None:
            return cls(stage=None, op=_OPT, mb=None)
        return cls(stage=None, op=_BUBBLE, mb=int(bubble))


PLACEMENTS = ("loop", "v")


@dataclass(frozen=True, slots=True)
class Placement:
    """Which pipeline rank holds each of the p * v virtual stages: the only place that is derived.

    "loop": stage k on rank k % p (Megatron interleaving; torch's generate_stage_to_rank_mapping loop style).
    "v": chunk c goes down the ranks when c is even and back up when it is odd (torch's "v" style), so with
    v = 2 rank r holds stages r and 2p - 1 - r and the middle two stages share rank p - 1.
    """

    style: str
    p: int
    v: int = 1
    rank_of: tuple[int, ...] = ()
    """rank_of[k]: the rank of stage k (derived; read it in hot loops)."""
    stages_of: tuple[tuple[int, ...], ...] = ()
    """stages_of[r]: the stages rank r holds, in stage order (derived)."""

    def __post_init__(self) -> None:
        if self.style not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.style!r}")
        check_shape(self.p, 1, self.v)
        p = self.p
        if self.style == "loop":
            ranks = tuple(k % p for k in range(p * self.v))
        else:
            ranks = tuple(k % p if (k // p) % 2 == 0 else p - 1 - k % p for k in range(p * self.v))
        object.__setattr__(self, "rank_of", ranks)
        object.__setattr__(self, "stages_of", tuple(tuple(k for k, r in enumerate(ranks) if r == rank)
                                                     for rank in range(p)))

    def rank(self, stage: int) -> int:
        return self.rank_of[stage]

    def stages(self, rank: int) -> tuple[int, ...]:
        """The stages rank `rank` holds, in stage (chunk) order."""
        return self.stages_of[rank]


@lru_cache(maxsize=1024)
def placement_of(style: str, p: int, v: int = 1) -> Placement:
    """The (shared, immutable) Placement of a style and shape: the search asks for it per configuration."""
    return Placement(style, p, v)


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One action list per pipeline rank for one training iteration."""

    kind: str
    """A registered schedule kind (planner.schedules): 'gpipe', '1f1b', 'interleaved', ..."""
    p: int
    """Pipeline ranks."""
    v: int
    """Model chunks per rank (virtual stages per rank)."""
    m: int
    """Microbatches per iteration."""
    ranks: tuple[tuple[Action, ...], ...]
    """ranks[r] is rank r's actions in execution order."""

    def __post_init__(self) -> None:
        from planner.schedules import get_schedule

        get_schedule(self.kind)
        for name in ("p", "v", "m"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"schedule {name} must be an int >= 1, got {value!r}")
        ranks = tuple(tuple(acts) for acts in self.ranks)
        if len(ranks) != self.p:
            raise ValueError(f"schedule has {len(ranks)} rank lists for p={self.p}")
        object.__setattr__(self, "ranks", ranks)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def placement(self) -> Placement:
        from planner.schedules import get_schedule

        return placement_of(get_schedule(self.kind).placement, self.p, self.v)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building or walking >100k small acyclic objects.

    Allocation-triggered full collections find nothing to free here and doubled the run time of
    generate/validate/simulate on 64-rank schedules.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Compute-only programs and the lowering passes


def check_shape(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


_new_action = Action.__new__
_set_stage, _set_op, _set_mb = Action.stage.__set__, Action.op.__set__, Action.mb.__set__  # type: ignore[attr-defined]


def _action(stage: int, op: Op, mb: int) -> Action:
    """``Action(stage=..., op=..., mb=...)`` without the checks, for passes whose actions are well formed
    by construction: a 64-rank schedule has ~400k actions and the checked frozen __init__ (~2 us each)
    dominated generation time."""
    obj = _new_action(Action)
    _set_stage(obj, stage)
    _set_op(obj, op)
    _set_mb(obj, mb)
    return obj


Compute = Iterable[tuple[Op, int, int]]
"""A rank's compute-only program: (op, stage, microbatch) with op in F, B, I, W."""


def add_send_recv(order: Compute, placement: Placement) -> list[Action]:
    """One rank's compute with each cross-rank transfer next to it: the RECV a compute consumes just before it,
    the SEND of what it produces just after (the runtime's sends are asynchronous, so a program whose compute
    order is consistent across ranks cannot deadlock; `validate` proves it)."""
    out: list[Action] = []
    add = out.append
    rank_of = placement.rank_of
    last = len(rank_of) - 1
    for op, k, mb in order:
        if op is _F:
            if k > 0 and rank_of[k - 1] != rank_of[k]:
                add(_action(k, _RECV_F, mb))
            add(_action(k, _F, mb))
            if k < last and rank_of[k + 1] != rank_of[k]:
                add(_action(k, _SEND_F, mb))
        elif op is _W:
            add(_action(k, _W, mb))
        else:  # B or I: consumes the gradient of stage k's output, produces its input's
            if k < last and rank_of[k + 1] != rank_of[k]:
                add(_action(k, _RECV_B, mb))
            add(_action(k, op, mb))
            if k > 0 and rank_of[k - 1] != rank_of[k]:
                add(_action(k, _SEND_B, mb))
    return out


def add_reduce_grad(actions: list[Action]) -> list[Action]:
    """End a rank's program with the data-parallel gradient reduction and the optimizer step."""
    return [*actions, Action(stage=None, op=_ALLREDUCE, mb=None), Action(stage=None, op=_OPT, mb=None)]


def lower(kind: str, p: int, m: int, v: int, compute: Iterable[Compute]) -> Schedule:
    """A kind's compute-only program (one per rank), lowered into the actions every rank runs."""
    from planner.schedules import get_schedule

    placement = placement_of(get_schedule(kind).placement, p, v)
    with gc_paused():
        ranks = tuple(tuple(add_reduce_grad(add_send_recv(order, placement))) for order in compute)
    return Schedule(kind=kind, p=p, v=v, m=m, ranks=ranks)


def lower_timed(kind: str, p: int, m: int, v: int, compute: Iterable[Compute]) -> Schedule:
    """`lower`'s schedule less its sends and receives, which take no time: every action the simulation times, in the
    same order on each rank (simulate.simulate_time reads nothing else), at under half the cost. Not a schedule to
    run or validate."""
    with gc_paused():
        ranks = tuple(tuple(add_reduce_grad([_action(k, op, mb) for op, k, mb in order])) for order in compute)
    return Schedule(kind=kind, p=p, v=v, m=m, ranks=ranks)


def one_f_one_b_order(r: int, p: int, v: int, m: int) -> list[tuple[Op, int, int]]:
    """Rank r's compute order in 1F1B (v is 1; the argument keeps one signature for both)."""
    warmup = min(p - r - 1, m)
    steady = m - warmup
    order = [(_F, r, mb) for mb in range(warmup)]
    for i in range(steady):
        order.append((_F, r, warmup + i))
        order.append((_B, r, i))
    order.extend((_B, r, mb) for mb in range(steady, m))
    return order


def generate(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by kind name (see planner.schedules for the registered kinds)."""
    from planner.schedules import get_schedule

    return get_schedule(kind).generate(p, m, v)


# ---------------------------------------------------------------------------------------------
# Validation
#
# Stage actions are indexed in one flat table: steps[code * n + k * m + mb] is the step of action
# (code, stage k, microbatch mb) on its rank, or -1; n = p * v * m. The rank is implied by the
# placement (checked first), so a step is enough to name the action.

_CODES = (_F, _B, _I, _W, _SEND_F, _RECV_F, _SEND_B, _RECV_B)
_CODE = {op: code for code, op in enumerate(_CODES)}
_CF, _CB, _CI, _CW, _CSEND_F, _CRECV_F, _CSEND_B, _CRECV_B = range(8)


def _at(r: int, i: int, a: Action) -> str:
    return f"rank {r}, step {i} ({a})"


def _text(op: Op, stage: int, mb: int) -> str:
    return f"{stage}{_OP_TEXT[op]}{mb}"


class _Table:
    """The flat step table plus what is needed to turn an index back into words."""

    __slots__ = ("s", "n", "steps", "rank_of")

    def __init__(self, s: Schedule, placement: Placement) -> None:
        self.s, self.n, self.rank_of = s, s.num_stages * s.m, placement.rank_of
        self.steps = [-1] * (len(_CODES) * self.n)

    def step(self, code: int, idx: int) -> int:
        return self.steps[code * self.n + idx]

    def name(self, code: int, idx: int) -> tuple[int, str]:
        """(rank, action text) of the action at code, idx = k * m + mb."""
        k, mb = divmod(idx, self.s.m)
        return self.rank_of[k], _text(_CODES[code], k, mb)

    def where(self, code: int, idx: int) -> str:
        r, text = self.name(code, idx)
        return f"rank {r}, step {self.step(code, idx)} ({text})"


def _check_action(s: Schedule, rank_of: tuple[int, ...], r: int, i: int, a: Action) -> None:
    if a.stage >= s.num_stages:
        raise ScheduleError(f"{_at(r, i, a)}: stage {a.stage} out of range 0..{s.num_stages - 1}")
    if rank_of[a.stage] != r:
        raise ScheduleError(f"{_at(r, i, a)}: stage {a.stage} lives on rank {rank_of[a.stage]}, not {r}")
    if a.mb >= s.m:
        raise ScheduleError(f"{_at(r, i, a)}: microbatch {a.mb} out of range 0..{s.m - 1}")


def _check_rank_tail(r: int, acts: tuple[Action, ...]) -> None:
    """Exactly one ALLREDUCE then one OPT, after every stage action; bubble ids unique."""
    steps: dict[Op, list[int]] = {_ALLREDUCE: [], _OPT: []}
    bubbles: set[int] = set()
    last_stage_step = -1
    for i, a in enumerate(acts):
        if a.stage is not None:
            last_stage_step = i
        elif a.op is _BUBBLE:
            if a.mb in bubbles:
                raise ScheduleError(f"{_at(r, i, a)}: duplicate bubble id {a.mb}")
            bubbles.add(a.mb)
        else:
            steps[a.op].append(i)
    for op, found in steps.items():
        if len(found) != 1:
            raise ScheduleError(f"rank {r}: expected one {op.value}, found {len(found)}")
    ar, opt = steps[_ALLREDUCE][0], steps[_OPT][0]
    if opt < ar:
        raise ScheduleError(f"{_at(r, opt, acts[opt])}: OPT before ALLREDUCE (step {ar})")
    if last_stage_step > ar:
        raise ScheduleError(
            f"{_at(r, last_stage_step, acts[last_stage_step])}: after ALLREDUCE (step {ar})"
        )


def _index(s: Schedule, placement: Placement) -> _Table:
    table = _Table(s, placement)
    steps, n, m, stages, code_of, rank_of = table.steps, table.n, s.m, s.num_stages, _CODE, placement.rank_of
    for r, acts in enumerate(s.ranks):
        _check_rank_tail(r, acts)
        for i, a in enumerate(acts):
            k = a.stage
            if k is None:
                continue
            if k >= stages or rank_of[k] != r or a.mb >= m:
                _check_action(s, rank_of, r, i, a)
            key = code_of[a.op] * n + k * m + a.mb
            if steps[key] >= 0:
                raise ScheduleError(f"{_at(r, i, a)}: duplicate of step {steps[key]}")
            steps[key] = i
    return table


def _check_coverage(t: _Table) -> None:
    """Every (stage, microbatch) has its forward and either one B or both an I and a W."""
    for idx in range(t.n):
        f, b, i, w = (t.step(c, idx) for c in (_CF, _CB, _CI, _CW))
        missing = _CF if f < 0 else None
        if missing is None and b < 0 and i < 0:
            missing = _CB
        elif missing is None and b >= 0 and (i >= 0 or w >= 0):
            r, text = t.name(_CI if i >= 0 else _CW, idx)
            raise ScheduleError(f"{t.where(_CB, idx)}: the backward runs whole and split ({text}) on rank {r}")
        elif missing is None and (i >= 0) != (w >= 0):
            missing = _CW if w < 0 else _CI
        if missing is not None:
            r, text = t.name(missing, idx)
            raise ScheduleError(f"rank {r}: missing {text} (stage {idx // t.s.m} lives there)")


def _before(t: _Table, need: int, need_idx: int, code: int, idx: int, step: int) -> None:
    before = t.step(need, need_idx)
    if not 0 <= before < step:
        r, text = t.name(need, need_idx)
        what = "comes later" if before >= 0 else "is missing"
        raise ScheduleError(f"{t.where(code, idx)}: needs {text} earlier on rank {r}, but it {what}")


def _check_local_order(t: _Table) -> None:
    """Each compute after what it consumes: a forward after its input (received, or the previous stage's forward
    on the same rank); a backward (B or I) after its own forward and its output's gradient; W after its I; a SEND
    after the compute that produced it."""
    m, rank_of = t.s.m, t.rank_of
    last = len(rank_of) - 1
    for idx in range(t.n):
        k = idx // m
        f = t.step(_CF, idx)
        if k > 0:
            local = rank_of[k - 1] == rank_of[k]
            _before(t, _CF if local else _CRECV_F, idx - m if local else idx, _CF, idx, f)
        code = _CB if t.step(_CB, idx) >= 0 else _CI
        back = t.step(code, idx)
        _before(t, _CF, idx, code, idx, back)
        if k < last:
            if rank_of[k + 1] == rank_of[k]:
                _before(t, _CB if t.step(_CB, idx + m) >= 0 else _CI, idx + m, code, idx, back)
            else:
                _before(t, _CRECV_B, idx, code, idx, back)
        if code == _CI:
            _before(t, _CI, idx, _CW, idx, t.step(_CW, idx))
        for send, producer in ((_CSEND_F, _CF), (_CSEND_B, code)):
            if (step := t.step(send, idx)) >= 0:
                _before(t, producer, idx, send, idx, step)


def _check_pairs(t: _Table) -> None:
    """A transfer between ranks for every boundary that crosses one (SEND and its RECV), none within a rank."""
    m, rank_of = t.s.m, t.rank_of
    for code, partner, shift in ((_CSEND_F, _CRECV_F, +1), (_CRECV_F, _CSEND_F, -1),
                                 (_CSEND_B, _CRECV_B, -1), (_CRECV_B, _CSEND_B, +1)):
        for idx in range(t.n):
            if t.step(code, idx) < 0:
                continue
            k = idx // m
            if not 0 <= k + shift < len(rank_of):
                raise ScheduleError(f"{t.where(code, idx)}: stage {k} has no neighbour stage {k + shift}")
            if rank_of[k + shift] == rank_of[k]:
                raise ScheduleError(f"{t.where(code, idx)}: stages {k} and {k + shift} share rank {rank_of[k]}; "
                                    "nothing is sent between them")
            other = idx + shift * m
            if t.step(partner, other) < 0:
                r, text = t.name(partner, other)
                raise ScheduleError(f"{t.where(code, idx)}: no matching {text} on rank {r}")


def _check_deadlock(s: Schedule, rank_of: tuple[int, ...]) -> None:
    """Run every rank in order with unbounded buffers; fail if some rank can never proceed.

    Only RECVs wait here: after the local-order and pairing checks, every cross-rank dependency goes through
    a SEND->RECV pair and every same-rank one is the rank's own order.
    """
    m = s.m
    n = s.num_stages * m
    sent = bytearray(2 * n)  # [0, n): SEND_F(k, mb) at k*m+mb ran; [n, 2n): SEND_B
    waiter = [-1] * (2 * n)  # the rank blocked on that send (each send has one receiver)
    ptr = [0] * s.p
    ready = list(range(s.p))
    while ready:
        r = ready.pop()
        acts = s.ranks[r]
        i, end = ptr[r], len(acts)
        while i < end:
            a = acts[i]
            op = a.op
            if op is _SEND_F or op is _SEND_B:
                key = a.stage * m + a.mb + (n if op is _SEND_B else 0)
                sent[key] = 1
                if waiter[key] >= 0:
                    ready.append(waiter[key])
                    waiter[key] = -1
            elif op is _RECV_F or op is _RECV_B:
                key = (a.stage - 1) * m + a.mb if op is _RECV_F else n + (a.stage + 1) * m + a.mb
                if not sent[key]:
                    waiter[key] = r
                    break
            i += 1
        ptr[r] = i
    stuck = [r for r in range(s.p) if ptr[r] < len(s.ranks[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(_stuck_text(s, rank_of, r, ptr[r]) for r in stuck[:4]))


def _stuck_text(s: Schedule, rank_of: tuple[int, ...], r: int, i: int) -> str:
    a = s.ranks[r][i]
    src = a.stage - 1 if a.op is _RECV_F else a.stage + 1
    sender = _SEND_F if a.op is _RECV_F else _SEND_B
    return f"{_at(r, i, a)} waits for {_text(sender, src, a.mb)} on rank {rank_of[src]}"


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (naming rank, step and action) unless the schedule is complete,
    respects every dependency, pairs every SEND with its RECV, and can run to completion."""
    placement = schedule.placement
    with gc_paused():
        table = _index(schedule, placement)
        _check_coverage(table)
        _check_local_order(table)
        _check_pairs(table)
        _check_deadlock(schedule, placement.rank_of)


# ---------------------------------------------------------------------------------------------
# Text grid

_GRID_OPS = frozenset({_F, _B, _I, _W, _BUBBLE})


def _mark_column(acts: tuple[Action, ...], step: int) -> int:
    """Grid column of a step: itself if F/B/I/W/BUBBLE, the next compute for a RECV, the previous
    compute for a SEND, the end of the row for ALLREDUCE/OPT."""
    col = sum(1 for a in acts[:step] if a.op in _GRID_OPS)
    op = acts[step].op
    if op in _GRID_OPS or op is _RECV_F or op is _RECV_B:
        return col
    if op is _SEND_F or op is _SEND_B:
        return max(col - 1, 0)
    return sum(1 for a in acts if a.op in _GRID_OPS)


def grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """One row per rank, one column per compute step (F, B, I, W, BUBBLE).

    ``mark=(rank, step)`` (step indexes ``schedule.ranks[rank]``, as in ScheduleError messages)
    puts ``>`` before that step's cell and adds a footer line naming the action.
    """
    rows = [[str(a) for a in acts if a.op in _GRID_OPS] for acts in schedule.ranks]
    width = max((len(c) for row in rows for c in row), default=1)
    label = len(str(schedule.p - 1))
    mark_at: tuple[int, int] | None = None
    if mark is not None:
        r, step = mark
        if not (0 <= r < schedule.p and 0 <= step < len(schedule.ranks[r])):
            raise ValueError(f"mark {mark} is outside the schedule (p={schedule.p})")
        mark_at = (r, _mark_column(schedule.ranks[r], step))
    lines = []
    for r, row in enumerate(rows):
        cells = [(">" if mark_at == (r, c) else " ") + text.ljust(width) for c, text in enumerate(row)]
        if mark_at == (r, len(row)):
            cells.append(">")
        lines.append(f"rank {r:>{label}} |" + "".join(cells).rstrip())
    if mark is not None:
        r, step = mark
        lines.append(f"> rank {r}, step {step}: {schedule.ranks[r][step]}")
    return "\n".join(lines)
