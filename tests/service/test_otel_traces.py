"""OpenTelemetry traces from real daemons (issue #60): one traced request through a prefill and a decode daemon
reaches an OTLP/gRPC receiver as one trace (the hold with its CONSUMED, the read with its stages), under the
request's own span; untraced, malformed and sampled-out requests make none."""

from __future__ import annotations

import functools

import numpy as np

from kvxferd.client import DaemonProcess
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.otlp import SpanReceiver
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STAGES = ("plan", "post", "transfer", "check", "completion")
EXPECTED = {"kvxferd.hold", "kvxferd.consumed", "kvxferd.read", *(f"kvxferd.read.{s}" for s in STAGES)}
UNTRACED = {  # served, but no span: none sent, a malformed one (dropped), one its parent sampled out
    "plain": "",
    "malformed": f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
    "zero-trace": f"00-{'0' * 32}-{PARENT_ID}-01",
    "sampled-out": f"00-{'1' * 32}-{PARENT_ID}-00",
}


def _read(cluster: DaemonCluster, request, traceparent: str) -> pb.Completion:
    cluster.hold(request, traceparent=traceparent)
    cluster.submit(request, traceparent=traceparent)
    (completion,) = cluster.completions(request)
    assert completion.ok, completion.error
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]
    return completion


def test_otlp_a_traced_read_is_one_trace_of_its_hold_consumed_and_read_stages(workdir):
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    rng = np.random.default_rng(60)
    with SpanReceiver() as receiver:
        start = functools.partial(DaemonProcess.start_many, env=receiver.environment())
        with DaemonCluster(prefill_groups, decode_groups, 1, 1, workdir=workdir, name="otel",
                           start_many=start) as cluster:
            for name, traceparent in UNTRACED.items():
                _read(cluster, random_request(name, prefill_groups, decode_groups, 70, rng), traceparent)
            traced = random_request("traced", prefill_groups, decode_groups, 70, rng)
            completion = _read(cluster, traced, f"00-{TRACE_ID}-{PARENT_ID}-01")
            spans = receiver.wait_for(lambda got: EXPECTED <= {s.name for s in got}, TRACE_ID)
        everything = receiver.spans()  # (the daemons flushed what they had when they stopped)
    by_name = {s.name: s for s in spans}
    assert sorted(s.name for s in spans) == sorted(EXPECTED), [s.name for s in spans]
    assert len(everything) == len(spans), [(s.name, s.attributes.get("kvxferd.request_id")) for s in everything]
    hold, consumed, read = by_name["kvxferd.hold"], by_name["kvxferd.consumed"], by_name["kvxferd.read"]
    # under the request's span (what vLLM's llm_request spans hang from too), and each child under its own
    assert hold.parent_span_id == read.parent_span_id == PARENT_ID
    assert consumed.parent_span_id == hold.span_id
    assert {s.service for s in spans} == {"kvxferd"}
    assert hold.attributes["kvxferd.engine_id"] == cluster.prefill_id
    assert hold.attributes["kvxferd.request_id"] == traced.remote_request_id
    assert hold.attributes["kvxferd.hold.end"] == "CONSUMED" and "kvxferd.hold.failed_readers" not in hold.attributes
    assert read.attributes["kvxferd.engine_id"] == cluster.decode_id
    assert read.attributes["kvxferd.remote_request_id"] == traced.remote_request_id
    assert read.attributes["kvxferd.read.ok"] is True and not read.error
    assert read.attributes["kvxferd.read.bytes"] == completion.num_bytes > 0
    # the stages tile the read, in order; the hold spans it (one host: one clock)
    stages = [by_name[f"kvxferd.read.{s}"] for s in STAGES]
    assert all(s.parent_span_id == read.span_id for s in stages)
    assert stages[0].start_ns == read.start_ns and stages[-1].end_ns == read.end_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(stages, stages[1:]))
    assert all(s.start_ns <= s.end_ns for s in stages)
    assert hold.start_ns < read.start_ns and read.end_ns <= consumed.start_ns <= consumed.end_ns == hold.end_ns
