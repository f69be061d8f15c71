"""The fd socket's refusal table (docs/protocol.md, "The fd socket"), each row from a raw socket.

Against the daemon's own inbox (:class:`FdInbox`) on a real UNIX socket: what
each client gets back, what is counted, and that nothing refused is kept.
"""

from __future__ import annotations

import array
import os
import socket
import time

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.engines.fdpass import FdInbox


@pytest.fixture
def inbox(tmp_path):
    refused: list[str] = []
    box = FdInbox(str(tmp_path / "e.sock.fds"), ttl_s=1.0, max_tokens=2, max_fds_waiting=3, recv_timeout_s=0.3,
                  on_refused=refused.append)
    box.refused = refused
    yield box
    box.close()


@pytest.fixture
def fd():
    fd = os.open("/dev/null", os.O_RDONLY)
    yield fd
    os.close(fd)


def deliver(path: str, token: bytes, fds: list[int], *, send: bool = True) -> bytes:
    """What the daemon answers one delivery (b"" for none)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(path)
        if send:
            conn.sendmsg([token], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds
                         else [])
        answer = b""
        try:
            while chunk := conn.recv(256):
                answer += chunk
        except ConnectionResetError:  # the daemon closed with our bytes unread
            pass
        return answer


def counted(inbox, reason: str, before: int) -> bool:
    deadline = time.monotonic() + 5  # the inbox counts on its own thread, before it answers or closes
    while inbox.refused.count(reason) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return inbox.refused.count(reason) == before + 1


@pytest.mark.parametrize("token,num_fds", [(b"two\nlines", 1), (b"t" * 257, 1), (b"no-fds", 0), (b"\xff\xfe", 1)],
                         ids=["not printable", "257 bytes", "no fds", "not UTF-8"])
def test_a_malformed_delivery_is_refused_and_nothing_is_kept(inbox, fd, token, num_fds):
    answer = deliver(inbox.path, token, [fd] * num_fds)
    assert answer.startswith(b"refused: not one printable token"), answer
    assert counted(inbox, "malformed", 0) and inbox.num_fds_waiting == 0
    for name in {token[:256].decode(errors="replace"), token.decode(errors="replace")}:
        with pytest.raises(InvalidArgumentError):
            inbox.take(name)


def test_a_token_of_256_bytes_is_kept(inbox, fd):
    """The control of the row above: the longest token allowed is taken."""
    assert deliver(inbox.path, b"t" * 256, [fd]) == b"ok"
    (kept,) = inbox.take("t" * 256)
    assert os.fstat(kept).st_ino == os.fstat(fd).st_ino
    os.close(kept)


def test_tokens_and_fds_waiting_are_bounded(inbox, fd):
    assert deliver(inbox.path, b"a", [fd, fd]) == b"ok"
    assert deliver(inbox.path, b"a", [fd]).startswith(b"refused: max_fd_tokens")  # a token in use
    assert counted(inbox, "tokens", 0)
    assert deliver(inbox.path, b"b", [fd, fd]).startswith(b"refused: max_fds_waiting")  # 2 + 2 > 3
    assert counted(inbox, "fds", 0)
    assert deliver(inbox.path, b"b", [fd]) == b"ok"
    assert deliver(inbox.path, b"c", [fd]).startswith(b"refused: max_fd_tokens")  # two deliveries wait
    assert counted(inbox, "tokens", 1) and inbox.num_fds_waiting == 3
    for token in ("a", "b"):
        for kept in inbox.take(token):
            os.close(kept)
    assert inbox.num_fds_waiting == 0


def test_a_client_that_sends_nothing_gets_no_answer_and_counts_as_io(inbox):
    assert deliver(inbox.path, b"", [], send=False) == b""  # silent past recv_timeout_s
    assert counted(inbox, "io", 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # gone before a message
        conn.connect(inbox.path)
    assert counted(inbox, "io", 1) and inbox.refused.count("malformed") == 0


def test_a_delivery_no_register_took_is_gone_after_its_ttl(inbox, fd):
    assert deliver(inbox.path, b"late", [fd]) == b"ok"
    time.sleep(1.2)
    with pytest.raises(InvalidArgumentError, match="no fds were sent under token"):
        inbox.take("late")
    assert inbox.num_fds_waiting == 0
