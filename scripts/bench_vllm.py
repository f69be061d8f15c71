"""Time to first token through prefill/decode with kvxferd vs one vLLM instance, on CPU, in one run.

Starts two kvxferd daemons, a prefill and a decode vLLM server (tiny Llama,
dummy weights) with the KvxferdConnector, and the proxy; then sends the
same prompts straight to the prefill server (the single instance) and
through the proxy, streaming, and reports time to first token, tokens
equal or not, and bytes the decode daemon read per request. Prefix caching
is off, so the prefill leg computes each prompt as the single instance did
(it would otherwise hit the cache the single-instance request warmed). Run
in .venv-vllm::

    .venv-vllm/bin/python scripts/bench_vllm.py [--requests 10] [--lengths 128 512 960]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxferd.client import DaemonProcess  # noqa: E402
from tests.integrations.vllm_cluster import metric, write_tiny_model  # noqa: E402


def post(url: str, body: dict) -> tuple[float, list[int]]:
    """Stream a completion: (seconds to the first token, every token id)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start, first, tokens = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=300) as answer:
        for line in answer:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens += ids
    return first, tokens


def wait_healthy(port: int, process: subprocess.Popen, log: pathlib.Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server on port {port} did not come up; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10, help="requests per prompt length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 960])
    parser.add_argument("--base-port", type=int, default=18100)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvx-bench-vllm"))
    model = write_tiny_model(work / "tiny-llama")
    daemons = DaemonProcess.start_many(["bp0", "bd0"], socket_dir=str(work))
    processes = []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    try:
        ports = {"prefill": args.base_port, "decode": args.base_port + 100}
        for (name, port), daemon in zip(ports.items(), daemons):
            config = {"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.integrations.vllm",
                      "kv_role": "kv_both", "engine_id": name, "kv_connector_extra_config": {"engine_socket": daemon.socket}}
            log = work / f"{name}.log"
            processes.append((subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--load-format", "dummy",
                 "--skip-tokenizer-init", "--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
                 "--seed", "0", "--no-enable-prefix-caching", "--port", str(port), "--kv-transfer-config", json.dumps(config)],
                stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env), port, log))
        proxy_port = args.base_port - 100
        processes.append((subprocess.Popen(
            [sys.executable, "-m", "kvxferd.integrations.vllm.proxy", "--prefill", f"http://127.0.0.1:{ports['prefill']}",
             "--decode", f"http://127.0.0.1:{ports['decode']}", "--port", str(proxy_port)],
            stdout=open(work / "proxy.log", "wb"), stderr=subprocess.STDOUT, env=env), None, work / "proxy.log"))
        for process, port, log in processes[:2]:
            wait_healthy(port, process, log)
        time.sleep(1)  # the proxy
        print("| prompt tokens | requests | TTFT single p50 ms | TTFT P/D p50 ms | P/D / single | KiB read per request | tokens equal |")
        print("|---|---|---|---|---|---|---|")
        for length in args.lengths:
            single_ttft, pd_ttft, equal = [], [], True
            read_before = metric(daemons[1], "kvxferd_read_bytes_total")
            for n in range(args.requests):
                prompt = [3 + (length * 7 + n * 13 + i * 31) % 500 for i in range(length)]  # fresh per request
                body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                        "return_token_ids": True}
                ttft, single = post(f"http://127.0.0.1:{ports['prefill']}/v1/completions", body)
                single_ttft.append(ttft)
                ttft, through_pd = post(f"http://127.0.0.1:{proxy_port}/v1/completions", body)
                pd_ttft.append(ttft)
                equal &= single == through_pd
            read = (metric(daemons[1], "kvxferd_read_bytes_total") - read_before) / args.requests
            s, p = statistics.median(single_ttft) * 1e3, statistics.median(pd_ttft) * 1e3
            print(f"| {length} | {args.requests} | {s:.1f} | {p:.1f} | {p / s:.2f} | {read / 1024:.0f} | {equal} |")
    finally:
        for process, _port, _log in processes:
            process.terminate()
        for process, _port, _log in processes:
            process.wait(30)
        for daemon in daemons:
            daemon.terminate()


if __name__ == "__main__":
    main()
