"""A partition stated as Megatron-Core states it (planner.layout): its layout string or its default even split, read
onto the model's units, searched only at that stage count, and written back by the export as it was stated."""
from __future__ import annotations

import pytest

from passes.errors import UserError
from planner.api import make_plan
from planner.export import to_megatron
from planner.layout import layout_bounds, layout_stages
from planner.search import Pins
from tests.conftest import EXAMPLES

KINDS = ["embedding"] + ["block"] * 61 + ["head"]  # DeepSeek-V3's units


def test_megatrons_own_example_and_the_deepseek_layout_read_as_megatron_reads_them():
    """pipeline_parallel_layer_layout.py's docstring example "Ettt|(tt|)*29,m|L": 32 stages, the embedding and 3
    layers, 29 of 2, an MTP stage and the loss; the planner prices multi-token prediction with the loss, so a stage
    of it alone is refused in one sentence."""
    assert layout_stages("Ettt|(tt|)*29,m|L") == 32
    with pytest.raises(UserError, match=r"multi-token prediction \(m\) in a stage without the loss"):
        layout_bounds("Ettt|(tt|)*29,m|L", ["embedding"] + ["block"] * 61 + ["head"], 32)
    with pytest.raises(UserError, match="no layer of this model"):
        layout_bounds("Ettt|(tt|)*29,|L", ["embedding"] + ["block"] * 61 + ["head"], 32)
    bounds = layout_bounds("Et|(tt|)*30mL", KINDS, 32)  # Megatron-Bridge's DeepSeek-V3 on H100, p8 v4
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [2] + [2] * 30 + [1]


def test_the_even_layout_is_megatrons_default():
    """Without a layout Megatron splits the layers evenly over the p*v virtual stages, the embedding with the first
    and the loss with the last, and refuses layers that do not divide."""
    assert layout_bounds("even", ["embedding"] + ["block"] * 8 + ["head"], 4) == (0, 3, 5, 7, 10)
    assert layout_bounds("even", ["embedding"] + ["block"] * 8 + ["head"], 1) == (0, 10)
    with pytest.raises(UserError, match="do not divide"):
        layout_bounds("even", ["embedding"] + ["block"] * 8 + ["head"], 3)


@pytest.mark.parametrize("layout, match", [("Et|tx|L", "not one of"), ("Et|tt|tL", "places 1 embedding, 4 layers"),
                                            ("Et|ttL", "states 2 virtual stages"), ("tE|tt|L", "embedding first")])
def test_a_layout_that_does_not_fit_the_model_is_one_sentence(layout, match):
    with pytest.raises(UserError, match=match):
        layout_bounds(layout, ["embedding"] + ["block"] * 3 + ["head"], 3)


def test_a_stated_layout_is_planned_and_exported_as_stated(tmp_path):
    """GPT with 6 layers on 4 GPUs, p2 v2: only that stage count is searched, the plan's partition is the layout's,
    and Megatron's launch states it back."""
    layout = "Ett|t|tt|tL"
    plan, res = make_plan(str(EXAMPLES / "gpt.py"), gpus=4, global_batch=8, target="h100-sxm",
                          model_args={"layers": 6, "hidden": 256, "heads": 4, "seq": 128, "vocab": 1024},
                          pins=Pins(pp=2, tp=1, layout=layout, engine="megatron"), plan_path=str(tmp_path / "p.json"))
    assert res.best.config.stages == 4 and res.best.bounds == (0, 3, 4, 6, 8)
    assert f"--pipeline-model-parallel-layout {layout}" in " ".join(to_megatron(plan).argv)
    with pytest.raises(UserError, match="states 4 virtual stages"):
        Pins(pp=2, v=3, layout=layout)


def test_the_cli_takes_a_layout_and_refuses_a_wrong_one_in_a_sentence(tmp_path):
    from typer.testing import CliRunner

    from planner.cli import app

    args = ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "4", "--gpus-per-node", "4", "--model-arg", "layers=6",
            "--tp", "1", "--pp", "2", "-o", str(tmp_path / "p.json")]
    res = CliRunner().invoke(app, [*args, "--pipeline-layout", "Ett|t|tt|tL"])
    assert res.exit_code == 0, res.stdout
    res = CliRunner().invoke(app, [*args, "--pipeline-layout", "Ett|t|tt|ttL"])
    out = res.stdout + (res.stderr or "")
    assert res.exit_code != 0 and "places 1 embedding, 7 layers and 1 loss; the model has 1, 6 and 1" in out, out
    assert "Traceback" not in out
    res = CliRunner().invoke(app, [*args, "--pipeline-layout", "Ett|t|tt|tt|L"])
    assert res.exit_code != 0 and "states 5 virtual stages, not a multiple of --pp 2" in res.stdout + (res.stderr or "")
