"""OpenTelemetry spans of the daemon's holds and reads (issue #60), off unless an OTLP endpoint is configured.

It follows OpenTelemetry's own environment variables: on when
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is
set, unless ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER`` names
another exporter than ``otlp``. The OTLP/gRPC exporter reads the rest
itself (headers, certificates, timeout, compression), the sampler follows
``OTEL_TRACES_SAMPLER`` (by default the parent's decision),
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the process.
Off, no module of the SDK is imported and the hot path pays one attribute
test per round of reads.

Only requests that carry a trace context (wire/tracecontext.py) make spans,
built after the fact from instants the daemon takes anyway (a read's stamps,
a hold's start): no span is open while bytes move. Their parent is the
request's context, so they sit beside vLLM's ``llm_request`` spans in the
request's trace::

    kvxferd.hold  (prefill daemon: Hold -> its end on the bus)
      └ kvxferd.consumed  (the data-plane thread handed the readers' notice over -> CONSUMED published)
    kvxferd.read  (decode daemon: the batch arrived -> its completion written)
      ├ kvxferd.read.plan        arrived -> planned, handed to the post
      ├ kvxferd.read.post        -> every rank's READ posted
      ├ kvxferd.read.transfer    -> every data READ ended
      ├ kvxferd.read.check       -> the board checks and digests in
      └ kvxferd.read.completion  -> the completion written or queued
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvxferd.plan.leases import CONSUMED, FAILED

log = logging.getLogger("kvxferd.spans")

OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
MAX_OPEN_HOLDS = 1 << 16  # traced holds waiting for their end; past it the oldest one's span is dropped
CLOSE_S = 2.0


def tracing_requested(environ: Mapping[str, str]) -> bool:
    """Whether OpenTelemetry's environment asks for OTLP traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        if exporters - {"none", ""}:
            log.warning("OTEL_TRACES_EXPORTER names no exporter kvxferd has (only otlp): no traces",
                        extra={"exporters": ",".join(sorted(exporters))})
        return False
    if not any(environ.get(name) for name in OTLP_ENDPOINT_VARIABLES):
        return False
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol != "grpc":  # (an endpoint of another protocol would only fill the log with export errors)
        log.warning("the OTLP protocol asked for is not the one kvxferd speaks (grpc): no traces",
                    extra={"protocol": protocol})
        return False
    return True


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


class Spans:
    """One process's spans: a no-op unless :func:`tracing_requested` (or an ``exporter`` is given, in tests).

    Its own tracer provider, never the global one: the process may be an
    engine that set up its own."""

    def __init__(self, service_name: str, *, instance_id: str = "", environ: Mapping[str, str] | None = None,
                 exporter=None) -> None:
        environ = os.environ if environ is None else environ
        self.on = exporter is not None or tracing_requested(environ)
        if not self.on:
            return
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win; kvxferd's names fill in only what they leave unset
        named = OTELResourceDetector().detect().attributes  # what the environment names
        attributes = {SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance_id}
        attributes = {key: value for key, value in attributes.items() if value and key not in named}
        resource = Resource.create(attributes).merge(Resource(dict(named)))
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))  # exports on its own thread
        self._tracer = self._provider.get_tracer("kvxferd")
        self._propagator = TraceContextTextMapPropagator()
        self._in_span = trace.set_span_in_context
        self._status, self._error_code = trace.Status, trace.StatusCode.ERROR
        log.info("OpenTelemetry traces on", extra={"service": str(resource.attributes.get(SERVICE_NAME))})

    def record(self, name: str, traceparent: str, start_unix_s: float, end_unix_s: float, attributes: dict,
               children: Iterable[tuple[str, float, float]] = (), *, error: str = "") -> None:
        """One finished span under ``traceparent`` (a checked one), with finished children (name, start, end)."""
        context = self._propagator.extract({"traceparent": traceparent})
        span = self._tracer.start_span(name, context=context, start_time=_ns(start_unix_s), attributes=attributes)
        if span.is_recording():  # (the sampler may drop it: then its children too)
            inner = self._in_span(span)
            for child, child_start_s, child_end_s in children:
                self._tracer.start_span(child, context=inner, start_time=_ns(child_start_s)).end(_ns(child_end_s))
            if error:
                span.set_status(self._status(self._error_code, error))
        span.end(_ns(end_unix_s))

    def close(self) -> None:
        """Export what is left, for at most CLOSE_S (a collector that is down must not hold up the daemon's exit
        past its pod's grace period; the SDK would wait 30 s)."""
        if self.on:
            # The SDK's shutdown exports what is left, retrying a collector that is down for up to 30 s; what it
            # has not sent by CLOSE_S is dropped with the process (its thread does not hold up the exit).
            closing = threading.Thread(target=self._provider.shutdown, name="otel-close", daemon=True)
            closing.start()
            closing.join(CLOSE_S)


@dataclass
class _OpenHold:
    traceparent: str
    start_unix_s: float
    attributes: dict


class DaemonSpans(Spans):
    """The daemon's spans: its traced holds until they end, and its traced reads once they ended."""

    def __init__(self, daemon_id: str, **kw) -> None:
        super().__init__("kvxferd", instance_id=daemon_id, **kw)
        self._holds: dict[tuple[str, str], _OpenHold] = {}

    def hold_placed(self, engine_id: str, request_id: str, traceparent: str, num_blocks: int, push: bool) -> None:
        """A traced hold was placed (event-loop thread); its span is made when it ends."""
        if len(self._holds) >= MAX_OPEN_HOLDS:
            self._holds.pop(next(iter(self._holds)))
        self._holds[(engine_id, request_id)] = _OpenHold(traceparent, time.time(), {
            "kvxferd.engine_id": engine_id, "kvxferd.request_id": request_id, "kvxferd.hold.blocks": num_blocks,
            "kvxferd.hold.push": push})

    def hold_ends(self, events, counted_unix_s: float) -> None:
        """A round's hold events, handed over by the data-plane thread at ``counted_unix_s`` and published on the
        bus since (event-loop thread): each traced hold that ended becomes its span; a reader's FAILED is
        counted on it."""
        now_s = time.time()
        for slot, end in events:
            key = (slot.engine_id, end.request_id)
            held = self._holds.get(key)
            if held is None:
                continue
            if end.kind is FAILED:
                failed = held.attributes.get("kvxferd.hold.failed_readers", 0)
                held.attributes["kvxferd.hold.failed_readers"] = failed + 1
                continue
            del self._holds[key]
            children = (("kvxferd.consumed", counted_unix_s, now_s),) if end.kind is CONSUMED else ()
            self.record("kvxferd.hold", held.traceparent, held.start_unix_s, now_s,
                        {**held.attributes, "kvxferd.hold.end": end.kind.value, "kvxferd.hold.reason": end.reason},
                        children)

    def reads(self, finished) -> None:
        """Spans of a round's ended reads that carry a trace context (event-loop thread, after their
        completions were written or queued). A read's instants are ``perf_counter`` ones; its end's wall
        time (``done_unix_s``, taken with ``ended_s``) places them."""
        written_s = time.perf_counter()
        for read in finished:
            if not read.traceparent:
                continue
            to_unix_s = read.done_unix_s - read.ended_s
            stamps = [("kvxferd.read.plan", read.received_s), ("kvxferd.read.post", read.queued_s),
                      ("kvxferd.read.transfer", read.posted_s),
                      ("kvxferd.read.check", read.inflight.transferred_s if read.inflight is not None else 0.0),
                      ("kvxferd.read.completion", read.ended_s), ("", written_s)]
            stamps = [(name, at_s) for name, at_s in stamps if at_s]  # (a stage it never reached)
            children = [(name, at_s + to_unix_s, next_s + to_unix_s)
                        for (name, at_s), (_, next_s) in zip(stamps, stamps[1:])]
            result = read.result
            self.record("kvxferd.read", read.traceparent, read.received_s + to_unix_s, written_s + to_unix_s, {
                "kvxferd.engine_id": read.slot.engine_id, "kvxferd.request_id": read.request_id,
                "kvxferd.remote_engine_id": read.remote_engine_id,
                "kvxferd.remote_request_id": read.request.remote_request_id, "kvxferd.read.ok": result.ok,
                "kvxferd.read.bytes": result.num_bytes, "kvxferd.read.push": read.push,
                "kvxferd.read.digests_checked": bool(read.request.remote_digests),
                "kvxferd.read.failure": "" if result.ok else (read.failure.value or "transfer")},
                children, error="" if result.ok else (result.error or "failed")[:256])
