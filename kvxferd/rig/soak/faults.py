"""The faults the soak injects, and when.

Faults come in a shuffled cycle, so every kind occurs about equally often
in any long enough run, at random moments: before the request's hold
(``between``) or a few milliseconds into its read (``mid``).

==================  ==========================================================
kind                what happens
==================  ==========================================================
kill_prefill_daemon kill -9 of one prefill rank's daemon, restarted at the same
                    addresses; the prefill engine registers that rank again
kill_decode_daemon  the same on a decode rank; the decode engine registers and
                    handshakes again
kill_prefill_engine kill -9 of the prefill engine process; a new one registers
                    once the old session's lease ran out; decode handshakes
kill_decode_engine  kill -9 of the decode engine process; a new one starts
stop_short          SIGSTOP of one daemon for less than the read deadline
stop_long           SIGSTOP for longer than the hold lease (a hung peer)
slow_read           SIGSTOP of a prefill daemon for a third to most of the
                    lease during a read (the decode side must renew)
early_release       the prefill engine releases before or while decode reads
lease_expiry        a lease short enough to run out around the read
bad_input           a burst of bad input on every listener of one daemon
forged_notices      after the hold, a rogue NIXL agent sends one prefill rank
                    notices naming the real readers, and junk: every one must
                    be dropped, and the hold must live on until it is read
kill_worker         (``--dataplane-workers`` only) kill -9 of one daemon's
                    data-plane worker, either side: the daemon and its holds
                    live on, a new worker serves (workers.py)
rotate_ca           (``--hosts --dataplane-workers`` only) the CA bundle every
                    daemon verifies peers with gains or loses a second CA:
                    every daemon replaces its workers, make before break
flip_held_byte      after a hold with digests, one bit of the request's last
                    token flips in every prefill rank's memory (one group's
                    block; the board cannot see it): the read must fail
                    ``corrupt``
write_held_block    the same element rewritten in every group and layer, as an
                    engine writing into a held block would
misplanned_read     one decode daemon plans this read from a wrong belief of
                    the holder's layout (misplan.py: one layer's K read as its
                    V): the read must fail ``corrupt`` on that rank
==================  ==========================================================

The last three (issue #59) always read with the holds' digests; the bytes
are put back after the read. Without ``--dataplane-reader-workers`` only:
a reader worker checks no digests.

With ``--hosts``, the network faults of netfaults.py join them (``link_down``,
``loss``, ``delay``, ``reorder``, ``partition``); ``bad_input`` and
``forged_notices`` then stay out: the driver does not sit on the hosts' links.
"""

from __future__ import annotations

import numpy as np

DIGEST_KINDS = ("flip_held_byte", "write_held_block", "misplanned_read")  # caught by the holds' digests alone
KINDS = ("kill_prefill_daemon", "kill_decode_daemon", "kill_prefill_engine", "kill_decode_engine", "stop_short",
         "stop_long", "slow_read", "early_release", "lease_expiry", "bad_input", "forged_notices", *DIGEST_KINDS)
NET_KINDS = ("link_down", "loss", "delay", "reorder", "partition")  # --hosts only (netfaults.py)
LOOPBACK_ONLY = ("bad_input", "forged_notices")
WORKER_KINDS = ("kill_worker", "rotate_ca")  # --dataplane-workers only (workers.py)
TLS_KINDS = ("rotate_ca",)  # --hosts only: the namespace hosts' daemons use mutual TLS


def default_kinds(hosts: bool, workers: bool = False, reader_workers: bool = False) -> tuple[str, ...]:
    """Every kind a run on loopback (``hosts`` False) or on namespace hosts, with data-plane workers (and
    reader workers) or without, can inject."""
    kinds = tuple(k for k in KINDS if k not in LOOPBACK_ONLY) + NET_KINDS if hosts else KINDS
    kinds += WORKER_KINDS if workers else ()
    kinds = tuple(k for k in kinds if not (reader_workers and k in DIGEST_KINDS))
    return kinds if hosts else tuple(k for k in kinds if k not in TLS_KINDS)


# Faults that act on a read in flight when drawn "mid"; the others always act before the hold
# (early_release and forged_notices: after it, before the read).
CAN_BE_MID = {"kill_prefill_daemon", "kill_decode_daemon", "kill_prefill_engine", "kill_decode_engine",
              "stop_short", "stop_long", "slow_read", "early_release", "kill_worker"}


class FaultPlan:
    """Which fault (if any) the next request gets, and whether it lands mid-read."""

    def __init__(self, rng: np.random.Generator, rate: float, kinds=KINDS) -> None:
        self.rng, self.rate, self.kinds = rng, rate, tuple(kinds)
        self._cycle: list[str] = []

    def next(self) -> tuple[str | None, bool]:
        """``(kind or None, mid)`` for the next request."""
        if not self.kinds or self.rng.random() >= self.rate:
            return None, False
        if not self._cycle:
            self._cycle = list(self.rng.permutation(self.kinds))
        kind = str(self._cycle.pop())
        return kind, kind in CAN_BE_MID and bool(self.rng.random() < 0.5)
