"""Per-request stamps (trace.py) on a real hold -> read cycle, and the benchmark's join of them into
consecutive segments of a P/D request's TTFT (kvxferd/rig/vllm/tracejoin.py). vLLM-free."""

from __future__ import annotations

import os

import torch

from kvxferd.integrations.vllm.scheduler import SchedulerSide
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.integrations.vllm.trace import TRACE_DIR_ENV, Trace, read_stamps
from kvxferd.integrations.vllm.worker import WorkerSide
from tests.integrations.connector_pair import connector_pair, read_held

from kvxferd.rig.vllm import tracejoin as join


def test_a_read_is_stamped_in_order_by_both_workers(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    folder = str(tmp_path / "trace")
    with connector_pair(tmp_path, ("tp0", "td0"), trace_dir=folder) as pair:
        WorkerSide("s", 0, 1, ConnectorSettings(engine_socket=pair.daemons[1].socket))  # no trace_dir, no env
        scheduler = SchedulerSide("p", pair.prefill.settings)
        scheduler.set_ranks(pair.ranks)
        _, params = scheduler.hold("req", ([3, 4],), 64)
        read_held(scheduler, pair.prefill, pair.decode, params, [7, 8])
        assert torch.equal(pair.decode_cache["layer.0"][7:9], pair.prefill_cache["layer.0"][3:5])
    stamps = read_stamps(folder)
    assert sorted(os.listdir(folder)) == sorted([f"p-worker0-{os.getpid()}.jsonl", f"d-worker0-{os.getpid()}.jsonl"])
    at = {(s["who"], s["event"], s["id"]): s["t"] for s in stamps}
    order = [("d-worker0", event, "d-req") for event in
             ("submitted", "daemon_got", "daemon_posted", "daemon_moved", "daemon_done", "completion_arrived",
              "completion_taken")]
    times = [at[key] for key in order]
    assert times == sorted(times), list(zip(order, times))
    assert at[("d-worker0", "daemon_done", "d-req")] <= at[("p-worker0", "bus_ended", "req")]  # CONSUMED after the read
    assert not any(s["who"].startswith("s-") for s in stamps)


def test_a_trace_without_a_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    trace = Trace("x")
    trace.stamp("e", ["a"])
    assert not trace.enabled
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "t"))
    on = Trace("x")
    on.stamp("e", ["a", "b"], at_s=5.0, remote="r")
    on.close()
    assert [(s["id"], s["t"], s["remote"]) for s in read_stamps(str(tmp_path / "t"))] == [("a", 5.0, "r"), ("b", 5.0, "r")]


def _request(prefill_id: str, decode_id: str, start_s: float) -> tuple[list[dict], dict]:
    """Stamps of one P/D request: each point 1 ms after the one before."""
    stamps, client = [], {"prefill_id": prefill_id}
    points = list(join.POINTS) + [p for a, b, _ in join.AFTER for p in (a, b) if p not in join.POINTS]
    for n, (kind, event) in enumerate(points):
        t = start_s + n * 1e-3
        if kind == "client":
            client[event] = t
            continue
        who = {"proxy": "proxy", "prefill": "kvx-prefill-worker0", "decode": "kvx-decode-worker0"}[kind]
        stamps.append({"t": t, "who": who, "event": event, "id": decode_id if kind == "decode" else prefill_id})
    stamps.append({"t": start_s, "who": "kvx-decode-scheduler", "event": "matched", "id": decode_id,
                   "remote": prefill_id})  # joins decode's own id to the prefill's
    return stamps, client


def test_segments_join_three_processes_and_add_up_to_ttft():
    stamps, client = _request("p1", "d1", 100.0)
    lines = join.timelines(stamps, [client], "kvx-prefill", "kvx-decode")
    assert len(lines) == 1
    segments = join.segment_ms(lines[0])
    assert len(segments) == len(join.SEGMENTS)
    ttft_ms = (client["first"] - client["start"]) * 1e3
    assert abs(sum(segments) - ttft_ms) < 1e-6
    got = join.summary(lines)
    assert got["requests"] == 1 and abs(got["ttft_ms"] - ttft_ms) < 1e-6 and got["early_holds"] == 0
    early = stamps + [{"t": 100.0, "who": "kvx-prefill-scheduler", "event": "hold_sent", "id": "p1"}]
    assert join.summary(join.timelines(early, [client], "kvx-prefill", "kvx-decode"))["early_holds"] == 1
    # The controls: a request missing one point, or whose decode names another prefill, is left out.
    missing = [s for s in stamps if s["event"] != "daemon_done"]
    assert join.timelines(missing, [client], "kvx-prefill", "kvx-decode") == []
    other = [dict(s, remote="p9") if s.get("remote") else s for s in stamps]
    assert join.timelines(other, [client], "kvx-prefill", "kvx-decode") == []
    # The earliest of repeated stamps counts (vLLM asks the scheduler again on every step it waits).
    again = stamps + [{"t": 500.0, "who": "kvx-prefill-scheduler", "event": "matched", "id": "p1"}]
    assert join.segment_ms(join.timelines(again, [client], "kvx-prefill", "kvx-decode")[0]) == segments


def test_a_push_is_joined_by_its_transfer_id_across_both_engines():
    """Push (issue #57): the engines' own request ids differ from the transfer id; both "matched" stamps
    name it, so each point is found and reported as ms after the client's start."""
    start_s, transfer = 50.0, "push-t1"
    stamps = [
        {"t": start_s + 0.001, "who": "proxy", "event": "prefill_sent", "id": transfer},
        {"t": start_s + 0.004, "who": "kvx-decode-scheduler", "event": "matched", "id": "d1", "remote": transfer},
        {"t": start_s + 0.006, "who": "kvx-decode-worker0", "event": "submitted", "id": "d1"},
        {"t": start_s + 0.005, "who": "kvx-prefill-scheduler", "event": "matched", "id": "p1", "remote": transfer},
        {"t": start_s + 0.020, "who": "kvx-prefill-scheduler", "event": "hold_start", "id": "p1"},
        {"t": start_s + 0.023, "who": "kvx-decode-worker0", "event": "daemon_done", "id": "d1"},
        {"t": start_s + 0.025, "who": "kvx-prefill-worker0", "event": "bus_ended", "id": transfer},
        {"t": start_s + 0.040, "who": "proxy", "event": "first_chunk_out", "id": transfer},
        {"t": start_s + 0.030, "who": "kvx-prefill-scheduler", "event": "hold_start", "id": "p2"},  # another's
    ]
    client = {"start": start_s, "first": start_s + 0.041, "prefill_id": transfer}
    (line,) = join.push_timelines(stamps, [client], "kvx-prefill", "kvx-decode")
    assert {k: round(v, 6) for k, v in line.items()} == {
        ("proxy", "prefill_sent"): 1.0, ("decode", "matched"): 4.0, ("decode", "submitted"): 6.0,
        ("prefill", "matched"): 5.0, ("prefill", "hold_start"): 20.0, ("decode", "daemon_done"): 23.0,
        ("transfer", "bus_ended"): 25.0, ("proxy", "first_chunk_out"): 40.0, ("client", "first"): 41.0}
    got = join.push_summary([line])
    assert got["requests"] == 1 and got["points_ms"]["prefill:hold_end"] == (None, 0)
    (each,) = got["per_request_ms"]  # each request's own points, for the JSON: which request was slow where
    assert each["prefill:hold_start"] == 20.0 and each["client:first"] == 41.0 and "prefill:hold_end" not in each
    # The control: a prefill "matched" naming another transfer leaves the prefill's points out.
    other = [dict(s, remote="push-t9") if s.get("who") == "kvx-prefill-scheduler" and s.get("remote") else s
             for s in stamps]
    (line,) = join.push_timelines(other, [client], "kvx-prefill", "kvx-decode")
    assert ("prefill", "hold_start") not in line and ("decode", "daemon_done") in line
