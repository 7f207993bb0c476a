"""Joint choice of the main configuration and the fill (the planner's reason to exist).

The main job comes first. Among main configurations whose simulated iteration time is within
`main_slack` of the fastest (0 by default: none slower), each one — with or without main-job optimizer
offload (PipeFill 4.2) — scores

    fastest simulated iteration time / its simulated iteration time  +  fill_value x recovered GPU-s/s

where "recovered GPU-s/s" is the fill work its bubbles do, in seconds of the fill jobs' own dedicated-GPU
time per wall second per GPU (`recovered_gpu_s_per_s`), and `fill_value` is what the user says one
recovered fill GPU-second is worth against one main-job GPU-second (0 by default: fill never slows the
main job; it only breaks exact ties). The highest score wins.

`choose_shrink_or_fill` makes the same choice between the configurations that shrink the bubbles
(zero-bubble schedules, whose backward is split) and those that keep them and fill them, and says in one
sentence which won and why, with both figures.

A packer other than greedy (CP-SAT) runs only where it can gain: greedy is proven optimal unless chunk
boundaries cost something (`PackingParams.state_swap_bw`, see planner/fill/packing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from planner.evaluate import Evaluation, Evaluator
from planner.simulate import SimResult

from .assign import FillAssignment, assign_fill
from .packing import BubbleSlot
from .physics import DEFAULT_SAFETY_MARGIN
from .profiles import FillProfile

__all__ = ["JointChoice", "choose_joint", "choose_shrink_or_fill", "offload_bytes", "bubble_cycles",
           "recovered_gpu_s_per_s", "hold_free", "greedy_proven_optimal", "boundaries_cost", "TIE"]

TIE = 1e-9
"""Relative tolerance under which two scores (or iteration times) are equal."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JointChoice:
    evaluation: Evaluation  # simulated
    simulation: SimResult
    fill: FillAssignment
    offloaded: tuple[int, ...]
    """Per pipeline rank, the optimizer bytes the main job moves to the host for the bubbles (offload_bytes);
    empty without offload."""
    main_useful_per_gpu: float  # FLOP/s
    considered: int  # main configurations admitted by main_slack
    recovered: float = 0.0  # fill GPU-seconds (dedicated-GPU equivalent) per wall second per GPU
    score: float = 0.0
    solver: str = "greedy"  # the packer that ran
    choice: str = ""  # shrinking vs filling: which won and why (choose_shrink_or_fill)

    @property
    def offload(self) -> bool:
        return bool(self.offloaded)


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


def hold_free(sim: SimResult, capacity: float) -> list[int]:
    """Per pipeline rank, the bytes free beside the main job at its peak (the memory ledger's highest point):
    what a fill job holds between bubbles must fit there. Optimizer offload does not raise it: the state is
    back on the device for the gradient reduction and the step."""
    return [max(0, int(capacity - peak)) for peak in sim.peak_bytes]


def _main_useful(ev: Evaluator, e: Evaluation) -> float:
    return ev.executed_flops("none") / (ev.n_gpus * e.iteration_s)


def recovered_gpu_s_per_s(fa: FillAssignment, iteration_s: float) -> float:
    """Dedicated-GPU-equivalent seconds of fill work done per wall second per GPU: on each pipeline rank, the
    fill FLOPs of one main iteration over the fill job's own FLOP rate on a dedicated GPU (its profile's FLOPs
    per iteration / its iteration time), over the main iteration time; weighted by the rank's turns and averaged
    over the pipeline ranks (FillAssignment.per_cycle)."""
    if iteration_s <= 0:
        return 0.0
    placed = {(rf.rank, rf.profile.job): rf.profile for q in fa.per_rank for rf in q}

    def rate(prof) -> float:
        return prof.flops_per_iteration / prof.dedicated_s if prof.dedicated_s > 0 and prof.flops_per_iteration > 0 else 0.0

    def dedicated_s(rf) -> float:
        if rf.pair is None:
            r = rate(rf.profile)
            return rf.packing.flops_per_cycle / r if r else 0.0
        # a pair's packing runs both jobs' units (waterwave.pair_units names them "0:..." and "1:..."): each job's
        # share of its FLOPs at that job's own rate
        total, out = sum(u.flops for u in rf.pair.units), 0.0
        for j, name in enumerate(rf.pair.jobs):
            r = rate(placed[(rf.rank, name)]) if (rf.rank, name) in placed else 0.0
            mine = sum(u.flops for u in rf.pair.units if u.name.startswith(f"{j}:"))
            out += rf.packing.flops_per_cycle * mine / total / r if r and total else 0.0
        return out

    return fa.per_cycle(dedicated_s) / iteration_s


def boundaries_cost(options: list[JointChoice]) -> bool:
    """Whether any chosen packing charges for where a chunk ends (state swapped at its boundaries): the one case
    where a packer can beat greedy."""
    return any(rf.packing.params.state_swap_bw is not None
               for o in options for q in o.fill.per_rank for rf in q)


def greedy_proven_optimal(packer: str) -> str:
    """The solver report when `packer` was asked for and greedy is already proven optimal."""
    name = {"cpsat": "CP-SAT"}.get(packer, packer)
    return f"greedy (proven optimal: chunk boundaries cost nothing here; {name} not needed)"


def _admitted(items: list, main_slack: float, time_of=lambda e: e.iteration_s) -> list:
    """The items whose iteration time is within main_slack of the fastest."""
    best = min(time_of(x) for x in items)
    return [x for x in items if time_of(x) <= best * (1 + main_slack) * (1 + TIE)]


def _options(ev: Evaluator, candidates: list[Evaluation], jobs: dict[str, list[FillProfile]], *, main_slack: float,
             offload: str, safety_margin: float, solver: str, policy: str) -> list[JointChoice]:
    """Every candidate within main_slack of the best (by the time it comes with), simulated, with and without
    offload as `offload` allows, its fill packed; score not set."""
    out = []
    for e in _admitted(candidates, main_slack):
        e, sim = ev.simulate_config(e)
        extras: list[tuple[int, ...] | None] = [None]
        if offload != "off":
            moved = offload_bytes(ev, e)
            if moved is not None:
                extras = [moved] if offload == "on" else [None, moved]
        for extra in extras:
            fa = assign_fill(bubble_cycles(sim, e.config.pp, extra), e.iteration_s, jobs, ev.hw,
                             safety_margin=safety_margin, solver=solver, hold_free=hold_free(sim, ev.capacity),
                             replicas=e.config.gpus_per_stage, policy=policy)
            out.append(JointChoice(evaluation=e, simulation=sim, fill=fa, offloaded=extra or (),
                                   main_useful_per_gpu=_main_useful(ev, e), considered=0,
                                   recovered=recovered_gpu_s_per_s(fa, e.iteration_s), solver=solver))
    return out


def _better(a: JointChoice, b: JointChoice) -> bool:
    """a beats b: a higher score; at a tie, more fill, then a faster main job, then no offload."""
    if abs(a.score - b.score) > TIE * max(abs(a.score), abs(b.score)):
        return a.score > b.score
    if abs(a.recovered - b.recovered) > TIE * max(a.recovered, b.recovered):
        return a.recovered > b.recovered
    ta, tb = a.evaluation.iteration_s, b.evaluation.iteration_s
    if abs(ta - tb) > TIE * max(ta, tb):
        return ta < tb
    return b.offload and not a.offload


def _pick(options: list[JointChoice], *, reference_s: float, main_slack: float, fill_value: float) -> JointChoice:
    """The best-scoring option among those within main_slack of the fastest simulated one."""
    admitted = _admitted(options, main_slack, lambda o: o.evaluation.iteration_s)
    considered = len({o.evaluation.config for o in admitted})
    best: JointChoice | None = None
    for o in admitted:
        o = replace(o, considered=considered, score=_score(o, reference_s, fill_value))
        if best is None or _better(o, best):
            best = o
    assert best is not None
    return best


def _score(o: JointChoice, reference_s: float, fill_value: float) -> float:
    return reference_s / o.evaluation.iteration_s + fill_value * o.recovered


def _solve(ev: Evaluator, groups: list[list[Evaluation]], jobs: dict[str, list[FillProfile]], *, main_slack: float,
           offload: str, safety_margin: float, solver: str, policy: str) -> list[list[JointChoice]]:
    """Each group's options, screened with greedy; re-packed with `solver` only where it can beat greedy."""
    kw = dict(main_slack=main_slack, offload=offload, safety_margin=safety_margin, policy=policy)
    out = [_options(ev, g, jobs, solver="greedy", **kw) if g else [] for g in groups]
    if solver != "greedy" and boundaries_cost([o for g in out for o in g]):
        out = [_options(ev, g, jobs, solver=solver, **kw) if g else [] for g in groups]
    return out


def choose_joint(ev: Evaluator, candidates: list[Evaluation], jobs: dict[str, list[FillProfile]], *,
                 main_slack: float = 0.0, offload: str = "auto", safety_margin: float = DEFAULT_SAFETY_MARGIN,
                 solver: str = "greedy", fill_value: float = 0.0, policy: str = "sjf") -> JointChoice:
    """The main configuration (and offload) with the highest score among `candidates` (see the module)."""
    (options,) = _solve(ev, [candidates], jobs, main_slack=main_slack, offload=offload, safety_margin=safety_margin,
                        solver=solver, policy=policy)
    reference = min(o.evaluation.iteration_s for o in options)
    return _pick(options, reference_s=reference, main_slack=main_slack, fill_value=fill_value)


def choose_shrink_or_fill(ev: Evaluator, shrink: list[Evaluation], keep: list[Evaluation],
                          jobs: dict[str, list[FillProfile]], *, main_slack: float = 0.0, offload: str = "auto",
                          safety_margin: float = DEFAULT_SAFETY_MARGIN, solver: str = "greedy", fill_value: float = 0.0,
                          no_shrink: str = "", no_keep: str = "", policy: str = "sjf") -> JointChoice:
    """The best of the configurations that shrink the bubbles (zero-bubble schedules: `shrink`) and those that
    keep them and fill them (`keep`), scored together, with `choice` saying which won and why, both figures
    given. `no_shrink` / `no_keep`: why a side has no candidate (when it has none)."""
    if not shrink and not keep:
        raise ValueError("choose_shrink_or_fill needs at least one candidate")
    opts_s, opts_k = _solve(ev, [shrink, keep], jobs, main_slack=main_slack, offload=offload,
                            safety_margin=safety_margin, solver=solver, policy=policy)
    everything = opts_s + opts_k
    reference = min(o.evaluation.iteration_s for o in everything)
    kw = dict(reference_s=reference, main_slack=main_slack, fill_value=fill_value)
    chosen = _pick(everything, **kw)
    shrinking = chosen.evaluation.config.schedule_kind.split_backward
    other = opts_k if shrinking else opts_s
    if not other:
        why = no_keep if shrinking else no_shrink
        lost = "filling" if shrinking else "shrinking"
        desc = _shrink_desc(chosen, True) if shrinking else _keep_desc(chosen, fill_value, True)
        return replace(chosen, choice=f"{_side(chosen)} won: {desc}; {lost} was not an option "
                                      f"({why or 'no configuration'})")
    rival = _pick(other, **kw)
    won, lost = _side(chosen), _side(rival)
    s, k = (chosen, rival) if shrinking else (rival, chosen)
    why = _why(chosen, rival, won, lost, reference, main_slack, fill_value)
    text = (f"{won} won ({why}; score, main speed against the fastest + fill value x recovered GPU-s/s: "
            f"{chosen.score:.4f} against {rival.score:.4f}): {_shrink_desc(s, s is chosen)}; "
            f"{_keep_desc(k, fill_value, k is chosen)}")
    return replace(chosen, choice=text)


def _why(chosen: JointChoice, rival: JointChoice, won: str, lost: str, reference_s: float, main_slack: float,
         fill_value: float) -> str:
    tc, tr = chosen.evaluation.iteration_s, rival.evaluation.iteration_s
    if rival.score > chosen.score and tr > reference_s * (1 + main_slack) * (1 + TIE):
        return (f"{lost} would score higher, but its main job is {tr / reference_s - 1:.2%} slower than the fastest, "
                f"past --main-slack {main_slack:g}")
    extra = abs(chosen.recovered - rival.recovered)
    if abs(tc - tr) <= TIE * max(tc, tr):
        return f"both run the main job equally fast and {won} recovers {extra:.4f} GPU-s/s more fill"
    speed = abs(reference_s / tc - reference_s / tr)  # main speed, in the score's units
    if tc < tr:
        if chosen.recovered >= rival.recovered:
            return f"{won} runs the main job {tr / tc - 1:.2%} faster and recovers as much fill or more"
        return (f"{won} runs the main job {tr / tc - 1:.2%} faster, worth {speed:.4f} in main speed, more than the "
                f"{fill_value * extra:.4f} that {lost}'s {extra:.4f} GPU-s/s more fill is worth at --fill-value "
                f"{fill_value:g}")
    return (f"{won}'s {extra:.4f} GPU-s/s more fill is worth {fill_value * extra:.4f} at --fill-value {fill_value:g}, "
            f"more than the {speed:.4f} of main speed it costs (its main job is {tc / tr - 1:.2%} slower)")


def _side(o: JointChoice) -> str:
    c = o.evaluation.config
    return "shrinking" if c.schedule_kind.split_backward else "filling" if c.pp > 1 else "not pipelining"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _figures(o: JointChoice) -> str:
    e = o.evaluation
    return f"{_seconds(e.iteration_s)} (MFU {e.mfu:.1%}, bubbles {e.bubble_fraction:.1%})"


def _shrink_desc(o: JointChoice, chosen: bool) -> str:
    c = o.evaluation.config
    rest = (f", and its remaining bubbles recover {o.fill.fill_flops_per_gpu_s / 1e12:.2f} TFLOP/s/GPU "
            f"({o.recovered:.4f} GPU-s/s)" if o.recovered > 0 else "")
    return f"{c.schedule if chosen else f'{c.schedule} ({c})'} runs an iteration in {_figures(o)}{rest}"


def _keep_desc(o: JointChoice, fill_value: float, chosen: bool) -> str:
    c = o.evaluation.config
    if c.pp == 1:
        return (f"not pipelining{'' if chosen else f' ({c})'} runs an iteration in {_figures(o)} and leaves no "
                "bubbles to fill")
    return (f"keeping the bubbles of {c.schedule if chosen else f'{c.schedule} ({c})'} and filling them runs "
            f"{_figures(o)} and recovers {o.fill.fill_flops_per_gpu_s / 1e12:.2f} TFLOP/s/GPU ({o.recovered:.4f} "
            f"GPU-s/s), worth {fill_value * o.recovered:.4f} at --fill-value {fill_value:g}")
