"""A NIXL agent with the settings kvxferd relies on.

* No NIXL progress thread: its default zero delay spins a whole core. With
  a 1 ms delay (``kvxferd bench floors``) it still costs about 2 % of a core
  per idle agent, spins a whole core while a peer's connection set-up is
  pending, and a notification reaches Python later, not sooner. The owner
  drives progress itself (``poll_notifications`` from a pump thread,
  transfers from the reader), which NIXL needs also on a pure read target.
* Thread-safe agent (``STRICT`` sync): a pump thread and a transfer thread
  may use it at once.
* Every NIXL exception becomes :class:`NixlError` with the call that failed,
  so callers turn it into a per-request status instead of a crash.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import os
import sys
import threading
import time

import numpy as np

from kvxferd.errors import InvalidArgumentError, TransferError, UnavailableError
from kvxferd.plan.groups import EngineCache
from kvxferd.xfer.nixl.nixl_module import nixl_api
from kvxferd.xfer.osutil.ucxwake import socket_sets_made_by


class TransferState(str, enum.Enum):
    """NIXL's transfer states (the bindings answer these strings)."""

    DONE = "DONE"
    PROC = "PROC"  # still running
    ERR = "ERR"

class NixlError(TransferError):
    """A NIXL call failed (remote gone, bad descriptors, backend error)."""

    def __init__(self, call: str, cause: Exception) -> None:
        super().__init__(call, f"{type(cause).__name__}: {cause}")
        self.cause = cause


def quiet_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout; keep stdout for our output."""
    logger = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


log = logging.getLogger(__name__)
SLOW_CALL_S = 0.1  # a NIXL call this long stalls the data plane: logged
# Calls made once per engine or peer, off the per-request path: a slow one is expected (create_agent
# takes about 0.5 s), so it is logged at INFO, not as a warning.
SETUP_CALLS = frozenset({"create_agent", "register_memory", "deregister_memory", "get_agent_metadata",
                         "add_remote_agent", "remove_remote_agent", "prep_xfer_dlist", "make_connection"})

METADATA_MAGIC, NAME_TAG = b"nixlSerDes|", b"Agent"
MAX_AGENT_NAME_BYTES = 1024


def agent_name_of(metadata: bytes, field: str = "agent_metadata") -> str:
    """The agent name NIXL metadata carries, read from its header without loading it.

    NIXL serialises ``nixlSerDes|`` then tagged fields, each ``tag, u64
    little-endian length, value, '|'``; the first is the agent name::

        nixlSerDes| Agent <06 00 00 00 00 00 00 00> reader | Conns ...
    """
    head = len(METADATA_MAGIC) + len(NAME_TAG)
    if not metadata.startswith(METADATA_MAGIC + NAME_TAG) or len(metadata) < head + 8:
        raise InvalidArgumentError(field, "not NIXL agent metadata (no agent-name header)")
    length = int.from_bytes(metadata[head : head + 8], "little")
    raw = metadata[head + 8 : head + 8 + length]
    if not 0 < length <= MAX_AGENT_NAME_BYTES or len(raw) != length or metadata[head + 8 + length : head + 9 + length] != b"|":
        raise InvalidArgumentError(field, f"NIXL agent metadata with a malformed name field (length {length})")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgumentError(field, f"the agent name is not UTF-8: {raw[:40]!r}") from None
    if not name.isprintable():
        raise InvalidArgumentError(field, f"the agent name is not printable: {name[:40]!r}")
    return name


def _nixl_errors() -> tuple[type[Exception], ...]:
    _, _bindings = nixl_api()

    return tuple(getattr(_bindings, name) for name in dir(_bindings) if name.startswith("nixl") and name.endswith("Error"))


def collect_agents() -> None:
    """Destroy closed agents now instead of at some later full collection (see :meth:`NixlAgent.close`).

    A full collection: call it where an engine's registration ended, not per request.
    """
    gc.collect()


class RemoteRefs:
    """Remote agents loaded, counted per name (the caller's lock guards it): the first reference loads a
    name, the last unloads it, and a name is never taken again with other bytes (NIXL replaces a known
    agent in place, so a truncated copy would break every link that uses it)."""

    def __init__(self) -> None:
        self._loaded: dict[str, tuple[bytes, int]] = {}  # agent name -> (metadata, references)

    def add(self, name: str, metadata: bytes, field: str) -> bool:
        """Count one reference; True for the first (the caller loads it, and :meth:`forget` s it if that fails)."""
        known = self._loaded.get(name)
        if known is not None:
            if known[0] != metadata:
                raise InvalidArgumentError(field, f"agent {name!r} is already connected with other metadata")
            self._loaded[name] = (metadata, known[1] + 1)
            return False
        self._loaded[name] = (metadata, 1)
        return True

    def remove(self, name: str) -> bool:
        """Drop one reference; True for the last (the caller unloads it). An unknown name is a no-op."""
        known = self._loaded.get(name)
        if known is None:
            return False
        if known[1] > 1:
            self._loaded[name] = (known[0], known[1] - 1)
            return False
        del self._loaded[name]
        return True

    def forget(self, name: str) -> None:
        self._loaded.pop(name, None)

    def metadata(self) -> dict[str, bytes]:
        """Each loaded name's metadata."""
        return {name: metadata for name, (metadata, _) in self._loaded.items()}

    def clear(self) -> None:
        self._loaded.clear()

    def __len__(self) -> int:
        return len(self._loaded)


class NixlAgent:
    """One named NIXL agent over UCX; a thin, typed wrapper."""

    def __init__(self, name: str, *, backends: tuple[str, ...] = ("UCX",), telemetry: bool = False) -> None:
        api, _ = nixl_api()
        nixl_agent, nixl_agent_config, nixl_thread_sync_t = api.nixl_agent, api.nixl_agent_config, api.nixl_thread_sync_t

        quiet_nixl_logging()
        self._errors = _nixl_errors()
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=list(backends),
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT, capture_telemetry=telemetry)
        self.name = name
        # The sets UCX's TCP transport keeps this agent's sockets in: the thread that drives the agent
        # sleeps on them (kvxferd.xfer.osutil.ucxwake); () where none was found.
        self._nixl, self._wake_fds = socket_sets_made_by(lambda: self._call("create_agent", nixl_agent, name, config))
        self._registrations: dict[str, object] = {}
        self._remotes = RemoteRefs()
        self._remotes_lock = threading.Lock()

    @property
    def wake_fds(self) -> tuple[int, ...]:
        """Readable when a peer's bytes reach this agent, or a socket it waits to write to drains: then it
        needs progress. ``()`` once closed (its fds may be reused), or where none were found."""
        return self._wake_fds if self._nixl is not None else ()

    @property
    def raw(self):
        """The underlying ``nixl_agent`` (for raw-NIXL baselines in benchmarks)."""
        return self._agent

    def _call(self, call: str, fn, *args, **kwargs):
        start_s = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except self._errors as err:
            raise NixlError(call, err) from err
        finally:
            # A NIXL call blocks the thread that made it (a read's deadline included): say so when one is slow.
            took_s = time.perf_counter() - start_s
            if took_s >= SLOW_CALL_S:
                level = logging.INFO if call in SETUP_CALLS else logging.WARNING
                log.log(level, "slow NIXL call %s on agent %s: %.3f s", call, self.name, took_s,
                        extra={"call": call, "took_s": round(took_s, 3), "agent": self.name})

    # ---- memory ---------------------------------------------------------
    def register(self, cache: EngineCache) -> None:
        """Register every region of an engine rank once."""
        # Once each: groups of one cache may overlay the same memory (vLLM's hybrid models), and NIXL must
        # not hold one range twice (its deregistration then frees one entry twice and leaks the other).
        regions = list(dict.fromkeys((m.address, m.num_bytes, m.device_id, "") for group in cache.memory for m in group))
        self._register(cache.engine_id, "engine_id", regions, cache.mem_type)

    def register_array(self, key: str, array: np.ndarray) -> None:
        """Register a host array of our own (a hold board, a check area) under ``key``; keep it alive until
        :meth:`deregister`."""
        self._register(key, "key", [(array.ctypes.data, array.nbytes, 0, "")], "DRAM")

    def _register(self, key: str, field: str, regions: list, mem_type: str) -> None:
        if key in self._registrations:
            raise InvalidArgumentError(field, f"{key!r} is already registered on agent {self.name!r}")
        self._registrations[key] = self._call("register_memory", self._agent.register_memory, regions, mem_type)

    def deregister(self, engine_id: str) -> None:
        """Deregister an engine's memory, or an array's by its key (before that memory may be freed)."""
        descs = self._registrations.pop(engine_id, None)
        if descs is not None:
            self._call("deregister_memory", self._agent.deregister_memory, descs)

    def close(self) -> None:
        """Let go of the agent; it is destroyed (UCX worker, sockets, shared memory) with the last
        prepared list or transfer handle that points at it. Every call after this fails.

        Found by the soak: a deregistered engine's agent (about 9 fds and 2
        UCX shared-memory segments) lived on until some later full garbage
        collection, because handles pointing at it sit in reference cycles;
        a daemon whose engines restart often piled them up. Whoever drops the
        last structure holding those handles calls :func:`collect_agents`.
        """
        self._registrations.clear()
        with self._remotes_lock:
            self._remotes.clear()
        self._nixl = None

    @property
    def _agent(self):
        if self._nixl is None:  # a late call after deregistration: an error the services map, not a crash
            raise UnavailableError("agent", f"NIXL agent {self.name!r} was closed (its engine deregistered)")
        return self._nixl

    # ---- peers ------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._call("get_agent_metadata", self._agent.get_agent_metadata)

    def add_remote(self, metadata: bytes, field: str = "agent_metadata") -> str:
        """Load a peer's metadata (untrusted bytes); returns its agent name. Pair with :meth:`remove_remote`.

        Loading is reference-counted per agent name, and a name already
        loaded is never loaded again with other bytes: NIXL replaces a
        known agent in place, so a truncated copy would break every link
        that uses it (and NIXL refuses the good copy afterwards).
        """
        name = agent_name_of(metadata, field)
        if name == self.name:
            raise InvalidArgumentError(field, f"agent {name!r} is this agent itself")
        with self._remotes_lock:
            if not self._remotes.add(name, metadata, field):
                return name
            try:
                try:
                    loaded = self._call("add_remote_agent", self._agent.add_remote_agent, metadata)
                except NixlError as err:
                    with contextlib.suppress(*self._errors):  # a half-loaded new name: drop it
                        self._agent.remove_remote_agent(name)
                    raise InvalidArgumentError(field, f"NIXL cannot load agent {name!r}: {err.message}") from None
                loaded = loaded.decode(errors="replace") if isinstance(loaded, bytes) else loaded
                if loaded != name:  # never seen; if NIXL ever disagrees with the header, keep nothing of it
                    with contextlib.suppress(*self._errors):
                        self._agent.remove_remote_agent(loaded)
                    raise InvalidArgumentError(field, f"NIXL loaded {loaded!r}, the metadata names {name!r}")
            except BaseException:
                self._remotes.forget(name)
                raise
        return name

    def remove_remote(self, name: str) -> None:
        """Drop one reference to a loaded agent; the last one unloads it from NIXL."""
        with self._remotes_lock:
            if self._remotes.remove(name):
                self._call("remove_remote_agent", self._agent.remove_remote_agent, name)

    def num_remotes(self) -> int:
        """Remote agents loaded now (each counted once)."""
        with self._remotes_lock:
            return len(self._remotes)

    # ---- descriptors and transfers ---------------------------------------
    def prep_local(self, rows: np.ndarray, mem_type: str):
        """Prepare local strided descriptor rows; returns the handle."""
        return self._call("prep_xfer_dlist", self._agent.prep_xfer_dlist, "", rows, mem_type)

    def prep_remote(self, agent_name: str, rows: np.ndarray, mem_type: str):
        return self._call("prep_xfer_dlist", self._agent.prep_xfer_dlist, agent_name, rows, mem_type)

    def make_read(self, local_list, local_ids: np.ndarray, remote_list, remote_ids: np.ndarray, notification: bytes):
        return self._call("make_prepped_xfer", self._agent.make_prepped_xfer, "READ", local_list, local_ids,
                          remote_list, remote_ids, notification)

    def make_write(self, local_list, local_ids: np.ndarray, remote_list, remote_ids: np.ndarray, notification: bytes):
        """A WRITE of local descriptors into the remote ones (a push, issue #57)."""
        return self._call("make_prepped_xfer", self._agent.make_prepped_xfer, "WRITE", local_list, local_ids,
                          remote_list, remote_ids, notification)

    def post(self, handle) -> "TransferState":
        """Post a transfer; its state right after."""
        return TransferState(self._call("transfer", self._agent.transfer, handle))

    def state(self, handle) -> "TransferState":
        return TransferState(self._call("check_xfer_state", self._agent.check_xfer_state, handle))

    def running(self, handle) -> bool:
        """Whether a transfer is still in flight (False once it ended, failed, or its handle is gone): an
        abandoned READ keeps writing until then, since releasing its handle does not stop it."""
        try:
            return self.state(handle) is TransferState.PROC
        except NixlError:
            return False

    def descriptors_moved(self, handle) -> int:
        """Descriptors NIXL moved for a finished transfer, after merging (needs ``telemetry``)."""
        return int(self._call("get_xfer_telemetry", self._agent.get_xfer_telemetry, handle).descCount)

    def release(self, handle) -> None:
        self._call("release_handle", handle.release)

    def notify(self, agent_name: str, message: bytes) -> None:
        self._call("send_notif", self._agent.send_notif, agent_name, message)

    def poll_notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; also makes progress for peers reading us."""
        return self._call("get_new_notifs", self._agent.get_new_notifs)

    def connect_to(self, agent_name: str) -> None:
        """Set up the connection to a loaded agent now, not with the first transfer or notification."""
        self._call("make_connection", self._agent.make_connection, agent_name)

    def new_messages(self) -> list[tuple[str, bytes]]:
        """:meth:`poll_notifications` as ``(sender agent name, message)`` pairs, in arrival order per sender."""
        return [(sender.decode() if isinstance(sender, bytes) else sender, message)
                for sender, messages in self.poll_notifications().items() for message in messages]
