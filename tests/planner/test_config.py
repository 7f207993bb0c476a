"""ParallelConfig: its rules (each message carries the numbers) and its one converter to and from the plan file."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.precision import PRECISIONS
from costmodels.recompute import RECOMPUTE
from passes.errors import UserError
from planner.config import ConfigError, ParallelConfig
from planner.plan import ConfigModel, load_plan, save_plan
from planner.schedules import SCHEDULES


@st.composite
def configs(draw: st.DrawFn) -> ParallelConfig:
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    pp = draw(st.integers(2 if SCHEDULES[schedule].split_backward else 1, 8))  # zero bubble fills a pipeline
    v = draw(st.sampled_from(list(SCHEDULES[schedule].v_choices(pp, 4)) or [1]))
    m = pp * draw(st.integers(2 if schedule == "zbv" else 1, 8))  # zbv fills its V with 2p-1 or more
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    return ParallelConfig(tp=tp, pp=pp, dp=draw(st.integers(1, 64)), cp=draw(st.sampled_from([1, 2, 4])),
                          sp=tp > 1 and draw(st.booleans()), zero=draw(st.sampled_from([0, 1, 2, 3])),
                          b=draw(st.integers(1, 16)), m=m, v=v, recompute=draw(st.sampled_from(sorted(RECOMPUTE))),
                          schedule=schedule, precision=draw(st.sampled_from(sorted(PRECISIONS))))


@settings(max_examples=150, deadline=None)
@given(configs())
def test_config_round_trips_through_the_plan_file_model(c: ParallelConfig) -> None:
    model = ConfigModel.of(c)
    assert model.to_config() == c
    assert ConfigModel.model_validate_json(model.model_dump_json()).to_config() == c
    assert c.world == c.tp * c.cp * c.dp * c.pp and c.global_batch == c.dp * c.b * c.m
    assert c.optimizer_shards == (c.dp * c.cp if c.zero else 1)


BASE = dict(tp=2, pp=4, dp=2, b=1, m=8)


@pytest.mark.parametrize(("change", "words"), [
    ({"tp": 0}, ["tp must be a positive integer", "got 0"]),
    ({"m": -3}, ["m must be a positive integer", "got -3"]),
    ({"b": 1.5}, ["b must be a positive integer", "got 1.5"]),
    ({"sp": True, "tp": 1}, ["sequence parallelism", "tp > 1", "tp=1"]),
    ({"zero": 4}, ["zero must be one of 0, 1, 2, 3", "got 4"]),
    ({"recompute": "some"}, ["'some'", "none, selective, full"]),
    ({"precision": "fp8"}, ["'fp8'", "bf16"]),
    ({"schedule": "zigzag"}, ["'zigzag'", "gpipe", "interleaved"]),
    ({"schedule": "gpipe", "v": 2}, ["pp=4", "v=2", "one model chunk"]),
    ({"schedule": "interleaved", "v": 2, "m": 3}, ["pp=4", "m=3", "at least p microbatches"]),
])
def test_every_rule_names_the_numbers(change: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**{**BASE, **change})
    assert all(w in str(err.value) for w in words), str(err.value)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)


def test_config_is_frozen_and_prints_like_the_cli() -> None:
    c = ParallelConfig(tp=8, pp=64, dp=6, b=1, m=512, v=2, recompute="full", schedule="interleaved")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tp = 4  # type: ignore[misc]
    assert str(c) == "t=8 p=64 d=6 b=1 m=512 v=2 interleaved recompute=full"
    assert "cp=2 sp zero=1" in str(dataclasses.replace(c, cp=2, sp=True, zero=1))


def test_a_plan_file_with_an_impossible_config_is_refused_with_the_rule(tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan = _plan_with(tmp_path)
    save_plan(plan, path)
    text = path.read_text().replace('"schedule": "1f1b"', '"schedule": "gpipe"').replace('"vp": 1', '"vp": 3')
    path.write_text(text)
    with pytest.raises(UserError, match=r"field config: .*gpipe runs one model chunk per rank"):
        load_plan(path)


def _plan_with(tmp_path):
    from planner.api import make_plan
    from planner.search import Pins
    from tests.conftest import EXAMPLES

    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=2, global_batch=4, target="a100-80gb", gpus_per_node=2,
                        model_args={"preset": "tiny", "layers": 2}, plan_path=str(tmp_path / "plan.json"),
                        pins=Pins(tp=1, pp=2, dp=1, b=1, schedule="1f1b", recompute="none"))
    return plan


@settings(max_examples=100, deadline=None)
@given(configs(), st.sampled_from([{"recompute": "block"}, {"zero": 2}, {"zero": 3}]))
def test_a_fallback_is_the_configuration_replace_would_make(c: ParallelConfig, change: dict) -> None:
    """ParallelConfig.fallback (the search's cheap copy, checking only the fields it changes) equals, and hashes as,
    dataclasses.replace, which checks every rule again."""
    extra = {"recompute_layers": 0} if "recompute" in change else {}
    made, checked = c.fallback(**change), dataclasses.replace(c, **change, **extra)
    assert made == checked and hash(made) == hash(checked) and str(made) == str(checked)
    with pytest.raises(ConfigError, match="zero must be one of 0, 1, 2, 3, got 5"):
        c.fallback(zero=5)
