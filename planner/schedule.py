"""Per-rank pipeline schedules: IR, generators, validator and a text grid.

A schedule is one list of small actions per pipeline rank. Actions print and parse like
torch.distributed.pipelining's ``_Action`` (``1F0``, ``0B3``, ``2SEND_F1``, ``3RECV_B0``), plus
``ALLREDUCE``, ``OPT`` and ``BUBBLE<id>``. Everything here is a pure function of plain data.

Stage placement follows Megatron interleaving: with p ranks and v chunks per rank there are p*v
virtual stages and virtual stage k lives on rank k % p, so rank r holds stages r, r+p, r+2p, ...

Communication naming follows torch: ``kSEND_Fm`` is sent by stage k (to k+1) and received there as
``(k+1)RECV_Fm``; ``kSEND_Bm`` is sent by stage k (to k-1) and received as ``(k-1)RECV_Bm``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Iterable

__all__ = [
    "KINDS",
    "Action",
    "Op",
    "Schedule",
    "ScheduleError",
    "generate",
    "gpipe",
    "grid",
    "interleaved",
    "one_f_one_b",
    "stage_rank",
    "validate",
]

KINDS = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule breaks a dependency, misses an action, or cannot run to completion."""


class Op(str, Enum):
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
COMPUTE_OPS = frozenset({_F, _B})
_OP_TEXT = {op: op.value for op in Op}
# Numbers without leading zeros and ASCII digits only, so that parse is the exact inverse of str.
_NUM = "(0|[1-9][0-9]*)"
_ACTION_RE = re.compile(
    rf"{_NUM}(F|B|SEND_F|RECV_F|SEND_B|RECV_B){_NUM}|(ALLREDUCE)|(OPT)|BUBBLE{_NUM}", re.ASCII
)


def _is_index(x: object) -> bool:
    return type(x) is int and x >= 0 or isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
    """'gpipe', '1f1b' or 'interleaved'."""
    p: int
    """Pipeline ranks."""
    v: int
    """Model chunks per rank (virtual stages per rank)."""
    m: int
    """Microbatches per iteration."""
    ranks: tuple[tuple[Action, ...], ...]
    """ranks[r] is rank r's actions in execution order."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"schedule kind {self.kind!r} is not one of {KINDS}")
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


# ---------------------------------------------------------------------------------------------
# Generators


def _check_pm(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _with_comm(order: Iterable[tuple[Op, int, int]], last: int) -> tuple[Action, ...]:
    """Wrap each compute (op, stage, mb) with its RECV before and SEND after; end with ALLREDUCE, OPT."""
    out: list[Action] = []
    add = out.append
    for op, k, mb in order:
        if op is _F:
            if k > 0:
                add(Action(stage=k, op=_RECV_F, mb=mb))
            add(Action(stage=k, op=_F, mb=mb))
            if k < last:
                add(Action(stage=k, op=_SEND_F, mb=mb))
        else:
            if k < last:
                add(Action(stage=k, op=_RECV_B, mb=mb))
            add(Action(stage=k, op=_B, mb=mb))
            if k > 0:
                add(Action(stage=k, op=_SEND_B, mb=mb))
    add(Action(stage=None, op=_ALLREDUCE, mb=None))
    add(Action(stage=None, op=_OPT, mb=None))
    return tuple(out)


def _one_f_one_b_order(r: int, p: int, m: int) -> list[tuple[Op, int, int]]:
    warmup = min(p - r - 1, m)
    steady = m - warmup
    order = [(_F, r, mb) for mb in range(warmup)]
    for i in range(steady):
        order.append((_F, r, warmup + i))
        order.append((_B, r, i))
    order.extend((_B, r, mb) for mb in range(steady, m))
    return order


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards, then all backwards (in microbatch order)."""
    _check_pm(p, m)
    ranks = tuple(
        _with_comm([(_F, r, mb) for mb in range(m)] + [(_B, r, mb) for mb in range(m)], p - 1)
        for r in range(p)
    )
    return Schedule(kind="gpipe", p=p, v=1, m=m, ranks=ranks)


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush 1F1B: rank r runs min(p-r-1, m) warm-up forwards, then alternates F and B."""
    _check_pm(p, m)
    ranks = tuple(_with_comm(_one_f_one_b_order(r, p, m), p - 1) for r in range(p))
    return Schedule(kind="1f1b", p=p, v=1, m=m, ranks=ranks)


def _virtual(k: int, r: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(stage, mb) of rank r's k-th forward (or backward) in Megatron's interleaved order."""
    in_group = k % (p * v)
    chunk = in_group // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk * p + r, (k // (p * v)) * p + k % p


def _interleaved_order(r: int, p: int, v: int, m: int) -> list[tuple[Op, int, int]]:
    total = m * v
    if m == p:
        warmup = total  # Megatron runs all forwards first when m == p
    else:
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    fwd = [(_F, *_virtual(k, r, p, v, True)) for k in range(total)]
    bwd = [(_B, *_virtual(k, r, p, v, False)) for k in range(total)]
    steady = total - warmup
    order = fwd[:warmup]
    for i in range(steady):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[steady:])
    return order


def interleaved(p: int, v: int, m: int) -> Schedule:
    """Megatron interleaved 1F1B with v chunks per rank; m must be a multiple of p.

    With v == 1 this is plain 1F1B (Megatron only interleaves when v > 1).
    """
    _check_pm(p, m, v)
    if m % p != 0:
        raise ValueError(
            f"interleaved schedule needs m to be a multiple of p: m={m} is not divisible by p={p}"
        )
    last = p * v - 1
    if v == 1:
        ranks = tuple(_with_comm(_one_f_one_b_order(r, p, m), last) for r in range(p))
    else:
        ranks = tuple(_with_comm(_interleaved_order(r, p, v, m), last) for r in range(p))
    return Schedule(kind="interleaved", p=p, v=v, m=m, ranks=ranks)


def generate(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by kind name: 'gpipe', '1f1b' or 'interleaved'."""
    if kind == "interleaved":
        return interleaved(p, v, m)
    if v != 1:
        raise ValueError(f"schedule kind {kind!r} has one chunk per rank; got v={v}")
    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    raise ValueError(f"unknown schedule kind {kind!r}; expected one of {KINDS}")


# ---------------------------------------------------------------------------------------------
# Validation

_Key = tuple[Op, int, int]
_Where = dict[_Key, tuple[int, int]]


def _at(r: int, i: int, a: Action) -> str:
    return f"rank {r}, step {i} ({a})"


def _text(op: Op, stage: int, mb: int) -> str:
    return f"{stage}{_OP_TEXT[op]}{mb}"


def _check_action(s: Schedule, r: int, i: int, a: Action) -> None:
    if a.stage is None:
        return
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
    steps = {_ALLREDUCE: [], _OPT: []}
    bubbles: set[int] = set()
    last_stage_step = -1
    for i, a in enumerate(acts):
        if a.op in steps:
            steps[a.op].append(i)
        elif a.op is _BUBBLE:
            if a.mb in bubbles:
                raise ScheduleError(f"{_at(r, i, a)}: duplicate bubble id {a.mb}")
            bubbles.add(a.mb)
        else:
            last_stage_step = i
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


def _index(s: Schedule) -> _Where:
    where: _Where = {}
    for r, acts in enumerate(s.ranks):
        _check_rank_tail(r, acts)
        for i, a in enumerate(acts):
            _check_action(s, r, i, a)
            if a.stage is None:
                continue
            key = (a.op, a.stage, a.mb)
            if key in where:
                r0, i0 = where[key]
                raise ScheduleError(f"{_at(r, i, a)}: duplicate of rank {r0}, step {i0}")
            where[key] = (r, i)
    return where


def _check_coverage(s: Schedule, where: _Where) -> None:
    for k in range(s.num_stages):
        for mb in range(s.m):
            for op in (_F, _B):
                if (op, k, mb) not in where:
                    r = stage_rank(k, s.p)
                    raise ScheduleError(f"rank {r}: missing {_text(op, k, mb)} (stage {k} lives there)")


def _needs_before(op: Op, k: int, last: int) -> list[Op]:
    """Actions of the same (stage, mb) that must come earlier on the same rank."""
    if op is _F:
        return [_RECV_F] if k > 0 else []
    if op is _B:
        return [_F, _RECV_B] if k < last else [_F]
    if op is _SEND_F:
        return [_F]
    if op is _SEND_B:
        return [_B]
    return []


def _check_local_order(s: Schedule, where: _Where) -> None:
    last = s.num_stages - 1
    for (op, k, mb), (r, i) in where.items():
        for need in _needs_before(op, k, last):
            found = where.get((need, k, mb))
            if found is None or found[1] > i:
                a = s.ranks[r][i]
                what = "comes later" if found else "is missing"
                raise ScheduleError(
                    f"{_at(r, i, a)}: needs {_text(need, k, mb)} earlier on rank {r}, but it {what}"
                )


_PARTNER = {
    _SEND_F: (_RECV_F, +1),
    _RECV_F: (_SEND_F, -1),
    _SEND_B: (_RECV_B, -1),
    _RECV_B: (_SEND_B, +1),
}


def _check_pairs(s: Schedule, where: _Where) -> None:
    for (op, k, mb), (r, i) in where.items():
        if op not in _PARTNER:
            continue
        partner, step = _PARTNER[op]
        other = k + step
        a = s.ranks[r][i]
        if not 0 <= other < s.num_stages:
            raise ScheduleError(f"{_at(r, i, a)}: stage {k} has no neighbour stage {other}")
        if (partner, other, mb) not in where:
            rr = stage_rank(other, s.p)
            raise ScheduleError(
                f"{_at(r, i, a)}: no matching {_text(partner, other, mb)} on rank {rr}"
            )


def _dependency(a: Action, last: int) -> _Key | None:
    """The cross-stage action that must have run before ``a`` can run."""
    op, k, mb = a.op, a.stage, a.mb
    if op is _RECV_F:
        return (_SEND_F, k - 1, mb)
    if op is _RECV_B:
        return (_SEND_B, k + 1, mb)
    if op is _F and k > 0:
        return (_F, k - 1, mb)
    if op is _B:
        return (_B, k + 1, mb) if k < last else (_F, k, mb)
    return None


def _check_deadlock(s: Schedule) -> None:
    """Run every rank in order with unbounded buffers; fail if some rank can never proceed."""
    last = s.num_stages - 1
    done: set[_Key] = set()
    waiting: dict[_Key, list[int]] = {}
    ptr = [0] * s.p
    ready = list(range(s.p))
    while ready:
        r = ready.pop()
        acts = s.ranks[r]
        i = ptr[r]
        while i < len(acts):
            a = acts[i]
            dep = _dependency(a, last)
            if dep is not None and dep not in done:
                waiting.setdefault(dep, []).append(r)
                break
            if a.stage is not None:
                key = (a.op, a.stage, a.mb)
                done.add(key)
                ready.extend(waiting.pop(key, ()))
            i += 1
        ptr[r] = i
    stuck = [r for r in range(s.p) if ptr[r] < len(s.ranks[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(_stuck_text(s, r, ptr[r], last) for r in stuck[:4]))


def _stuck_text(s: Schedule, r: int, i: int, last: int) -> str:
    a = s.ranks[r][i]
    dep = _dependency(a, last)
    return f"{_at(r, i, a)} waits for {_text(*dep)}" if dep else _at(r, i, a)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (naming rank, step and action) unless the schedule is complete,
    respects every dependency, pairs every SEND with its RECV, and can run to completion."""
    where = _index(schedule)
    _check_coverage(schedule, where)
    _check_local_order(schedule, where)
    _check_pairs(schedule, where)
    _check_deadlock(schedule)


# ---------------------------------------------------------------------------------------------
# Text grid

_GRID_OPS = frozenset({_F, _B, _BUBBLE})


def _mark_column(acts: tuple[Action, ...], step: int) -> int:
    """Grid column of a step: itself if F/B/BUBBLE, the next compute for a RECV, the previous
    compute for a SEND, the end of the row for ALLREDUCE/OPT."""
    cols = [sum(1 for a in acts[:i] if a.op in _GRID_OPS) for i in (step, step + 1)]
    op = acts[step].op
    if op in _GRID_OPS or op in (_RECV_F, _RECV_B):
        return cols[0]
    if op in (_SEND_F, _SEND_B):
        return max(cols[0] - 1, 0)
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
