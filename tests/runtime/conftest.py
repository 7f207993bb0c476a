from __future__ import annotations

from pathlib import Path

import pytest

from ._util import GPT, gpt_args, plan_file


@pytest.fixture(scope="session")
def small_plan(tmp_path_factory) -> Path:
    """GPT tiny with 2 layers on p=2 (world 2), 1F1B, global batch 4."""
    path = tmp_path_factory.mktemp("small") / "plan.json"
    plan_file(path, GPT, gpt_args(2), gpus=2, global_batch=4, t=1, p=2, d=1, b=1, v=1, schedule="1f1b")
    return path
