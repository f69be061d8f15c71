"""The worker channel's checks: whatever arrives is bounded and shaped, and fds of a refused message close."""

from __future__ import annotations

import os
import socket

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.wire import workerchannel as channel


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_message_and_its_fds_arrive_whole(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        channel.send(a, {"op": "map", "n": 1}, [r])
        message, fds = channel.receive(b)
        assert message == {"op": "map", "n": 1} and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        channel.close_all(fds)
    finally:
        os.close(r)
        os.close(w)


def num_open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("data", [b"{", b"[1, 2]", b'{"op": 3}', b'{"no": "op"}', b"\xff\xfe"])
def test_what_is_not_a_command_is_refused_and_its_fds_closed(pair, data):
    a, b = pair
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b'{"op": "fine"}'], [r])  # the control: a good message adds its fd here
        before = num_open_fds()
        _, fds = channel.receive(b)
        assert num_open_fds() == before + 1
        channel.close_all(fds)
        socket.send_fds(a, [data], [r])
        with pytest.raises(InvalidArgumentError):
            channel.receive(b)
        assert num_open_fds() == before
    finally:
        os.close(r)
        os.close(w)


def test_a_message_longer_than_the_channel_carries(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    a.send(b"{" + b" " * (channel.MAX_MESSAGE_BYTES + 10) + b"}")
    with pytest.raises(InvalidArgumentError, match="longer"):
        channel.receive(b)
    with pytest.raises(InvalidArgumentError):
        channel.send(a, {"op": "x", "pad": "y" * channel.MAX_MESSAGE_BYTES})


def test_end_of_file_is_channel_closed(pair):
    a, b = pair
    a.close()
    with pytest.raises(channel.ChannelClosed):
        channel.receive(b)


def test_notices_are_bounded_and_shaped():
    assert channel.notices_of({"op": "notices", "notices": [["agent", "6869"]]}) == [("agent", b"hi")]
    for bad in (None, "x", [["a"]], [[1, "00"]], [["a", "zz"]], [["a", "00" * (channel.MAX_NOTICE_BYTES + 1)]],
                [["a" * (channel.MAX_NAME_CHARS + 1), "00"]], [["a", "00"]] * (channel.MAX_NOTICES + 1)):
        with pytest.raises(InvalidArgumentError):
            channel.notices_of({"op": "notices", "notices": bad})


def test_a_notify_batch_skips_only_its_bad_entries():
    name = "h" * channel.MAX_NAME_CHARS  # a long agent name is a name (a holder's engine id may be 256 characters)
    good = [[name, "6869"], ["b", "00" * channel.MAX_NOTICE_BYTES]]
    bad = [["a", "zz"], [1, "00"], ["a" * (channel.MAX_NAME_CHARS + 1), "00"],
           ["a", "00" * (channel.MAX_NOTICE_BYTES + 1)]]
    assert channel.notify_entries({"op": "notify", "notices": bad[:2] + good + bad[2:]}) == (
        [(name, b"hi"), ("b", bytes(channel.MAX_NOTICE_BYTES))], 4)
    for shape in (None, [["a", "00"]] * (channel.MAX_NOTICES + 1)):
        with pytest.raises(InvalidArgumentError):
            channel.notify_entries({"op": "notify", "notices": shape})
