"""Fault points: every point the product code names is a known one, and a misspelt one fails
loudly instead of never firing (a crash test armed with it would then test nothing). A point
armed to pause stands until it is resumed, once."""
import ast
import threading
from pathlib import Path

import pytest

from scheduling.faults import POINTS, fault_point
from tests.conftest import REPO, pause_at


def named_points() -> set[str]:
    names = set()
    for app in ("budgets", "exports", "scheduling", "tasks", "usage"):
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


def test_a_point_armed_to_pause_waits_until_resumed_and_pauses_once(tmp_path, monkeypatch):
    pause = pause_at("mid_stream", tmp_path)
    for name, value in pause.env.items():
        monkeypatch.setenv(name, value)
    fault_point("after_claim")  # another point: goes straight on
    assert not pause.reached()

    passed = threading.Event()
    waiting = threading.Thread(target=lambda: (fault_point("mid_stream"), passed.set()))
    waiting.start()
    assert not passed.wait(0.5)  # standing at the point
    assert pause.reached()
    pause.resume()
    assert passed.wait(5)
    waiting.join()

    fault_point("mid_stream")  # fired once: a retry passes the point without stopping
