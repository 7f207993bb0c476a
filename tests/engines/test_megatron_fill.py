"""Fill inside Megatron-LM's pipeline bubbles (issue 48): megatron-core's own schedule functions
(forward_backward_pipelining_without_interleaving / with_interleaving) run in one CPU process, one pipeline rank at
a time, with the model steps, the process groups and `P2PCommunicator._communicate` stubbed, and the fill adapter
(planner/engines/megatron_fill.py) attached as in a run. The stub numbers each receive in its direction and hands
out tensors holding that number; the stub forward and backward steps read it back, so the test knows which stage and
microbatch each receive fed, as Megatron queued it.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.api import make_plan
from planner.engines.megatron_fill import MegatronFill, _calls_1f1b, _calls_interleaved, bubble_receives, main
from planner.plan import Plan, save_plan
from planner.schedules.interleaved import group_size
from planner.search import Pins
from tests.runtime._util import ROOT, gpt_args

pytest.importorskip("megatron.core.pipeline_parallel.schedules")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication, schedules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated")

PLANS = {"p2": (2, 1, "1f1b"), "p4": (4, 1, "1f1b"), "i2": (2, 2, "interleaved")}
LAUNCHED: dict[str, Any] = {}
"""What the launcher test's script reads: the stubbed Megatron it steps, and the argv it saw."""


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    out = {}
    for name, (p, v, schedule) in PLANS.items():
        out[name], _ = make_plan(str(ROOT / "examples" / "gpt.py"), gpus=p, global_batch=16,
                                 target=str(ROOT / "examples" / "targets" / "cpu-core.yaml"), gpus_per_node=p,
                                 model_args=gpt_args(),
                                 pins=Pins(tp=1, pp=p, dp=1, b=2, v=v, schedule=schedule, recompute="none",
                                           precision="fp32"))
    return out


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Work:
    """A receive's request under overlap_p2p_comm: its wait is where the receive completes."""

    def __init__(self, log: list, received: tuple[str, int]) -> None:
        self.log, self.received = log, received

    def wait(self) -> None:
        self.log.append(("recv", [self.received]))


class _Megatron:
    """One pipeline rank of megatron-core's schedules, stubbed around the receives (monkeypatch: undone after)."""

    def __init__(self, mp: pytest.MonkeyPatch, p: int, r: int, v: int, m: int, g: int, overlap: bool) -> None:
        self.p, self.r, self.v, self.m = p, r, v, m
        self.log: list[tuple[str, Any]] = []
        self.fed: dict[tuple[str, int], tuple[int, int]] = {}
        """(direction, n): the n-th receive in that direction -> (model chunk, microbatch) it fed."""
        self.count = count = {"F": 0, "B": 0}
        log, fed = self.log, self.fed

        def communicate(comm: Any, *, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool,
                        tensor_shape: Any, wait_on_reqs: bool = True) -> tuple:
            got = []
            for flag, direction in ((recv_prev, "F"), (recv_next, "B")):
                if flag:
                    got.append((direction, count[direction]))
                    count[direction] += 1
            tensors = {d: torch.full(tensor_shape, float(n)) for d, n in got}
            reqs = {}
            if wait_on_reqs and got:
                log.append(("recv", got))
            elif got:
                reqs = {("recv_prev" if d == "F" else "recv_next"): _Work(log, (d, n)) for d, n in got}
            return tensors.get("F"), tensors.get("B"), reqs

        def first(x: Any) -> Any:
            return x[0] if isinstance(x, list) else x

        def forward_step(*args: Any, current_microbatch: int, vp_stage: int | None = None, **kwargs: Any) -> tuple:
            if (received := first(args[4])) is not None:
                fed["F", int(received.flatten()[0])] = (vp_stage or 0, current_microbatch)
            return torch.tensor([(vp_stage or 0) * 1000.0 + current_microbatch]), torch.zeros([], dtype=torch.int)

        def backward_step(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, *args: Any) -> Any:
            if (received := first(output_tensor_grad)) is not None:
                fed["B", int(received.flatten()[0])] = divmod(int(output_tensor[0]), 1000)
            return torch.zeros(1)

        zeros = torch.zeros
        group, one = _Group(r, p), _Group(0, 1)
        mp.setattr(p2p_communication.P2PCommunicator, "_communicate", communicate)
        mp.setattr(schedules, "forward_step", forward_step)
        mp.setattr(schedules, "backward_step", backward_step)
        mp.setattr(torch, "zeros", lambda *a, device=None, **kw: zeros(*a, **kw))  # the schedules count on cuda
        mp.setattr(dist, "is_initialized", lambda: True)
        mp.setattr(dist, "get_global_rank", lambda g, rank: rank)
        mp.setattr(dist, "barrier", lambda group=None: log.append(("barrier", "world" if group is None else "pp")))
        for name, value in (("get_pipeline_model_parallel_group", group), ("get_tensor_model_parallel_group", one),
                            ("get_context_parallel_group", one), ("get_embedding_group", None),
                            ("get_position_embedding_group", None), ("get_data_parallel_group", one)):
            mp.setattr(parallel_state, name, lambda *a, _v=value, **kw: _v)
        self.config = TransformerConfig(num_layers=2 * p * v, hidden_size=4, num_attention_heads=1,
                                        pipeline_model_parallel_size=p, pipeline_dtype=torch.float32,
                                        virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                        microbatch_group_size_per_vp_stage=g, overlap_p2p_comm=overlap,
                                        batch_p2p_comm=not overlap)
        self.chunks = []
        for _ in range(v):
            chunk = torch.nn.Module()
            chunk.config, chunk.model_type = self.config, ModelType.encoder_or_decoder
            self.chunks.append(chunk)

    def step(self, forward_only: bool = False) -> None:
        """One call of the schedule Megatron's get_forward_backward_func picks (the adapter's, once attached)."""
        self.count.update(F=0, B=0)
        fn = schedules.get_forward_backward_func(self.p, self.v if self.v > 1 else None)
        fn(forward_step_func=None, data_iterator=[None] * self.v if self.v > 1 else None,
           model=self.chunks if self.v > 1 else self.chunks[0], num_microbatches=self.m, seq_length=3,
           micro_batch_size=2, forward_only=forward_only)


class _Hooks:
    """A fill client that logs the bubbles it is told of."""

    def __init__(self, log: list) -> None:
        self.log = log

    def bubble_begin(self, bubble_id: int, duration_s: float, free_bytes: int, ready: Any = None) -> None:
        self.log.append(("begin", bubble_id))

    def bubble_end(self, bubble_id: int) -> None:
        self.log.append(("end", bubble_id))

    def report(self, timeout_s: float = 60.0) -> dict:
        return {"filled": True}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("name,overlap", [("p2", False), ("p4", False), ("i2", False), ("i2", True)])
def test_bubbles_begin_at_the_receives_megatron_makes(plans: dict[str, Plan], name: str, overlap: bool) -> None:
    plan = plans[name]
    c = plan.config
    for r in range(c.pp):
        stages = sorted(s.stage for s in plan.partition if s.rank == r)
        receives = bubble_receives(plan, r, overlap_p2p_comm=overlap)
        ordinal = {d: [x for x in receives if x.direction == d] for d in "FB"}
        expected = {x.bubble: (x.direction, ordinal[x.direction].index(x))
                    for x in receives if x.bubble is not None}
        ids = sorted(b.id for b in plan.bubbles if b.rank == r)
        (trailing,) = set(ids) - set(expected) or {None}
        with pytest.MonkeyPatch.context() as mp:
            megatron = _Megatron(mp, c.pp, r, c.vp, c.microbatches, group_size(c.pp, c.microbatches), overlap)
            client = SimpleNamespace(start=lambda *a, **kw: _Hooks(megatron.log))
            fill = MegatronFill(plan, device="cpu", global_rank=r, client=client).attach()
            try:
                megatron.step()
                evaluation = len(megatron.log)
                megatron.step(forward_only=True)
                assert not [e for e in megatron.log[evaluation:] if e[0] in ("begin", "barrier")]
                megatron.fed.clear()
                start = len(megatron.log)
                megatron.step()
                report = fill.report()
            finally:
                fill.close()
            assert not hasattr(p2p_communication.P2PCommunicator._communicate, "__wrapped__")  # detached
        where = f"{name} rank {r}"
        # what each receive fed, as Megatron queued it, is what the mapping says
        for d, xs in ordinal.items():
            assert [(x.stage, x.microbatch) for x in xs] == [
                (stages[chunk], mb) for chunk, mb in (megatron.fed[d, n] for n in range(len(xs)))], where
        # step 1 (with fill): each bubble begun once, right before the receive the mapping predicts, ended after it
        step1 = megatron.log[start:]
        assert step1[0] == ("barrier", "world"), where
        begun = [(i, e[1]) for i, e in enumerate(step1) if e[0] == "begin"]
        assert sorted(b for _, b in begun) == ids, where
        for i, bubble in begun:
            if bubble == trailing:
                assert step1[i + 1:] == [("barrier", "pp"), ("end", bubble)], where
            else:
                assert step1[i + 1][0] == "recv" and expected[bubble] in step1[i + 1][1], where
                assert step1[i + 2] == ("end", bubble), where
        if trailing is None:
            assert step1[-1] == ("barrier", "pp"), where
        if not overlap:  # the replayed calls are Megatron's
            calls = [e[1] for e in step1 if e[0] == "recv"]
            assert [[d for d, _ in call] for call in calls] == [
                [x.direction for x in receives if x.call == k] for k in range(len(calls))], where
        assert [s["fill"] for s in report["steps"]] == [False, True]
        for s in report["steps"]:
            assert sorted(b["id"] for b in s["bubbles"]) == ids, where
        assert report["fill_report"] == {"filled": True} and report["rank"] == r


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (2, 2), (3, 2), (4, 3)])
def test_replayed_calls_are_megatrons(p: int, v: int) -> None:
    """The replay of the schedules' receiving calls against megatron-core's own functions, beyond the plans above:
    few microbatches (every one in the warm-up), groups longer than p."""
    for m in range(p if v > 1 else 1, 2 * p + 3):
        for g in range(p, m + 1) if v > 1 else (1,):
            if v > 1 and 0 < m % g < p:
                continue  # Megatron refuses a last group shorter than p
            for r in range(p):
                with pytest.MonkeyPatch.context() as mp:
                    megatron = _Megatron(mp, p, r, v, m, g, overlap=False)
                    megatron.step()
                got = [[d for d, _ in e[1]] for e in megatron.log if e[0] == "recv"]
                calls = _calls_interleaved(p, r, v, m, g) if v > 1 else _calls_1f1b(p, r, m)
                assert got == [[d for d, _ in call] for call in calls], (p, v, m, g, r)


def test_bubbles_megatron_cannot_mark_are_refused(plans: dict[str, Plan]) -> None:
    plan = plans["p2"]
    actions = [list(a) for a in plan.actions]
    actions[0][actions[0].index("BUBBLE0")] = "0RECV_F9"
    actions[0].insert(0, "BUBBLE0")
    edited = plan.model_copy(update={"actions": actions})
    with pytest.raises(ValueError, match="pipeline rank 0: bubble 0 precedes 0F0, not a receive"):
        bubble_receives(edited, 0)
    actions[0][:2] = ["BUBBLE0", "0RECV_F9", "0F0"]
    with pytest.raises(ValueError, match="pipeline rank 0: bubble 0 precedes 0RECV_F9, which Megatron-Core's"):
        bubble_receives(plan.model_copy(update={"actions": actions}), 0)
    # interleaved without p2p overlap: one call waits a forward and a backward receive; a bubble before each
    plan = plans["i2"]
    receives = bubble_receives(plan, 0)
    call = next(k for k, n in Counter(x.call for x in receives).items() if n == 2)
    order = list(plan.actions[0])
    for i, x in enumerate(x for x in receives if x.call == call):
        recv = f"{x.stage}RECV_{x.direction}{x.microbatch}"
        if x.bubble is None:
            order.insert(order.index(recv), f"BUBBLE{90 + i}")
    both = plan.model_copy(update={"actions": [order, *plan.actions[1:]]})
    with pytest.raises(ValueError, match="pipeline rank 0: bubbles .* end at one Megatron receive"):
        bubble_receives(both, 0)
    assert sum(x.bubble is not None for x in bubble_receives(both, 0, overlap_p2p_comm=True) if x.call == call) == 2


def test_megatron_without_the_receive_is_refused(plans: dict[str, Plan], monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core

    monkeypatch.delattr(p2p_communication.P2PCommunicator, "_communicate")
    with pytest.raises(RuntimeError) as err:
        MegatronFill(plans["p2"], client=None).attach()
    message = str(err.value)
    assert message.startswith(f"megatron-core {megatron.core.__version__} has no P2PCommunicator._communicate")
    assert "\n" not in message and message.count(". ") == 0
    assert not hasattr(schedules.forward_backward_pipelining_without_interleaving, "__wrapped__")


def test_launcher_runs_the_script_with_the_adapter(plans: dict[str, Plan], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m planner.engines.megatron_fill PLAN script ARGS`: the script runs as __main__ with its argv, the
    adapter resolves its rank at the first training step, and each rank's report lands in --out."""
    plan = plans["p2"]
    save_plan(plan, tmp_path / "plan.json")
    script = tmp_path / "pretrain.py"
    script.write_text("import sys\nfrom tests.engines.test_megatron_fill import LAUNCHED\n"
                      "if __name__ == '__main__':\n    LAUNCHED['argv'] = sys.argv\n"
                      "    LAUNCHED['megatron'].step()\n    LAUNCHED['megatron'].step()\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("RANK", "1")
    LAUNCHED["megatron"] = _Megatron(monkeypatch, 2, 1, 1, plan.config.microbatches, 2, overlap=False)
    assert main(["--out", str(tmp_path / "fill"), str(tmp_path / "plan.json"), str(script), "--lr", "1"]) == 0
    assert LAUNCHED.pop("argv") == [str(script), "--lr", "1"]
    report = json.loads((tmp_path / "fill" / "rank1.json").read_text())
    assert report["rank"] == 1 and [s["step"] for s in report["steps"]] == [0, 1]
    assert [b["id"] for b in report["steps"][1]["bubbles"]] == [0, 1]  # rank 1: the first receive, the trailing one
    assert not hasattr(schedules.forward_backward_pipelining_without_interleaving, "__wrapped__")
