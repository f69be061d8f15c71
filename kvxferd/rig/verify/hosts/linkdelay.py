"""Delay and reorder the packets of one host's link in user space, through NFQUEUE.

This kernel has no netem qdisc (``tc qdisc add ... netem`` fails: "Specified
qdisc kind is unknown") and nftables has no ``queue`` statement here; the
legacy iptables NFQUEUE target works. A rule queues the packets arriving
on ``eth0`` (linkfaults.py says why not those leaving); this program holds
each one and lets it in later by its verdict (NF_ACCEPT), speaking
nfnetlink_queue itself (stdlib only)::

    eth0 ingress ─► iptables -j NFQUEUE ─► [kernel queue] ─► this program: packet id, due time
                                                                  │ heap of (due, id)
    the host's sockets ◄──── NF_ACCEPT verdict when due ◄─────────┘

Each packet goes ``delay`` (+ uniform ``[0, jitter]``) after it arrived; with
probability ``reorder`` it goes at once instead, overtaking the held ones
(netem's ``delay D reorder P``). Only packet ids cross to user space
(``NFQNL_COPY_META``), and GSO packets are queued whole (``F_GSO``), so a
64 KiB TCP segment costs one verdict. A full queue lets packets through
rather than drop them (``F_FAIL_OPEN``), and stopping lets every held packet
go: this program delays, never loses.

    python -m kvxferd.rig.verify.hosts.linkdelay --netns NAME --queue N --delay-ms D [--jitter-ms J] [--reorder P]
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import sys
import threading
import time

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
PACKET_MESSAGE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x1, 0x4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 0x1, 0x4, 2
QUEUE_MAXLEN = 65536
RECV_BUFFER_BYTES = 8 << 20
VERDICTS_PER_SEND = 128  # 32 bytes each: one sendto carries a whole burst
READS_PER_WAKEUP = 256  # one packet per datagram: read a burst before releasing, not one per select
IDLE_WAIT_S = 0.1  # how soon a set ``stop`` is seen (an Event cannot be selected on)
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id (native byte order)
NFGEN_HEADER = struct.Struct("!BBH")  # family, version, queue number (big-endian)


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)  # nlattr header is native-endian; the payloads here are big-endian
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attributes: bytes, flags: int = NLM_F_REQUEST, sequence: int = 0) -> bytes:
    body = NFGEN_HEADER.pack(socket.AF_UNSPEC, 0, queue) + attributes
    return NLMSG_HEADER.pack(NLMSG_HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, sequence, 0) + body


def _attributes(data: bytes, offset: int, end: int):
    while offset + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4:
            return
        yield kind & 0x7FFF, data[offset + 4:offset + length]
        offset += (length + 3) & ~3


def _check(queue: int, delay_s: float, jitter_s: float, reorder: float) -> None:
    if not 0 <= queue <= 65535:
        raise ValueError(f"queue number must be in 0..65535, got {queue}")
    if delay_s < 0 or jitter_s < 0:
        raise ValueError(f"delay and jitter must be >= 0, got {delay_s} and {jitter_s}")
    if not 0.0 <= reorder <= 1.0:
        raise ValueError(f"reorder must be a probability in [0, 1], got {reorder}")


class LinkDelay:
    """One bound NFQUEUE (in the calling thread's network namespace) and the packets it holds."""

    def __init__(self, queue: int, delay_s: float, jitter_s: float = 0.0, reorder: float = 0.0,
                 seed: int | None = None) -> None:
        _check(queue, delay_s, jitter_s, reorder)
        self.queue, self.delay_s, self.jitter_s, self.reorder = queue, delay_s, jitter_s, reorder
        self.random = random.Random(seed)
        self.held: list[tuple[float, int, int]] = []  # (due, arrival order, packet id): FIFO among equal dues
        self.num_packets = 0
        self.max_held = 0
        self._sequence = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            try:  # a burst of queued packets must fit; FORCE passes net.core.rmem_max (root only)
                self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECV_BUFFER_BYTES)
            except PermissionError:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)  # an overrun must not error the socket
            self.sock.bind((0, 0))
            self._configure(_attribute(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_UNSPEC)))
            flags = struct.pack("!I", NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN)
            self._configure(_attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                            + _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                            + _attribute(NFQA_CFG_MASK, flags) + _attribute(NFQA_CFG_FLAGS, flags))
        except BaseException:
            self.sock.close()
            raise

    def _configure(self, attributes: bytes) -> None:
        """Send one config message and wait for the kernel's answer to it (an error is raised)."""
        self._sequence += 1
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, attributes, NLM_F_REQUEST | NLM_F_ACK, self._sequence))
        while True:
            data = self.sock.recv(1 << 16)
            _, kind, _, sequence, _ = NLMSG_HEADER.unpack_from(data)
            if kind != NLMSG_ERROR:  # a packet queued meanwhile: held like the others
                self._take(data)
            elif sequence == self._sequence:  # not the error of an earlier verdict (those have sequence 0)
                (error,) = struct.unpack_from("=i", data, NLMSG_HEADER.size)
                if error:
                    raise OSError(-error, f"NFQUEUE {self.queue} config: {OSError(-error, '').strerror}")
                return

    def _take(self, data: bytes) -> None:
        """Every packet in one datagram from the kernel: when it may go."""
        offset, now = 0, time.monotonic()
        while offset + NLMSG_HEADER.size <= len(data):
            length, kind = NLMSG_HEADER.unpack_from(data, offset)[:2]
            if length < NLMSG_HEADER.size:
                break
            if kind == PACKET_MESSAGE:
                start = offset + NLMSG_HEADER.size + NFGEN_HEADER.size
                for attribute, payload in _attributes(data, start, offset + length):
                    if attribute == NFQA_PACKET_HDR:
                        (packet_id,) = struct.unpack_from("!I", payload)
                        at_once = self.reorder and self.random.random() < self.reorder
                        due = now if at_once else now + self.delay_s + self.random.uniform(0.0, self.jitter_s)
                        heapq.heappush(self.held, (due, self.num_packets, packet_id))
                        self.num_packets += 1
            offset += (length + 3) & ~3
        self.max_held = max(self.max_held, len(self.held))

    def _release(self, until: float) -> None:
        """Verdicts (accept) for every held packet due by ``until``, many per datagram."""
        batch = []
        while self.held and self.held[0][0] <= until:
            _, _, packet_id = heapq.heappop(self.held)
            batch.append(_message(NFQNL_MSG_VERDICT, self.queue,
                                  _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))))
            if len(batch) == VERDICTS_PER_SEND:
                self.sock.send(b"".join(batch))
                batch.clear()
        if batch:
            self.sock.send(b"".join(batch))

    def run(self, stop: threading.Event, ready=None) -> int:
        """Hold and release packets until ``stop``; then let every packet go, unbind; the number held."""
        if ready is not None:
            ready()
        try:
            while not stop.is_set():
                wait_s = self.held[0][0] - time.monotonic() if self.held else IDLE_WAIT_S
                readable, _, _ = select.select([self.sock], [], [], min(max(wait_s, 0.0), IDLE_WAIT_S))
                for _ in range(READS_PER_WAKEUP if readable else 0):
                    try:
                        self._take(self.sock.recv(1 << 16, socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        break
                self._release(time.monotonic())
        finally:
            self.close()
        return self.num_packets

    def close(self) -> None:
        """Let every packet go and unbind. Unbinding alone would drop what the kernel still queues
        (its flush is NF_DROP), so first a queue length of 0: with F_FAIL_OPEN, new packets pass at once;
        the answer to that comes after the messages of all packets already queued, which are taken."""
        if self.sock.fileno() < 0:
            return
        try:
            self._configure(_attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 0)))
            self._release(float("inf"))
            self._configure(_attribute(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, socket.AF_UNSPEC)))
        finally:
            self.sock.close()


def run(queue_num: int, delay_s: float, jitter_s: float = 0.0, reorder: float = 0.0,
        stop: threading.Event | None = None, ready=None) -> int:
    """Delay the packets queued to NFQUEUE ``queue_num`` (in this thread's network namespace) until ``stop``
    is set (forever without one); ``ready()`` is called once bound. Returns how many packets it held."""
    delayer = LinkDelay(queue_num, delay_s, jitter_s, reorder)
    return delayer.run(stop if stop is not None else threading.Event(), ready)


def _number(kind, check, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring): runs until SIGTERM or SIGINT, then lets every packet go."""
    parser = argparse.ArgumentParser(prog="python -m kvxferd.rig.verify.hosts.linkdelay",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--netns", help="network namespace to enter first (its iptables rule queues to --queue)")
    parser.add_argument("--queue", required=True, type=_number(int, lambda v: 0 <= v <= 65535, "in 0..65535"),
                        help="NFQUEUE number")
    parser.add_argument("--delay-ms", required=True, type=_number(float, lambda v: v >= 0, ">= 0"),
                        help="how long each packet waits")
    parser.add_argument("--jitter-ms", default=0.0, type=_number(float, lambda v: v >= 0, ">= 0"),
                        help="up to this much more, uniformly at random")
    parser.add_argument("--reorder", default=0.0, type=_number(float, lambda v: 0 <= v <= 1, "in [0, 1]"),
                        help="probability that a packet goes at once instead, overtaking the held ones")
    args = parser.parse_args(argv)
    stop = threading.Event()
    try:
        if args.netns:
            from kvxferd.rig.verify.hosts.nsenter import enter_netns

            enter_netns(args.netns)  # while this process has one thread, as it needs
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        delayer = LinkDelay(args.queue, args.delay_ms / 1e3, args.jitter_ms / 1e3, args.reorder)
    except OSError as err:
        print(f"linkdelay: {err}", file=sys.stderr)
        return 1
    started = time.monotonic()
    held = delayer.run(stop, ready=lambda: print("linkdelay ready", flush=True))
    print(f"linkdelay: {held} packets held in {time.monotonic() - started:.1f} s, at most {delayer.max_held} at once",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
