"""An OTLP/gRPC trace receiver: the collector's ``TraceService`` (from the OpenTelemetry protos), keeping every
span it is sent, for the tests of issue #60 (a stand-in for an OpenTelemetry collector, on loopback).

Point a process at it with :meth:`SpanReceiver.environment` (OpenTelemetry's own variables)::

    with SpanReceiver() as receiver:
        start_daemon(env=receiver.environment())
        ...
        spans = receiver.wait_for(lambda spans: any(s.name == "kvxferd.read" for s in spans))
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it (ids as hex; times in ns since the epoch)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    error: bool = False


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A TraceService on ``127.0.0.1`` (a free port) that keeps what it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def Export(self, request, context):  # noqa: N802 - gRPC's name
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        str(resource.get("service.name", "")), span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.start_time_unix_nano, span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes},
                        span.status.code == span.status.STATUS_CODE_ERROR))
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def environment(self, service_name: str | None = None) -> dict[str, str]:
        """OpenTelemetry's variables that send a process's traces here, exported within 0.1 s."""
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        if service_name:
            env["OTEL_SERVICE_NAME"] = service_name
        return env

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        """Every span received so far (of one trace)."""
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, done, trace_id: str | None = None, timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans (of one trace) once ``done(spans)`` is true, or what came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self._server.stop(0)

    def __enter__(self) -> "SpanReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
