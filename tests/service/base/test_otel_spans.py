"""When the daemon's OpenTelemetry spans are on (issue #60): OpenTelemetry's own variables, and nothing of the
SDK loaded when off."""

import subprocess
import sys

import pytest

from kvxferd.service.base.spans import tracing_requested

ENDPOINT = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}


@pytest.mark.parametrize("environ,on", [
    ({}, False),
    (ENDPOINT, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, False),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, True),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "console"}, False),  # an exporter kvxferd does not have
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "console,otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, False),  # no endpoint: nowhere to send
])
def test_otel_traces_follow_opentelemetrys_variables(environ, on):
    assert tracing_requested(environ) is on


def test_otel_off_loads_no_module_of_the_sdk():
    code = ("import sys; from kvxferd.service.base.spans import DaemonSpans\n"
            "spans = DaemonSpans('d', environ={})\n"
            "import kvxferd.service.daemon\n"
            "print(spans.on, sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "[]"]
    on = subprocess.run([sys.executable, "-c", code.replace("environ={}", "environ=" + repr(ENDPOINT))],
                        capture_output=True, text=True, check=True).stdout
    assert on.startswith("True ['opentelemetry")  # the control: on, the SDK is there


def test_otel_a_collector_that_is_down_holds_up_closing_for_at_most_close_s():
    """A daemon stopping with spans left for a collector that is down leaves within CLOSE_S (+ slack), not after
    the SDK's 30 s: its pod's grace period is drain_timeout_s + 5 s."""
    import socket
    import time

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from kvxferd.service.base.spans import CLOSE_S, Spans

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spans = Spans("t", exporter=OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}"))
    now = time.time()
    for n in range(10):
        spans.record("s", f"00-{'1' * 32}-{n + 1:016x}-01", now, now + 0.001, {})
    start = time.monotonic()
    spans.close()
    assert time.monotonic() - start < CLOSE_S + 3.0


def test_otel_the_environments_names_win_over_kvxferds_and_fill_in_what_they_leave():
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the process; kvxferd's names only fill the gaps."""
    code = ("from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
            "from kvxferd.service.base.spans import Spans\n"
            "spans = Spans('kvxferd', instance_id='d0', exporter=InMemorySpanExporter())\n"
            "a = spans._provider.resource.attributes\n"
            "print(a['service.name'], a['service.instance.id'])")
    import os

    def names(**env) -> list[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**clean, **env}).stdout.split()

    assert names() == ["kvxferd", "d0"]
    assert names(OTEL_SERVICE_NAME="svc") == ["svc", "d0"]
    assert names(OTEL_RESOURCE_ATTRIBUTES="service.name=res,service.instance.id=pod-7") == ["res", "pod-7"]


@pytest.mark.parametrize("protocol,on", [("grpc", True), ("http/protobuf", False)])
def test_otel_only_the_grpc_protocol_is_spoken(protocol, on):
    assert tracing_requested({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}) is on
    assert tracing_requested({**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}) is on
