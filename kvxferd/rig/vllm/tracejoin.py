"""Where one P/D request's time to first token goes, from the stamps of every process (issue #41).

``kvxferd/rig/vllm/bench.py --trace`` sets ``KVXFERD_TRACE_DIR`` for the proxy,
both engines (their connectors' scheduler and worker sides) and records the
client's own send and first-token times; this joins them per request and
cuts the request's TTFT into consecutive segments that add up to it::

    client ─► proxy ─► prefill scheduler ─► (forward) ─► hold on the daemons ─► proxy
           ─► decode scheduler ─► worker submits ─► decode daemon reads ─► completion
           ─► vLLM takes it ─► scheduler told ─► (forward) ─► proxy ─► client

After the first token (not in TTFT): the prefill worker hears CONSUMED on the
bus and vLLM's prefill scheduler is told the blocks may go.
"""

from __future__ import annotations

import statistics

# The points a P/D request passes, in order: (process, event). "prefill"/"decode": the engine's
# connector, scheduler or worker side; "client": the benchmark's own stamps.
POINTS = (
    ("client", "start"),
    ("proxy", "prefill_sent"),
    ("prefill", "matched"),
    ("prefill", "hold_start"),
    ("prefill", "hold_end"),
    ("proxy", "prefill_back"),
    ("decode", "matched"),
    ("decode", "submitted"),
    ("decode", "daemon_got"),
    ("decode", "daemon_posted"),
    ("decode", "daemon_moved"),
    ("decode", "daemon_done"),
    ("decode", "completion_arrived"),
    ("decode", "completion_taken"),
    ("decode", "told_recving"),
    ("proxy", "first_chunk_out"),
    ("client", "first"),
)
SEGMENTS = (  # one per pair of consecutive points: what it is, and whose time it is
    ("client -> proxy -> prefill request sent", "proxy (aiohttp)"),
    ("-> prefill scheduler sees it", "vLLM prefill front end"),
    ("prefill: schedule, forward the prompt", "vLLM prefill"),
    ("prefill: request_finished (the Hold answered)", "kvxferd connector + daemon"),
    ("-> proxy has the prefill answer", "vLLM prefill output + HTTP"),
    ("-> decode scheduler sees it", "proxy + vLLM decode front end"),
    ("decode: matched -> worker submits the read", "vLLM decode step"),
    ("submitted -> decode daemon has it", "kvxferd reads socket"),
    ("daemon: checks, plan, post", "kvxferd daemon"),
    ("daemon: the bytes move (same-host copy or NIXL)", "kvxferd daemon"),
    ("daemon: holders' boards checked, notices sent", "kvxferd daemon"),
    ("read done -> completion at the worker", "kvxferd reads socket"),
    ("completion waits for vLLM to ask", "vLLM decode step"),
    ("taken -> vLLM scheduler told", "vLLM decode step"),
    ("told -> first token out of the proxy", "vLLM decode: schedule, forward, output; proxy"),
    ("proxy -> client has the first token", "proxy (aiohttp)"),
)
AFTER = (  # after the first token: the prefill's blocks let go
    (("decode", "daemon_done"), ("prefill", "bus_ended"), "read done -> prefill worker hears CONSUMED"),
    (("prefill", "bus_ended"), ("prefill", "told_sending"), "-> prefill scheduler told (blocks free)"),
)


# Push (issue #57): both legs run at once, so a request's points are not a chain; each is reported as its
# median time after the client sent the request, in the order they usually come. Joined by the transfer id
# (both engines' "matched" name it; the proxy and the prefill's bus event use it).
PUSH_POINTS = (
    ("proxy", "prefill_sent", "proxy sends both legs"),
    ("decode", "matched", "decode scheduler sees its leg"),
    ("decode", "submitted", "decode worker submits the expectation"),
    ("prefill", "matched", "prefill scheduler sees its leg"),
    ("prefill", "hold_start", "prefill forward done: request_finished holds"),
    ("prefill", "hold_end", "the Hold answered (the daemons write now)"),
    ("decode", "daemon_done", "decode daemon: every writer notified"),
    ("decode", "completion_arrived", "completion at the decode worker"),
    ("decode", "completion_taken", "vLLM asks for it"),
    ("decode", "told_recving", "decode scheduler told"),
    ("transfer", "bus_ended", "prefill worker hears CONSUMED"),
    ("proxy", "prefill_back", "proxy has the prefill answer"),
    ("proxy", "first_chunk_out", "first token out of the proxy"),
    ("client", "first", "client has the first token"),
)


def _by_process(stamps: list[dict], prefill_engine: str, decode_engine: str) -> dict[str, list[dict]]:
    """The stamps of each engine's processes (scheduler, workers: ``<engine>-...``) and of the proxy."""
    by_kind: dict[str, list[dict]] = {"prefill": [], "decode": [], "proxy": []}
    for stamp in stamps:
        who = stamp["who"]
        for kind, engine in (("prefill", prefill_engine), ("decode", decode_engine)):
            if who.startswith(engine + "-"):
                by_kind[kind].append(stamp)
        if who == "proxy":
            by_kind["proxy"].append(stamp)
    return by_kind


def _own_ids(stamps: list[dict]) -> dict[str, str]:
    """What joins an engine's own request ids to the other processes': its first "matched" stamp of each id
    names the id the proxy knows (a pull's prefill request id, a push's transfer id)."""
    own: dict[str, str] = {}
    for stamp in stamps:
        if stamp["event"] == "matched" and stamp.get("remote"):
            own.setdefault(stamp["remote"], stamp["id"])
    return own


def push_timelines(stamps: list[dict], clients: list[dict], prefill_engine: str, decode_engine: str) -> list[dict]:
    """Per client push request (``prefill_id`` is its transfer id): ``{(process, event): ms after its start}``
    for the :data:`PUSH_POINTS` it passed."""
    by_kind = _by_process(stamps, prefill_engine, decode_engine)
    vllm_id = {kind: _own_ids(by_kind[kind]) for kind in ("prefill", "decode")}
    out = []
    for client in clients:
        transfer_id = client["prefill_id"]
        events = {"client": {"first": client["first"]}, "proxy": _first(by_kind["proxy"], transfer_id),
                  "transfer": _first(by_kind["prefill"], transfer_id)}
        for kind in ("prefill", "decode"):
            events[kind] = _first(by_kind[kind], vllm_id[kind].get(transfer_id, ""))
        out.append({(kind, event): (events[kind][event] - client["start"]) * 1e3
                    for kind, event, _ in PUSH_POINTS if event in events[kind]})
    return out


def push_summary(lines: list[dict]) -> dict:
    """Per push point, the median ms after the client's start (and how many requests passed it)."""
    points = {}
    for kind, event, _ in PUSH_POINTS:
        seen = [line[(kind, event)] for line in lines if (kind, event) in line]
        points[f"{kind}:{event}"] = (statistics.median(seen), len(seen)) if seen else (None, 0)
    # each request's points too (JSON): medians of points are times, not segments, and hide which request was slow
    each = [{f"{kind}:{event}": round(line[(kind, event)], 2) for kind, event, _ in PUSH_POINTS if (kind, event) in line}
            for line in lines]
    return {"requests": len(lines), "points_ms": points, "per_request_ms": each}


def print_push_trace(report: dict) -> None:
    """One table for push: a row per point (its median ms after the client sent), a column per length."""
    rows = [(row["tokens"], row.get("push_trace")) for row in report["lengths"]]
    rows = [(tokens, got) for tokens, got in rows if got and got["requests"]]
    if not rows:
        return
    print(f"\nOne push request ({report.get('push_traced', 'kvxferd-push')}), point by point: median ms after the "
          "client sent it (both legs run "
          "at once, so these are times, not segments):\n")
    print("| point | " + " | ".join(f"{tokens} tokens" for tokens, _ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for kind, event, name in PUSH_POINTS:
        cells = [got["points_ms"][f"{kind}:{event}"] for _, got in rows]
        print(f"| {name} | " + " | ".join("-" if ms is None else f"{ms:.1f}" for ms, _ in cells) + " |")
    print("| requests | " + " | ".join(str(got["requests"]) for _, got in rows) + " |")


FREED_BOUND_MS = 20.0  # read done -> vLLM's prefill scheduler frees the blocks, p50 (issue #41: "a few ms")
CPU_BOUND_S = 0.1  # the prefill server's CPU after a P/D request, beyond what a request it served alone costs


def _first(stamps: list[dict], request_id: str) -> dict[str, float]:
    """event -> earliest time among ``stamps`` of ``request_id``."""
    out: dict[str, float] = {}
    for stamp in stamps:
        if stamp["id"] == request_id:
            out[stamp["event"]] = min(out.get(stamp["event"], stamp["t"]), stamp["t"])
    return out


def timelines(stamps: list[dict], clients: list[dict], prefill_engine: str, decode_engine: str) -> list[dict]:
    """Per client request (``{"start", "first", "prefill_id"}``), its points: ``{(process, event): t}``, and
    ``"hold_sent_early"``: whether its prefill's hold went out with the prompt's step. A request missing
    any point is left out."""
    by_engine = _by_process(stamps, prefill_engine, decode_engine)
    decode_of = _own_ids(by_engine["decode"])
    early = {stamp["id"] for stamp in by_engine["prefill"] if stamp["event"] == "hold_sent"}
    out = []
    for client in clients:
        prefill_id = client["prefill_id"]
        decode_id = decode_of.get(prefill_id)
        if decode_id is None:
            continue
        events = {"client": {"start": client["start"], "first": client["first"]},
                  "proxy": _first(by_engine["proxy"], prefill_id),
                  "prefill": _first(by_engine["prefill"], prefill_id),
                  "decode": _first(by_engine["decode"], decode_id)}
        points = {(kind, event): events[kind].get(event) for kind, event in POINTS + tuple(
            p for a, b, _ in AFTER for p in (a, b))}
        if all(t is not None for t in points.values()):
            points["hold_sent_early"] = prefill_id in early
            out.append(points)
    return out


def segment_ms(timeline: dict) -> list[float]:
    """The consecutive segments of one request, ms (they add up to its TTFT)."""
    return [(timeline[b] - timeline[a]) * 1e3 for a, b in zip(POINTS, POINTS[1:])]


def summary(lines: list[dict]) -> dict:
    """Medians per segment (and after), and the median TTFT, over requests."""
    if not lines:
        return {"requests": 0}
    per = list(zip(*(segment_ms(t) for t in lines)))
    after = [[(t[b] - t[a]) * 1e3 for t in lines] for a, b, _ in AFTER]
    ttft = [(t[POINTS[-1]] - t[POINTS[0]]) * 1e3 for t in lines]
    freed = [(t[AFTER[-1][1]] - t[AFTER[0][0]]) * 1e3 for t in lines]
    return {"requests": len(lines), "segments_ms": [statistics.median(s) for s in per],
            "after_ms": [statistics.median(s) for s in after], "ttft_ms": statistics.median(ttft),
            "freed_ms": freed, "early_holds": sum(t["hold_sent_early"] for t in lines)}


def print_trace(report: dict) -> None:
    """One table: a row per segment, a column per prompt length (medians over the requests)."""
    rows = [(row["tokens"], row.get("trace")) for row in report["lengths"]]
    rows = [(tokens, got) for tokens, got in rows if got and got["requests"]]
    if not rows:
        print("\ntrace: no complete P/D request timeline (were the stamps written?)")
        return
    print("\nOne P/D request's TTFT, segment by segment (medians over requests; ms; stamps of the client, proxy, "
          "both engines' connectors and the decode daemon's completion, one wall clock):\n")
    head = ["segment", "whose", *[f"{tokens} tokens" for tokens, _ in rows]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n, (name, whose) in enumerate(SEGMENTS):
        print(f"| {name} | {whose} | " + " | ".join(f"{got['segments_ms'][n]:.2f}" for _, got in rows) + " |")
    print("| sum of the medians | | " + " | ".join(f"{sum(got['segments_ms']):.1f}" for _, got in rows) + " |")
    print("| median TTFT (P/D) | | " + " | ".join(f"{got['ttft_ms']:.1f}" for _, got in rows) + " |")
    print("| requests | | " + " | ".join(str(got["requests"]) for _, got in rows) + " |")
    print("| of which held with the prompt's step | | " + " | ".join(str(got["early_holds"]) for _, got in rows) + " |")
    for n, (_, _, name) in enumerate(AFTER):
        print(f"| after: {name} | kvxferd bus; vLLM prefill step | "
              + " | ".join(f"{got['after_ms'][n]:.2f}" for _, got in rows) + " |")


def print_bounds(report: dict) -> None:
    """The prefill side after decode's read, each against its bound (printed, not asserted)."""
    rows = [row for row in report["lengths"] if row.get("trace", {}).get("requests")]
    if rows:
        p50s = [statistics.median(row["trace"]["freed_ms"]) for row in rows]
        worst = max(max(row["trace"]["freed_ms"]) for row in rows)
        verdict = "met" if max(p50s) <= FREED_BOUND_MS else "NOT met"
        print(f"\nDecode's read done -> vLLM's prefill scheduler frees the blocks, p50 per length: "
              f"{', '.join(f'{x:.1f}' for x in p50s)} ms (slowest request {worst:.1f} ms); "
              f"bound p50 <= {FREED_BOUND_MS:g} ms: {verdict}")
    settle_s = report.get("settings", {}).get("settle_s")
    for row in report["lengths"]:
        after = row.get("prefill_cpu_after_s") or {}
        pd, alone = after.get("kvxferd"), after.get("single")
        if pd is None:
            continue
        line = f"{row['tokens']} tokens: the prefill server's CPU in the {settle_s} s after a P/D request {pd:.2f} s"
        if alone is not None:
            verdict = "met" if pd - alone <= CPU_BOUND_S else "NOT met"
            line += (f", after a request it served alone {alone:.2f} s; bound P/D - alone <= {CPU_BOUND_S:g} s: "
                     f"{verdict}")
        print(line)
