"""The plan file: schema drift, round trip, validation on load, launch commands."""
from __future__ import annotations

import json

import pytest

from passes.errors import UserError
from planner.api import make_plan
from planner.plan import SCHEMA, Plan, json_schema, load_plan, save_plan
from tests.conftest import EXAMPLES, ROOT

SCHEMA_FILE = ROOT / "schemas" / "plan.schema.json"


def test_exported_json_schema_has_not_drifted(regen):
    current = json.dumps(json_schema(), indent=1, sort_keys=True) + "\n"
    if regen:
        SCHEMA_FILE.write_text(current)
    assert SCHEMA_FILE.read_text() == current, "plan schema changed: bump SCHEMA if needed, then --regen-golden"


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    plan, result = make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=16, target="a100-80gb",
                             model_args={"preset": "tiny", "layers": 4}, plan_path=str(out))
    save_plan(plan, out)
    return plan, result, out


def test_plan_round_trips_through_json(tiny_plan):
    plan, _, out = tiny_plan
    assert load_plan(out) == plan
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA
    assert Plan.model_validate(data) == plan


def test_plan_contents_are_consistent(tiny_plan):
    plan, result, _ = tiny_plan
    c = plan.config
    assert c.tp * c.pp * c.dp == 8 and c.dp * c.microbatch * c.microbatches == 16
    assert len(plan.partition) == c.pp * c.vp and len(plan.actions) == c.pp
    units = [u for s in plan.partition for u in s.units]
    assert units == [u for u in units]  # ordered, each once
    assert len(set(units)) == len(units)
    bubble_actions = sum(a.startswith("BUBBLE") for acts in plan.actions for a in acts)
    assert bubble_actions == len(plan.bubbles)
    assert len(plan.launch.commands) == plan.launch.nnodes == 1
    assert "--nproc-per-node 8" in plan.launch.commands[0] and "-m planner.runtime" in plan.launch.commands[0]
    assert len(plan.source.model_sha256) == 64


def test_unknown_fields_and_wrong_schema_are_rejected(tiny_plan, tmp_path):
    _, _, out = tiny_plan
    data = json.loads(out.read_text())
    data["config"]["surprise"] = 1
    bad = tmp_path / "extra.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match="config.surprise"):
        load_plan(bad)
    data = json.loads(out.read_text())
    data["schema"] = "fxplanner.plan/v0"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match="this planner reads"):
        load_plan(bad)
