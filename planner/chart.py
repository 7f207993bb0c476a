"""Gantt chart of one iteration per pipeline rank: forward, backward, communication, bubbles."""
from __future__ import annotations

from passes.errors import UserError

from .plan import Plan, plan_schedule
from .simulate import SimCosts, SimResult, simulate

__all__ = ["plan_simulation", "draw_plan"]

COLORS = {"F": "#4c78a8", "B": "#f58518", "comm": "#54a24b", "OPT": "#b279a2", "bubble": "#e45756",
          "fill": "#72b7b2"}


def plan_simulation(plan: Plan) -> SimResult:
    """Re-run the plan's simulation of its own action lists from the figures stored in it (no model needed)."""
    pr = plan.predictions
    costs = SimCosts(forward_s=tuple(s.forward_s for s in plan.partition),
                     backward_s=tuple(s.backward_s for s in plan.partition), p2p_s=pr.p2p_s,
                     allreduce_s=tuple(pr.allreduce_s), optimizer_s=tuple(pr.optimizer_s),
                     static_bytes=tuple(int(m.total - m.activations) for m in pr.memory),
                     activation_bytes=tuple(int(s.activation_bytes) for s in plan.partition),
                     capacity_bytes=int(pr.memory[0].capacity))
    return simulate(plan_schedule(plan), costs)


def _color(action: str, kind: str) -> str:
    if kind == "bubble":
        return COLORS["bubble"]
    if kind == "comm":
        return COLORS["comm"]
    if action == "OPT":
        return COLORS["OPT"]
    return COLORS["B"] if "B" in action.lstrip("0123456789")[:1] else COLORS["F"]


def _draw_fill(ax, plan: Plan, sim: SimResult, scale: float) -> None:
    """Fill chunks drawn inside their bubbles (one iteration of the repeating cycle)."""
    if plan.fill is None:
        return
    where = {(b.rank, b.id): b for b in sim.bubbles}
    for ch in plan.fill.chunks:
        bub = where.get((ch.rank, ch.bubble_id))
        if bub is not None:
            ax.barh(ch.rank, min(ch.expected_s, bub.duration_s) * scale, left=bub.start_s * scale,
                    color=COLORS["fill"], height=0.45, hatch="//", edgecolor="black", linewidth=0.2)


def draw_plan(plan: Plan, path: str, max_labels: int = 200) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UserError("charts need matplotlib: pip install 'fxplanner[charts]'") from None
    sim = plan_simulation(plan)
    p = plan.config.pp
    fig, ax = plt.subplots(figsize=(14, 0.6 * p + 1.8))
    labels = 0
    scale, unit = (1e3, "ms") if sim.iteration_s < 10 else (1.0, "s")
    for r, timeline in enumerate(sim.timelines):
        for iv in timeline:
            width = (iv.end - iv.start) * scale
            ax.barh(r, width, left=iv.start * scale, color=_color(iv.action, iv.kind), edgecolor="white",
                    linewidth=0.3, height=0.8)
    _draw_fill(ax, plan, sim, scale)
    for bub in sim.bubbles:
        if labels < max_labels and bub.duration_s > 0.02 * sim.iteration_s:
            ax.text((bub.start_s + bub.duration_s / 2) * scale, bub.rank,
                    f"{bub.duration_s * scale:.3g}{unit}\n{bub.free_bytes / 2**30:.0f}GiB free",
                    ha="center", va="center", fontsize=6, color="black")
            labels += 1
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time in iteration ({unit})")
    ax.set_title(f"{plan.source.model_file}: {plan.config.to_config()}; bubble fraction {sim.bubble_fraction:.1%}")
    ax.legend(handles=[Patch(color=v, label=k) for k, v in COLORS.items()], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
