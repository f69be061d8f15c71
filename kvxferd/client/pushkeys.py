"""A push's key (issue #57), made where both legs of a request are dispatched (the proxy).

The decode leg carries the key, the prefill leg its digest (the prefill hold keeps only that); the
prefill daemons write a hold's blocks only into an expectation presenting the key
(:mod:`kvxferd.plan.capability`).
"""

from __future__ import annotations

import secrets

from kvxferd.plan.capability import PUSH_KEY_BYTES, push_key_digest


def new_push_key() -> tuple[bytes, bytes]:
    """A fresh push key (random) and its digest: ``(key, digest)``."""
    key = secrets.token_bytes(PUSH_KEY_BYTES)
    return key, push_key_digest(key)
