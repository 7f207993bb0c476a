"""Zero-bubble schedules and the placement: torch's generators, the paper's closed form, the memory they hold."""
from __future__ import annotations

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                    ScheduleZBVZeroBubble)

from planner.schedule_ir import Op, Placement, validate
from planner.schedules import SCHEDULES
from planner.simulate import SimCosts, simulate

SHAPES = [(2, 2), (2, 4), (3, 7), (4, 2), (4, 3), (4, 4), (4, 6), (4, 8), (4, 12), (8, 16)]


def order_memory(kind: str, p: int, v: int, m: int) -> list[tuple[float, float]]:
    """Per rank, from the generated order: (chunks between their F and their I/B at the peak, chunks between
    their I and W then), each over v; the peak is of F - I - B + omega (I - W) for omega = 1/2, the weight
    gradient's share of the activations (ties broken by the larger W share)."""
    out = []
    for order in SCHEDULES[kind].compute(p, m, v):
        a = c = 0
        best = (-1.0, 0, 0)
        for op, _, _ in order:
            if op is Op.F:
                a += 1
            elif op is Op.I:
                a, c = a - 1, c + 1
            elif op is Op.W:
                c -= 1
            else:
                a -= 1
            best = max(best, (a + c / 2, c, a))
        out.append((best[2] / v, best[1] / v))
    return out


def _torch_order(cls: type, p: int, m: int, v: int) -> list[list[str]]:
    """The compute order torch's schedule class builds for every rank (its per-rank generator, without stages
    or process groups: the attributes it reads, set as its __init__ sets them)."""
    s = object.__new__(cls)
    s.pp_group_size, s._n_microbatches, s.n_local_stages, s.num_stages = p, m, v, p * v
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    s.rank, s.stage_index_to_group_rank = 0, generate_stage_to_rank_mapping(p, p * v)
    return [[str(a) for a in s._calculate_single_rank_operations(r) if a is not None] for r in range(p)]


def _ours(kind: str, p: int, m: int, v: int) -> list[list[str]]:
    return [[f"{k}{op.value}{mb}" for op, k, mb in order] for order in SCHEDULES[kind].compute(p, m, v)]


@pytest.mark.parametrize("p,m", SHAPES)
@pytest.mark.parametrize("kind,cls,v", [("zbh1", ScheduleInterleavedZeroBubble, 1), ("zbv", ScheduleZBVZeroBubble, 2)])
def test_zero_bubble_compute_order_is_torchs(kind: str, cls: type, v: int, p: int, m: int) -> None:
    assert _ours(kind, p, m, v) == _torch_order(cls, p, m, v)
    validate(SCHEDULES[kind].generate(p, m, v))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (2, 8), (4, 12)])
def test_interleaved_compute_order_is_torchs(p: int, m: int) -> None:
    """Megatron's interleaving as torch generates it where the two agree on the warm-up (m a multiple of p, m > p: at
    m == p Megatron runs every forward first, torch does not)."""
    assert _ours("interleaved", p, m, 2) == _torch_order(ScheduleInterleaved1F1B, p, m, 2)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (3, 4), (1, 2)])
def test_placements_are_torchs(p: int, v: int) -> None:
    for style in ("loop", "v"):
        place = Placement(style, p, v)
        assert dict(enumerate(place.rank_of)) == generate_stage_to_rank_mapping(p, p * v, style=style)
        assert sorted(k for r in range(p) for k in place.stages(r)) == list(range(p * v))
    assert Placement("v", 4, 2).stages(1) == (1, 6)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 24)])
@pytest.mark.parametrize("tf,ti,tw", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.8), (1.2, 1.0, 0.5), (1.0, 2.0, 0.4)])
def test_zbh1_bubble_is_the_papers_closed_form(p: int, m: int, tf: float, ti: float, tw: float) -> None:
    """Qi et al. 2024, section 2.1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) (T_B their input gradient, our I;
    a third of 1F1B's (p-1)(T_F + T_B + T_W) when the three are equal), for m >= p."""
    costs = SimCosts(forward_s=(tf,) * p, backward_s=(ti + tw,) * p, weight_s=(tw,) * p, p2p_s=0.0,
                     allreduce_s=(0.0,) * p, optimizer_s=(0.0,) * p, static_bytes=(0,) * p,
                     activation_bytes=(1,) * p, weight_bytes=(0,) * p, capacity_bytes=10)
    res = simulate(SCHEDULES["zbh1"].generate(p, m, 1), costs)
    work = m * (tf + ti + tw)
    assert res.iteration_s == pytest.approx(work + (p - 1) * (tf + ti - tw))
    assert SCHEDULES["zbh1"].analytic_s((tf,) * p, (ti + tw,) * p, p, 1, m, 0.0, (tw,) * p) == \
        pytest.approx(res.iteration_s)
    one_f_one_b = simulate(SCHEDULES["1f1b"].generate(p, m, 1), costs)
    assert res.iteration_s <= one_f_one_b.iteration_s + 1e-9  # (p-1)(T_F + T_B + T_W) there


@pytest.mark.parametrize("kind,v", [("zbh1", 1), ("zbv", 2), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 2), (4, 3), (4, 4), (4, 8), (4, 12), (8, 8), (8, 15), (8, 32)])
def test_memory_model_matches_the_generated_order(kind: str, v: int, p: int, m: int) -> None:
    """The kind's in-flight and pending-W counts (what the search's memory check multiplies) are the generated
    order's, and bound the simulated ledger from above for any split of the activations into I's and W's."""
    k = SCHEDULES[kind]
    if k.check(p, v, m) is not None:
        pytest.skip(k.check(p, v, m))
    assert [(k.inflight(p, v, m, r), k.w_pending(p, v, m, r)) for r in range(p)] == \
        order_memory(kind, p, v, m)
    s = k.generate(p, m, v)
    for keep in (0, 3, 5):  # of 10 bytes a stage's microbatch holds, what waits for W
        costs = SimCosts(forward_s=(1.0,) * (p * v), backward_s=(2.0,) * (p * v), weight_s=(0.7,) * (p * v),
                         p2p_s=0.1, allreduce_s=(0.0,) * p, optimizer_s=(0.0,) * p, static_bytes=(0,) * p,
                         activation_bytes=(10,) * (p * v), weight_bytes=(keep,) * (p * v), capacity_bytes=10**6)
        res = simulate(s, costs)
        for r in range(p):
            bound = (k.inflight(p, v, m, r) * 10 + k.w_pending(p, v, m, r) * keep) * v
            assert res.peak_bytes[r] <= bound + 1e-9, (r, res.peak_bytes[r], bound)
            ledger = res.memory[r]
            assert ledger[0] == (0.0, 0) and ledger[-1][1] == 0  # everything held is freed by the end


def test_v_placement_hands_over_without_transfers() -> None:
    """ZB-V's middle stages p-1 and p share rank p-1: no SEND/RECV between them, and the simulator charges no hop."""
    p, m = 4, 8
    s = SCHEDULES["zbv"].generate(p, m, 2)
    texts = {str(a) for a in s.ranks[p - 1]}
    assert f"{p - 1}SEND_F0" not in texts and f"{p}RECV_F0" not in texts and f"{p}SEND_B0" not in texts
    assert f"{p}SEND_F0" in texts and f"{p - 2}SEND_F0" not in texts  # stage p goes on to rank p-2
    assert any(a.op is Op.I for a in s.ranks[0]) and any(a.op is Op.W for a in s.ranks[0])


@pytest.mark.parametrize("t,recompute", [(1, "none"), (2, "selective"), (1, "full")])
def test_zbh1_bubble_with_the_units_own_split(t: int, recompute: str) -> None:
    """T_F, T_I and T_W of a GPT-3 block on an A100 (costmodels.compute.unit_time: W is the four linears' dW)
    put into p uniform stages: the simulated ZB-H1 iteration is the paper's closed form, and below 1F1B by
    (p-1)(2 T_W)."""
    from costmodels.compute import unit_time
    from costmodels.hardware import Hardware
    from passes.pipeline import analyze
    from planner.config import ParallelConfig
    from targets.registry import get_target
    from tests.conftest import EXAMPLES

    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b", "layers": 2})
    block = next(u for u in prof.units if u.kind == "block")
    p, m = 4, 16
    cfg = ParallelConfig(tp=t, pp=p, dp=1, b=1, m=m, recompute=recompute, schedule="zbh1")
    ut = unit_time(block, Hardware(target=get_target("a100-80gb")), cfg)
    tf, ti, tw = ut.fwd_s, ut.bwd_input_s, ut.bwd_weight_s
    assert 0 < tw < ti and ti + tw == pytest.approx(ut.bwd_s)
    costs = SimCosts(forward_s=(tf,) * p, backward_s=(ut.bwd_s,) * p, weight_s=(tw,) * p, p2p_s=0.0,
                     allreduce_s=(0.0,) * p, optimizer_s=(0.0,) * p, static_bytes=(0,) * p,
                     activation_bytes=(1,) * p, weight_bytes=(0,) * p, capacity_bytes=10)
    zb = simulate(SCHEDULES["zbh1"].generate(p, m, 1), costs).iteration_s
    assert zb == pytest.approx(m * (tf + ti + tw) + (p - 1) * (tf + ti - tw), rel=1e-9)
    one_f_one_b = simulate(SCHEDULES["1f1b"].generate(p, m, 1), costs).iteration_s
    assert one_f_one_b - zb == pytest.approx((p - 1) * 2 * tw, rel=1e-9)


def test_ranks_are_derived_only_by_the_placement() -> None:
    """No code outside planner/schedule_ir.py's Placement turns a stage into a rank with `% p` (strings and
    comments aside): a new placement changes one class."""
    import io
    import re
    import tokenize
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"\b(stage|k|j|s|idx)(\.stage)? *% *[a-z_.]*\bp(p|p_size)?\b")
    found = []
    for path in [*root.glob("planner/**/*.py"), *root.glob("costmodels/*.py"), *root.glob("passes/*.py")]:
        if path.name == "schedule_ir.py" and path.parent.name == "planner":
            continue
        code: dict[int, list[str]] = {}
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type not in (tokenize.STRING, tokenize.COMMENT):
                code.setdefault(tok.start[0], []).append(tok.string)
        found += [f"{path.relative_to(root)}:{n}" for n, toks in code.items()
                  if pattern.search(" ".join(toks).replace(" . ", "."))]
    assert not found, found
