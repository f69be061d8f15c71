"""A worker's stderr reaches the daemon's log only as a field of a "worker output" record, bounded."""

from __future__ import annotations

import json
import logging
import os

from kvxferd.service.base.logs import JsonFormatter
from kvxferd.service.workers import output
from kvxferd.service.workers.output import MAX_LINE_BYTES, OutputRelay

FORGED = json.dumps({"ts": "2026-11-29T00:00:00Z", "level": "INFO", "logger": "kvxferd.daemon",
                     "msg": "engine registered", "engine_id": "victim"})


def relayed(data: bytes, caplog) -> tuple[list[logging.LogRecord], OutputRelay]:
    """Relay ``data`` (all in the pipe before the relay reads: one chunk) to its end of file."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as stream:
        stream.write(data)
    relay = OutputRelay(os.fdopen(read_end, "rb"), "kvx-test-w1")
    relay.join(10)
    assert not relay.thread.is_alive()
    return [r for r in caplog.records if r.name == "kvxferd.workers"], relay


def test_a_line_that_looks_like_the_daemons_own_is_a_field_of_a_worker_record(caplog):
    caplog.set_level(logging.WARNING, "kvxferd.workers")
    records, relay = relayed(f"{FORGED}\r\nE1129 ucx_utils.cpp:210] UCX AM send failed\n".encode(), caplog)
    assert [(r.getMessage(), r.worker, r.line) for r in records] == [
        ("worker output", "kvx-test-w1", FORGED), ("worker output", "kvx-test-w1", "E1129 ucx_utils.cpp:210] UCX AM send failed")]
    assert relay.num_lines == 2 and relay.num_dropped == 0
    # As the daemon writes it: one record of the workers' logger, the forged line inside it as a string.
    written = json.loads(JsonFormatter().format(records[0]))
    assert (written["logger"], written["msg"], written["line"]) == ("kvxferd.workers", "worker output", FORGED)
    # The control: the same line written to the daemon's stderr as it was would read as the daemon's record.
    assert json.loads(FORGED)["logger"] == "kvxferd.daemon" and json.loads(FORGED)["msg"] == "engine registered"


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


def test_once_out_of_lines_a_flood_is_counted_by_the_chunk(caplog, monkeypatch):
    """Past the budget the relay only counts newlines: a worker writing a million empty lines costs a few
    reads, and the dropped count is said."""
    caplog.set_level(logging.WARNING, "kvxferd.workers")
    monkeypatch.setattr(output, "LINES_PER_S", 0.0)
    monkeypatch.setattr(output, "BURST_LINES", 0)
    read_end, write_end = os.pipe()
    relay = OutputRelay(os.fdopen(read_end, "rb"), "kvx-test-w2")
    with os.fdopen(write_end, "wb") as stream:
        for _ in range(16):
            stream.write(b"\n" * 65536)
    relay.join(10)
    assert relay.num_lines == 0 and relay.num_dropped == 16 * 65536
    dropped = sum(r.dropped_lines for r in caplog.records if r.getMessage() == "worker output dropped")
    assert dropped == 16 * 65536
