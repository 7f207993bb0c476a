"""The plan file's fill section, from a fill assignment."""
from __future__ import annotations

from planner.plan import Fill, FillChunk, FillJob, FillPair, FillPredictions, FillShard

from .assign import FillAssignment, RankFill
from .spec import FillSpec
from .waterwave import split_of

__all__ = ["fill_section"]


def job_key(prof) -> str:
    """A fill job's name in the plan: the spec's name with the batch size and configuration it runs at."""
    return f"{prof.job}@b{prof.batch_size}-{prof.config}"


def fill_section(fa: FillAssignment, spec: FillSpec, *, offload: bool, main_useful_per_gpu: float,
                 offload_bytes: tuple[int, ...] | list[int] = ()) -> Fill:
    """`main_useful_per_gpu`: the main job's useful FLOP/s per GPU, to which the fill's are added."""
    specs = {j.name: j for j in spec.jobs}
    jobs: dict[str, FillJob] = {}
    chunks: list[FillChunk] = []
    for turn in fa.turns:
        rf, prof = turn.fill, turn.fill.profile
        key = job_key(prof)
        if key not in jobs:
            js = specs[prof.job]
            jobs[key] = FillJob(name=key, model_file=js.model, model_sha256=prof.sha256, model_args=js.model_args,
                                kind=prof.kind, batch_size=prof.batch_size, config=prof.config,
                                units=[u.name for u in prof.units], unit_time_s=[u.time_s for u in prof.units],
                                resident=rf.resident, load_groups=[list(g) for g in rf.load_groups],
                                leaves=list(js.leaves), iterations=prof.batches,
                                arrival_s=js.arrival_s, deadline_s=js.deadline_s, priority=js.priority,
                                notes=_host_note(prof))
        jobs[key].shards.append(FillShard(rank=turn.rank, first_batch=turn.first_batch, batches=turn.batches,
                                          start_s=turn.start_s, end_s=turn.end_s))
        chunks.extend(_chunks(rf, key))
    pairs = {}
    for turn in fa.turns:
        pair = turn.fill.pair
        if pair is not None and (pair.rank, pair.jobs) not in pairs:
            s, led = pair.schedule, pair.schedule.ledger
            names = [next(job_key(t.fill.profile) for t in fa.turns if t.rank == pair.rank and t.job == j)
                     for j in pair.jobs]
            pairs[(pair.rank, pair.jobs)] = FillPair(
                rank=pair.rank, jobs=names, budget_bytes=led.budget, split_bytes=split_of(led.budget),
                stops=[list(x) for x in led.stops], mem_bytes=[list(x) for x in led.mem],
                state_bytes=[list(x) for x in led.state], iterations=s.iterations, peak_bytes=s.peak_bytes,
                held_bytes=s.held_bytes, side_by_side_bytes=s.side_by_side_bytes)
    return Fill(safety_margin=spec.safety_margin, policy=spec.policy, gpu_sharing=spec.gpu_sharing,
                jobs=list(jobs.values()), chunks=chunks, pairs=list(pairs.values()),
                predictions=FillPredictions(fill_tflops_per_gpu=fa.fill_flops_per_gpu_s / 1e12,
                                            bubble_time_used=fa.bubble_time_used,
                                            total_useful_tflops_per_gpu=(main_useful_per_gpu +
                                                                         fa.fill_flops_per_gpu_s) / 1e12,
                                            offload_optimizer=offload,
                                            offload_bytes=list(offload_bytes) if offload else [],
                                            unplaceable=fa.unplaceable,
                                            not_chosen=fa.not_chosen, notes=fa.notes))


def _host_note(prof) -> list[str]:
    """Say where the host issuing the job's units (eager PyTorch, op by op) is slower than the GPU runs them, by more
    than a tenth of its iteration."""
    bound = sum(u.gpu_s is not None for u in prof.units)
    if prof.host_wait_s <= 0.1 * prof.dedicated_s:
        return []
    return [f"the host issues {bound} of its {len(prof.units)} units slower than the GPU runs them at batch "
            f"{prof.batch_size} (eager PyTorch, planner/fill/physics.py HOST_UNIT_S): alone, the GPU waits for the "
            f"host {prof.host_wait_s / prof.dedicated_s:.0%} of its time; a larger batch does more work in the same "
            "bubbles"]


def _chunks(rf: RankFill, key: str) -> list[FillChunk]:
    """The job's chunks in the first bubble cycle; a paired job's are its own units of the pair's chunks (their
    positions counted in its own stream of units, after the schedule's prologue)."""
    cycle0 = [ch for ch in rf.packing.chunks if ch.cycle == 0]
    if rf.pair is None:
        return [FillChunk(job=key, rank=rf.rank, bubble_id=ch.bubble_id, first_unit=ch.first_unit, units=ch.num_units,
                          expected_s=ch.time_s, memory_bytes=ch.mem_bytes) for ch in cycle0]
    j = rf.pair.jobs.index(rf.profile.job)
    period = rf.pair.schedule.period
    mine = [jj == j for jj, _ in period]

    def before(v: int) -> int:  # the job's units among the first v units of the pair's stream
        return sum(jj == j for jj, _ in rf.pair.schedule.prologue) + v // len(period) * sum(mine) + \
            sum(mine[:v % len(period)])

    out = []
    for ch in cycle0:
        first, stop = before(ch.first_unit), before(ch.first_unit + ch.num_units)
        share = sum(rf.pair.units[v % len(period)].time_s for v in range(ch.first_unit, ch.first_unit + ch.num_units)
                    if mine[v % len(period)])
        whole = sum(rf.pair.units[v % len(period)].time_s for v in range(ch.first_unit, ch.first_unit + ch.num_units))
        if stop > first:
            out.append(FillChunk(job=key, rank=rf.rank, bubble_id=ch.bubble_id, first_unit=first, units=stop - first,
                                 expected_s=ch.time_s * share / whole if whole else 0.0, memory_bytes=ch.mem_bytes))
    return out
