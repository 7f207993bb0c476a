"""Joint choice of the main configuration and the fill (the planner's reason to exist).

Among main configurations whose predicted throughput is within `main_slack` of the best, choose
the one — with or without main-job optimizer offload (PipeFill 4.2) — that maximizes total useful
FLOPs: the main job's (forward + backward; recomputation is not useful work) plus the fill jobs'.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.evaluate import Evaluation, Evaluator
from planner.simulate import SimResult

from .assign import FillAssignment, assign_fill
from .packing import BubbleSlot
from .profiles import FillProfile

__all__ = ["JointChoice", "choose_joint", "offload_bytes", "bubble_cycles"]


@dataclass(frozen=True, kw_only=True, slots=True)
class JointChoice:
    evaluation: Evaluation
    simulation: SimResult
    fill: FillAssignment
    offload: bool
    main_useful_per_gpu: float  # FLOP/s
    considered: int


def offload_bytes(ev: Evaluator, e: Evaluation) -> tuple[int, ...] | None:
    """Per pipeline rank, optimizer bytes that can live on the host: moved out during the forward
    passes and back during the gradient all-reduce — as much as PCIe moves inside both phases
    (PipeFill offloads it all; with 12 bytes of Adam state per 2 bytes of all-reduced gradient the
    whole state rarely fits the all-reduce, so the part that fits is offloaded). None if nothing fits."""
    pcie = ev.hw.gpu.pcie_bw
    c, out = e.config, []
    for r, mem in enumerate(e.rank_memory):
        forward_phase = c.m * sum(e.forward_s[j] for j in c.placement.stages(r))
        out.append(int(min(mem.optimizer, pcie * min(forward_phase, e.allreduce_s[r]))))
    return tuple(out) if any(out) else None


def bubble_cycles(sim: SimResult, p: int, extra: tuple[int, ...] | None = None) -> list[list[BubbleSlot]]:
    cycles: list[list[BubbleSlot]] = [[] for _ in range(p)]
    for b in sim.bubbles:
        cycles[b.rank].append(BubbleSlot(id=b.id, duration_s=b.duration_s,
                                         free_bytes=b.free_bytes + (extra[b.rank] if extra else 0)))
    return cycles


def _main_useful(ev: Evaluator, e: Evaluation) -> float:
    return ev.executed_flops("none") / (ev.n_gpus * e.iteration_s)


def choose_joint(ev: Evaluator, candidates: list[Evaluation], jobs: dict[str, list[FillProfile]], *,
                 main_slack: float = 0.0, offload: str = "auto", safety_margin: float = 0.1,
                 solver: str = "greedy") -> JointChoice:
    best_time = min(e.iteration_s for e in candidates)
    pool = [e for e in candidates if e.iteration_s <= best_time * (1 + main_slack) * (1 + 1e-9)]
    choice: JointChoice | None = None
    for e in pool:
        e, sim = ev.simulate_config(e)
        extras = [None]
        if offload != "off":
            moved = offload_bytes(ev, e)
            if moved is not None:
                extras = [moved] if offload == "on" else [None, moved]
        for extra in extras:
            fa = assign_fill(bubble_cycles(sim, e.config.pp, extra), e.iteration_s, jobs, ev.hw,
                             safety_margin=safety_margin, solver=solver)
            cand = JointChoice(evaluation=e, simulation=sim, fill=fa, offload=extra is not None,
                               main_useful_per_gpu=_main_useful(ev, e), considered=len(pool))
            if choice is None or _total(cand) > _total(choice):
                choice = cand
    assert choice is not None
    return choice


def _total(j: JointChoice) -> float:
    return j.main_useful_per_gpu + j.fill.fill_flops_per_gpu_s
