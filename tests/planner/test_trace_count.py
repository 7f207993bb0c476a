"""A plan traces its model once (issue 47): torch.export for the priced graph, which is also the graph the fxplanner
runtime splits its stages from. What of a tensor- or context-parallel split the runtime cannot run is read off that
graph (passes/sharding/check.py): no second trace, no second search."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx as fx

from planner.api import make_plan
from planner.search import Pins

from ..runtime._util import GPT, ROOT

CUMSUM = ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py"
KW = dict(gpus=2, global_batch=4, target=str(ROOT / "examples" / "targets" / "cpu-core.yaml"), gpus_per_node=2)
ARGS = {"preset": "tiny", "layers": 2, "dropout": 0}


@pytest.fixture
def traces(monkeypatch) -> Counter:
    """torch.export.export calls, and symbolic traces outside them (export runs fx's tracer inside)."""
    counts: Counter = Counter()
    inside: list[bool] = []
    fx_trace, export = fx.Tracer.trace, torch.export.export

    def counted_trace(self, root, *args, **kwargs):
        counts["fx"] += not inside
        return fx_trace(self, root, *args, **kwargs)

    def counted_export(*args, **kwargs):
        counts["export"] += 1
        inside.append(True)
        try:
            return export(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(fx.Tracer, "trace", counted_trace)
    monkeypatch.setattr(torch.export, "export", counted_export)
    return counts


@pytest.mark.parametrize("model,args", [(GPT, ARGS), (CUMSUM, ARGS)])
def test_a_plan_traces_its_model_once(traces, model, args):
    plan, _ = make_plan(str(model), model_args=args, pins=Pins(pp=1, precision="fp32"), **KW)
    assert traces == Counter(export=1), traces
    if model == CUMSUM:  # the runtime cannot split it: the search left tensor parallelism out, traced once all the same
        assert plan.config.tp == 1
        assert any("tensor parallelism, which the runtime cannot run" in k and "cumsum_mlp.py:14" in k
                   for k in plan.search.rejected), plan.search.rejected
