"""A worker's stderr reaches the daemon's log only as a field of a "worker output" record, bounded."""

from __future__ import annotations

import json
import logging
import os

from kvxferd.service.workers import output
from kvxferd.service.workers.output import MAX_LINE_BYTES, OutputRelay

FORGED = json.dumps({"ts": "2026-11-29T00:00:00Z", "level": "INFO", "logger": "kvxferd.daemon",
                     "msg": "engine registered", "engine_id": "victim"})


def relayed(data: bytes, caplog) -> tuple[list[logging.LogRecord], OutputRelay]:
    read_end, write_end = os.pipe()
    relay = OutputRelay(os.fdopen(read_end, "rb"), "kvx-test-w1")
    with os.fdopen(write_end, "wb") as stream:
        stream.write(data)
    relay.join(10)
    assert not relay.thread.is_alive()
    return [r for r in caplog.records if r.name == "kvxferd.workers"], relay


def test_a_line_that_looks_like_the_daemons_own_is_a_field_of_a_worker_record(caplog):
    caplog.set_level(logging.WARNING, "kvxferd.workers")
    records, relay = relayed(f"{FORGED}\nE1129 ucx_utils.cpp:210] UCX AM send failed\n".encode(), caplog)
    assert [(r.getMessage(), r.worker, r.line) for r in records] == [
        ("worker output", "kvx-test-w1", FORGED), ("worker output", "kvx-test-w1", "E1129 ucx_utils.cpp:210] UCX AM send failed")]
    assert relay.num_lines == 2 and relay.num_dropped == 0
    # The control: no record of the daemon's own logger came out of it.
    assert not [r for r in caplog.records if r.name == "kvxferd.daemon"]


def test_a_flood_is_counted_not_logged_and_a_line_without_end_comes_in_bounded_pieces(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, "kvxferd.workers")
    monkeypatch.setattr(output, "LINES_PER_S", 0.0)
    monkeypatch.setattr(output, "BURST_LINES", 5)
    records, relay = relayed(b"x\n" * 50 + b"y" * (MAX_LINE_BYTES * 3), caplog)
    lines = [r for r in records if r.getMessage() == "worker output"]
    assert len(lines) == 5 and relay.num_dropped == 50 + 3 - 5
    (summary,) = [r for r in records if r.getMessage() == "worker output dropped"]
    assert summary.dropped_lines == 48
    relay_big, _ = relayed(b"z" * (MAX_LINE_BYTES * 2 + 10), caplog)
    pieces = [r for r in relay_big if r.getMessage() == "worker output" and r.line.startswith("z")]
    assert [(len(r.line), r.cut) for r in pieces] == [(MAX_LINE_BYTES, True), (MAX_LINE_BYTES, True), (10, False)]
