"""Per-rank pipeline schedules: IR, validator and a text grid (the generators are in planner.schedules).

A schedule is one list of small actions per pipeline rank. Actions print and parse like
torch.distributed.pipelining's ``_Action`` (``1F0``, ``0B3``, ``2SEND_F1``, ``3RECV_B0``), plus
``ALLREDUCE``, ``OPT`` and ``BUBBLE<id>``. Everything here is a pure function of plain data.

Stage placement follows Megatron interleaving: with p ranks and v chunks per rank there are p*v
virtual stages and virtual stage k lives on rank k % p, so rank r holds stages r, r+p, r+2p, ...

Communication naming follows torch: ``kSEND_Fm`` is sent by stage k (to k+1) and received there as
``(k+1)RECV_Fm``; ``kSEND_Bm`` is sent by stage k (to k-1) and received as ``(k-1)RECV_Bm``.
"""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Iterator

__all__ = [
    "Action",
    "Op",
    "Schedule",
    "ScheduleError",
    "check_shape",
    "gc_paused",
    "generate",
    "grid",
    "one_f_one_b_order",
    "stage_rank",
    "validate",
    "with_comm",
]


class ScheduleError(ValueError):
    """A schedule breaks a dependency, misses an action, or cannot run to completion."""


class Op(str, Enum):
    """What an action does; the value is its text inside an action string."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    OPT = "OPT"
    BUBBLE = "BUBBLE"


# Enum attribute access (Op.F) is slow on CPython 3.11; hot paths use these module constants.
_F, _B, _SEND_F, _RECV_F, _SEND_B, _RECV_B = Op.F, Op.B, Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B
_ALLREDUCE, _OPT, _BUBBLE = Op.ALLREDUCE, Op.OPT, Op.BUBBLE
STAGE_OPS = frozenset({_F, _B, _SEND_F, _RECV_F, _SEND_B, _RECV_B})
_OP_TEXT = {op: op.value for op in Op}
# Numbers without leading zeros and ASCII digits only, so that parse is the exact inverse of str.
_NUM = "(0|[1-9][0-9]*)"
_ACTION_RE = re.compile(
    rf"{_NUM}(F|B|SEND_F|RECV_F|SEND_B|RECV_B){_NUM}|(ALLREDUCE)|(OPT)|BUBBLE{_NUM}", re.ASCII
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
                f"not an action: {text!r} (expected e.g. '1F0', '0B3', '2SEND_F1', '3RECV_B0', "
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


def stage_rank(stage: int, p: int) -> int:
    """Rank that holds virtual stage ``stage`` (Megatron interleaved placement)."""
    return stage % p


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
# Building blocks of the generators (planner.schedules)


def check_shape(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


_new_action = Action.__new__
_set_stage, _set_op, _set_mb = Action.stage.__set__, Action.op.__set__, Action.mb.__set__  # type: ignore[attr-defined]


def _action(stage: int, op: Op, mb: int) -> Action:
    """``Action(stage=..., op=..., mb=...)`` without the checks, for generators whose actions are
    well formed by construction: a 64-rank schedule has ~400k actions and the checked frozen
    __init__ (~2 us each) dominated generation time."""
    obj = _new_action(Action)
    _set_stage(obj, stage)
    _set_op(obj, op)
    _set_mb(obj, mb)
    return obj


def with_comm(order: Iterable[tuple[Op, int, int]], last: int) -> tuple[Action, ...]:
    """Wrap each compute (op, stage, mb) with its RECV before and SEND after; end with ALLREDUCE, OPT."""
    out: list[Action] = []
    add = out.append
    for op, k, mb in order:
        if op is _F:
            if k > 0:
                add(_action(k, _RECV_F, mb))
            add(_action(k, _F, mb))
            if k < last:
                add(_action(k, _SEND_F, mb))
        else:
            if k < last:
                add(_action(k, _RECV_B, mb))
            add(_action(k, _B, mb))
            if k > 0:
                add(_action(k, _SEND_B, mb))
    add(Action(stage=None, op=_ALLREDUCE, mb=None))
    add(Action(stage=None, op=_OPT, mb=None))
    return tuple(out)


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

_CODES = (_F, _B, _SEND_F, _RECV_F, _SEND_B, _RECV_B)
_CODE = {op: code for code, op in enumerate(_CODES)}
_CF, _CB, _CSEND_F, _CRECV_F, _CSEND_B, _CRECV_B = range(6)


def _at(r: int, i: int, a: Action) -> str:
    return f"rank {r}, step {i} ({a})"


def _text(op: Op, stage: int, mb: int) -> str:
    return f"{stage}{_OP_TEXT[op]}{mb}"


class _Table:
    """The flat step table plus what is needed to turn an index back into words."""

    __slots__ = ("s", "n", "steps")

    def __init__(self, s: Schedule) -> None:
        self.s, self.n = s, s.num_stages * s.m
        self.steps = [-1] * (6 * self.n)

    def name(self, code: int, idx: int) -> tuple[int, str]:
        """(rank, action text) of the action at code, idx = k * m + mb."""
        k, mb = divmod(idx, self.s.m)
        return stage_rank(k, self.s.p), _text(_CODES[code], k, mb)

    def where(self, code: int, idx: int) -> str:
        r, text = self.name(code, idx)
        return f"rank {r}, step {self.steps[code * self.n + idx]} ({text})"


def _check_action(s: Schedule, r: int, i: int, a: Action) -> None:
    if a.stage >= s.num_stages:
        raise ScheduleError(f"{_at(r, i, a)}: stage {a.stage} out of range 0..{s.num_stages - 1}")
    if stage_rank(a.stage, s.p) != r:
        raise ScheduleError(
            f"{_at(r, i, a)}: stage {a.stage} lives on rank {stage_rank(a.stage, s.p)}, not {r}"
        )
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


def _index(s: Schedule) -> _Table:
    table = _Table(s)
    steps, n, m, p, stages, code_of = table.steps, table.n, s.m, s.p, s.num_stages, _CODE
    for r, acts in enumerate(s.ranks):
        _check_rank_tail(r, acts)
        for i, a in enumerate(acts):
            k = a.stage
            if k is None:
                continue
            if k >= stages or k % p != r or a.mb >= m:
                _check_action(s, r, i, a)
            key = code_of[a.op] * n + k * m + a.mb
            if steps[key] >= 0:
                raise ScheduleError(f"{_at(r, i, a)}: duplicate of step {steps[key]}")
            steps[key] = i
    return table


def _check_coverage(t: _Table) -> None:
    for code in (_CF, _CB):
        lo = code * t.n
        try:
            idx = t.steps.index(-1, lo, lo + t.n) - lo
        except ValueError:
            continue
        r, text = t.name(code, idx)
        raise ScheduleError(f"rank {r}: missing {text} (stage {idx // t.s.m} lives there)")


def _require_before(t: _Table, need: int, code: int, lo: int, hi: int) -> None:
    """For idx in [lo, hi): where action (code, idx) exists, (need, idx) must come earlier."""
    steps, n = t.steps, t.n
    for idx in range(lo, hi):
        step = steps[code * n + idx]
        if step < 0:
            continue
        before = steps[need * n + idx]
        if not 0 <= before < step:
            r, text = t.name(need, idx)
            what = "comes later" if before >= 0 else "is missing"
            raise ScheduleError(
                f"{t.where(code, idx)}: needs {text} earlier on rank {r}, but it {what}"
            )


def _check_local_order(t: _Table) -> None:
    n, m = t.n, t.s.m
    _require_before(t, _CRECV_F, _CF, m, n)  # a forward of stage k > 0 needs its input
    _require_before(t, _CF, _CB, 0, n)  # a backward needs its own forward
    _require_before(t, _CRECV_B, _CB, 0, n - m)  # ... and, below the last stage, its gradient
    _require_before(t, _CF, _CSEND_F, 0, n)
    _require_before(t, _CB, _CSEND_B, 0, n)


def _require_partner(t: _Table, code: int, partner: int, shift: int) -> None:
    """Every (code, idx) has (partner, idx + shift) on the neighbour; shift is +-m (one stage)."""
    steps, n = t.steps, t.n
    for idx in range(n):
        if steps[code * n + idx] < 0:
            continue
        other = idx + shift
        if not 0 <= other < n:
            k = idx // t.s.m
            raise ScheduleError(f"{t.where(code, idx)}: stage {k} has no neighbour stage {k + shift // t.s.m}")
        if steps[partner * n + other] < 0:
            r, text = t.name(partner, other)
            raise ScheduleError(f"{t.where(code, idx)}: no matching {text} on rank {r}")


def _check_pairs(t: _Table) -> None:
    m = t.s.m
    _require_partner(t, _CSEND_F, _CRECV_F, +m)
    _require_partner(t, _CRECV_F, _CSEND_F, -m)
    _require_partner(t, _CSEND_B, _CRECV_B, -m)
    _require_partner(t, _CRECV_B, _CSEND_B, +m)


def _check_deadlock(s: Schedule) -> None:
    """Run every rank in order with unbounded buffers; fail if some rank can never proceed.

    Only RECVs wait here: after the local-order and pairing checks, the edges F(k-1)->F(k),
    B(k+1)->B(k) and F(last)->B(last) follow from SEND->RECV edges plus each rank's own order.
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
        raise ScheduleError("deadlock: " + "; ".join(_stuck_text(s, r, ptr[r]) for r in stuck[:4]))


def _stuck_text(s: Schedule, r: int, i: int) -> str:
    a = s.ranks[r][i]
    src = a.stage - 1 if a.op is _RECV_F else a.stage + 1
    sender = _SEND_F if a.op is _RECV_F else _SEND_B
    return f"{_at(r, i, a)} waits for {_text(sender, src, a.mb)} on rank {stage_rank(src, s.p)}"


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (naming rank, step and action) unless the schedule is complete,
    respects every dependency, pairs every SEND with its RECV, and can run to completion."""
    with gc_paused():
        table = _index(schedule)
        _check_coverage(table)
        _check_local_order(table)
        _check_pairs(table)
        _check_deadlock(schedule)


# ---------------------------------------------------------------------------------------------
# Text grid

_GRID_OPS = frozenset({_F, _B, _BUBBLE})


def _mark_column(acts: tuple[Action, ...], step: int) -> int:
    """Grid column of a step: itself if F/B/BUBBLE, the next compute for a RECV, the previous
    compute for a SEND, the end of the row for ALLREDUCE/OPT."""
    col = sum(1 for a in acts[:step] if a.op in _GRID_OPS)
    op = acts[step].op
    if op in _GRID_OPS or op is _RECV_F or op is _RECV_B:
        return col
    if op is _SEND_F or op is _SEND_B:
        return max(col - 1, 0)
    return sum(1 for a in acts if a.op in _GRID_OPS)


def grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """One row per rank, one column per compute step (F, B, BUBBLE).

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
