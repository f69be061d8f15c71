"""Enter a named network namespace: a whole process (at its start), or one thread for one call.

A "host" of the namespace rig is a network namespace (``ip netns add``),
named under ``/run/netns``. Daemons start in theirs through ``ip netns exec``;
engine processes the rig spawns call :func:`enter_netns` first thing, while
they have one thread (it also gives them the namespace's ``/sys``, as ``ip
netns exec`` does, for UCX reads ``/sys/class/net/<interface>``).

A network namespace belongs to a thread, not to a process: the driver, which
stays in the host's namespace, reaches a daemon's loopback listeners (metrics,
the notify bus) from a thread that entered the daemon's namespace
(:func:`call_in_netns`). Sockets stay in the namespace they were made in, and
so do the threads a library starts from there (libzmq's I/O thread)::

    driver process
      main thread ── root namespace
      call_in_netns("kvx-h0", f) ── thread ── setns(kvx-h0) ── f() ── exits
"""

from __future__ import annotations

import ctypes
import os
import threading

import zmq

NETNS_DIR = "/run/netns"  # where `ip netns add` names namespaces
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE = 0x4000, 0x80000
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceError(OSError):
    """A namespace could not be entered (not root, no such namespace, no kernel support)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise NamespaceError(errno, f"{what}: {os.strerror(errno)}")


def netns_path(name: str) -> str:
    """The file that names network namespace ``name``."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad network namespace name {name!r}")
    return os.path.join(NETNS_DIR, name)


def setns_thread(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (root only)."""
    fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(fd, name)
    finally:
        os.close(fd)


def setns_fd(fd: int, what: str = "fd") -> None:
    """Move the calling thread into the network namespace open as ``fd`` (e.g. ``/proc/self/ns/net``, kept to
    come back)."""
    _check(_libc.setns(fd, CLONE_NEWNET), f"setns({what})")


def enter_netns(name: str) -> None:
    """Move this process (which must have one thread) into ``name``, with that namespace's ``/sys``."""
    if threading.active_count() != 1:
        raise NamespaceError(0, "enter_netns needs a process with one thread; use call_in_netns")
    setns_thread(name)
    # /sys shows the namespace that mounted it: mount it again in a mount namespace of our own, as
    # `ip netns exec` does, without letting the change leak back to the host.
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    _check(_libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    _check(_libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def call_in_netns(name: str | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a new thread inside ``name`` (in this thread when ``name`` is None);
    its result, or its exception re-raised here."""
    if name is None:
        return fn(*args, **kwargs)
    outcome: dict = {}

    def body() -> None:
        try:
            setns_thread(name)
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=body, name=f"kvxferd-netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def zmq_context_in(name: str, make=zmq.Context) -> zmq.Context:
    """A ZMQ context (``make()``: a new one, or ``zmq.Context.instance`` for the process's global one) whose
    I/O thread runs inside ``name``: libzmq starts that thread with the context's first socket, and every
    later connection of the context is made from it, so subscriptions reach ``name``'s loopback."""
    def start() -> zmq.Context:
        context = make()
        context.socket(zmq.SUB).close(linger=0)
        return context

    return call_in_netns(name, start)
