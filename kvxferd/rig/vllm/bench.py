"""Time to first token through prefill/decode with kvxferd (and vLLM's NixlConnector) vs one vLLM instance, on CPU.

Starts two kvxferd daemons, a prefill and a decode vLLM server with the
KvxferdConnector, and the proxy (kvxferd/integrations/vllm/proxy.py); then
streams the same prompts (token ids, the tiny Llama of
``kvxferd.rig.vllm.tinymodel`` with its real weights) straight to a
single instance and through the proxy, and reports time to first token,
whether the tokens are equal, and the bytes the decode daemon read per
request. Prefix caching is off, so every prefill computes its prompt.

``--push`` adds kvxferd's push mode (issue #57): the same kvxferd servers
(their connectors run ``mode: push``, which serves pulls too), a second proxy
sending both legs at once; ``--compare nixl-push`` adds vLLM's own
``NixlPushConnector`` pair behind kvxferd/rig/vllm/nixlpush.py.
``--compare nixl`` adds a third column: a prefill and a decode server with
vLLM's own NixlConnector (in-process NIXL, ``kv_buffer_device: "cpu"``)
behind the same proxy, and the single instance becomes its own plain vLLM
server. The setups take turns request by request (the order rotates), so
drift hits all alike; the NIXL servers are paused (SIGSTOP) while the others
are measured, since NIXL's progress thread spins a core even when idle. A
breakdown (on with ``--compare``) sends each P/D setup the proxy's two legs
straight from here too, to split P/D's added time into the prefill leg, the
decode leg's read (the decode side's own metrics) and the rest of the decode
leg, and the proxy's hops. ``--trace`` stamps each kvxferd P/D request in
every process it crosses (kvxferd/rig/vllm/tracejoin.py) and cuts its TTFT into
segments; it also prints when the prefill freed the blocks after decode's
read and the prefill server's CPU after each request, each against its bound.
``--worker-cores 0 1`` binds the prefill's and the decode's model to cores of
their own (docs/vllm.md, Limits). Run in .venv-vllm::

    .venv-vllm/bin/python -m kvxferd.rig.vllm.bench [--requests 10] [--lengths 128 512 960]
    .venv-vllm/bin/python -m kvxferd.rig.vllm.bench --compare nixl [--json out.json]
    .venv-vllm/bin/python -m kvxferd.rig.vllm.bench --compare nixl nixl-push --push --worker-cores 0 1  # #57
    .venv-vllm/bin/python -m kvxferd.rig.vllm.bench --trace --worker-cores 0 1 --requests 15 --lengths 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request

from kvxferd.rig.vllm.servers import Setup, metric_sum, nixl_log_notes, scrape, start_setups

from kvxferd.rig.vllm.contention import cores_used, print_waiting_cpu, process_groups, waiting_push_cpu
from kvxferd.rig.vllm.tracejoin import (print_bounds, print_push_trace, print_trace, push_summary, push_timelines,
                                        summary, timelines)

from kvxferd.integrations.vllm.proxy import PREFILL_ID_HEADER, decode_request, prefill_request
from kvxferd.integrations.vllm.trace import TRACE_DIR_ENV, read_stamps
from kvxferd.rig.vllm.tinymodel import TINY_LLAMA, write_tiny_model

MAX_TOKENS = 8
FIRST_PUSH_TIMEOUT_S = 300.0  # the first request of vLLM's NixlPushConnector pays its reverse handshake


def block_kib(config: dict = TINY_LLAMA, block_size: int = 32) -> float:
    """KiB of one block of every layer's K and V."""
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[config.get("torch_dtype", "bfloat16")]
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * block_size * config["head_dim"]
            * dtype_bytes / 1024)


def post(url: str, body: dict, timeout_s: float, stamps: dict | None = None) -> tuple[float, list[int], dict | None]:
    """(seconds to the first token, every token id, kv_transfer_params) of one completion, streamed or not.

    ``stamps`` (a dict) gets the wall-clock ``start`` and ``first`` (token) and the proxy's prefill request id."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start_s = time.time()
    start, first, tokens = time.perf_counter(), None, []
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            if stamps is not None:
                stamps.update(start=start_s, prefill_id=answer.headers.get(PREFILL_ID_HEADER, ""))
            if not body.get("stream"):
                whole = json.loads(answer.read())
                ids = whole["choices"][0].get("token_ids") or []
                return time.perf_counter() - start, ids, whole.get("kv_transfer_params")
            for line in answer:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "choices" not in chunk:
                    raise RuntimeError(f"{url} streamed {line[6:306].decode(errors='replace').strip()}")
                ids = chunk["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - start
                    if stamps is not None:
                        stamps["first"] = time.time()
                tokens += ids
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"HTTP {err.code} from {url}: {err.read()[:300].decode(errors='replace')}") from None
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first, tokens, None


def prompt_ids(length: int, n: int) -> list[int]:
    """A prompt of ``length`` token ids, different for every ``n`` (the same for every setup)."""
    return [3 + (length * 7 + n * 13 + i * 31) % 500 for i in range(length)]


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class Bench:
    def __init__(self, args, setups: dict[str, Setup], model: str) -> None:
        self.args, self.setups, self.model = args, setups, model
        self.failures: dict[str, int] = {}  # failed requests in a row
        self.errors: dict[str, list[str]] = {name: [] for name in setups}
        self.clients: list[dict] = []  # --trace: the client's stamps of each P/D request through kvxferd
        self.push_clients: list[dict] = []  # and through one push column (the layer-by-layer one, if run)
        self.push_traced = "kvxferd-push-layers" if "kvxferd-push-layers" in setups else "kvxferd-push"

    def live(self, name: str) -> bool:
        return name in self.setups and self.setups[name].error is None

    def use(self, name: str) -> Setup:
        """``name``'s setup, running; every other pausable setup paused."""
        for other in self.setups.values():
            if other.name != name:
                other.pause()
        setup = self.setups[name]
        if setup.resume():
            # Timers that ran out while paused fire now: uvicorn closes idle keep-alive connections
            # (5 s), and a request sent on one at that moment is reset. Let them settle first.
            time.sleep(0.3)
        return setup

    def body(self, prompt: list[int]) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "return_token_ids": True}

    def request(self, name: str, prompt: list[int], timeout_s: float | None = None) -> tuple[float, list[int]]:
        setup = self.use(name)
        stamps = {} if self.args.trace and name in ("kvxferd", self.push_traced) else None
        ttft, tokens, _ = post(setup.url, self.body(prompt), timeout_s or self.args.timeout, stamps)
        if stamps and "first" in stamps:
            (self.clients if name == "kvxferd" else self.push_clients).append(stamps)
        return ttft, tokens

    def legs(self, name: str, prompt: list[int]) -> dict:
        """The proxy's two legs sent from here: prefill (one token, whole request) then decode (streamed)."""
        setup = self.use(name)
        body = self.body(prompt)
        prefill_s, _, params = post(f"http://127.0.0.1:{setup.prefill}/v1/completions", prefill_request(body),
                                    self.args.timeout)
        if not params:
            raise RuntimeError(f"{name}'s prefill returned no kv_transfer_params")
        decode_s, tokens, _ = post(f"http://127.0.0.1:{setup.decode}/v1/completions", decode_request(body, params),
                                   self.args.timeout)
        return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens}

    def attempt(self, name: str, call, *args):
        """``call(*args)``, or None after recording its error; a P/D setup failing 3 times running is dropped."""
        try:
            result = call(*args)
            self.failures[name] = 0
            return result
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            self.failures[name] = self.failures.get(name, 0) + 1
            self.errors[name].append(str(err))
            print(f"{name}: request failed: {err}", file=sys.stderr)
            setup = self.setups[name]
            if self.failures[name] >= 3 and name != "single":
                dead = [p.failure() for p in setup.processes if p.popen.poll() is not None]
                setup.error = f"3 requests in a row failed, the last: {err}" + (f"; {dead[0]}" if dead else "")
                setup.stop()
            return None

    def metrics(self, name: str) -> dict[str, float]:
        setup = self.setups[name]
        if setup.error is not None:
            return {}
        if setup.pausable:
            self.use(name)
        try:
            return setup.read_metrics()
        except OSError as err:
            print(f"{name}: metrics: {err}", file=sys.stderr)
            return {}


def delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def idle_cpu(setups: dict[str, Setup], seconds: float = 3.0) -> dict[str, float]:
    """Cores each server (its process group) and each daemon uses while no request runs."""
    measured = process_groups(setups)
    for setup in setups.values():
        setup.resume()
    return cores_used(measured, seconds)


def run(args, setups: dict[str, Setup], model: str) -> dict:
    bench = Bench(args, setups, model)
    pd_names = [name for name in setups if name != "single"]
    breakdown = [name for name in ("kvxferd", "nixl") if name in setups and args.breakdown]  # a pull's two legs
    report: dict = {"model": dict(TINY_LLAMA), "max_tokens": MAX_TOKENS, "requests": args.requests,
                    "push_layer_min_tokens": args.push_layer_min_tokens, "num_blocks": args.num_blocks,
                    "push_traced": bench.push_traced,
                    "block_kib": block_kib(), "idle_cpu_cores": idle_cpu(setups),
                    "unavailable": {n: s.error for n, s in setups.items() if s.error}, "first_request": {},
                    "lengths": []}
    # First requests after start (not counted): the first handshake of each P/D pair is in them.
    warm = prompt_ids(args.lengths[0], args.requests + 1)
    for name in setups:
        if bench.live(name):
            before = bench.metrics(name) if name in pd_names else {}
            # (vLLM's NixlPushConnector: its prefill's reverse handshake registered the decode's 32768 blocks in
            # 89 s here while its worker busy-polled, so its first request gets FIRST_PUSH_TIMEOUT_S)
            result = bench.attempt(name, bench.request, name, warm,
                                   max(args.timeout, FIRST_PUSH_TIMEOUT_S) if name == "nixl-push" else None)
            after = bench.metrics(name) if name in pd_names else {}
            report["first_request"][name] = {"tokens": args.lengths[0], "ttft_ms": result and result[0] * 1e3,
                                             "handshake_ms": _per(delta(after, before), "handshake_s", "handshakes")}
    for length in args.lengths:
        row: dict = {"tokens": length, "setups": {}, "breakdown": {}}
        ttft = {name: [] for name in setups}
        tokens: dict[str, list] = {name: [] for name in setups}
        legs = {name: [] for name in breakdown}
        before = {name: bench.metrics(name) for name in pd_names}
        bench.clients, bench.push_clients = [], []
        # the prefill server's CPU in the pause after each request it took part in (a P/D request, and a
        # request it served alone when it is the single instance): vLLM's worker spins a second after any
        after_cpu: dict[str, list[float]] = {"kvxferd": [], "single": []}
        prefill_server = setups["kvxferd"].processes[0]
        single_is_prefill = not setups["single"].processes
        previous = None
        items = [(name, "request") for name in setups] + [(name, "legs") for name in breakdown]
        for n in range(args.requests):
            prompt = prompt_ids(length, n)
            shift = n % len(items)
            for name, kind in items[shift:] + items[:shift]:
                if not bench.live(name):
                    continue
                measured = previous == "kvxferd" or (previous == "single" and single_is_prefill)
                cpu_s = prefill_server.cpu_seconds() if measured else 0.0
                time.sleep(args.settle_s)  # the last request's vLLM workers stop spinning (see --settle-s)
                if measured:
                    after_cpu[previous].append(prefill_server.cpu_seconds() - cpu_s)
                previous = name if kind == "request" else None
                if kind == "request":
                    result = bench.attempt(name, bench.request, name, prompt)
                    ttft[name].append(result and result[0])
                    tokens[name].append(result and result[1])
                else:
                    legs[name].append(bench.attempt(name, bench.legs, name, prompt))
        transfers = {name: delta(bench.metrics(name), before[name]) for name in pd_names if before[name]}
        reference = tokens["single"]
        for name in setups:
            times = [t * 1e3 for t in ttft[name] if t is not None]
            same = sum(1 for mine, ref in zip(tokens[name], reference) if mine is not None and mine == ref)
            row["setups"][name] = {"requests": len(times), "ttft_ms": times, "p50_ms": quantile(times, 0.5),
                                   "p99_ms": quantile(times, 0.99), "tokens_equal": same,
                                   "error": setups[name].error}
        for name in pd_names:
            got = transfers.get(name, {})
            row["setups"][name]["transfers"] = got.get("reads")
            row["setups"][name]["kib_per_transfer"] = _per(got, "bytes", "reads", 1 / 1024)
            row["setups"][name]["read_ms"] = _per(got, "read_s", "reads")
            row["setups"][name]["engine_wait_ms"] = _per(got, "wait_s", "waits")  # kvxferd: submit -> vLLM told
        for name in breakdown:
            done = [leg for leg in legs[name] if leg]
            prefill = quantile([leg["prefill_s"] * 1e3 for leg in done], 0.5)
            decode = quantile([leg["decode_s"] * 1e3 for leg in done], 0.5)
            same = sum(1 for leg, ref in zip(legs[name], reference) if leg and leg["tokens"] == ref)
            row["breakdown"][name] = {"requests": len(done), "prefill_leg_p50_ms": prefill,
                                      "decode_leg_ttft_p50_ms": decode, "tokens_equal": same}
        row["prefill_cpu_after_s"] = {k: statistics.median(v) if v else None for k, v in after_cpu.items()}
        row["clients"], row["push_clients"] = bench.clients, bench.push_clients
        report["lengths"].append(row)
    report["waiting_push_cpu"] = waiting_push_cpu(bench, post, args.timeout)
    if args.trace:
        time.sleep(args.settle_s)  # the last requests' prefills hear CONSUMED and stamp it
        stamps = read_stamps(args.trace_dir)
        for row in report["lengths"]:
            row["trace"] = summary(timelines(stamps, row["clients"], "kvx-prefill", "kvx-decode"))
            row["push_trace"] = push_summary(push_timelines(stamps, row["push_clients"], "kvx-prefill", "kvx-decode"))
    report["unavailable"] = {n: s.error for n, s in setups.items() if s.error}
    report["errors"] = {name: errors for name, errors in bench.errors.items() if errors}
    return report


def disconnect_check(setups: dict[str, Setup], model: str, timeout_s: float = 20.0) -> tuple[bool, str]:
    """A client that leaves mid-stream through the kvxferd proxy: no prefill hold stays pinned (each
    ends within ``timeout_s``, far inside the 30 s lease), decode stops the request, and P/D serves on."""
    import socket

    setup = setups["kvxferd"]
    body = {"model": model, "prompt": prompt_ids(200, 999), "max_tokens": 400, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", setup.port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        seen = b""
        while b"data: {" not in seen:  # decode streams: its read is done
            chunk = sock.recv(65536)
            if not chunk:
                return False, "the proxy closed the stream before a token"
            seen += chunk
    deadline = time.monotonic() + timeout_s
    prefill_daemon, decode_url = setup.daemons[0], f"http://127.0.0.1:{setup.decode}/metrics"
    while time.monotonic() < deadline:
        pending = prefill_daemon.metric("kvxferd_holds_pending")
        running = metric_sum(scrape(decode_url), "vllm:num_requests_running")
        if pending == 0 and running == 0:
            break
        time.sleep(0.2)
    else:
        return False, f"after {timeout_s:g} s: {pending:g} prefill holds pending, {running:g} decode requests running"
    prompt = {**body, "prompt": prompt_ids(150, 998), "max_tokens": MAX_TOKENS, "ignore_eos": False}
    _, single, _ = post(setups["single"].url, prompt, 120)
    _, through, _ = post(setup.url, prompt, 120)
    if single != through:
        return False, f"the next P/D request gave {through}, one instance {single}"
    return True, "ok: no hold pending, decode stopped the request, the next P/D request gave one instance's tokens"


def _per(values: dict, amount: str, count: str, scale: float = 1e3) -> float | None:
    if not values.get(count):
        return None
    return values[amount] / values[count] * scale


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def print_default(report: dict) -> None:
    """The table tests/integrations/test_vllm_serve.py reads: 7 columns."""
    print("| prompt tokens | requests | TTFT single p50 ms | TTFT P/D p50 ms | P/D / single | KiB read per request "
          "| tokens equal |")
    print("|---|---|---|---|---|---|---|")
    for row in report["lengths"]:
        single, pd = row["setups"]["single"], row["setups"]["kvxferd"]
        kib = pd["kib_per_transfer"]
        equal = pd["requests"] == single["requests"] == report["requests"] and pd["tokens_equal"] == pd["requests"]
        print(f"| {row['tokens']} | {pd['requests']} | {ms(single['p50_ms'])} | {ms(pd['p50_ms'])} "
              f"| {ratio(pd['p50_ms'], single['p50_ms'])} | {'n/a' if kib is None else f'{kib:.0f}'} | {equal} |")


def print_compare(report: dict) -> None:
    names = [n for n in report["lengths"][0]["setups"] if n != "single"]
    print("\nTime to first token, ms (P/D: proxy -> prefill server -> decode server):\n")
    head = ["prompt tokens", "requests", *[f"tokens equal {n}" for n in names], "single p50", "single p99"]
    for n in names:
        head += [f"{n} p50", f"{n} p99"]
    head += [f"{n} / single p50" for n in names] + ["kvxferd - nixl p50 ms", "kvxferd vs nixl p50"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in report["lengths"]:
        s = row["setups"]
        cells = [str(row["tokens"]), str(report["requests"])]
        cells += [f"{s[n]['tokens_equal']}/{report['requests']}" if not s[n]["error"] else "n/a" for n in names]
        cells += [ms(s["single"]["p50_ms"]), ms(s["single"]["p99_ms"])]
        for n in names:
            cells += [ms(s[n]["p50_ms"]), ms(s[n]["p99_ms"])]
        cells += [ratio(s[n]["p50_ms"], s["single"]["p50_ms"]) for n in names]
        kvx, nixl = s["kvxferd"]["p50_ms"], s.get("nixl", {}).get("p50_ms")
        diff = minus(kvx, nixl)
        cells += [ms(diff), "n/a" if diff is None or not nixl else f"{diff / nixl * 100:+.1f}%"]
        print("| " + " | ".join(cells) + " |")
    for name, why in report["unavailable"].items():
        print(f"\n{name}: unavailable: {why}")


def print_breakdown(report: dict) -> None:
    names = list(report["lengths"][0]["breakdown"])
    if not names:
        return
    print("\nWhere P/D's added time goes, ms. Legs: the proxy's two requests sent from here (p50s); read: mean "
          "per transfer, the decode side's metrics (kvxferd: its daemon's read duration; nixl: "
          "vllm:nixl_xfer_time_seconds); engine wait: kvxferd's worker, submit -> vLLM told it ended "
          "(vllm:kvxferd_wait_time_seconds); decode rest: decode leg - read; proxy hops: P/D - both legs:\n")
    head = ["connector", "prompt tokens", "single", "P/D", "added", "prefill leg", "prefill leg - single",
            "decode leg TTFT", "read", "engine wait", "decode rest", "proxy hops", "KiB per transfer",
            "legs tokens equal"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in names:
        for row in report["lengths"]:
            single, pd, legs = row["setups"]["single"], row["setups"][name], row["breakdown"][name]
            if pd["error"]:
                continue
            prefill, decode = legs["prefill_leg_p50_ms"], legs["decode_leg_ttft_p50_ms"]
            kib = pd["kib_per_transfer"]
            proxy_hops = minus(pd["p50_ms"], None if prefill is None or decode is None else prefill + decode)
            cells = [name, str(row["tokens"]), ms(single["p50_ms"]), ms(pd["p50_ms"]),
                     ms(minus(pd["p50_ms"], single["p50_ms"])), ms(prefill), ms(minus(prefill, single["p50_ms"])),
                     ms(decode), ms(pd["read_ms"]), ms(pd["engine_wait_ms"]), ms(minus(decode, pd["read_ms"])),
                     ms(proxy_hops),
                     "n/a" if kib is None else f"{kib:.0f}", f"{legs['tokens_equal']}/{legs['requests']}"]
            print("| " + " | ".join(cells) + " |")
    first = report["first_request"]
    print("\nFirst request after start (not counted above; the first handshake is in it):\n")
    print("| setup | prompt tokens | first TTFT ms | p50 at that length ms | first - p50 ms | handshake ms |")
    print("|---|---|---|---|---|---|")
    for name, got in first.items():
        p50 = report["lengths"][0]["setups"][name]["p50_ms"]
        print(f"| {name} | {got['tokens']} | {ms(got['ttft_ms'])} | {ms(p50)} | {ms(minus(got['ttft_ms'], p50))} "
              f"| {ms(got['handshake_ms']) if name == 'kvxferd' else 'not measured'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10, help="requests per prompt length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 960])
    parser.add_argument("--base-port", type=int, default=18100,
                        help="kvxferd proxy -100, prefill +0, decode +100; with --compare up to +612")
    parser.add_argument("--compare", choices=["nixl", "nixl-push"], nargs="+",
                        help="add vLLM's NixlConnector (nixl) and/or its NixlPushConnector (nixl-push) as columns")
    parser.add_argument("--push", action="store_true",
                        help="add kvxferd's push mode (issue #57: the same servers, the proxy in push mode)")
    parser.add_argument("--num-blocks", type=int, metavar="N",
                        help="every vLLM server's KV cache pool in blocks of 32 tokens (default: vLLM's, from its CPU "
                             "KV cache space; NixlPushConnector's reverse handshake describes the whole pool)")
    parser.add_argument("--push-layers", action="store_true",
                        help="add kvxferd push layer by layer (issue #57: the same servers, a proxy asking for it; "
                             "the --push column is then the whole write after the forward pass)")
    parser.add_argument("--push-layer-min-tokens", type=int, metavar="N",
                        help="the kvxferd servers write pushes of prompts of N tokens and more layer by layer "
                             "(the connector's push_layer_min_tokens; 0: never; default: the connector's)")
    parser.add_argument("--single", choices=["own", "prefill"],
                        help="the single instance: its own plain server (default with --compare) or the kvxferd "
                             "prefill server (default without)")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction,
                        help="also send the proxy's legs from here (default: on with --compare)")
    parser.add_argument("--pause-nixl", action=argparse.BooleanOptionalAction, default=True,
                        help="SIGSTOP the NIXL servers while the other setups are measured (default: on)")
    parser.add_argument("--nixl-progress-thread", choices=["on", "off"], default="on",
                        help="on: vLLM's NixlConnector as shipped (nixl's UCX progress thread polls without pause, a "
                             "core per server); off: without it, as kvxferd's agents run (not stock vLLM)")
    parser.add_argument("--nixl-pin", choices=["on", "off"], default="on",
                        help="on: as shipped (on CPU the NIXL worker pins the model runner's main thread to the last "
                             "core); off: that pinning skipped (not stock vLLM)")
    parser.add_argument("--nixl-threads", type=int,
                        help="kv_connector_extra_config num_threads of the NixlConnector (vLLM's default: 4)")
    parser.add_argument("--reserved-cpus", default="1",
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server, so all compute on the same cores "
                             "(default 1); 'auto': vLLM's own choice, which differs between plain and P/D servers")
    parser.add_argument("--worker-cores", nargs=2, metavar=("PREFILL", "DECODE"),
                        help="VLLM_CPU_OMP_THREADS_BIND of the kvxferd prefill and decode servers (e.g. 0 1): each "
                             "P/D server's model on cores of its own; default: vLLM's choice")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--settle-s", type=float, default=1.2,
                        help="pause before each request: a vLLM worker busy-polls for 1 s after every step "
                             "(vLLM's shm broadcast, busy_loop_s), and on 2 cores a spinning worker of one server "
                             "slows the next request of another (issue #41); 0: back to back, as before")
    parser.add_argument("--trace", action="store_true",
                        help="stamp every kvxferd P/D request in the client, proxy, both engines' connectors and the "
                             "decode daemon's completion, and print its TTFT segment by segment (issue #41)")
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    parser.add_argument("--disconnect-check", action="store_true",
                        help="then a client that leaves mid-stream through the kvxferd proxy: no hold may stay pinned")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (their folder is printed)")
    args = parser.parse_args()
    if args.breakdown is None:
        args.breakdown = bool(args.compare)
    single_on_prefill = (args.single or ("own" if args.compare else "prefill")) == "prefill"
    names = (["single", "kvxferd"] + (["kvxferd-push"] if args.push else []) + (["kvxferd-push-layers"] if args.push_layers
             else []) + list(dict.fromkeys(args.compare or [])))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops every server
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvx-bench-vllm"))
    model = write_tiny_model(work / "tiny-llama")
    args.trace_dir = str(work / "trace")
    if args.trace:
        os.environ[TRACE_DIR_ENV] = args.trace_dir  # every server and proxy started below inherits it
    setups: dict[str, Setup] = {}
    failed = True
    try:
        patches = tuple(patch for patch, on in (("no-progress-thread", args.nixl_progress_thread == "on"),
                                                 ("no-pin", args.nixl_pin == "on")) if not on)
        start_setups(setups, names, model, args.base_port, work, single_on_prefill, args.pause_nixl, patches,
                     args.reserved_cpus, args.nixl_threads, tuple(args.worker_cores) if args.worker_cores else None,
                     args.push_layer_min_tokens, args.num_blocks)
        setups = {name: setups[name] for name in names}
        report = run(args, setups, model)
        if args.disconnect_check:
            report["disconnect_check_ok"], message = disconnect_check(setups, model)
            print(f"disconnect check: {message}")
        report["single_instance"] = "the kvxferd prefill server" if single_on_prefill else "a plain vLLM server"
        report["settings"] = {"reserved_cpus": args.reserved_cpus, "nixl_patches": list(patches),
                              "nixl_threads": args.nixl_threads, "pause_nixl": args.pause_nixl,
                              "breakdown": args.breakdown,
                              "worker_cores": args.worker_cores,
                              "settle_s": args.settle_s}
        if "nixl" in setups:
            report["nixl_prefill_log"] = nixl_log_notes(work / "nixl-prefill.log")
        if args.compare or args.push:
            tweaks = [*patches] + ([f"num_threads {args.nixl_threads}"] if args.nixl_threads is not None else [])
            print(f"Single instance: {report['single_instance']}; every server: VLLM_CPU_NUM_OF_RESERVED_CPU="
                  f"{args.reserved_cpus}; NixlConnector: "
                  + (", ".join(tweaks) + " (not as shipped)" if tweaks else "as shipped"))
            print("Idle CPU, cores: " + ", ".join(f"{k} {v}" for k, v in report["idle_cpu_cores"].items())
                  + ("; the NIXL servers are paused while the others are measured" if args.pause_nixl else ""))
            print_compare(report)
        else:
            print_default(report)
        if args.breakdown:
            print_breakdown(report)
        if args.trace:
            print_trace(report)
            print_push_trace(report)
        print_waiting_cpu(report)
        print_bounds(report)
        notes = report.get("nixl_prefill_log") or {}
        if notes.get("expired_before_read"):
            print(f"\nnixl: the prefill server released {notes['expired_before_read']} request(s)' blocks when their "
                  f"lease ran out (vLLM's kv_lease_duration, 30 s) before decode's read was done, and heard of "
                  f"{notes['read_after_expiry']} read(s) only after that (\"Potentially invalid KV blocks\"): those "
                  "reads stalled until then")
        for name, errors in report["errors"].items():
            print(f"\n{name}: {len(errors)} request(s) failed (counted nowhere above); the first: {errors[0]}")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        failed = bool(report["unavailable"] or report["errors"] or report.get("disconnect_check_ok") is False)  # keep the logs that say why
    finally:
        for setup in setups.values():
            setup.stop()
        if failed or args.keep_logs:
            print(f"logs: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
