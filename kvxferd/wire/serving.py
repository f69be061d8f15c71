"""Which engine socket each running ``kvxferd serve`` listens on, for ``kvxferd health`` with no target.

A container's HEALTHCHECK runs ``kvxferd health`` with the image's
environment, never with the daemon's command line: a daemon started with
``--engine-socket /run/kvxferd/gpu0.sock`` listens where no environment
variable says. So each daemon, once serving, leaves a record in its runtime
directory, and removes it when it stops::

    <runtime_dir>/serving.<mount namespace>.<pid>    {"engine_socket": "/run/kvxferd/gpu0.sock", "start": ...}

``kvxferd health`` reads the directory its environment names
(``KVXFERD_RUNTIME_DIR``, else the default runtime directory) and keeps the
records of live processes in its own mount namespace: its container. The
containers of a pod may share that directory and even the PID namespace,
never the mount namespace, so one sidecar's health never depends on its
neighbours'. A process's start time guards against a reused pid; a record
left by ``kill -9`` is ignored, and removed by the next daemon that starts.
"""

from __future__ import annotations

import json
import os
import pathlib

from kvxferd.wire.names import default_runtime_dir, env_name

RECORD_PREFIX = "serving."
MAX_RECORD_BYTES = 4096  # a path and two numbers; anything longer is not ours


def record_dir() -> str:
    """The runtime directory the environment names: where ``kvxferd health`` looks for records."""
    return os.environ.get(env_name("runtime_dir")) or default_runtime_dir()


def mount_namespace(pid: int | str = "self") -> str:
    """The mount namespace's inode number ("0" where /proc cannot say: then every record matches)."""
    try:
        return str(os.stat(f"/proc/{pid}/ns/mnt").st_ino)
    except OSError:
        return "0"


def process_start(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (/proc/<pid>/stat, field 22); None when it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def write_record(runtime_dir: str, engine_socket: str) -> str:
    """Record this process's engine socket (atomically); the record's path. Prunes stale records first."""
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
    engine_socket = os.path.abspath(engine_socket)
    prune(runtime_dir, engine_socket)
    pid, namespace = os.getpid(), mount_namespace()
    path = os.path.join(runtime_dir, f"{RECORD_PREFIX}{namespace}.{pid}")
    scratch = f"{path}.tmp"
    with open(scratch, "w") as out:
        json.dump({"engine_socket": engine_socket, "pid": pid, "start": process_start(pid)}, out)
    os.replace(scratch, path)
    return path


def remove_record(path: str) -> None:
    """Remove a record this process wrote (gone already is fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _records(runtime_dir: str):
    """``(path, namespace, record)`` of every well-formed record the current user may trust."""
    try:
        names = os.listdir(runtime_dir)
    except OSError:
        return
    for name in names:
        parts = name.split(".")
        if len(parts) != 3 or parts[0] + "." != RECORD_PREFIX or not parts[2].isdigit():
            continue
        path = os.path.join(runtime_dir, name)
        try:
            if os.getuid() != 0 and os.lstat(path).st_uid != os.getuid():
                continue  # someone else's file in a shared directory: not a daemon of ours
            with open(path, "rb") as record_file:
                record = json.loads(record_file.read(MAX_RECORD_BYTES))
        except (OSError, ValueError):
            continue
        if (isinstance(record, dict) and isinstance(record.get("engine_socket"), str)
                and record.get("pid") == int(parts[2])):
            yield path, parts[1], record


def _alive(record: dict) -> bool:
    start = process_start(record["pid"])
    return start is not None and (record.get("start") is None or start == record.get("start"))


def live_engine_sockets(runtime_dir: str) -> list[str]:
    """The engine sockets of the daemons serving in this mount namespace (this container), sorted."""
    namespace = mount_namespace()
    return sorted({record["engine_socket"] for _, ns, record in _records(runtime_dir)
                   if ns in (namespace, "0") and _alive(record)})


def prune(runtime_dir: str, engine_socket: str) -> None:
    """Remove records of dead processes in this namespace, and any record naming ``engine_socket`` (now ours)."""
    namespace = mount_namespace()
    for path, ns, record in list(_records(runtime_dir)):
        if record["engine_socket"] == engine_socket or (ns == namespace and not _alive(record)):
            remove_record(path)
