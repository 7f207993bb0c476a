"""Gantt chart of one iteration per pipeline rank: forward, backward, communication, bubbles."""
from __future__ import annotations

import textwrap
from pathlib import Path

from passes.errors import UserError, write_atomic

from .plan import Plan, plan_schedule
from .simulate import SimCosts, SimResult, simulate

__all__ = ["plan_simulation", "draw_plan", "figure"]

COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#eeca3b", "comm": "#54a24b", "OPT": "#b279a2", "bubble": "#e45756",
          "fill": "#72b7b2"}


def plan_simulation(plan: Plan) -> SimResult:
    """Re-run the plan's simulation of its own action lists from the figures stored in it (no model needed)."""
    pr = plan.predictions
    costs = SimCosts(forward_s=tuple(s.forward_s for s in plan.partition),
                     backward_s=tuple(s.backward_s for s in plan.partition), p2p_s=pr.p2p_s,
                     allreduce_s=tuple(pr.allreduce_s), optimizer_s=tuple(pr.optimizer_s),
                     static_bytes=tuple(int(m.total - m.activations) for m in pr.memory),
                     activation_bytes=tuple(int(s.activation_bytes) for s in plan.partition),
                     capacity_bytes=int(pr.memory[0].capacity),
                     weight_s=tuple(s.weight_s for s in plan.partition),
                     weight_bytes=tuple(int(s.weight_bytes) for s in plan.partition))
    return simulate(plan_schedule(plan), costs)


def _color(action: str, kind: str) -> str:
    if kind == "bubble":
        return COLORS["bubble"]
    if kind == "comm":
        return COLORS["comm"]
    if action == "OPT":
        return COLORS["OPT"]
    op = action.lstrip("0123456789")[:1]
    return COLORS["W"] if op == "W" else COLORS["B"] if op in "BI" else COLORS["F"]


def _draw_fill(ax, plan: Plan, sim: SimResult, scale: float) -> None:
    """Fill chunks inside their bubbles (one iteration of the repeating cycle), in the lower half of the bar
    so that the bubble's label above stays readable; a paired job's (Waterwave) and a streamed one's (PipeSwitch)
    hatched apart."""
    if plan.fill is None:
        return
    where = {(b.rank, b.id): b for b in sim.bubbles}
    paired = {n: i for i, pair in enumerate(plan.fill.pairs) for n in pair.jobs}
    streamed = {j.name for j in plan.fill.jobs if not j.resident}
    used: dict[tuple, float] = {}  # a pair's two jobs share its bubbles: their chunks end to end (jobs taking turns
    for ch in plan.fill.chunks:    # overlap: each chunk is drawn from its bubble's start)
        bub = where.get((ch.rank, ch.bubble_id))
        if bub is not None:
            key = (ch.rank, ch.bubble_id, paired.get(ch.job, ch.job))
            at = used.get(key, 0.0)
            width = max(0.0, min(ch.expected_s, bub.duration_s - at))
            used[key] = at + width
            ax.barh(ch.rank + 0.2, width * scale, left=(bub.start_s + at) * scale, color=COLORS["fill"], height=0.38,
                    hatch=HATCH["paired"] if ch.job in paired else HATCH["streamed"] if ch.job in streamed else "//",
                    edgecolor="black", linewidth=0.2)


HATCH = {"paired": "xx", "streamed": ".."}
LEGEND = {"paired": "fill, paired (Waterwave)", "streamed": "fill, loaded per bubble (PipeSwitch)"}
LABEL_SHARE = 0.03  # a bubble is labelled when at least this share of the iteration wide: its label fits inside
BINS = 800  # columns the time axis is cut into: about two pixels each at the chart's size


def _filled(plan: Plan) -> dict[tuple[int, int], float]:
    """Per (rank, bubble), the share of it fill runs in one iteration of the cycle: the most any one job (or pair)
    takes there, as jobs taking turns use the same bubbles at different times."""
    if plan.fill is None:
        return {}
    group = {n: "+".join(pair.jobs) for pair in plan.fill.pairs for n in pair.jobs}
    used: dict[tuple[int, int, str], float] = {}
    for ch in plan.fill.chunks:
        key = (ch.rank, ch.bubble_id, group.get(ch.job, ch.job))
        used[key] = used.get(key, 0.0) + ch.expected_s
    dur = {(b.rank, b.id): b.duration_s for b in plan.bubbles}
    out: dict[tuple[int, int], float] = {}
    for (r, b, _), t in used.items():
        if dur.get((r, b)):
            out[(r, b)] = max(out.get((r, b), 0.0), min(1.0, t / dur[(r, b)]))
    return out


def _binned(sim: SimResult, p: int, bins: int, filled: dict[tuple[int, int], float] | None = None):
    """Per rank and column, the colour mix of what the rank does there (each kind weighted by its time; a bubble's
    filled share in the fill's colour)."""
    import numpy as np
    from matplotlib.colors import to_rgb

    width = sim.iteration_s / bins
    img = np.zeros((p, bins, 3))
    fill = np.array(to_rgb(COLORS["fill"]))
    for r, timeline in enumerate(sim.timelines):
        for iv in timeline:
            rgb = np.array(to_rgb(_color(iv.action, iv.kind)))
            if iv.kind == "bubble" and filled:
                share = filled.get((r, int(iv.action.removeprefix("BUBBLE"))), 0.0)
                rgb = share * fill + (1 - share) * rgb
            a, b = iv.start / width, iv.end / width
            for col in range(int(a), min(int(np.ceil(b)), bins)):
                img[r, col] += rgb * (min(b, col + 1) - max(a, col))
    covered = img.sum(axis=2, keepdims=True) > 0
    return np.where(covered, img, 1.0).clip(0, 1)  # idle time outside every interval stays white


def draw_plan(plan: Plan, path: str, max_labels: int = 200) -> str:
    """Draw the plan's iteration to `path`; returns what the chart had to aggregate or widen (also written on
    it), or ''."""
    import io

    fmt = image_format(path)
    fig, note = figure(plan, max_labels)
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, dpi=130, format=fmt)
    plt.close(fig)
    write_atomic(path, buf.getvalue(), "chart")
    return note


def _matplotlib():
    """matplotlib on its file-only backend, or the install hint as a one-sentence error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        raise UserError("charts need matplotlib: pip install 'fxplanner[charts]'") from None
    return matplotlib


def image_format(path: str) -> str:
    """The image format `path`'s suffix names (png when it has none), refused before any drawing when matplotlib
    cannot write it."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    kinds = FigureCanvasBase.get_supported_filetypes()
    if fmt not in kinds:
        raise UserError(f"cannot write chart {path}: matplotlib writes images ending in "
                        f"{', '.join('.' + k for k in sorted(kinds))}, not .{fmt}")
    return fmt


def figure(plan: Plan, max_labels: int = 200):
    """(matplotlib figure, note): the chart of `draw_plan`, not yet saved."""
    _matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    sim = plan_simulation(plan)
    p = plan.config.pp
    fig, ax = plt.subplots(figsize=(14, 0.6 * p + 2.2))
    scale, unit = (1e3, "ms") if sim.iteration_s < 10 else (1.0, "s")
    column = sim.iteration_s / BINS
    busiest = max(len(t) for t in sim.timelines)
    notes = []
    if busiest > BINS // 2:  # more intervals than the width can show apart: draw each column's mix
        bins = max(50, min(BINS, busiest // 4))  # about four intervals a column: a mix, not stripes
        column = sim.iteration_s / bins
        ax.imshow(_binned(sim, p, bins, _filled(plan)), aspect="auto", interpolation="nearest",
                  extent=(0, sim.iteration_s * scale, p - 0.5, -0.5))
        ax.hlines([r + 0.5 for r in range(p - 1)], 0, sim.iteration_s * scale, color="white", linewidth=1.5)
        notes.append(f"{busiest} intervals on the busiest rank are more than the chart can show apart: each of "
                     f"{bins} columns ({column * scale:.3g} {unit}) shows the mix of what the rank does in it, "
                     "bubbles as red in proportion to their time, the share fill runs in as fill; bubble labels "
                     "are left out (`planner show` lists them)")
        labels = max_labels  # none
    else:
        short = 0
        for bubbles in (False, True):  # bubbles last, so that a widened one is drawn over its neighbours
            for r, timeline in enumerate(sim.timelines):
                for iv in timeline:
                    if (iv.kind == "bubble") != bubbles:
                        continue
                    width = (iv.end - iv.start) * scale
                    if bubbles and iv.end - iv.start < column:  # would be invisible: one column wide
                        width, short = column * scale, short + 1
                    ax.barh(r, width, left=iv.start * scale, color=_color(iv.action, iv.kind), edgecolor="white",
                            linewidth=0.3 if not bubbles or width > column * scale else 0, height=0.8)
        if short:
            notes.append(f"{short} bubbles shorter than a column ({column * scale:.3g} {unit}) are drawn one column "
                         "wide so that they show")
        _draw_fill(ax, plan, sim, scale)
        labels = 0
    for bub in sim.bubbles:
        if labels < max_labels and bub.duration_s > LABEL_SHARE * sim.iteration_s:
            ax.text((bub.start_s + bub.duration_s / 2) * scale, bub.rank - 0.2,
                    f"{bub.duration_s * scale:.3g}{unit}\n{bub.free_bytes / 2**30:.0f}GiB free",
                    ha="center", va="center", fontsize=6, color="black",
                    bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
            labels += 1
    hidden = sum(1 for b in sim.bubbles if b.duration_s > LABEL_SHARE * sim.iteration_s) - labels
    if hidden > 0 and busiest <= BINS // 2:
        notes.append(f"{hidden} more bubble labels left out (at most {max_labels})")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7 if p > 16 else 9)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, sim.iteration_s * scale)
    ax.set_xlabel(f"time in iteration ({unit})")
    ax.set_title(f"{plan.source.model_file}: {plan.config.to_config()}; bubble fraction {sim.bubble_fraction:.1%}",
                 fontsize=9)
    note = "; ".join(notes)
    height = fig.get_size_inches()[1]
    foot = (0.25 + (0.3 if note else 0.0)) / height  # figure share kept below the axes: legend, then the note
    handles = [Patch(color=v, label=k) for k, v in COLORS.items()]
    if plan.fill is not None:
        shown = {"paired": bool(plan.fill.pairs), "streamed": any(not j.resident for j in plan.fill.jobs)}
        handles += [Patch(facecolor=COLORS["fill"], hatch=HATCH[k], edgecolor="black", label=LEGEND[k])
                    for k, on in shown.items() if on]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, (0.3 if note else 0.02) / height),
               ncol=len(handles), fontsize=7, frameon=False)
    if note:
        fig.text(0.01, 0.02 / height, "\n".join(textwrap.wrap(note, 200)), fontsize=6.5, va="bottom", ha="left",
                 color="#444444")
    fig.tight_layout(rect=(0, foot, 1, 1))
    return fig, note
