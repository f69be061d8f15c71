"""Names both sides of a socket agree on: where a daemon's sockets are, the session header, bus topics."""

from __future__ import annotations

import os
import pathlib
import stat

from kvxferd.errors import InvalidArgumentError

SESSION_KEY = "kvxferd-session"  # gRPC metadata carrying an engine's session on every call after Register
MAX_TOPIC_BYTES = 257  # an engine id (at most 256 bytes) and the NUL
ENV_PREFIX = "KVXFERD_"  # the daemon's configuration from the environment: KVXFERD_<FIELD>
SHM_DIR = pathlib.Path("/dev/shm")
SHM_NAME_MAX_BYTES = 255  # NAME_MAX: one path component under /dev/shm


def env_name(field: str) -> str:
    """The environment variable of a ``kvxferd serve`` setting (``engine_socket`` -> ``KVXFERD_ENGINE_SOCKET``)."""
    return ENV_PREFIX + field.upper()


def default_runtime_dir() -> str:
    """Where a daemon keeps its sockets unless told: a directory only its user may enter.

    ``$XDG_RUNTIME_DIR/kvxferd`` (per user, 0700 by systemd), else
    ``/run/kvxferd`` when ``/run`` or it is writable (a container), else
    :func:`tmp_runtime_dir`.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "kvxferd")
    if os.access("/run/kvxferd", os.W_OK) or (not os.path.exists("/run/kvxferd") and os.access("/run", os.W_OK)):
        return "/run/kvxferd"
    return tmp_runtime_dir()


TMP_PARENT = "/tmp"


def tmp_runtime_dir(parent: str = TMP_PARENT) -> str:
    """``/tmp/kvxferd-<uid>``, which the daemon creates 0700, unless another user made it first (anyone may
    create names in /tmp): then this user's fallback, the first by name of the directories
    ``/tmp/kvxferd-<uid>.<random>`` that belong to this user and no one else may write. Another user cannot
    make one of those (a directory belongs to whoever creates it; the sticky /tmp lets no one else rename
    or remove it), so daemons and engines of this user agree on it without asking anyone. When no
    fallback exists yet, the squatted path itself (the daemon makes a fallback:
    :func:`kvxferd.service.base.localsock.claim_runtime_dir`).
    """
    primary = os.path.join(parent, f"kvxferd-{os.getuid()}")
    if not os.path.lexists(primary) or own_private_dir(primary):
        return primary
    fallbacks = own_fallback_dirs(parent)
    return fallbacks[0] if fallbacks else primary


def own_private_dir(path: str) -> bool:
    """``path`` is a directory (not a link) of this user that no one else may write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def own_fallback_dirs(parent: str = TMP_PARENT) -> list[str]:
    """This user's fallback runtime directories under ``parent`` (``kvxferd-<uid>.<random>``), by name."""
    prefix = f"kvxferd-{os.getuid()}."
    try:
        names = [entry.name for entry in os.scandir(parent) if entry.name.startswith(prefix)]
    except OSError:
        return []
    return sorted(path for path in (os.path.join(parent, name) for name in names) if own_private_dir(path))


def default_engine_socket(daemon_id: str = "kvxferd", runtime_dir: str | None = None) -> str:
    """The engine socket of ``kvxferd serve --daemon-id DAEMON_ID`` with no ``--engine-socket``."""
    return os.path.join(runtime_dir or default_runtime_dir(), f"{daemon_id}.sock")


def fd_socket_path(engine_socket: str) -> str:
    """The fd socket next to an engine socket: where an engine passes fds before ``Register``."""
    return engine_socket + ".fds"


FD_ANSWER_MAX_BYTES = 256  # the fd socket's answer: "ok" or "refused: <limit>"


def topic(engine_id: str) -> bytes:
    """The subscription prefix of one engine's events."""
    return engine_id.encode() + b"\0"


def is_engine_topic(prefix: bytes) -> bool:
    """One whole engine topic: a printable id and exactly one NUL, at the end."""
    if not 2 <= len(prefix) <= MAX_TOPIC_BYTES or not prefix.endswith(b"\0") or b"\0" in prefix[:-1]:
        return False
    try:
        return prefix[:-1].decode().isprintable()
    except UnicodeDecodeError:
        return False


def shm_path(name: str, field: str) -> pathlib.Path:
    """``/dev/shm/<name>`` for a POSIX shared-memory name (``name`` or ``/name``), validated.

    One component, printable, at most ``NAME_MAX`` bytes, not ``.``/``..``:
    anything else could point outside ``/dev/shm`` or fail deep inside the
    kernel with a message that names the server's paths.
    """
    bare = name[1:] if name.startswith("/") else name
    if (not bare or "/" in bare or bare in (".", "..") or not bare.isprintable()
            or len(bare.encode("utf-8", "surrogatepass")) > SHM_NAME_MAX_BYTES):
        raise InvalidArgumentError(f"{field}.shm_name", f"not a shared-memory object name (one printable component of "
                                                         f"1..{SHM_NAME_MAX_BYTES} bytes, optionally after one '/'): "
                                                         f"{name[:64]!r}")
    return SHM_DIR / bare
