"""gRPC core's stderr through the child that reads it (service/net/corelog.py): failed TLS handshakes
become audit lines, everything else passes unchanged, and what a dying daemon wrote last still gets out."""

from __future__ import annotations

import json
import subprocess
import sys

HANDSHAKE_LINE = (b"E1128 22:34:09.374385 7865 ssl_transport_security.cc:2563] Handshake failed with error "
                  b"SSL_ERROR_SSL: error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE")

DYING = f"""
import os, sys
from kvxferd.service.base.logs import setup_logging
from kvxferd.service.net import corelog
setup_logging("INFO", "json")
corelog.route_core_log("INFO", "json", 10.0, 5)
os.write(2, {HANDSHAKE_LINE!r} + b"\\n")
os.write(2, b"[1764369249] ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout\\n")
os.abort()  # as UCX does right after its Fatal line
"""


def test_a_dying_daemons_last_line_gets_out_and_a_refused_handshake_is_an_audit_line():
    done = subprocess.run([sys.executable, "-c", DYING], capture_output=True, timeout=60)
    assert done.returncode != 0  # it aborted
    lines = done.stderr.decode().splitlines()
    assert any("Fatal: unexpected error: Endpoint timeout" in line for line in lines), lines
    audit = [json.loads(line) for line in lines if line.startswith("{") and "kvxferd.audit" in line]
    assert any(r.get("reason") == "PEER_DID_NOT_RETURN_A_CERTIFICATE" for r in audit), lines
    assert not any("Handshake failed" in line for line in lines if not line.startswith("{")), lines
