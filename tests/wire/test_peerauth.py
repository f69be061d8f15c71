"""The host peer secret: how it is written, what is refused when it is read, and what a token binds."""

import os
import threading

import pytest

from kvxferd.errors import PermissionDeniedError, UnauthenticatedError
from kvxferd.wire.listening import listener_uids
from kvxferd.wire.peerauth import (TOKEN_WINDOW_S, check_peer_token, load_or_create_peer_secret,
                                   peer_metadata, peer_token, read_peer_secret, token_window)


def test_racing_daemons_agree_on_one_secret(tmp_path):
    path = str(tmp_path / "run" / "peer.secret")
    secrets, barrier = [], threading.Barrier(8)

    def start():
        barrier.wait()
        secrets.append(load_or_create_peer_secret(path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(secrets)) == 1 and len(secrets[0]) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(tmp_path / "run").st_mode & 0o777 == 0o700
    assert sorted(os.listdir(tmp_path / "run")) == ["peer.secret"]  # no scratch file left
    assert load_or_create_peer_secret(path) == secrets[0]  # kept, never replaced


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620])
def test_a_secret_others_may_read_or_its_group_write_is_refused(tmp_path, mode):
    path = tmp_path / "peer.secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(mode)
    with pytest.raises(PermissionDeniedError, match=f"mode {mode:o}"):
        read_peer_secret(str(path))
    path.chmod(0o640)  # control: group-readable is allowed (daemons of several users in one group)
    assert len(read_peer_secret(str(path))) == 32


def test_a_symlink_a_short_or_a_garbled_secret_is_refused(tmp_path):
    real = tmp_path / "real"
    real.write_text(os.urandom(32).hex())
    real.chmod(0o600)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(PermissionDeniedError, match="symlink"):
        read_peer_secret(str(tmp_path / "link"))
    for text in (os.urandom(8).hex(), "not hex at all" * 8):
        real.write_text(text)
        with pytest.raises(PermissionDeniedError, match="does not hold a secret"):
            read_peer_secret(str(real))


def test_a_token_binds_the_secret_the_exact_address_and_its_window():
    """Issue 35 review: a daemon on 127.0.0.1:P took tokens for [::1]:P and localhost:P, addresses another
    local user could bind; and a token never expired. Now only the exact address, this window or the last."""
    secret, now = os.urandom(32), 1_000_000.0
    window = token_window(now)
    check_peer_token(secret, "127.0.0.1:4000", peer_token(secret, "127.0.0.1:4000", window), now)
    check_peer_token(secret, "127.0.0.1:4000", peer_token(secret, "127.0.0.1:4000", window - 1), now)
    for presented in ("", peer_token(secret, "127.0.0.1:4001", window), peer_token(secret, "[::1]:4000", window),
                      peer_token(secret, "localhost:4000", window), peer_token(os.urandom(32), "127.0.0.1:4000", window),
                      peer_token(secret, "127.0.0.1:4000", window - 2), peer_token(secret, "127.0.0.1:4000", window + 1)):
        with pytest.raises(UnauthenticatedError):
            check_peer_token(secret, "127.0.0.1:4000", presented, now)
    assert token_window(now + TOKEN_WINDOW_S) == window + 1


def test_no_token_goes_to_a_listener_of_another_user():
    """The caller asks the kernel who listens on the loopback port first: its own uid (or root) only."""
    import socket
    import subprocess
    import sys

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        assert listener_uids("127.0.0.1", port) == {os.getuid()}
        assert peer_metadata(os.urandom(32), f"127.0.0.1:{port}")  # our own: a token
    finally:
        listener.close()
    assert listener_uids("198.18.0.1", port) is None  # not loopback: cannot tell
    # A listener of uid 65534 (a child that drops privileges, then listens until told to stop).
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, sys\nos.setgid(65534); os.setuid(65534)\ns = socket.socket(socket.AF_INET6)\n"
        "s.bind(('::', 0)); s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        assert listener_uids("127.0.0.1", port) == {65534}  # a dual-stack wildcard reaches 127.0.0.1 too
        with pytest.raises(PermissionDeniedError, match="uid 65534"):
            peer_metadata(os.urandom(32), f"127.0.0.1:{port}")
    finally:
        child.stdin.close()
        child.wait(10)
