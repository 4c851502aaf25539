"""Fault points: every point the product code names is a known one, and a misspelt one fails
loudly instead of never firing (a crash test armed with it would then test nothing)."""
import ast
from pathlib import Path

import pytest

from scheduling.faults import POINTS, fault_point
from tests.conftest import REPO


def named_points() -> set[str]:
    names = set()
    for app in ("budgets", "exports", "scheduling"):
        for path in (REPO / app).rglob("*.py"):
            for node in ast.walk(ast.parse(Path(path).read_text())):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fault_point"
                        and node.args and isinstance(node.args[0], ast.Constant)):
                    names.add(node.args[0].value)
    return names


def test_every_fault_point_in_the_code_is_known_and_every_known_point_is_used():
    assert named_points() == POINTS


def test_an_unknown_fault_point_fails_loudly():
    with pytest.raises(ValueError, match="unknown fault point 'after_setle'"):
        fault_point("after_setle")
