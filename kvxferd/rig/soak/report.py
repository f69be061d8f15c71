"""What a soak run counts: requests, outcomes, faults, bytes verified, holds, figures, violations."""

from __future__ import annotations

import collections
import sys
import time

import numpy as np

INVARIANTS = {
    "bytes_right": "every byte a completion reports delivered is right; a failed read names every block "
                   "that may be wrong; a refused read writes nothing",
    "completion_in_time": "every read gets its completion within deadline + grace (+ the time its own daemon "
                          "was frozen), or its stream breaks because its daemon was killed",
    "hold_ends_once": "every hold ends exactly once (CONSUMED or EXPIRED); none ends that was never placed",
    "bus_sequence": "the notify bus sequence of each daemon life has no gaps",
    "no_leaks": "a surviving daemon holds no more fds, threads or memory at the end than after the first "
                "pairing, maps no shared memory and has no engine registered once the engines are gone",
    "daemon_alive": "daemons that were not killed never exit",
    "workers_alive": "(--dataplane-workers) a data-plane worker dies only when the soak kills it (or its daemon), "
                     "a new one serves within 30 s, and no daemon gives up on its workers",
    "bad_input_refused": "bad input is refused with a precise status, in time",
    "forged_notices_dropped": "a notice from an agent its reader did not introduce, or one that is not a notice, "
                              "is dropped and counted, and ends no hold",
    "recovery": "after a fault, engines register and handshake again",
    "corruption_caught": "a read checked against its holds' digests fails corrupt where a held byte changed after "
                         "the hold or its plan was wrong (issue #59), on a rank that read the change; no other "
                         "read fails corrupt",
}
# Reads sent with their holds' digests; corruptions injected (digest faults that changed bytes a read
# carried), caught (failed corrupt), unjudged (the read failed otherwise first: nothing used), not injected
# (nothing to damage or misplan), and the bytes the damage changed.
DIGEST_COUNTS = ("reads_with_digests", "corruptions_injected", "corruptions_caught", "corruptions_unjudged",
                 "not_injected", "bytes_damaged")
MAX_EXAMPLES = 5  # per invariant, in the JSON
MAX_LOG_LINES = 200  # the last lines of the fault log, in the JSON


class Report:
    """Counters of one run; :meth:`summary` is the JSON object."""

    def __init__(self, seed: int, duration_s: float) -> None:
        self.seed, self.duration_s = seed, duration_s
        self.start_s = time.monotonic()
        self.requests = 0
        self.pushes = 0  # of them, pushes (issue #57)
        self.layered_pushes = 0  # of those, held layer by layer
        self.verified_bytes = 0
        self.outcomes: collections.Counter = collections.Counter()
        self.push_outcomes: collections.Counter = collections.Counter()  # of them, the pushes' (issue #57)
        self.faults: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()
        self.digests: collections.Counter = collections.Counter()  # reads with digests, corruptions (issue #59)
        self.violations: dict[str, list[str]] = collections.defaultdict(list)
        self.figures: dict[str, list[float]] = collections.defaultdict(list)
        self.configs: list[str] = []
        self.refused_configs = 0
        self.holds: dict[str, int] = {}
        self.usage: dict[str, dict] = {}
        self._last_line_s = 0.0
        self.fault_log: list[str] = []  # what struck when: for replaying a failure with the same seed

    def violate(self, invariant: str, detail: str) -> None:
        self.violations[invariant].append(detail)
        print(f"kvxferd soak: VIOLATION {invariant}: {detail}", file=sys.stderr)

    def log(self, line: str) -> None:
        self.fault_log.append(f"{time.monotonic() - self.start_s:8.2f} s  {line}")

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def figure(self, name: str, value_s: float) -> None:
        self.figures[name].append(value_s)

    def new_config(self, config, refused: int) -> None:
        self.configs.append(config.describe())
        self.refused_configs += refused
        self.log(f"pairing {len(self.configs)}: {config.describe()}")
        print(f"pairing {len(self.configs)}: {config.describe()}", file=sys.stderr)

    def line(self, holds_open: int) -> None:
        """The progress line (stderr), every 5 s."""
        now = time.monotonic()
        if now - self._last_line_s < 5:
            return
        self._last_line_s = now
        tty = sys.stderr.isatty()  # a terminal gets one line rewritten; a log gets one line each
        prefix = "\r" if tty else ""
        print(f"{prefix}[{now - self.start_s:6.0f}/{self.duration_s:.0f} s] requests {self.requests}  "
              f"faults {sum(self.faults.values())}  verified {self.verified_bytes / 2**20:,.1f} MiB  "
              f"holds open {holds_open}  violations {sum(map(len, self.violations.values()))}",
              end="" if tty else "\n", file=sys.stderr, flush=True)

    def summary(self) -> dict:
        figures = {name: {"n": len(v), "p50_s": round(float(np.median(v)), 4), "max_s": round(float(max(v)), 4)}
                   for name, v in sorted(self.figures.items()) if v}
        return {
            "seed": self.seed, "duration_s": round(time.monotonic() - self.start_s, 1),
            "requests": self.requests, "pushes": self.pushes, "layered_pushes": self.layered_pushes, "verified_bytes": self.verified_bytes,
            "read_outcomes": dict(self.outcomes), "push_outcomes": dict(self.push_outcomes),
            "digests": {key: self.digests[key] for key in DIGEST_COUNTS}, "faults": dict(self.faults), "holds": self.holds,
            "violations": [{"invariant": k, "count": len(v), "examples": v[:MAX_EXAMPLES]}
                           for k, v in sorted(self.violations.items())],
            "invariants": {name: len(self.violations.get(name, ())) for name in INVARIANTS},
            "counts": dict(self.counts), "figures": figures, "pairings": len(self.configs),
            "refused_pairings": self.refused_configs, "daemon_usage": self.usage,
            "fault_log": self.fault_log[-MAX_LOG_LINES:],
        }
