"""The backend seam holds: NIXL's ReadExecutor implements every member of ReadBackend, and the service
layer reaches a slot's backend only through those members (a second data path then needs no change
to the read's record, the session or the books)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kvxferd.xfer.backend import ReadBackend
from kvxferd.xfer.reads import ReadExecutor

SERVICE = Path(__file__).resolve().parents[2] / "kvxferd" / "service"


def _members() -> set[str]:
    names = {name for name, value in vars(ReadBackend).items() if not name.startswith("_") and callable(value)}
    return names | set(ReadBackend.__annotations__)


def _backend_uses(source: str) -> set[str]:
    """Attributes taken of anything named ``executor`` (``slot.executor.poll``, ``executor.lock``)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "executor":
                used.add(node.attr)
    return used


def test_the_nixl_executor_implements_every_member_with_the_same_parameters():
    for name in _members():
        assert hasattr(ReadExecutor, name) or name in ReadBackend.__annotations__, name
        declared = getattr(ReadBackend, name, None)
        if callable(declared):
            expected = list(inspect.signature(declared).parameters)
            assert list(inspect.signature(getattr(ReadExecutor, name)).parameters) == expected, name


def test_the_service_layer_uses_the_backend_only_through_the_seam():
    used: dict[str, set[str]] = {}
    for path in SERVICE.rglob("*.py"):
        for attr in _backend_uses(path.read_text()):
            used.setdefault(attr, set()).add(path.name)
    assert used, "the scan found no use of a backend at all: it looks in the wrong place"
    outside = {attr: files for attr, files in used.items() if attr not in _members()}
    assert not outside, f"service code reaches past the backend seam: {outside}"


def test_the_scan_sees_a_reach_past_the_seam():
    """The negative control: a service file touching the NIXL agent behind the backend is caught."""
    assert _backend_uses("slot.executor.agent.name\nexecutor.notices.poll_notifications()") == {"agent", "notices"}
    assert not {"agent", "notices"} <= _members()
