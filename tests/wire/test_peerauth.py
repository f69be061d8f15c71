"""The host peer secret: how it is written, what is refused when it is read, and what a token binds."""

import os
import threading

import pytest

from kvxferd.errors import PermissionDeniedError, UnauthenticatedError
from kvxferd.wire.challenge import ChallengeBook, Nonces, call_token, new_nonce, proof_matches, secret_proof
from kvxferd.wire.listening import listener_uids
from kvxferd.wire.peerauth import check_peer_call, load_or_create_peer_secret, read_peer_secret, refuse_listener


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


def test_a_token_binds_the_secret_the_exact_address_and_one_unused_challenge():
    """Issue 35 review: a daemon on 127.0.0.1:P took tokens for [::1]:P and localhost:P, addresses another
    local user could bind. Issue 53: a token captured by a listener that squatted a restarting daemon's port
    was good for ten minutes. Now a token names the exact address and one challenge this daemon issued, once."""
    secret, address = os.urandom(32), "127.0.0.1:4000"
    book = ChallengeBook()
    nonces = book.issue(new_nonce())
    check_peer_call(secret, address, book, nonces.text(), call_token(secret, address, nonces))
    with pytest.raises(UnauthenticatedError, match="already used"):  # replayed
        check_peer_call(secret, address, book, nonces.text(), call_token(secret, address, nonces))
    made_up = Nonces(new_nonce(), new_nonce())  # not issued here (a predecessor's, or invented)
    with pytest.raises(UnauthenticatedError, match="did not issue"):
        check_peer_call(secret, address, book, made_up.text(), call_token(secret, address, made_up))
    for token_of in (lambda n: call_token(secret, "127.0.0.1:4001", n), lambda n: call_token(secret, "[::1]:4000", n),
                     lambda n: call_token(secret, "localhost:4000", n), lambda n: call_token(os.urandom(32), address, n),
                     lambda n: secret_proof(secret, address, n).hex(), lambda n: "", lambda n: "é" * 64):
        nonces = book.issue(new_nonce())
        with pytest.raises(UnauthenticatedError):
            check_peer_call(secret, address, book, nonces.text(), token_of(nonces))
    for text in ("", "00:11", "zz" * 16 + ":" + "00" * 16, "00" * 16):
        with pytest.raises(UnauthenticatedError, match="no challenge"):
            check_peer_call(secret, address, book, text, "0" * 64)


def test_a_challenge_expires_and_a_flood_of_challenges_evicts_nothing():
    """Review of issue 53: the server kept every nonce it issued (4096), so a local user's flood of Challenge
    calls could evict an honest caller's before its call. Nonces are made without state now."""
    secret, address = os.urandom(32), "127.0.0.1:4000"
    book = ChallengeBook(ttl_s=30)
    old = book.issue(new_nonce(), now=0.0)
    with pytest.raises(UnauthenticatedError, match="older than 30 s"):
        book.take(old, now=31.0)
    first = book.issue(new_nonce())
    for _ in range(20_000):
        book.issue(new_nonce())
    assert len(book) == 0  # issuing stored nothing
    check_peer_call(secret, address, book, first.text(), call_token(secret, address, first))
    assert len(book) == 1  # an authenticated call is remembered, against replay
    with pytest.raises(UnauthenticatedError, match="did not issue"):  # another daemon's (another process key)
        ChallengeBook().take(book.issue(new_nonce()))
    bad = book.issue(new_nonce())
    with pytest.raises(UnauthenticatedError, match="not this daemon's"):  # a wrong token marks nothing used
        check_peer_call(secret, address, book, bad.text(), "0" * 64)
    check_peer_call(secret, address, book, bad.text(), call_token(secret, address, bad))


def test_a_proof_binds_the_secret_the_address_dialed_and_both_nonces():
    secret, address = os.urandom(32), "127.0.0.1:4000"
    nonces = Nonces(new_nonce(), new_nonce())
    proof = secret_proof(secret, address, nonces)
    assert proof_matches(secret, address, nonces, proof)
    assert not proof_matches(secret, "127.0.0.1:4001", nonces, proof)  # another daemon's answer passed on
    assert not proof_matches(secret, address, Nonces(new_nonce(), nonces.server), proof)  # an old answer replayed
    assert not proof_matches(os.urandom(32), address, nonces, proof)
    assert not proof_matches(secret, address, nonces, bytes.fromhex(call_token(secret, address, nonces)))


def test_a_failed_challenge_names_a_listener_of_another_user():
    """Who listens is asked only to word the refusal (the proof decides): its own uid, or another's."""
    import socket
    import subprocess
    import sys

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        assert listener_uids("127.0.0.1", port) == {os.getuid()}
        assert "uid" not in refuse_listener(f"127.0.0.1:{port}", "no proof").message
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
        error = refuse_listener(f"127.0.0.1:{port}", "no proof")
        assert isinstance(error, PermissionDeniedError) and "uid 65534" in error.message
    finally:
        child.stdin.close()
        child.wait(10)
