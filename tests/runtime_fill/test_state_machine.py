"""FreeRide's side-task state machine (§3.1, Figure 3a): five states, six transitions, nothing else."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.runtime.fill_executor import (TRANSITIONS, FillExecutorOptions, IllegalTransition, Occurrence,
                                           SideTaskState, State, Transition)

LEGAL = {
    (State.SUBMITTED, Transition.CREATE): State.CREATED,
    (State.CREATED, Transition.INIT): State.PAUSED,
    (State.PAUSED, Transition.START): State.RUNNING,
    (State.RUNNING, Transition.RUN_NEXT_STEP): State.RUNNING,
    (State.RUNNING, Transition.PAUSE): State.PAUSED,
    (State.CREATED, Transition.STOP): State.STOPPED,
    (State.PAUSED, Transition.STOP): State.STOPPED,
    (State.RUNNING, Transition.STOP): State.STOPPED,
}


def test_the_six_transitions_have_freerides_names() -> None:
    assert [t.value for t in Transition] == ["CreateSideTask", "InitSideTask", "StartSideTask", "RunNextStep",
                                             "PauseSideTask", "StopSideTask"]
    assert [s.value for s in State] == ["SUBMITTED", "CREATED", "PAUSED", "RUNNING", "STOPPED"]
    table = {(src, tr): dst for tr, (srcs, dst) in TRANSITIONS.items() for src in srcs}
    assert table == LEGAL


def test_a_side_task_life_cycle_is_logged() -> None:
    task = SideTaskState(job="mlp")
    for tr in (Transition.CREATE, Transition.INIT, Transition.START, Transition.RUN_NEXT_STEP,
               Transition.RUN_NEXT_STEP, Transition.PAUSE, Transition.START, Transition.STOP):
        task.apply(tr, reason=f"because {tr.value}")
    assert task.state is State.STOPPED
    assert [(e["transition"], e["from"], e["to"]) for e in task.log] == [
        ("CreateSideTask", "SUBMITTED", "CREATED"), ("InitSideTask", "CREATED", "PAUSED"),
        ("StartSideTask", "PAUSED", "RUNNING"), ("RunNextStep", "RUNNING", "RUNNING"),
        ("RunNextStep", "RUNNING", "RUNNING"), ("PauseSideTask", "RUNNING", "PAUSED"),
        ("StartSideTask", "PAUSED", "RUNNING"), ("StopSideTask", "RUNNING", "STOPPED")]
    assert all(e["job"] == "mlp" and e["reason"].startswith("because") for e in task.log)
    assert [e["t"] for e in task.log] == sorted(e["t"] for e in task.log)


@pytest.mark.parametrize(("state", "transition"),
                         [p for p in itertools.product(State, Transition) if p not in LEGAL])
def test_illegal_transitions_raise_and_change_nothing(state: State, transition: Transition) -> None:
    task = SideTaskState(job="j", state=state)
    assert not task.can(transition)
    with pytest.raises(IllegalTransition, match=f"{transition.value} is not allowed from {state.value}"):
        task.apply(transition)
    assert task.state is state and task.log == []


def test_tasks_share_one_log() -> None:
    log: list[dict] = []
    a, b = SideTaskState(job="a", log=log), SideTaskState(job="b", log=log)
    a.apply(Transition.CREATE)
    b.apply(Transition.CREATE)
    b.apply(Transition.STOP, reason="failed: boom")
    assert [(e["job"], e["transition"]) for e in log] == [("a", "CreateSideTask"), ("b", "CreateSideTask"),
                                                          ("b", "StopSideTask")]


@given(st.lists(st.sampled_from(list(Transition)), max_size=30))
def test_any_sequence_replays_from_its_log(seq: list[Transition]) -> None:
    task = SideTaskState(job="j")
    for tr in seq:
        before = task.state
        if (before, tr) in LEGAL:
            assert task.apply(tr) is LEGAL[(before, tr)]
        else:
            with pytest.raises(IllegalTransition):
                task.apply(tr)
            assert task.state is before
    state = State.SUBMITTED
    for entry in task.log:
        assert entry["from"] == state.value
        state = LEGAL[(state, Transition(entry["transition"]))]
    assert state is task.state


def test_pause_points_of_a_bubble() -> None:
    occ = Occurrence(bubble_id=3, seq=1, duration_s=0.4, free_bytes=1, called_at=100.0, start_wall=100.0,
                     start_mono=10.0, margin=0.25, jobs=[], planned_units={})
    assert occ.pause_mono() == pytest.approx(10.4) and occ.sigstop_mono() == pytest.approx(10.3)
    occ.end_mono = 10.1  # the main job resumed early: pause now
    assert occ.pause_mono() == pytest.approx(10.1) and occ.sigstop_mono() == pytest.approx(10.1)
    d = occ.to_dict()
    assert d["deadline"] == pytest.approx(100.4) and d["usable_until"] == pytest.approx(100.3)


def test_options_are_checked() -> None:
    assert FillExecutorOptions(interface={"a": "imperative"}).interface_of("a") == "imperative"
    assert FillExecutorOptions().interface_of("b") == "iterative"
    with pytest.raises(ValueError, match="iterative"):
        FillExecutorOptions(interface={"a": "threaded"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="step_safety=0.5"):
        FillExecutorOptions(step_safety=0.5)


def test_a_slow_observation_relaxes_back_to_the_profile():
    """One inflated timing must not hold a unit (and the stream behind it) out of every bubble."""
    from planner.plan import FillJob
    from planner.runtime.fill_executor import TaskHandle, TaskOptions

    job = FillJob(name="j", model_file="m.py", model_sha256="", model_args={}, kind="infer", batch_size=1,
                  config="plain", units=["F:a", "F:b"], unit_time_s=[1e-3, 2e-3], resident=True)
    handle = TaskHandle(job, TaskOptions(device="cpu", interface="iterative", iterations=None), [])
    handle.profile = [1e-3, 2e-3]
    handle.observed = {0: 9e-3}
    handle.relax(2)  # position 2 is unit 0 of the second iteration
    assert handle.observed[0] == pytest.approx(5e-3)
    for _ in range(20):
        handle.relax(0)
    assert handle.observed[0] == pytest.approx(1e-3, rel=1e-3)
    handle.relax(1)  # never observed: nothing to relax
    assert 1 not in handle.observed
