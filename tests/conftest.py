from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FIXTURES = Path(__file__).parent / "fixtures"


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true", help="rewrite golden files (schemas/) from the code")


@pytest.fixture
def regen(request) -> bool:
    return request.config.getoption("--regen-golden")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under xdist (--dist loadgroup, pyproject.toml) the tests of a module that launches torchrun stay on one
    worker: its module-scoped launch then runs once, not once per worker, and two launches never contend for the
    machine's cores. First, before xdist's own hook reads the groups into the test ids."""
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
