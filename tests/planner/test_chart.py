"""`planner chart`: legible at p=2 and p=32 — the legend outside the ranks, labels clear of the fill, and what
cannot be drawn apart aggregated, with a note on the chart saying so."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="charts need matplotlib")

from planner.api import make_plan  # noqa: E402
from planner.chart import draw_plan, figure  # noqa: E402
from planner.fill.spec import load_fill_spec  # noqa: E402
from planner.search import Pins  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402


@pytest.fixture(scope="module")
def small():
    """p=2 with the example fill jobs in its bubbles."""
    return make_plan(str(EXAMPLES / "gpt.py"), gpus=16, global_batch=32, target="a100-80gb",
                     fill=load_fill_spec(EXAMPLES / "fill" / "jobs.yaml"),
                     pins=Pins(pp=2, tp=8, schedule="gpipe", recompute="full"))[0]


@pytest.fixture(scope="module")
def wide():
    """p=32, m=256: more intervals per rank than the chart's width can show apart."""
    return make_plan(str(EXAMPLES / "gpt.py"), gpus=2048, global_batch=2048, target="a100-80gb",
                     model_args={"preset": "310b"},
                     pins=Pins(tp=8, pp=32, b=1, schedule="1f1b", recompute="full", sp=True, cp=1))[0]


def _boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    return ax, renderer, ax.get_window_extent(renderer)


def test_the_legend_and_the_note_sit_below_the_ranks(small, wide):
    for plan in (small, wide):
        fig, _ = figure(plan)
        ax, renderer, axes_box = _boxes(fig)
        legend = fig.legends[0].get_window_extent(renderer)
        assert legend.y1 <= axes_box.y0  # display coordinates grow upwards: the legend is under the axes
        assert not ax.get_legend()


def test_bubble_labels_sit_above_the_fill_chunks(small):
    fig, _ = figure(small)
    ax = fig.axes[0]
    fill = [p for p in ax.patches if p.get_hatch() == "//"]
    assert fill and ax.texts
    for text in ax.texts:
        _, y = text.get_position()
        rank = round(y + 0.2)
        rows = [p for p in fill if abs(p.get_y() + p.get_height() / 2 - (rank + 0.2)) < 1e-9]
        assert all(p.get_y() > y for p in rows)  # the fill fills the lower half of the bar, the label the upper


def test_what_cannot_be_drawn_apart_is_aggregated_and_said(wide, small, tmp_path):
    fig, note = figure(wide)
    ax = fig.axes[0]
    assert ax.images and not ax.texts  # one column per pixel pair mixes each rank's work and bubbles
    assert "more than the chart can show apart" in note and "columns" in note
    assert any(note.split(";")[0][:40] in t.get_text().replace("\n", " ") for t in fig.texts)
    _, small_note = figure(small)
    assert "more than the chart can show apart" not in small_note
    path = tmp_path / "chart.png"
    assert draw_plan(wide, str(path)) == note and path.stat().st_size > 10_000


@pytest.mark.parametrize("p", [8, 32])
def test_at_p8_and_p32_a_bubbles_filled_share_is_drawn_in_the_fills_colour(p):
    """Issue 22: charts show fill at p = 8 and 32 too, where each column is a mix: the filled share of a bubble is
    drawn in the fill's colour instead of the bubble's."""
    import numpy as np

    from planner.chart import _binned, _filled, plan_simulation

    plan = make_plan(str(EXAMPLES / "gpt.py"), gpus=8 * p, global_batch=256, target="a100-80gb",
                     fill=load_fill_spec(EXAMPLES / "fill" / "jobs.yaml"),
                     pins=Pins(tp=8, pp=p, b=1, schedule="1f1b", recompute="selective", sp=True))[0]
    filled = _filled(plan)
    assert filled and all(0 < share <= 1 for share in filled.values())
    assert {r for r, _ in filled} == {c.rank for c in plan.fill.chunks}
    sim = plan_simulation(plan)
    with_fill, without = _binned(sim, p, 200, filled), _binned(sim, p, 200)
    changed = {r for r in range(p) if not np.allclose(with_fill[r], without[r])}
    assert changed == {r for r, _ in filled}
    _, note = figure(plan)
    assert "the share fill runs in as fill" in note
