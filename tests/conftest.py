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
