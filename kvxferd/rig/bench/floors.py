"""What each step of a read costs alone on this machine: the floors the daemon's figures stand on.

    kvxferd bench floors [--json]

* wake-ups: a polling thread sleeping 100 µs per round, CPU per wake-up and
  the real interval, for ``threading.Event.wait``, the data plane's
  :class:`~kvxferd.xfer.osutil.waker.Waker` (eventfd + select) and ``time.sleep``;
* thread hop: one thread hands an item to another that sleeps on a Waker
  (the event loop to the data-plane thread), latency until it runs;
* UDP wake-up: a 28-byte datagram over loopback to a thread asleep in
  ``select`` on its socket, latency until it has read it (what a "poke"
  from a peer daemon would cost instead of polling; docs/benchmarks.md);
* NIXL: ``get_new_notifs`` with nothing new; a notification from one agent
  to another until the receiver sees it (both polling, same process);
* gRPC: one message each way on a bidirectional ``grpc.aio`` stream over a
  UNIX socket (the engine's Reads stream without the daemon behind it), with
  client and server on one event loop, and as an engine makes them (the server
  in another process, a synchronous client with a reader thread), back to back
  and one every 3 ms; and the same trip over the reads socket's frames (an
  asyncio protocol on uvloop in the other process: gRPC's framework left out);
* planning: ``plan_request`` for a 2-layer, 2-block request, back to back
  and with 3 ms between calls (how the daemon calls it at 300 requests/s);
* NIXL's own progress thread with a 1 ms delay (:mod:`kvxferd.rig.bench.nixl_progress`):
  its idle CPU, a read from an owner that never polls, a notification's trip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from kvxferd.rig.bench import nixl_progress
from kvxferd.rig.bench.common import bench_main, full_attention_groups, percentiles_us, process_cpu_s
from kvxferd.wire.frames import FrameReader, encode_frame
from kvxferd.xfer.osutil.waker import Waker


def wakeups(seconds: float = 2.0, interval_s: float = 100e-6) -> dict:
    """CPU per wake-up and real interval of a thread that sleeps ``interval_s`` per round."""
    event, waker = threading.Event(), Waker()
    rows = {}
    for name, sleep in (("threading.Event.wait", lambda: event.wait(interval_s)),
                        ("Waker.wait (eventfd + select)", lambda: waker.wait(interval_s)),
                        ("time.sleep", lambda: time.sleep(interval_s))):
        n, start, cpu = 0, time.perf_counter(), process_cpu_s()
        while time.perf_counter() - start < seconds:
            sleep()
            n += 1
        wall_s, cpu_s = time.perf_counter() - start, process_cpu_s() - cpu
        rows[name] = {"cpu_us_per_wake": cpu_s / n * 1e6, "interval_us": wall_s / n * 1e6,
                      "core_percent": cpu_s / wall_s * 100}
    return rows


def _wake_latencies(repeat: int, wake: Callable[[], None], wait: Callable[[], bool]) -> list[float]:
    """Latency from ``wake()`` here until a thread blocked in ``wait()`` (True: woken) runs; one every 200 µs."""
    sent, latencies, done = [0.0], [], threading.Event()

    def worker():
        while len(latencies) < repeat:
            if wait():
                latencies.append(time.perf_counter() - sent[0])
        done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    for _ in range(repeat):
        time.sleep(200e-6)
        sent[0] = time.perf_counter()
        wake()
    done.wait(10)
    thread.join(1.0)
    return latencies


def thread_hop(repeat: int = 2000) -> dict:
    """Latency from ``Waker.set`` in one thread until the sleeping thread runs."""
    waker = Waker()
    return percentiles_us(_wake_latencies(repeat, waker.set, lambda: waker.wait(1.0)))


def udp_wakeup(repeat: int = 2000) -> dict:
    """A datagram's trip over loopback to a thread asleep in ``select`` on its socket; and what
    sending and reading one costs back to back (no sleeper)."""
    sender, receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    address, datagram = receiver.getsockname(), b"x" * 28

    def wait() -> bool:
        if not select.select([receiver], [], [], 1.0)[0]:
            return False
        receiver.recv(64)
        return True

    try:
        latencies = _wake_latencies(repeat, lambda: sender.sendto(datagram, address), wait)
        start = time.perf_counter()
        for _ in range(repeat):
            sender.sendto(datagram, address)
            receiver.recv(64)
        back_to_back_us = (time.perf_counter() - start) / repeat * 1e6
    finally:
        sender.close()
        receiver.close()
    return {"one_way": percentiles_us(latencies[repeat // 10:]), "send_and_read_us": back_to_back_us}


def nixl_notifications(repeat: int = 2000) -> dict:
    """``get_new_notifs`` alone, and a notification's trip between two polling agents."""
    from kvxferd.xfer.nixl.agent import NixlAgent

    sender, receiver = NixlAgent("floor-sender"), NixlAgent("floor-receiver")
    sender.add_remote(receiver.metadata())
    receiver.add_remote(sender.metadata())
    raw_sender, raw_receiver = sender.raw, receiver.raw
    empty = []
    for _ in range(repeat):
        start = time.perf_counter()
        raw_receiver.get_new_notifs()
        empty.append(time.perf_counter() - start)
    trips = []
    for n in range(repeat // 4):
        start = time.perf_counter()
        raw_sender.send_notif("floor-receiver", b"n%d" % n)
        while not raw_receiver.get_new_notifs():
            raw_sender.get_new_notifs()  # the sender must make progress too
        trips.append(time.perf_counter() - start)
    return {"get_new_notifs_empty": percentiles_us(empty), "notification_one_way": percentiles_us(trips[10:])}


def _echo_server(path: str) -> grpc.aio.Server:
    """A grpc.aio server on ``unix://path`` whose one stream method sends back each message it gets."""
    async def echo(request_iterator, context):
        async for message in request_iterator:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Echo", {"Echo": handler}),))
    server.add_insecure_port(f"unix://{path}")
    return server


def grpc_stream(repeat: int = 1000) -> dict:
    """Round trips of one small message each way on a bidirectional grpc.aio stream (UNIX socket),
    client and server on one event loop."""
    async def run(path: str) -> list[float]:
        server = _echo_server(path)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
                call = channel.stream_stream("/floor.Echo/Echo")()
                trips = []
                for _ in range(repeat):
                    start = time.perf_counter()
                    await call.write(b"x" * 64)
                    await call.read()
                    trips.append(time.perf_counter() - start)
                await call.done_writing()
                return trips
        finally:
            await server.stop(None)

    with tempfile.TemporaryDirectory() as workdir:
        cpu = process_cpu_s()
        trips = asyncio.run(run(os.path.join(workdir, "echo.sock")))
        cpu_s = process_cpu_s() - cpu
    return {"round_trip": percentiles_us(trips[50:]), "cpu_us_per_round_trip_both_sides": cpu_s / len(trips) * 1e6}


def serve_echo(path: str) -> None:
    """Body of the echo server process of :func:`grpc_stream_engine_client` (prints ``ready``)."""
    async def run() -> None:
        server = _echo_server(path)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


def grpc_stream_engine_client(repeat: int = 1000, gap_s: float = 3e-3) -> dict:
    """Round trips as an engine makes them: the server in another process, and a synchronous client
    that puts each message on its request iterator's queue and takes replies on a reader thread,
    as :class:`~kvxferd.client.engine.EngineClient` does. Back to back, and one every ``gap_s``
    (300 requests/s leave 3 ms between messages: caches and threads are cold again)."""
    with _echo_process("serve_echo", "echo.sock") as path, grpc.insecure_channel(f"unix:{path}") as channel:
        return {"back_to_back": _engine_client_trips(channel, repeat, 0.0),
                f"every_{gap_s * 1e3:g}_ms": _engine_client_trips(channel, max(repeat // 4, 20), gap_s)}


@contextlib.contextmanager
def _echo_process(serve: str, socket_name: str):
    """One of this module's echo servers (``serve``: its function) in another process; yields its
    socket's path once it is ready, kills it afterwards."""
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, socket_name)
        code = f"from kvxferd.rig.bench.floors import {serve}; {serve}({path!r})"
        server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server process did not start")
            yield path
        finally:
            server.kill()
            server.wait()


def _timed_trips(send, replies: queue.SimpleQueue, repeat: int, gap_s: float) -> dict:
    """``repeat`` round trips, one every ``gap_s``: ``send`` one message, wait for its echo on ``replies``."""
    trips = []
    for _ in range(repeat):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        send()
        replies.get(timeout=10.0)
        trips.append(time.perf_counter() - start)
    return percentiles_us(trips[len(trips) // 10:])


def serve_socket_echo(path: str) -> None:
    """Body of the echo server process of :func:`socket_engine_client`: frames back as they came, from an
    asyncio protocol on uvloop, as the daemon's reads socket takes them (prints ``ready``)."""
    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.frames = transport, FrameReader(1 << 20)

        def data_received(self, data: bytes) -> None:
            for payload in self.frames.feed(data):
                self.transport.write(encode_frame(payload))

    async def run() -> None:
        await asyncio.get_running_loop().create_unix_server(Echo, path)
        print("ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(run())


def socket_engine_client(repeat: int = 1000, gap_s: float = 3e-3) -> dict:
    """:func:`grpc_stream_engine_client` over the reads socket's framing instead of gRPC: the client
    sends from the calling thread and takes replies on a reader thread, as
    :class:`~kvxferd.client.readsock.ReadsSocketStream` does."""
    with _echo_process("serve_socket_echo", "echo.reads") as path, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        replies: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            frames = FrameReader(1 << 20)
            with contextlib.suppress(OSError):  # ends when the socket is shut down and closed
                while data := conn.recv(1 << 16):
                    for payload in frames.feed(data):
                        replies.put(payload)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        frame = encode_frame(b"x" * 64)
        rows = {"back_to_back": _timed_trips(lambda: conn.sendall(frame), replies, repeat, 0.0),
                f"every_{gap_s * 1e3:g}_ms": _timed_trips(lambda: conn.sendall(frame), replies,
                                                          max(repeat // 4, 20), gap_s)}
        conn.shutdown(socket.SHUT_RDWR)
        reader.join(timeout=5.0)
        return rows


def _engine_client_trips(channel: grpc.Channel, repeat: int, gap_s: float) -> dict:
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    replies: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        while (message := outbox.get()) is not None:
            yield message

    call = channel.stream_stream("/floor.Echo/Echo")(requests())

    def read() -> None:
        try:
            for message in call:
                replies.put(message)
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    row = _timed_trips(lambda: outbox.put(b"x" * 64), replies, repeat, gap_s)
    outbox.put(None)
    call.cancel()
    reader.join(timeout=5.0)
    return row


def planning(repeat: int = 300) -> dict:
    """``plan_request`` for a small request, back to back and spaced out."""
    from kvxferd.plan.engine import EngineTransferPlan, ReadRequest
    from kvxferd.rig.verify.buffers import allocate_engine

    groups = full_attention_groups(2, 8)
    plan = EngineTransferPlan(allocate_engine("fd", groups, 1, 0, tagged=False).cache,
                              [allocate_engine("fp", groups, 1, 0, tagged=False).cache])
    request = ReadRequest("r", "r@p", (np.array([3, 5]),), (np.array([0, 1]),))
    rows = {}
    for name, gap_s in (("back to back", 0.0), ("every 3 ms", 3e-3)):
        times = []
        for _ in range(repeat):
            if gap_s:
                time.sleep(gap_s)
            start = time.perf_counter()
            plan.plan_request(request)
            times.append(time.perf_counter() - start)
        rows[name] = statistics.median(times) * 1e6
    return rows


def sealing(repeat: int = 2000) -> dict:
    """What a sealed read costs: minting a capability at Hold, and checking one rank's at submit, for a request
    of 2 blocks and of 512 blocks (one group), in µs (medians)."""
    from kvxferd.plan.capability import check_read_capabilities, hold_capability

    key, rows = bytes(range(32)), {}
    for num_blocks in (2, 512):
        blocks = (np.arange(num_blocks),)
        capability = hold_capability(key, "r@p", blocks)
        mint, check = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            hold_capability(key, "r@p", blocks)
            middle = time.perf_counter()
            check_read_capabilities([key], "r@p", blocks, [capability])
            mint.append(middle - start)
            check.append(time.perf_counter() - middle)
        rows[f"{num_blocks} blocks"] = {"mint_us": statistics.median(mint) * 1e6,
                                        "check_us": statistics.median(check) * 1e6}
    return rows


def digests(repeat: int = 5) -> dict:
    """Issue #59: the logical digest of 100 held blocks of one layer (16 tokens, 8 KV heads of 128, bf16), in
    GB/s, against copying the same bytes once (numpy into a buffer already faulted in): best of ``repeat``."""
    from kvxferd.layout.digests import atom_tokens, field_digests, field_key
    from kvxferd.layout.specs import AttentionSpec
    from kvxferd.rig.verify.physical import region_num_bytes

    rows = {}
    for layout in ("packed_HND", "packed_NHD", "kv_per_head_kt"):
        spec = AttentionSpec(layout, num_blocks=128, num_kv_heads=8, head_size=128, block_size=16)
        memory = np.random.default_rng(0).integers(0, 256, region_num_bytes(spec, 1, 0), dtype=np.uint8)
        block_ids, region = np.arange(100), spec.region(1, 0)
        held = memory[: memory.nbytes * 100 // 128]
        copy = np.empty_like(held)
        digest_s, copy_s = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            for f in region.fields:
                field_digests(memory, f, block_ids, field_key(0, 0, f.name), atom_tokens(spec.block_size))
            middle = time.perf_counter()
            np.copyto(copy, held)
            digest_s.append(middle - start)
            copy_s.append(time.perf_counter() - middle)
        rows[layout] = {"digest_gbps": held.nbytes / min(digest_s) / 1e9, "copy_gbps": held.nbytes / min(copy_s) / 1e9}
    return rows


def run() -> dict:
    return {"wakeups_100us": wakeups(), "thread_hop": thread_hop(), "udp_wakeup": udp_wakeup(), "nixl": nixl_notifications(),
            "grpc_stream": grpc_stream(), "grpc_engine_client": grpc_stream_engine_client(),
            "socket_engine_client": socket_engine_client(),
            "planning_us": planning(), "sealing_us": sealing(), "digests": digests(),
            "nixl_progress_thread": nixl_progress.run()}


def format_table(f: dict) -> str:
    lines = ["polling thread sleeping 100 us per round", f"{'':<32}{'CPU us/wake':>12}{'interval us':>12}{'% core':>8}"]
    for name, row in f["wakeups_100us"].items():
        lines.append(f"{name:<32}{row['cpu_us_per_wake']:>12.1f}{row['interval_us']:>12.0f}{row['core_percent']:>8.1f}")
    n, g = f["nixl"], f["grpc_stream"]
    lines += ["", f"{'step':<56}{'p50 us':>9}{'p99 us':>9}"]
    for label, row in (("thread hop (Waker.set -> sleeping thread runs)", f["thread_hop"]),
                       ("UDP datagram -> thread asleep in select has read it", f["udp_wakeup"]["one_way"]),
                       ("NIXL get_new_notifs, nothing new", n["get_new_notifs_empty"]),
                       ("NIXL notification, one way (both polling)", n["notification_one_way"]),
                       ("gRPC aio stream, one message each way", g["round_trip"])):
        lines.append(f"{label:<56}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}")
    for key, name in (("grpc_engine_client", "gRPC stream"), ("socket_engine_client", "reads socket")):
        for gap, row in f.get(key, {}).items():
            label = f"{name}, sync client, other process, {gap.replace('_', ' ')}"
            lines.append(f"{label:<56}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}")
    lines.append(f"gRPC aio stream: {g['cpu_us_per_round_trip_both_sides']:.0f} us CPU per round trip (both sides)")
    lines.append(f"UDP datagram: {f['udp_wakeup']['send_and_read_us']:.1f} us to send and read one (back to back, loopback)")
    p = f["planning_us"]
    lines.append(f"plan_request, 2 layers x 2 blocks: {p['back to back']:.0f} us back to back, "
                 f"{p['every 3 ms']:.0f} us every 3 ms")
    for size, row in f.get("sealing_us", {}).items():
        lines.append(f"sealed read, {size}: {row['mint_us']:.1f} us to mint at Hold, {row['check_us']:.1f} us to "
                     "check one remote rank's capability")
    for layout, row in f.get("digests", {}).items():
        lines.append(f"digest of 100 held blocks, {layout}: {row['digest_gbps']:.2f} GB/s (a copy of them: "
                     f"{row['copy_gbps']:.2f} GB/s, ratio {row['digest_gbps'] / row['copy_gbps']:.2f})")
    if "nixl_progress_thread" in f:
        lines += [""] + nixl_progress.format_lines(f["nixl_progress_thread"])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run_args(args: argparse.Namespace) -> int:
    figures = run()
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m kvxferd.rig.bench.floors", __doc__, add_arguments, run_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
