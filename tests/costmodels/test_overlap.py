"""Data-parallel communication overlapped with compute (Megatron-Core's --overlap-grad-reduce /
--overlap-param-gather): what stays exposed, and how the evaluator prices it."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from costmodels.comm import exposed_reduction_s, megatron_bucket_params

seconds = st.floats(0.0, 2.0)


@st.composite
def ranks(draw):
    v = draw(st.integers(1, 6))
    lists = [draw(st.lists(seconds, min_size=v, max_size=v)) for _ in range(4)]
    bucket = draw(st.lists(st.floats(0.01, 1.0), min_size=v, max_size=v))
    return (*lists, bucket, draw(st.integers(1, 8)), draw(st.integers(1, 8)))


@given(ranks())
def test_exposed_is_between_the_last_bucket_and_the_whole_communication(r):
    grads, gather, fwd, bwd, bucket, first, last = r
    exposed = exposed_reduction_s(grads, gather, fwd, bwd, bucket, first_group=first, last_group=last)
    assert exposed <= sum(grads) + sum(gather) + 1e-12  # overlap never costs time
    assert exposed >= grads[0] * bucket[0] - 1e-12  # the first layers' bucket is final only at the very end
    assert exposed >= gather[0] * bucket[0] - 1e-12  # the first forward waits for its first bucket


@given(ranks(), st.floats(1.0, 4.0))
def test_more_compute_to_hide_behind_never_exposes_more(r, k):
    grads, gather, fwd, bwd, bucket, first, last = r
    base = exposed_reduction_s(grads, gather, fwd, bwd, bucket, first_group=first, last_group=last)
    longer = exposed_reduction_s(grads, gather, [f * k for f in fwd], [b * k for b in bwd], bucket,
                                 first_group=first, last_group=last)
    assert longer <= base + 1e-12


def test_one_chunk_hides_all_but_what_exceeds_its_last_backward():
    # 1F1B, one chunk: 0.3 s of reduction behind a 0.2 s backward, buckets of a tenth: 0.1 s exposed
    assert exposed_reduction_s([0.3], [0.0], [0.1], [0.2], [0.1], first_group=4, last_group=4) == pytest.approx(0.1)
    # a reduction shorter than the backward leaves only the last bucket
    assert exposed_reduction_s([0.1], [0.0], [0.1], [0.2], [0.1], first_group=4, last_group=4) == pytest.approx(0.01)
    # nothing to overlap with: all of it
    assert exposed_reduction_s([0.3], [0.0], [0.1], [0.0], [1.0], first_group=4, last_group=4) == pytest.approx(0.3)


def test_interleaved_chunks_reduce_while_the_earlier_chunks_still_run_backward():
    # v = 2, p = 4: chunk 1's gradients are final 4 backwards of chunk 0 (4 x 0.1 s) before the end
    later = exposed_reduction_s([0.3, 0.3], [0.0, 0.0], [0.05, 0.05], [0.1, 0.1], [0.1, 0.1], first_group=4,
                                last_group=4)
    assert later == pytest.approx(0.3 - 0.1)  # chunk 1 hidden; chunk 0's 0.3 s behind its own 0.1 s backward


def test_megatron_bucket_size():
    assert megatron_bucket_params(8) == 40_000_000
    assert megatron_bucket_params(128) == 128_000_000


def test_the_evaluator_prices_overlap_below_the_plain_reduction_and_the_plan_records_it():
    from passes.pipeline import analyze
    from planner.config import ParallelConfig
    from planner.evaluate import Evaluator
    from planner.plan import ConfigModel
    from costmodels.hardware import Hardware
    from targets.registry import get_target
    from pathlib import Path

    prof, _ = analyze(str(Path(__file__).parents[2] / "examples" / "gpt.py"), {})
    ev = Evaluator(units=prof.units, hw=Hardware(target=get_target("a100-80gb")), global_batch=512, n_gpus=256,
                   tokens_per_sample=prof.tokens_per_sample)
    for v, sched in ((1, "1f1b"), (2, "interleaved")):
        common = dict(tp=8, pp=2, dp=16, b=1, m=32, v=v, schedule=sched, recompute="full")
        for zero in (0, 1):
            plain = ev.evaluate(ParallelConfig(**common, zero=zero))
            over = ev.evaluate(ParallelConfig(**common, zero=zero, overlap_grad_reduce=True))
            assert all(0 < o < a for o, a in zip(over.allreduce_s, plain.allreduce_s))
            assert over.iteration_s < plain.iteration_s
    cfg = ParallelConfig(**common, zero=1, overlap_grad_reduce=True)
    assert ConfigModel.of(cfg).to_config() == cfg


def test_tensor_parallel_overlap_hides_communication_behind_the_gemms_and_needs_sp():
    from pathlib import Path

    from costmodels.compute import unit_time
    from costmodels.hardware import Hardware
    from passes.pipeline import analyze
    from planner.config import ConfigError, ParallelConfig
    from targets.registry import get_target

    prof, _ = analyze(str(Path(__file__).parents[2] / "examples" / "gpt.py"), {})
    hw = Hardware(target=get_target("h100-sxm"))
    block = next(u for u in prof.units if u.kind == "block")
    plain = unit_time(block, hw, ParallelConfig(tp=8, pp=1, dp=1, b=1, m=1, sp=True))
    over = unit_time(block, hw, ParallelConfig(tp=8, pp=1, dp=1, b=1, m=1, sp=True, tp_comm_overlap=True))
    assert 0 <= over.tp_comm_s < plain.tp_comm_s
    assert over.fwd_s + over.bwd_s == pytest.approx(plain.fwd_s + plain.bwd_s - (plain.tp_comm_s - over.tp_comm_s))
    with pytest.raises(ConfigError, match="needs sp"):
        ParallelConfig(tp=8, pp=1, dp=1, b=1, m=1, tp_comm_overlap=True)
