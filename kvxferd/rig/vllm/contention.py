"""What a push's waiting decode leg costs the machine (issue #57), for ``bench.py --push``.

In push mode the decode leg arrives while the prefill still computes, and
waits for its KV. vLLM steps a waiting engine about every millisecond
(its engine core sleeps 1 ms between empty steps, its worker busy-polls
vLLM's shared-memory queue), and the decode daemon polls for the writers'
notices. On a machine with few cores that CPU is taken from the prefill's
forward pass. This measures it: each process group's cores while idle, and
while the kvxferd decode server waits for a push that never comes (a
transfer id nobody holds; the request is dropped after the sample).
"""

from __future__ import annotations

import threading
import time

from kvxferd.integrations.vllm.proxy import decode_request, prefill_request
from kvxferd.rig.vllm.servers import cpu_seconds

SAMPLE_S = 2.0


def process_groups(setups: dict) -> dict:
    """name -> a function listing the processes to count (a server's process group, a daemon)."""
    import psutil

    measured = {p.name: p.members for s in setups.values() if s.error is None for p in s.servers}
    for setup in setups.values():
        for daemon in setup.daemons:
            measured[f"daemon-{daemon.daemon_id}"] = lambda pid=daemon.process.pid: [psutil.Process(pid)]
    return measured


def cores_used(measured: dict, seconds: float) -> dict[str, float]:
    """Cores each group of :func:`process_groups` used over the next ``seconds``."""
    before = {name: cpu_seconds(members()) for name, members in measured.items()}
    time.sleep(seconds)
    return {name: round((cpu_seconds(members()) - before[name]) / seconds, 2) for name, members in measured.items()}


def waiting_push_cpu(bench, post, timeout_s: float) -> dict | None:
    """Cores per process group, ``{"idle": {...}, "waiting": {...}}``, around one decode leg of the
    kvxferd-push setup waiting ``SAMPLE_S`` for a transfer nobody holds; None without that setup."""
    if not bench.live("kvxferd-push"):
        return None
    setup = bench.use("kvxferd-push")
    body = bench.body([5, 6, 7, 8] * 16)
    # Where the prefill engine is: a pull's prefill leg names it.
    _, _, params = post(f"http://127.0.0.1:{setup.prefill}/v1/completions", prefill_request(body), timeout_s)
    where = {k: params[k] for k in ("remote_engine_id", "remote_peer_addresses")}
    measured = process_groups({name: s for name, s in bench.setups.items() if name in ("single", "kvxferd")})
    time.sleep(bench.args.settle_s)  # the servers' workers stop spinning after their last step
    idle = cores_used(measured, SAMPLE_S)
    leg = decode_request(body, {"do_remote_prefill": True, "kvxferd": 1, "kvxferd_push": True,
                                "transfer_id": f"never-held-{time.time_ns()}", "push_key": "00" * 16, **where})
    waiter = threading.Thread(target=_drop_after, args=(post, setup.decode, leg, SAMPLE_S + 0.5), daemon=True)
    waiter.start()
    time.sleep(0.25)  # the leg is in: the decode engine waits for its KV
    waiting = cores_used(measured, SAMPLE_S)
    waiter.join()
    time.sleep(bench.args.settle_s)
    return {"idle": idle, "waiting": waiting}


def _drop_after(post, port: int, leg: dict, seconds: float) -> None:
    try:
        post(f"http://127.0.0.1:{port}/v1/completions", leg, seconds)
    except (OSError, RuntimeError, ValueError):
        pass  # (the timeout drops the connection: vLLM aborts the request, its expectation is released)


def print_waiting_cpu(report: dict) -> None:
    got = report.get("waiting_push_cpu")
    if not got:
        return
    print("\nCores used while idle and while the kvxferd decode server waits for a push (2 s each; its decode "
          "leg holds a transfer nobody fills):\n")
    print("| process group | idle | decode leg waiting |\n|---|---|---|")
    for name in got["idle"]:
        print(f"| {name} | {got['idle'][name]:.2f} | {got['waiting'][name]:.2f} |")
    print(f"| all | {sum(got['idle'].values()):.2f} | {sum(got['waiting'].values()):.2f} |")
