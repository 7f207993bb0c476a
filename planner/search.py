"""Search PTD-P configurations: (t, p, d), microbatch b, interleaving v, recomputation, schedule.

Candidates are enumerated under the divisibility rules, pruned by a memory lower bound, and
priced in order of an optimistic throughput bound (perfectly balanced stages), so that once that
bound falls below the k-th best priced configuration the rest cannot enter the top k
(branch and bound). The best few are then simulated event by event, and so is every other priced
configuration whose lower bound (`Evaluation.lower_bound_s`) is below the best simulated time;
the simulated times rank them.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import chain, product
from typing import Callable, Iterable, Iterator

from costmodels.recompute import RECOMPUTE
from passes.errors import UserError

from .config import ConfigError, ParallelConfig
from .evaluate import Evaluation, Evaluator, Rejected
from .layout import layout_stages
from .options import ENGINES, Pins, check_cluster  # (a light module: the CLI checks its options without torch)
from .schedules import SCHEDULES
from .simulate import SimResult

__all__ = ["ENGINES", "Pins", "SearchResult", "search", "divisors", "NoFeasibleConfig"]


class NoFeasibleConfig(UserError):
    """No configuration fits in memory (or survives the pins)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    best: Evaluation
    simulation: SimResult
    runners_up: tuple[Evaluation, ...]
    evaluated: int
    rejected: dict[str, int] = field(default_factory=dict)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_reason(t: int, heads: Iterable[tuple[int, int]]) -> str | None:
    """Why tensor-parallel degree t cannot split the attention of units with (heads, kv heads), or None."""
    for h, kv in heads:
        if h and h % t:
            return f"t={t} does not divide the {h} attention heads"
        if kv and kv % t and t % kv:  # below t, each kv head is replicated on t / kv ranks
            return f"t={t} neither divides nor is a multiple of the {kv} key/value heads"
    return None


def cp_reason(cp: int, seq: int) -> str | None:
    """Why context-parallel degree cp cannot split sequences of `seq` tokens, or None."""
    if cp == 1:
        return None
    if not seq:
        return f"cp={cp} needs a model whose input is token ids (context parallelism splits the sequence)"
    if seq % (2 * cp):
        return f"cp={cp} does not split the {seq}-token sequence into 2*cp equal chunks (Megatron's load balance)"
    return None


def cp_choices(t: int, rest: int, gpus_per_node: int, seq: int, pins: Pins, rejected: Counter) -> list[int]:
    """Context-parallel degrees for tensor-parallel degree t with `rest` GPUs per t left: the pinned one, or
    every degree whose ring stays inside a node (t * cp GPUs) and splits the sequence."""
    if pins.cp is not None:
        pool = [pins.cp] if rest % pins.cp == 0 else []
        if not pool:
            rejected[f"cp={pins.cp} does not divide the {rest} GPUs left per tensor-parallel group"] += 1
    else:
        pool = [c for c in divisors(rest) if t * c <= gpus_per_node] if seq else [1]
    out = []
    for c in pool:
        if (why := cp_reason(c, seq)) is not None:
            rejected[why] += 1
        else:
            out.append(c)
    return out


def ep_choices(experts: int, ranks: int, pins: Pins, rejected: Counter) -> list[int]:
    """Expert-parallel degrees for a stage whose `ranks` hold different tokens: the pinned one, or every degree that
    divides both them and the experts (1 for a model without experts)."""
    if pins.ep is not None:
        why = (f"ep={pins.ep} needs a model with mixture-of-experts layers" if pins.ep > 1 and not experts else
               f"ep={pins.ep} does not divide the {experts} experts" if pins.ep > 1 and experts % pins.ep else
               f"ep={pins.ep} does not divide the {ranks} ranks holding different tokens (sp_degree*cp*dp)"
               if ranks % pins.ep else None)
        if why:
            rejected[why] += 1
            return []
        return [pins.ep]
    return [e for e in divisors(ranks) if experts % e == 0] if experts else [1]


def candidates(n_units: int, n_gpus: int, gpus_per_node: int, global_batch: int, pins: Pins,
               rejected: Counter, heads: Iterable[tuple[int, int]] = (), seq: int = 0,
               experts: int = 0, refused: dict[str, str] | None = None) -> Iterator[ParallelConfig]:
    """`refused`: {"t" or "t+sp" or "cp": the op and source line} of the splits the engine cannot run
    (Evaluator.refused; "cp": context parallelism at any degree)."""
    heads, refused = set(heads), refused or {}
    t_pool = divisors(n_gpus) if pins.allow_cross_node_tp else divisors(min(gpus_per_node, n_gpus))
    if pins.tp is not None and pins.tp not in t_pool:
        t = pins.tp
        rejected[tp_reason(t, heads) or (f"t={t} does not divide {n_gpus} GPUs" if n_gpus % t else
                 f"t={t} does not divide the {gpus_per_node} GPUs of a node" if t < gpus_per_node else
                 f"t={t} spans more than one node of {gpus_per_node} GPUs (allow it with --allow-cross-node-tp)")] += 1
    for t in t_pool:
        if pins.tp not in (None, t):
            continue
        if (why := tp_reason(t, heads)) is not None:
            rejected[why] += 1
            continue
        if (op := refused.get(str(t))) is not None:
            rejected[f"tensor parallelism, which the runtime cannot run for this model ({op})"] += 1
            continue
        for cp in cp_choices(t, n_gpus // t, gpus_per_node, seq, pins, rejected):
            if cp > 1 and (op := refused.get("cp")) is not None:
                rejected[f"context parallelism, which the runtime cannot run for this model ({op})"] += 1
                continue
            for p in divisors(n_gpus // (t * cp)):
                d = n_gpus // (t * cp * p)
                if pins.pp not in (None, p) or pins.dp not in (None, d):
                    continue
                if p > n_units:
                    rejected["more stages than units"] += 1
                    continue
                if global_batch % d:
                    rejected["global batch not divisible by d"] += 1
                    continue
                if pins.dp_replicate is not None and d % pins.dp_replicate:
                    rejected["d not a multiple of --dp-replicate"] += 1
                    continue
                for r in _replicas(t, d, cp, gpus_per_node, pins, pins.zero):
                    yield from _per_replica(t, p, d, cp, r, n_units, global_batch // d, pins, rejected, experts,
                                            refused.get(f"{t}+sp"))


def _replicas(t: int, d: int, cp: int, node: int, pins: Pins, zero: int | None) -> list[int]:
    """The hybrid-sharding replica counts R to try (ParallelConfig.dp_replicate) at ZeRO stage `zero` (None: not yet
    chosen): the pinned one; else 1, and at ZeRO-3 where the engine runs HSDP each R whose shard group (d/R x cp
    ranks, t apart) fills 1, 2, 4 or 8 whole nodes: the within-node and few-node shard groups HSDP is run with."""
    if pins.dp_replicate is not None:
        return [pins.dp_replicate]
    if not ENGINES[pins.engine].hsdp or zero != 3:  # (unpinned, ZeRO-3 is a fallback: _fallbacks)
        return [1]
    ranks = t * d * cp
    return [1, *sorted({r for k in (1, 2, 4, 8) if ranks % (k * node) == 0 and (r := ranks // (k * node)) > 1
                        and d % r == 0})]


def _per_replica(t: int, p: int, d: int, cp: int, r: int, n_units: int, per_replica: int, pins: Pins,
                 rejected: Counter, experts: int = 0, sp_refused: str | None = None) -> Iterator[ParallelConfig]:
    """`r`: the hybrid-sharding replicas (ZeRO-3 within each where above 1); `sp_refused`: the op the engine cannot
    run under sequence parallelism at this t, if any."""
    replicas = d * cp > 1
    zero = 3 if r > 1 else pins.zero if pins.zero is not None else \
        ENGINES[pins.engine].zero_stages[1] if replicas else 0
    overlap = pins.overlap_grad_reduce if pins.overlap_grad_reduce is not None else replicas
    for b in divisors(per_replica):
        if pins.b not in (None, b) or (pins.b is None and b > pins.max_microbatch):
            continue
        m = per_replica // b
        for name, kind in SCHEDULES.items():
            if pins.schedule not in (None, name) or (pins.schedules is not None and name not in pins.schedules):
                continue
            for v in kind.v_choices(p, max(pins.max_v, pins.v or 0)):  # a pinned v is always a choice
                if pins.v not in (None, v):
                    continue
                why = kind.check(p, v, m)
                if why is not None:
                    rejected[why] += 1
                    continue
                if p * v > n_units:
                    rejected["more stages than units"] += 1
                    continue
                if pins.layout and layout_stages(pins.layout) not in (None, p * v):
                    rejected["not the stated layout's stage count"] += 1
                    continue
                for rc in RECOMPUTE:
                    partial = RECOMPUTE[rc].partial  # priced where "none" does not fit (_fallbacks) unless pinned
                    if pins.recompute not in (None, rc) or (pins.recompute_layers and not partial) or (
                            partial and pins.recompute != rc):
                        continue
                    layers = (pins.recompute_layers or 0) if partial else 0
                    for sp in ((False, True) if pins.sp is None else (pins.sp,)) if t > 1 else (False,):
                        if sp and sp_refused is not None:
                            rejected[f"sequence parallelism, which the runtime cannot run for this model ({sp_refused})"] += 1
                            continue
                        # Megatron-Core runs expert parallelism beside tensor parallelism only under sp
                        # (under hybrid sharding the experts are divided within a replica)
                        eps = ep_choices(experts, (t if sp else 1) * cp * d // r, pins, rejected) \
                            if sp or t == 1 else [1] if (pins.ep or 1) == 1 else []
                        if not eps and not sp and t > 1:
                            rejected["expert parallelism beside tensor parallelism needs sequence parallelism"] += 1
                        # async TP where the engine runs it over compiled blocks: tried both ways unless pinned
                        atps = (False, True) if sp and pins.async_tp is None and pins.compile and \
                            ENGINES[pins.engine].async_tp else (bool(pins.async_tp) and sp,)
                        for ep, atp in product(eps, atps):
                            yield ParallelConfig(tp=t, pp=p, dp=d, cp=cp, ep=ep, b=b, m=m, v=v, zero=zero,
                                                 dp_replicate=r,
                                                 grad_fp32=bool(pins.grad_fp32), overlap_grad_reduce=overlap,
                                                 tp_comm_overlap=pins.tp_comm_overlap and sp,
                                                 async_tp=atp,
                                                 recompute=rc, recompute_layers=layers, sp=sp, schedule=name,
                                                 precision=pins.precision,
                                                 fp8=pins.fp8, fp8_params=pins.fp8_params, compile=bool(pins.compile),
                                                 expert_load=pins.moe_capacity or (pins.expert_load or 1.0
                                                                                   if ep > 1 else 1.0),
                                                 moe_capacity=pins.moe_capacity,
                                                 moe_dispatcher=pins.moe_dispatcher,
                                                 moe_a2a_overlap=pins.moe_a2a_overlap and ep > 1)


_UNBOUNDED, _BOUNDED, _FALLBACK = range(3)  # what a queued configuration's lower bound is: its share of the work
# (_least_work_s), its optimistic time; and whether it only adds work to one that did not fit


def _least_work_s(ev: Evaluator, c: ParallelConfig) -> float:
    """No rank of c, nor of what it falls back to (_fallbacks: more recomputation or sharding, no less work), is
    busy less than its share of the m microbatches' forward and backward (the FP8 weights' casts aside): a bound
    below _optimistic_iteration's, from one sum per unit_key."""
    key = ("work", c.unit_key())
    if key not in ev._cache:
        count = ev.twin_counts
        ev._cache[key] = sum(count[i] * (r[0] + r[1]) for i, r in ev.distinct_costs(c).items())
    return c.m * ev._cache[key] / c.pp


def _optimistic_iteration(ev: Evaluator, c: ParallelConfig) -> float:
    """The schedule's own time with perfectly balanced stages and free p2p: no partition beats it."""
    k, split = c.stages, c.schedule_kind.split_backward
    key = ("optimistic", c.unit_key(), c.m, k, c.recompute_layers if c.recompute_mode.partial else -1, split)
    if key not in ev._cache:  # (a balanced stage's seconds; under a split backward its least F and most W), over
        # one unit of each kind (Evaluator.distinct_costs) with its count: ~10^4 configurations a search
        rows, count = ev.distinct_costs(c), ev.twin_counts
        fwd = {i: r[0] + r[6] / c.m for i, r in rows.items()}  # the forward with its share of the FP8 casts
        work = {i: fwd[i] + r[1] for i, r in rows.items()}
        stage = max(sum(count[i] * x for i, x in work.items()) / k, max(work.values(), default=0.0))
        if c.recompute_mode.partial:  # every stage redoes at least one block (or recompute_layers of them, of the
            # blocks a balanced stage holds)
            redo = ev.distinct_costs(c.fallback(recompute="full"))
            blocks = sum(count[i] for i in rows if ev.units[i].kind == "block")
            stage += max(1, min(c.recompute_layers, blocks // k)) * min(
                (redo[i][1] - r[1] for i, r in rows.items() if ev.units[i].kind == "block"), default=0.0)
        # a split backward's bubble shrinks as W grows and F shrinks: the extreme shares of any unit bound it below
        f = stage * min((fwd[i] / x for i, x in work.items() if x), default=0.0) if split else 0.0
        w = stage * max((rows[i][4] / x for i, x in work.items() if x), default=0.0) if split else 0.0
        ev._cache[key] = (stage, f, w)
    stage, f, w = ev._cache[key]
    floor = ev.dp_comm_floor(c)  # ZeRO-2/3: the sharded collectives' own time
    if not split:  # one stage no faster than memory lets it be (Evaluator.least_slowest_stage_s), the others
        # sharing the rest of the work evenly
        slowest = max(stage, ev.least_slowest_stage_s(c))
        rest = (stage * k - slowest) / (k - 1) if k > 1 else 0.0
        return max(floor, c.schedule_kind.analytic_s((slowest,) + (rest,) * (k - 1), (0.0,) * k, c.pp, c.v, c.m,
                                                     0.0, ()))
    return max(floor, c.schedule_kind.analytic_s((f,) * k, (stage - f,) * k, c.pp, c.v, c.m, 0.0,
                                                 (min(w, stage - f),) * k))


def search(ev: Evaluator, pins: Pins = Pins(), *, top: int = 6, simulate_top: int = 3,
           progress: Callable[[int, int], None] | None = None,
           simulating: Callable[[], None] | None = None) -> SearchResult:
    """`progress`: (configurations taken from the queue, queued so far), at each; `simulating`: called once the
    queue is done, before the best configurations are simulated event by event."""
    cl = ev.hw.cluster
    check_cluster(ev.n_gpus, cl.gpus_per_node)
    rejected: Counter = Counter()
    pool = list(candidates(len(ev.units), ev.n_gpus, cl.gpus_per_node, ev.global_batch, pins, rejected,
                           heads=((u.heads, u.kv_heads) for u in ev.units), seq=ev.tokens_per_sample,
                           experts=math.gcd(*(u.experts for u in ev.units)), refused=ev.refused))
    if not pool:
        raise NoFeasibleConfig(_no_candidates_message(ev, pins, rejected))
    leanest: tuple[float, ParallelConfig] | None = None
    found: list[Evaluation] = []
    # one queue by lower bound. A configuration enters with its ranks' share of the work (_least_work_s, ~1 us) and
    # is bounded in full (its memory, its schedule: _optimistic_iteration, ~40 us) only when it reaches the front, so
    # the ~10^4 the search never prices are never bounded either; what did not fit comes back with more
    # recomputation or sharding (_fallbacks), priced only where it could beat the best found (not merely rank among
    # the top)
    heap = [(_least_work_s(ev, c), i, c, _UNBOUNDED) for i, c in enumerate(pool)]
    heapq.heapify(heap)
    seen, count = set(pool), len(heap)

    def push(c: ParallelConfig, lower: float, kind: int) -> None:
        nonlocal count
        heapq.heappush(heap, (lower, count, c, kind))
        count += 1

    def retry(c: ParallelConfig, lower: float, r: Rejected | None = None) -> None:
        """Queue what c falls back to (_fallbacks), each bounded below by `lower` and its own optimistic time (with
        at least the recomputation `r`, c's shortfall, says it needs)."""
        for f in _fallbacks(c, pins, cl.gpus_per_node):
            if f not in seen:
                seen.add(f)
                push(f, max(lower, _optimistic_iteration(ev, f if r is None else _at_least(ev, f, r))), _FALLBACK)
    while heap:
        lower, _, c, kind = heapq.heappop(heap)
        if progress:
            progress(count - len(heap) - 1, count)
        if len(found) >= top and lower >= found[top - 1].iteration_s:
            rejected["cannot beat the top configurations"] += 1 + len(heap)
            break
        if kind == _UNBOUNDED:  # the first of c and its fallbacks that memory does not rule out, bounded in full
            short = 0.0  # bytes the last configuration tried was over by, at the least
            for k, f in enumerate(chain((c,), _fallbacks(c, pins, cl.gpus_per_node))):
                need = ev.memory_lower_bound(f)
                if need <= ev.capacity:
                    bound = f if not short or not f.recompute_mode.partial or f.recompute_layers else \
                        replace(f, recompute_layers=ev.least_recompute_for(f, short))  # it redoes no fewer blocks
                    if not k or f not in seen:
                        seen.add(f)
                        push(f, max(lower, _optimistic_iteration(ev, bound)), _FALLBACK if k else _BOUNDED)
                    break
                short = need - ev.capacity
                rejected["memory (lower bound)"] += 1
                leanest = min(leanest or (need, f), (need, f), key=lambda x: x[0])
            continue
        if kind == _FALLBACK and found and lower >= found[0].iteration_s:
            rejected["cannot beat the best configuration"] += 1
            continue
        try:
            e = ev.evaluate(c)
        except Rejected as r:
            rejected[r.reason] += 1
            if r.need_bytes and (leanest is None or r.need_bytes < leanest[0]):
                leanest = (r.need_bytes, c)
            if r.reason == "memory":  # what only adds work to c is no faster than c would have been
                retry(c, max(lower, r.lower_s), r)
        else:
            found.append(e)
            found.sort(key=lambda e: e.iteration_s)
            if ev.memory_shaped(e):  # it fits, but slower than with more memory: as where it does not fit
                retry(c, lower)
    if not found:
        raise NoFeasibleConfig(_no_fit_message(ev, leanest, rejected))
    if simulating:
        simulating()
    # simulated times only (Evaluator.simulated); the timelines of the best alone, once it is known
    simulated = [ev.simulated(e) for e in found[:simulate_top]]
    # the analytic ranking is not the simulated one: simulate every other configuration whose lower bound
    # (Evaluation.lower_bound_s: no simulation of it ends sooner) is below the best simulated time so far
    best_s = min(x.iteration_s for x in simulated)
    for e in sorted(found[simulate_top:], key=Evaluation.lower_bound_s):
        if e.lower_bound_s() >= best_s:
            break
        simulated.append(ev.simulated(e))
        best_s = min(best_s, simulated[-1].iteration_s)
    simulated.sort(key=lambda x: x.iteration_s)
    best, sim = ev.simulate_config(simulated[0])
    done = {s.config for s in simulated}
    rest = (simulated[1:] + [e for e in found[:top] if e.config not in done])[:max(top - 1, 0)]
    return SearchResult(best=best, simulation=sim, runners_up=tuple(rest),
                        evaluated=len(found) + sum(rejected.values()), rejected=dict(rejected))


def _at_least(ev: Evaluator, c: ParallelConfig, r: Rejected) -> ParallelConfig:
    """For bounding a partial recomputation `c` whose sibling recomputing nothing was short of memory by what `r`
    says: with the count of blocks per chunk it needs at least (Evaluator.recompute_guess; a heuristic bound: another
    partition may need fewer)."""
    if not c.recompute_mode.partial or c.recompute_layers or r.need_bytes <= ev.capacity:
        return c
    return replace(c, recompute_layers=ev.recompute_guess(c, r.need_bytes - ev.capacity, r.bounds))


def _fallbacks(c: ParallelConfig, pins: Pins, node: int) -> Iterator[ParallelConfig]:
    """What to price, in order, where `c` does not fit: partial recomputation of each chunk's first blocks for a
    configuration that recomputes nothing (the least count that fits; where the engine runs it), then ZeRO-2 and
    ZeRO-3 for a ZeRO-1 one (the stages past the engine's first sharded one: Engine.zero_stages), ZeRO-3 first as
    hybrid sharding where the engine runs it (_replicas: the fewest ranks of `node` GPUs sharding first). Each only
    adds work, so it is priced only where less does not fit, and only what the search chooses (none pinned); made as
    they are asked for."""
    engine = ENGINES[pins.engine]
    if c.recompute == "none" and pins.recompute is None and engine.recompute_block:
        yield c.fallback(recompute="block")
    if pins.zero is None and c.zero == engine.zero_stages[1]:
        for z in engine.zero_stages[2:]:
            for r in reversed(_replicas(c.tp, c.dp, c.cp, node, pins, z)):
                try:
                    yield c.fallback(zero=z) if r == 1 else replace(c.fallback(zero=z), dp_replicate=r)
                except ConfigError:  # (expert parallelism that does not divide the shard group)
                    continue


def _pins_arithmetic(n_gpus: int, global_batch: int, pins: Pins, gpus: bool = True) -> str | None:
    """Where the pinned degrees' products cannot add up, that arithmetic in one sentence: t*p*d*cp GPUs against
    --gpus (unless not `gpus`), and d*b samples a step against the global batch (each data-parallel rank runs whole
    microbatches). Either excludes every configuration, whatever else was rejected."""
    import math

    flags = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp"}
    pinned = [(flags[k], getattr(pins, k)) for k in flags if getattr(pins, k) is not None]
    product = math.prod(v for _, v in pinned)
    named = " x ".join(f"{f} {v}" for f, v in pinned)
    fixed = {k for k in flags if getattr(pins, k) is not None}
    if gpus and fixed >= {"tp", "pp", "dp"} and product != n_gpus and (
            product > n_gpus or n_gpus % product or "cp" in fixed):  # (no cp pinned: it may take what is left)
        return f"{named} is {product} GPUs, not {n_gpus}: t*p*d*cp must be the GPU count (--gpus)"
    if gpus and pinned and n_gpus % product:
        return (f"{named} {'is' if len(pinned) > 1 else 'needs'} {product} GPUs, which does not divide {n_gpus}: "
                "t*p*d*cp must be the GPU count (--gpus), the search choosing what is not pinned")
    if pins.b is None:
        return None
    d = pins.dp if pins.dp is not None else n_gpus // product if fixed == {"tp", "pp", "cp"} else None
    if d is not None and global_batch % (d * pins.b):
        by = f"--dp {pins.dp}" if pins.dp is not None else f"d={d} (the GPUs the pinned degrees leave)"
        return (f"{by} x --microbatch {pins.b} is {d * pins.b} samples a step, which does not divide the global batch "
                f"of {global_batch}: d*b must divide it (each data-parallel rank runs whole microbatches)")
    if d is None and not n_gpus % product and all(global_batch % (k * pins.b) for k in divisors(n_gpus // product)):
        return (f"--microbatch {pins.b} times no data-parallel degree these {n_gpus} GPUs allow divides the global "
                f"batch of {global_batch}: d*b must divide it (each data-parallel rank runs whole microbatches)")
    return None


def _no_candidates_message(ev: Evaluator, pins: Pins, rejected: Counter) -> str:
    # (the GPU count's only where nothing else was rejected: a pinned t's own reason, its heads, says more)
    if (arithmetic := _pins_arithmetic(ev.n_gpus, ev.global_batch, pins, gpus=not rejected)) is not None:
        return arithmetic
    why = "; ".join(f"{k}: {v}" for k, v in rejected.items()) or "the pins exclude every configuration"
    others = [k for k in rejected if "which the runtime cannot run" not in k]  # (the model's splits: said elsewhere)
    if others == ["global batch not divisible by d"]:
        return (f"global batch {ev.global_batch} is not divisible by d*b for any data-parallel degree d "
                f"allowed here{' (d pinned to ' + str(pins.dp) + ')' if pins.dp else ''}; choose a global batch "
                f"that is a multiple of {pins.dp or ev.n_gpus}")
    return f"no configuration of {ev.n_gpus} GPUs satisfies the constraints ({why})"


def _no_fit_message(ev: Evaluator, leanest: tuple[float, ParallelConfig] | None, rejected: Counter) -> str:
    cap = ev.capacity / 2**30
    if leanest is None:
        why = "; ".join(f"{k}: {v}" for k, v in rejected.items())
        return f"no configuration of {ev.n_gpus} GPUs works ({why})"
    need, c = leanest
    node = ev.hw.cluster.gpus_per_node
    more = int(-(-ev.n_gpus * need // ev.capacity))
    more = -(-more // node) * node  # whole nodes
    return (f"the model fits no configuration on {ev.n_gpus} x {ev.hw.name}: the leanest ({c}) needs "
            f"{need / 2**30:.1f} GiB per GPU against {cap:.0f} GiB; use about {more} or more GPUs "
            f"({more // node} nodes of {node}), a GPU "
            "with more memory (--target), a smaller microbatch or global batch, or sharded optimizer state")
