"""The read path's shape holds (issue #54): one function plans and seal-checks a read, the executor
never asks what kind of transfer it holds, and its class and in-flight record stay small."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import InFlightRead

ROOT = Path(__file__).resolve().parents[2] / "kvxferd"
ADMISSION = ROOT / "xfer" / "admission.py"
HANDLE_TYPES = {"NixlTransfer", "PendingDeviceCopy", "BoardCheck", "TransferHandle"}
ADMITTING_CALLS = {"plan_request", "check_read_capabilities", "AdmittedRead"}


def _called(source: str) -> set[str]:
    """Names of everything called in ``source`` (``f(...)`` and ``x.f(...)``)."""
    return {getattr(n.func, "attr", None) or getattr(n.func, "id", None)
            for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)}


def _isinstance_types(source: str) -> set[str]:
    """Type names ``isinstance`` is asked about in ``source``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            names |= {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node.args[1])}
    return names


def _product_sources():
    """The daemon's and the connector's code: not the rig, not the pure plan layer that defines planning."""
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] not in ("rig", "plan"):
            yield path


def test_only_admission_plans_or_seal_checks_a_read():
    callers = {path.relative_to(ROOT).as_posix() for path in _product_sources()
               if _called(path.read_text()) & ADMITTING_CALLS}
    # A push (issue #57) is planned in one place too, PushExecutor.plan: it has no capability to seal (the
    # expectation's tag is checked on the decode board before and after the WRITE).
    assert callers == {"xfer/admission.py", "xfer/pushes.py"}
    # Negative control: the scan sees a planning call where one is.
    assert _called("planned = remote.plan.plan_request(request)") & ADMITTING_CALLS


def test_no_isinstance_on_transfer_handles_in_xfer():
    for path in (ROOT / "xfer").rglob("*.py"):
        assert not _isinstance_types(path.read_text()) & HANDLE_TYPES, path
    assert _isinstance_types("isinstance(h, (int, PendingDeviceCopy))") & HANDLE_TYPES  # negative control


def test_the_executor_and_its_in_flight_record_stay_small():
    lines, _ = inspect.getsourcelines(ReadExecutor)
    assert len(lines) <= 300
    assert len(dataclasses.fields(InFlightRead)) <= 8
