"""Schedule IR, generators, validator and grid (planner/schedule_ir.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.schedule_ir import (
    COMPUTE_OPS,
    Action,
    Op,
    Schedule,
    ScheduleError,
    generate,
    grid,
    validate,
)
from planner.schedules import SCHEDULES
from tests.planner.kinds import KINDS, gpipe, interleaved, one_f_one_b

FAST = settings(max_examples=120, deadline=None)


@st.composite
def schedules(draw: st.DrawFn, max_p: int = 8) -> Schedule:
    kind = draw(st.sampled_from(KINDS))
    p = draw(st.integers(1, max_p))
    if kind == "interleaved":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 4))
    else:  # the chunks per rank the kind runs (zbv: 2)
        v, m = max(SCHEDULES[kind].v_choices(max(p, 2), 4), default=1), draw(st.integers(1, 16))
    assume(SCHEDULES[kind].check(p, v, m) is None)
    return generate(kind, p, m, v)


def _replace_rank(s: Schedule, r: int, acts: list[Action]) -> Schedule:
    ranks = list(s.ranks)
    ranks[r] = tuple(acts)
    return dataclasses.replace(s, ranks=tuple(ranks))


def _strings(acts: tuple[Action, ...], ops: set[Op] = {Op.F, Op.B}) -> list[str]:
    return [str(a) for a in acts if a.op in ops]


# --- Action strings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(stage=1, op=Op.F, mb=0), "1F0"),
        (Action(stage=0, op=Op.B, mb=3), "0B3"),
        (Action(stage=2, op=Op.SEND_F, mb=1), "2SEND_F1"),
        (Action(stage=3, op=Op.RECV_B, mb=0), "3RECV_B0"),
        (Action(stage=12, op=Op.RECV_F, mb=105), "12RECV_F105"),
        (Action(stage=4, op=Op.SEND_B, mb=7), "4SEND_B7"),
        (Action(stage=None, op=Op.ALLREDUCE, mb=None), "ALLREDUCE"),
        (Action(stage=None, op=Op.OPT, mb=None), "OPT"),
        (Action(stage=None, op=Op.BUBBLE, mb=4), "BUBBLE4"),
    ],
)
def test_action_string_matches_torch_format(action: Action, text: str) -> None:
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize(
    "text",
    ["", "F0", "1F", "1X0", "1f0", " 1F0", "1F0 ", "01F0", "1F00", "-1F0", "1F-1", "ALLREDUCE0",
     "0ALLREDUCE", "OPT1", "BUBBLE", "BUBBLE-1", "1BUBBLE2", "1SEND0", "1SEND_X0", "1F0\n",
     "\u0661F0", "1 F 0", "SEND_F"],
)
def test_parse_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(stage=None, op=Op.F, mb=0), ValueError),
        (dict(stage=0, op=Op.F, mb=None), ValueError),
        (dict(stage=-1, op=Op.B, mb=0), ValueError),
        (dict(stage=0, op=Op.B, mb=True), ValueError),
        (dict(stage=1, op=Op.ALLREDUCE, mb=None), ValueError),
        (dict(stage=None, op=Op.OPT, mb=0), ValueError),
        (dict(stage=None, op=Op.BUBBLE, mb=None), ValueError),
        (dict(stage=0, op="F", mb=0), TypeError),
    ],
)
def test_action_rejects_malformed_fields(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        Action(**kwargs)


@FAST
@given(schedules())
def test_every_action_round_trips_through_its_string(s: Schedule) -> None:
    for acts in s.ranks:
        for a in acts:
            assert Action.parse(str(a)) == a


# --- generators ---------------------------------------------------------------------------------


@FAST
@given(schedules())
def test_generated_schedules_validate(s: Schedule) -> None:
    validate(s)
    for r, acts in enumerate(s.ranks):
        assert [str(a) for a in acts[-2:]] == ["ALLREDUCE", "OPT"]
        assert all(s.placement.rank(a.stage) == r for a in acts if a.stage is not None), "the kind's placement"
        split = 3 if SCHEDULES[s.kind].split_backward else 2  # F, I, W or F, B per chunk and microbatch
        assert len([a for a in acts if a.op in COMPUTE_OPS]) == split * s.v * s.m


def test_gpipe_golden() -> None:
    s = gpipe(2, 2)
    assert [str(a) for a in s.ranks[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "ALLREDUCE", "OPT",
    ]
    assert [str(a) for a in s.ranks[1]] == [
        "1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1", "ALLREDUCE", "OPT",
    ]


@pytest.mark.parametrize(("p", "m"), [(1, 1), (4, 1), (4, 3), (4, 4), (4, 9), (8, 5)])
def test_1f1b_warmup_and_in_flight_bound(p: int, m: int) -> None:
    s = one_f_one_b(p, m)
    for r, acts in enumerate(s.ranks):
        ops = [a.op for a in acts if a.op in (Op.F, Op.B)]
        # min(p-r-1, m) warm-up forwards, then the steady state starts with one more forward.
        assert ops.index(Op.B) == min(p - r, m)
        in_flight = peak = 0
        for op in ops:
            in_flight += 1 if op is Op.F else -1
            peak = max(peak, in_flight)
        assert peak == min(p - r, m)


def test_interleaved_golden_megatron_order() -> None:
    s = interleaved(2, 2, 4)
    assert _strings(s.ranks[0]) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()
    )
    assert _strings(s.ranks[1]) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split()
    )


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    assert interleaved(4, 1, 8).ranks == one_f_one_b(4, 8).ranks


def test_interleaved_needs_at_least_p_microbatches() -> None:
    with pytest.raises(ValueError, match=r"p=4 m=3: interleaving needs at least p microbatches"):
        interleaved(4, 2, 3)


@pytest.mark.parametrize("p,m,g", [(4, 8, 4), (4, 10, 5), (4, 9, 5), (4, 7, 7), (2, 5, 3), (8, 12, 12), (8, 20, 10)])
def test_interleaved_groups_microbatches_as_megatron_core_does(p, m, g) -> None:
    """m not a multiple of p: each chunk runs its microbatches in groups of g (Megatron-Core's
    microbatch_group_size_per_vp_stage), the last group empty or at least p long; the order is complete
    and deadlock-free."""
    from planner.schedules.interleaved import group_size

    assert group_size(p, m) == g
    s = interleaved(p, 2, m)
    validate(s)
    if (p, m) == (2, 5):  # Megatron-Core's own example (model_parallel_config.py): rank 0 | 0 1 2 0 1 2 3 4 3 4
        fwd = [(a.stage // p, a.mb) for a in s.ranks[0] if a.op is Op.F]
        assert [mb for _, mb in fwd] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
        assert [c for c, _ in fwd] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    ("args", "match"),
    [(("zigzag", 2, 2), "unknown schedule kind"), (("gpipe", 2, 2, 2), "v=2"), (("1f1b", 0, 2), "p must")],
)
def test_generate_rejects_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(*args)


# --- validator ----------------------------------------------------------------------------------


def test_backward_before_its_forward_names_the_rank() -> None:
    s = one_f_one_b(2, 2)
    acts = list(s.ranks[1])  # 1RECV_F0 1F0 1B0 ...: swap the forward and its backward
    i, j = acts.index(Action.parse("1F0")), acts.index(Action.parse("1B0"))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 1, step 1 \(1B0\): needs 1F0 earlier"):
        validate(_replace_rank(s, 1, acts))


def test_dropped_recv_names_the_rank() -> None:
    s = gpipe(3, 2)
    acts = [a for a in s.ranks[2] if str(a) != "2RECV_F1"]
    with pytest.raises(ScheduleError, match=r"rank 2, step \d+ \(2F1\): needs 2RECV_F1 earlier"):
        validate(_replace_rank(s, 2, acts))


def test_dropped_send_is_an_unmatched_recv() -> None:
    s = gpipe(3, 2)
    acts = [a for a in s.ranks[0] if str(a) != "0SEND_F1"]
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+ \(1RECV_F1\): no matching 0SEND_F1 on rank 0"):
        validate(_replace_rank(s, 0, acts))


def test_duplicate_and_missing_compute() -> None:
    s = gpipe(2, 2)
    acts = list(s.ranks[0])
    with pytest.raises(ScheduleError, match=r"rank 0, step 3 \(0F0\): duplicate of step 0"):
        validate(_replace_rank(s, 0, acts[:3] + [acts[0]] + acts[3:]))
    without_b = [a for a in acts if str(a) not in ("0B1", "0RECV_B1")]
    with pytest.raises(ScheduleError, match=r"rank 0: missing 0B1"):
        validate(_replace_rank(s, 0, without_b))


def test_action_on_the_wrong_rank() -> None:
    s = gpipe(2, 1)
    acts = list(s.ranks[0])
    acts.insert(0, Action.parse("1F0"))
    with pytest.raises(ScheduleError, match=r"rank 0, step 0 \(1F0\): stage 1 lives on rank 1"):
        validate(_replace_rank(s, 0, acts))


def test_allreduce_and_opt_close_each_rank() -> None:
    s = gpipe(2, 1)
    acts = list(s.ranks[1])
    with pytest.raises(ScheduleError, match=r"rank 1: expected one OPT, found 0"):
        validate(_replace_rank(s, 1, acts[:-1]))
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+ \(1SEND_B0\): after ALLREDUCE"):
        validate(_replace_rank(s, 1, acts[:-3] + acts[-2:] + acts[-3:-2]))


def _deadlocked() -> Schedule:
    """Rank 0 waits for microbatch 0's gradient before sending microbatch 1, while rank 1 waits
    for microbatch 1 first. Every local check passes; only the cross-rank cycle is wrong."""
    rank0 = "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1 ALLREDUCE OPT"
    rank1 = "1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0 ALLREDUCE OPT"
    ranks = tuple(tuple(Action.parse(t) for t in row.split()) for row in (rank0, rank1))
    return Schedule(kind="1f1b", p=2, v=1, m=2, ranks=ranks)


def test_deadlock_is_reported_with_the_waiting_ranks() -> None:
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 0, step 2 \(0RECV_B0\) waits for 1SEND_B0"):
        validate(_deadlocked())


@settings(max_examples=80, deadline=None)
@given(schedules(max_p=4), st.data())
def test_dropping_any_stage_action_is_caught(s: Schedule, data: st.DataObject) -> None:
    r = data.draw(st.integers(0, s.p - 1))
    acts = list(s.ranks[r])
    candidates = [i for i, a in enumerate(acts) if a.stage is not None]
    del acts[data.draw(st.sampled_from(candidates))]
    with pytest.raises(ScheduleError, match=r"rank \d+"):
        validate(_replace_rank(s, r, acts))


# --- grid ---------------------------------------------------------------------------------------


def test_grid_rows_columns_and_mark() -> None:
    s = one_f_one_b(3, 3)
    lines = grid(s).splitlines()
    assert len(lines) == 3
    assert lines[0].split("|")[1].split() == _strings(s.ranks[0])
    assert len({line.index("|") for line in lines}) == 1
    step = s.ranks[1].index(Action.parse("1B0"))
    marked = grid(s, mark=(1, step)).splitlines()
    assert ">1B0" in marked[1] and ">" not in marked[0] + marked[2]
    assert marked[-1] == f"> rank 1, step {step}: 1B0"
    # A RECV marks the compute it feeds.
    recv = s.ranks[1].index(Action.parse("1RECV_F2"))
    assert ">1F2" in grid(s, mark=(1, recv)).splitlines()[1]
    with pytest.raises(ValueError, match="outside the schedule"):
        grid(s, mark=(3, 0))


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (4, 2, 4), (4, 3, 4), (2, 2, 4), (4, 2, 8), (4, 2, 12), (3, 3, 6),
                                   (4, 2, 6), (4, 3, 9), (4, 2, 10), (3, 2, 5), (8, 2, 12)])
def test_memory_model_in_flight_count_is_the_generated_orders_peak(name, p, v, m):
    """The memory model's microbatches in flight per rank (inflight) equal the peak of forwards run minus
    backwards run in the order the generator emits, over v — for m = p (Megatron's all-forwards-first case)
    and m not a multiple of p too."""
    from planner.schedules import SCHEDULES

    kind = SCHEDULES[name]
    v = v if name == "interleaved" else 1
    sched = kind.generate(p, m, v)
    for r, acts in enumerate(sched.ranks):
        live = peak = 0
        for a in acts:
            live += {Op.F: 1, Op.B: -1}.get(a.op, 0)
            peak = max(peak, live)
        assert kind.inflight(p, v, m, r) == pytest.approx(peak / v), (r, peak)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (4, 2, 4), (4, 3, 9), (4, 2, 10), (3, 2, 5), (8, 2, 12), (8, 4, 32),
                                   (16, 2, 32)])
def test_each_chunks_in_flight_microbatches_are_the_generated_orders(p, v, m):
    """interleaved.chunk_peaks: for any bytes per microbatch of each chunk, the most a rank holds after a forward of
    the generated order is the most over the returned peaks, each peak is reached, and the largest total is the
    rank's inflight (so a rank whose chunks keep alike needs what it needed before)."""
    import random

    from planner.schedule_ir import placement_of
    from planner.schedules.interleaved import chunk_peaks

    kind = SCHEDULES["interleaved"]
    sched = kind.generate(p, m, v)
    for r, acts in enumerate(sched.ranks):
        local = {s: c for c, s in enumerate(placement_of("loop", p, v).stages(r))}
        live, states = [0] * v, set()
        for a in acts:
            if a.op in (Op.F, Op.B):
                live[local[a.stage]] += 1 if a.op == Op.F else -1
                if a.op == Op.F:
                    states.add(tuple(live))
        peaks = chunk_peaks(p, v, m, r)
        rng = random.Random(r)
        units = [[float(i == c) for i in range(v)] for c in range(v)]  # bytes per microbatch of each chunk
        for w in units + [[rng.random() for _ in range(v)] for _ in range(50)]:
            most = [max(sum(a * b for a, b in zip(w, x)) for x in xs) for xs in (peaks, states)]
            assert most[0] == pytest.approx(most[1]), (r, w)
        assert {tuple(int(x) for x in pk) for pk in peaks} <= states
        assert max(sum(pk) for pk in peaks) == pytest.approx(kind.inflight(p, v, m, r) * v)


def test_a_ranks_memory_counts_each_chunk_at_its_own_microbatches():
    """p=8 v=4 m=128: rank 0's first chunk holds 15 or 16 microbatches at its peak, the others 8 or fewer. With the
    embedding alone in the first chunk and a block in each other, the rank holds the most over its peaks of each
    chunk's count times its bytes, not the average count times the sum."""
    from costmodels.hardware import Hardware
    from costmodels.memory import activation_bytes, stage_memory
    from passes.pipeline import analyze
    from planner.config import ParallelConfig
    from planner.schedules.interleaved import chunk_peaks
    from targets.registry import get_target
    from tests.conftest import EXAMPLES

    units = analyze(EXAMPLES / "gpt.py", {"layers": 4, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128})[0].units
    chunks = [units[0], *[u for u in units if u.kind == "block"][:3]]
    cfg = ParallelConfig(tp=1, pp=8, dp=1, b=1, m=128, v=4, schedule="interleaved")
    hw = Hardware(target=get_target("a100-80gb"))
    exact = stage_memory(chunks, hw, cfg, 0, chunks=[1, 1, 1, 1]).activations
    a = [activation_bytes(u, cfg) for u in chunks]
    assert a[0] < a[1]
    assert exact == pytest.approx(max(sum(n * x for n, x in zip(pk, a)) for pk in chunk_peaks(8, 4, 128, 0)))
    assert exact < stage_memory(chunks, hw, cfg, 0).activations  # the average charges the embedding's count to all
