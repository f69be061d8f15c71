"""The demo's figures: one row per (model, TP pairing), totals, a table and JSON."""

from __future__ import annotations

import numpy as np


def new_row(model: str, prefill_tp: int, decode_tp: int, groups: str) -> dict:
    return {"model": model, "pairing": f"{prefill_tp}->{decode_tp}", "groups": groups, "requests": 0,
            "failed_requests": 0, "bytes": 0, "descriptors": 0, "verified_bytes": 0, "mismatched_bytes": 0,
            "holds": 0, "consumed": 0, "lost_events": 0, "stray_events": 0, "latency_s": [], "raw_s": [],
            "raw_bytes": 0, "raw_warm_up_ms": [], "warm_up_ms": 0.0, "problems": [], "stages_s": {},
            "same_host_copies": 0, "digest_checked_bytes": 0, "read_paths": []}


def add_read(row: dict, result: dict) -> None:
    """Fold one request's result (from the decode engine) into ``row``."""
    row["requests"] += 1
    row["failed_requests"] += not result["ok"]
    for key in ("bytes", "descriptors", "verified_bytes", "mismatched_bytes"):
        row[key] += result[key]
    row["latency_s"].append(result["latency_s"])
    for stage, seconds in result.get("stages_s", {}).items():
        row["stages_s"].setdefault(stage, []).append(seconds)
    row["problems"] += result["errors"] + result["mismatches"]


def add_events(row: dict, events: dict, num_holds: int) -> None:
    """Fold the prefill engine's bus events into ``row``: one CONSUMED per rank and request, nothing else."""
    row["holds"] += num_holds
    row["consumed"] += events["consumed"]
    row["lost_events"] += len(events["missing"])
    row["stray_events"] += len(events["other"])
    row["problems"] += events["missing"] + events["other"]


def finish_row(row: dict) -> dict:
    """Derived figures: GB/s, latency percentiles, the raw-NIXL baseline and the ratio."""
    latency = np.asarray(row.pop("latency_s") or [0.0])
    raw = np.asarray(row.pop("raw_s") or [0.0])
    requests = max(row["requests"], 1)
    row["seconds"] = float(latency.sum())
    row["gbps"] = row["bytes"] / max(row["seconds"], 1e-9) / 1e9
    row["descriptors_per_request"] = row["descriptors"] / requests
    row["latency_p50_ms"] = float(np.percentile(latency, 50) * 1e3)
    row["latency_p99_ms"] = float(np.percentile(latency, 99) * 1e3)
    # p50 of each stage separately (their sum need not be the latency's p50)
    row["stage_p50_ms"] = {stage: float(np.percentile(values, 50) * 1e3) for stage, values in row.pop("stages_s").items()}
    row["raw_seconds"] = float(raw.sum())
    row["raw_gbps"] = row["raw_bytes"] / max(row["raw_seconds"], 1e-9) / 1e9
    row["raw_p50_ms"] = float(np.percentile(raw, 50) * 1e3)
    row["ratio"] = row["gbps"] / row["raw_gbps"] if row["raw_gbps"] else 0.0
    row["ok"] = not (row["failed_requests"] or row["mismatched_bytes"] or row["lost_events"] or row["stray_events"]
                     or row["problems"] or row["raw_bytes"] != row["bytes"])
    return row


TOTALS = ("requests", "failed_requests", "bytes", "verified_bytes", "mismatched_bytes", "holds", "consumed",
          "lost_events", "stray_events", "same_host_copies", "digest_checked_bytes")


def summarize(rows: list[dict]) -> dict:
    """The JSON object of ``kvxferd demo --json``: every row and the totals."""
    summary = {key: sum(row[key] for row in rows) for key in TOTALS}
    seconds, raw_seconds = sum(r["seconds"] for r in rows), sum(r["raw_seconds"] for r in rows)
    summary["gbps"] = summary["bytes"] / max(seconds, 1e-9) / 1e9
    summary["raw_gbps"] = sum(r["raw_bytes"] for r in rows) / max(raw_seconds, 1e-9) / 1e9
    summary["ratio"] = summary["gbps"] / summary["raw_gbps"] if summary["raw_gbps"] else 0.0
    summary["ok"] = bool(rows) and all(row["ok"] for row in rows)
    summary["read_paths"] = sorted({path for row in rows for path in row["read_paths"]})
    summary["rows"] = rows
    return summary


def format_table(summary: dict) -> str:
    """A fixed-width table, a totals line and what the columns mean."""
    head = (f"{'model':<7}{'P->D':<6}{'groups':<11}{'reqs':>5}{'MiB':>8}{'desc/req':>9}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'GB/s':>7}{'raw GB/s':>9}{'ratio':>7}{'consumed':>10}  result")
    lines = [head, "-" * len(head)]
    for row in summary["rows"]:
        verdict = "byte-exact" if row["ok"] else f"FAILED: {(row['problems'] or ['byte counts differ'])[0]}"
        lines.append(f"{row['model']:<7}{row['pairing']:<6}{row['groups']:<11}{row['requests']:>5}"
                     f"{row['bytes'] / 2**20:>8.1f}{row['descriptors_per_request']:>9.0f}{row['latency_p50_ms']:>8.1f}"
                     f"{row['latency_p99_ms']:>8.1f}{row['gbps']:>7.2f}{row['raw_gbps']:>9.2f}{row['ratio']:>7.2f}"
                     f"{row['consumed']:>5}/{row['holds']:<4}  {verdict}")
    lines += _stage_lines(summary["rows"])
    s = summary
    lines += ["", f"{s['requests']} requests, {s['bytes'] / 2**20:.1f} MiB through the daemons at {s['gbps']:.2f} GB/s "
                  f"(raw NIXL on the same transfers {s['raw_gbps']:.2f} GB/s, ratio {s['ratio']:.2f}); "
                  f"{s['verified_bytes'] / 2**20:.1f} MiB of decode memory checked, {s['mismatched_bytes']} bytes wrong; "
                  f"{s['digest_checked_bytes'] / 2**20:.1f} MiB of reads checked by the decode daemons against "
                  "their holds' digests; "
                  f"{s['failed_requests']} failed requests; {s['consumed']}/{s['holds']} holds CONSUMED, "
                  f"{s['lost_events']} lost and {s['stray_events']} stray events; "
                  f"{s['same_host_copies']} remote ranks' parts of reads copied same-host, the rest over NIXL; "
                  f"UCX's READ paths: {', '.join(s['read_paths']) or 'none (no READ over NIXL)'}.",
              "p50/p99: a read on every decode rank's Reads session (the reads socket) -> every completion delivered; "
              "each preset's first read is an untimed warm-up, as raw NIXL's first rounds are (checked like the rest). "
              "GB/s: bytes over that time; "
              "raw GB/s: the same descriptors posted straight on NIXL from the decode engine, no daemon in the path. "
              "consumed: CONSUMED events on the prefill notify bus / holds (one per prefill rank and request, "
              "the warm-up's included)."]
    if "hosts" in summary:
        lines += ["", "hosts (network namespaces; bytes their eth0 moved, packets their policy refused):"]
        lines += [f"  {name} {h['role']:<8}{h['address']:<13} rx {h['rx_bytes'] / 2**20:9.1f} MiB  tx "
                  f"{h['tx_bytes'] / 2**20:9.1f} MiB  refused {h['policy_refused_packets']}"
                  for name, h in summary["hosts"].items()]
    return "\n".join(lines)


STAGE_HEADS = (("to_daemon", "to daemon"), ("plan", "plan"), ("post", "post+copy"), ("transfer", "transfer"),
               ("check", "check"), ("to_engine", "to engine"))


def _stage_lines(rows: list[dict]) -> list[str]:
    """Where a read's time went (p50 ms per stage), next to its latency and raw NIXL's time for the same bytes."""
    rows = [row for row in rows if row.get("stage_p50_ms")]
    if not rows:
        return []
    lines = ["", "where a read's time went, p50 ms (on the decode rank whose completion came last):",
             f"{'model':<7}" + "".join(f"{head:>11}" for _, head in STAGE_HEADS) + f"{'latency':>9}{'raw NIXL':>10}"]
    for row in rows:
        stages = row["stage_p50_ms"]
        lines.append(f"{row['model']:<7}" + "".join(f"{stages.get(key, 0.0):>11.2f}" for key, _ in STAGE_HEADS)
                     + f"{row['latency_p50_ms']:>9.2f}{row['raw_p50_ms']:>10.2f}")
    return lines
