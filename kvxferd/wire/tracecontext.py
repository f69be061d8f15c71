"""W3C trace context (``traceparent``) as kvxferd carries it: engine -> daemon, prefill -> decode (issue #60).

A P/D request's trace context travels with it so that the daemons' spans
join the trace vLLM continues from the request's HTTP headers::

    router span ─┬─ vLLM llm_request (prefill)      traceparent in the request's headers
                 ├─ vLLM llm_request (decode)
                 ├─ kvxferd.hold ── kvxferd.consumed     prefill daemon (HoldRequest.traceparent)
                 └─ kvxferd.read ── plan, post, transfer, check, completion
                                                      decode daemon (kv_transfer_params -> ReadSpec)

Only version 00 is taken, in its exact form (55 characters, lower-case
hex, ids not all zero): anything else arrives from a socket and is dropped,
as the W3C spec says a receiver does with a traceparent it cannot parse (the
request is served, untraced).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TRACEPARENT_LENGTH = 55
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def check_traceparent(value: str) -> str:
    """``value`` when it is a version-00 ``traceparent``, else "" (untraced)."""
    if len(value) != TRACEPARENT_LENGTH or _TRACEPARENT.fullmatch(value) is None:
        return ""
    return value


def traceparent_of(headers: Mapping[str, str] | None) -> str:
    """The valid ``traceparent`` of a request's trace headers (vLLM's ``Request.trace_headers``), or ""."""
    if not headers:
        return ""
    value = headers.get("traceparent")
    return check_traceparent(value) if isinstance(value, str) else ""
