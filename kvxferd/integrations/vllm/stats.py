"""The connector's transfer stats as vLLM carries them: worker -> scheduler -> frontend -> Prometheus.

::

    WorkerSide.results ─► TransferStats.record_* (per read vLLM waited for, per hold ended)
    get_kv_connector_stats ─► the stats since the last call (then empty again)
    vLLM: aggregate over TP workers ─► to_dict() ─► frontend ─► TransferPromMetrics.observe
                                                       └► build_kv_connector_stats(data).reduce() (its log line)

vLLM-free: both classes follow the protocol of vLLM's ``KVConnectorStats`` and
``KVConnectorPromMetrics`` (``kv_connector/v1/metrics.py``) without importing
vLLM, so the worker side (and its tests) stay vLLM-free. Every count is per TP
rank: a TP-2 engine reads each request twice, half the bytes each time.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram

# Why a read vLLM waited for failed (a bounded label, set where it is known):
FAILURE_REASONS = (
    "read",  # the daemon posted it and it failed (the daemon's kvxferd_read_failures_total{reason} says why)
    "refused",  # the daemon refused it before posting anything
    "not_submitted",  # it never reached the daemon (bad params, a failed handshake, a daemon error)
    "lost",  # the daemon went away with it in flight
)
HOLD_ENDS = ("consumed", "expired")  # how a prefill hold ended (the notify bus's CONSUMED / EXPIRED)

# From about a local 100 KB read to a stuck one (a read's deadline is seconds).
TIME_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def empty_data() -> dict[str, Any]:
    """One interval's data, nothing recorded (plain ints, lists and dicts: vLLM serializes it)."""
    return {
        "num_transfers": 0,  # reads vLLM waited for that ended, ok or failed
        "transferred_bytes": 0,  # of the ok ones
        "transfer_s": [],  # per ok read: the daemon's time, submit received -> read ended
        "wait_s": [],  # per ended read: this worker's clock, submitted -> vLLM told it ended
        "num_failed": dict.fromkeys(FAILURE_REASONS, 0),
        "num_holds_ended": dict.fromkeys(HOLD_ENDS, 0),
    }


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    """``into`` += ``other``, key by key: ints add, lists extend, dicts recurse."""
    for key, value in other.items():
        if isinstance(value, dict):
            _add(into.setdefault(key, {}), value)
        elif isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value


class TransferStats:
    """One interval's reads and holds, as vLLM's ``KVConnectorStats``: ``data`` is what crosses processes."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = empty_data()
        if data:
            _add(self.data, copy.deepcopy(data))  # never alias vLLM's payload: aggregate() adds in place

    def __repr__(self) -> str:
        return f"TransferStats({self.reduce()})"

    # ---- recording (worker side) ---------------------------------------------------
    def record_read(self, num_bytes: int, transfer_s: float, wait_s: float | None = None) -> None:
        """An ok read of ``num_bytes`` that took the daemon ``transfer_s``."""
        self.data["num_transfers"] += 1
        self.data["transferred_bytes"] += int(num_bytes)
        self.data["transfer_s"].append(float(transfer_s))
        if wait_s is not None:
            self.data["wait_s"].append(float(wait_s))

    def record_failed_read(self, reason: str, wait_s: float | None = None) -> None:
        """A failed read (``reason``: one of FAILURE_REASONS); its bytes, if any, do not count."""
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r}, expected one of {FAILURE_REASONS}")
        self.data["num_transfers"] += 1
        self.data["num_failed"][reason] += 1
        if wait_s is not None:
            self.data["wait_s"].append(float(wait_s))

    def record_hold_ended(self, how: str) -> None:
        """A prefill hold ended: ``consumed`` (read) or ``expired`` (its lease ran out)."""
        if how not in HOLD_ENDS:
            raise ValueError(f"unknown hold end {how!r}, expected one of {HOLD_ENDS}")
        self.data["num_holds_ended"][how] += 1

    def clone_and_reset(self) -> TransferStats:
        """What was recorded, as a new object; this one starts empty again."""
        taken = TransferStats()
        taken.data, self.data = self.data, empty_data()
        return taken

    # ---- vLLM's KVConnectorStats protocol ------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: TransferStats) -> TransferStats:
        """Add ``other`` (another worker, or a later interval) into this one; returns this one."""
        _add(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        data = self.data
        return not data["num_transfers"] and not any(data["num_holds_ended"].values())

    @property
    def num_failed_transfers(self) -> int:
        return sum(self.data["num_failed"].values())

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's periodic "KV Transfer metrics" log line."""
        data = self.data
        transfer_s = np.asarray(data["transfer_s"], dtype=np.float64)
        wait_s = np.asarray(data["wait_s"], dtype=np.float64)
        total_s = float(transfer_s.sum())
        mb = data["transferred_bytes"] / 2**20

        def ms(values: np.ndarray, q: float | None = None) -> float:
            if not values.size:
                return 0.0
            return round(float(values.mean() if q is None else np.percentile(values, q)) * 1e3, 3)

        return {
            "num_transfers": data["num_transfers"],
            "num_failed_transfers": self.num_failed_transfers,
            "transferred_MB": round(mb, 3),
            "avg_transfer_ms": ms(transfer_s),
            "p90_transfer_ms": ms(transfer_s, 90),
            "throughput_MB_per_s": round(mb / total_s, 3) if total_s > 0 else 0.0,
            "avg_wait_ms": ms(wait_s),
            "num_holds_consumed": data["num_holds_ended"]["consumed"],
            "num_holds_expired": data["num_holds_ended"]["expired"],
        }


class TransferPromMetrics:
    """vLLM's ``KVConnectorPromMetrics`` for kvxferd: the metrics, one child per engine (and reason).

    ``metric_types`` maps prometheus_client's ``Counter`` / ``Histogram`` to the
    classes to build (vLLM passes its own, e.g. Ray's wrappers); ``labelnames``
    and ``per_engine_labelvalues`` are vLLM's (``model_name``, ``engine``).
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        self.per_engine_labelvalues = per_engine_labelvalues
        counter, histogram = metric_types[Counter], metric_types[Histogram]
        labelnames = list(labelnames)

        def per_engine(metric, *extra: str) -> dict[int, Any]:
            return {idx: metric.labels(*values, *extra) for idx, values in per_engine_labelvalues.items()}

        def per_engine_and(metric, values: tuple[str, ...]) -> dict[int, dict[str, Any]]:
            return {idx: {v: metric.labels(*labels, v) for v in values}
                    for idx, labels in per_engine_labelvalues.items()}

        self.transfers = per_engine(counter(
            name="vllm:kvxferd_num_transfers", labelnames=labelnames,
            documentation="kvxferd reads this engine waited for that ended, ok or failed (per TP rank)."))
        self.failed = per_engine_and(counter(
            name="vllm:kvxferd_num_failed_transfers", labelnames=[*labelnames, "reason"],
            documentation="kvxferd reads that failed, by reason: read (posted, then failed), refused, "
                          "not_submitted, lost (the daemon went away)."), FAILURE_REASONS)
        self.bytes = per_engine(counter(
            name="vllm:kvxferd_transferred_bytes", labelnames=labelnames,
            documentation="Bytes of KV cache the ok kvxferd reads wrote into this engine."))
        self.transfer_time = per_engine(histogram(
            name="vllm:kvxferd_transfer_time_seconds", labelnames=labelnames, buckets=list(TIME_BUCKETS_S),
            documentation="Per ok kvxferd read: the daemon's time from submit to the read's end."))
        self.wait_time = per_engine(histogram(
            name="vllm:kvxferd_wait_time_seconds", labelnames=labelnames, buckets=list(TIME_BUCKETS_S),
            documentation="Per ended kvxferd read: submitted by the worker -> the worker told vLLM it ended."))
        self.holds_ended = per_engine_and(counter(
            name="vllm:kvxferd_num_holds_ended", labelnames=[*labelnames, "how"],
            documentation="Prefill holds that ended: consumed (read by decode) or expired (lease ran out)."),
            HOLD_ENDS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's ``TransferStats.to_dict()`` (summed over workers) to ``engine_idx``'s metrics."""
        data = transfer_stats_data
        self.transfers[engine_idx].inc(data["num_transfers"])
        self.bytes[engine_idx].inc(data["transferred_bytes"])
        for reason, n in data["num_failed"].items():
            if reason in self.failed[engine_idx]:  # a reason unknown here is dropped, never a new label
                self.failed[engine_idx][reason].inc(n)
        for how, n in data["num_holds_ended"].items():
            if how in self.holds_ended[engine_idx]:
                self.holds_ended[engine_idx][how].inc(n)
        for seconds in data["transfer_s"]:
            self.transfer_time[engine_idx].observe(seconds)
        for seconds in data["wait_s"]:
            self.wait_time[engine_idx].observe(seconds)
