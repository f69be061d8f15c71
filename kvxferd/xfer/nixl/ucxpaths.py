"""Which path UCX chose for a READ, read from UCX's own protocol-selection report.

A registration that succeeds can still be served at TCP-emulation speed: UCX
picks a protocol per endpoint configuration and memory-type pair when the
first operation of that kind runs, and says nothing unless asked. Asked
(``UCX_PROTO_INFO=y``), it writes one table per selection to its log; with
``UCX_LOG_FILE`` that log is a file of this process's own, which the daemon
reads (:class:`UcxLog`). A READ's table looks like::

    [ts] [host:pid:tid]   | reader intra-node cfg#1                                        |
    [ts] [host:pid:tid]   | remote memory read by ucp_get*(multi) into host memory from host |
    [ts] [host:pid:tid]   | Range  |    Description     |   Config   |
    [ts] [host:pid:tid]   | 0..inf | software emulation | tcp/lo     |

The header names the UCX worker (the NIXL agent), whether the peer is on
this node (``intra-node``) or not (``inter-node``), and the memory types;
each row a size range, how (``zero-copy``, ``software emulation``, a copy)
and over which lane (``transport/device``). :func:`classify` turns a row into
one of a fixed set of path names (a metrics label). Parsing is pure; only
:class:`UcxLog` touches files.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Path names (a bounded metrics label): a lane's transport family, or "emulated" when UCX moves a READ
# with active messages because no lane can READ these memories directly (the silent slow fallback).
PATHS = ("cma", "shared_memory", "xpmem", "knem", "cuda_ipc", "rdma", "cuda_copy", "gdr_copy", "tcp", "emulated",
         "other")
FAST_PATHS = frozenset({"cma", "shared_memory", "xpmem", "knem", "cuda_ipc", "rdma", "cuda_copy", "gdr_copy"})
MEMORY_PAIRS = ("host<-host", "cuda<-cuda", "host<-cuda", "cuda<-host")
_FAMILIES = {"cma": "cma", "sysv": "shared_memory", "posix": "shared_memory", "xpmem": "xpmem", "knem": "knem",
             "cuda_ipc": "cuda_ipc", "cuda_copy": "cuda_copy", "gdr_copy": "gdr_copy", "tcp": "tcp",
             "rc_mlx5": "rdma", "rc_verbs": "rdma", "dc_mlx5": "rdma", "ud_mlx5": "rdma", "ud_verbs": "rdma",
             "srd": "rdma", "rc": "rdma", "dc": "rdma", "ud": "rdma"}

_PREFIX = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s*")
_HEADER = re.compile(r"^\|\s*(.+?) (intra-node|inter-node|self) cfg#(\d+)\s*\|$")
# "into host memory from host" for host memory; a device's memory is named with its device, without
# "memory" ("into cuda/GPU0 from cuda/GPU1"), and a datatype may come first ("into iov[3] cuda/GPU0").
_READ = re.compile(r"^\|\s*remote memory read by ucp_get\*(?:\([^)]*\))? into (.+?) from (.+?)\s*\|$")
_SIZE = r"\d+[KMGTPE]?"  # UCX prints sizes divisible by 1024 with a unit: 16K..inf
_ROW = re.compile(rf"^\|\s*({_SIZE}(?:\.\.(?:{_SIZE}|inf))?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|$")
_LANE = re.compile(r"([a-z][a-z0-9_]*)/([\w:.\-]+)")
_LEVEL = re.compile(r"\bUCX\s+(ERROR|WARN|DIAG)\b")


@dataclass(frozen=True)
class ReadPath:
    """UCX's choice for READs of one memory pair on one kind of endpoint: the rows, and the bulk path."""

    worker: str  # the UCX worker: the NIXL agent's name
    locality: str  # intra-node, inter-node or self
    config: int  # UCX's endpoint configuration number (per process)
    memory: str  # "<local> <- <remote>", e.g. host<-host
    rows: tuple[tuple[str, str, str], ...]  # (size range, how, lanes)

    @property
    def path(self) -> str:
        """The path of the largest reads (the last row: UCX lists ranges smallest first)."""
        return classify(*self.rows[-1][1:]) if self.rows else "other"

    @property
    def emulated(self) -> bool:
        return self.path == "emulated"

    def describe(self) -> str:
        """One line a person can read: ``host<-host intra-node: 0..inf zero-copy over cma/memory``."""
        rows = "; ".join(f"{size} {how} over {lanes}" for size, how, lanes in self.rows)
        return f"{self.memory} {self.locality} ({self.worker}): {rows}"


_libc = ctypes.CDLL(None)
FLUSH_EVERY_S = 1.0  # how often a data-plane worker flushes its UCX log (the daemon reads it)


def flush_c_streams() -> None:
    """``fflush(NULL)``: UCX writes its log through a buffered C stream, which would hold a selection's
    table until 4 KiB more came; each process whose file the daemon reads flushes its own streams."""
    _libc.fflush(None)


def classify(how: str, lanes: str) -> str:
    """A row's path name (one of :data:`PATHS`)."""
    if "emulation" in how:
        return "emulated"
    families = {_FAMILIES.get(transport, "other") for transport, _device in _LANE.findall(lanes)}
    if len(families) == 1:
        return families.pop()
    return "rdma" if families and families <= {"rdma", "other"} else "other"


def memory_pair(local: str, remote: str) -> str:
    """``host<-host`` style (UCX says ``cuda`` for device memory); other types keep UCX's word."""
    return f"{local}<-{remote}"


def _memory_type(words: str) -> str:
    """``host memory`` -> host, ``cuda/GPU0`` -> cuda, ``iov[3] cuda/GPU0`` -> cuda."""
    kept = [word for word in words.split() if word != "memory"]
    return kept[-1].split("/")[0] if kept else "unknown"


def parse(text: str) -> tuple[list[ReadPath], list[tuple[str, str]]]:
    """The READ selections in a stretch of UCX's log, and its other lines at WARN or above (level, text).

    Only complete tables count: a table cut off at the end of ``text`` is not
    returned (:class:`UcxLog` reads whole lines only and reads it again).
    """
    found: list[ReadPath] = []
    messages: list[tuple[str, str]] = []
    header: tuple[str, str, int] | None = None
    current: list | None = None  # [header, memory, rows] while inside a READ table
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line.startswith(("|", "+")):
            level = _LEVEL.search(line)
            if level and level.group(1) != "DIAG":  # "file.c:123 UCX  WARN  what" -> "what (file.c:123)"
                where = line[:level.start()].strip()
                messages.append((level.group(1), line[level.end():].strip() + (f" ({where})" if where else "")))
            continue
        if line.startswith("+"):
            if current is not None and current[2]:  # the rule after a READ table's rows closes it
                found.append(ReadPath(*current[0], current[1], tuple(current[2])))
                current, header = None, None
            elif current is None:
                header = None  # a title that did not parse must not lend the table after it this one's worker
            continue
        if match := _HEADER.match(line):
            if current is not None and current[2]:
                found.append(ReadPath(*current[0], current[1], tuple(current[2])))
            header, current = (match.group(1), match.group(2), int(match.group(3))), None
            continue
        if match := _READ.match(line):
            if header is not None:
                current = [header, memory_pair(_memory_type(match.group(1)), _memory_type(match.group(2))), []]
            continue
        if current is not None and (match := _ROW.match(line)) and match.group(1) != "Range":
            current[2].append((match.group(1), match.group(2), match.group(3)))
    if current is not None and current[2]:
        found.append(ReadPath(*current[0], current[1], tuple(current[2])))
    return found, messages


def log_environment(directory: str, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The UCX variables that make UCX report its selections into ``directory`` (one file per process).

    Set before the first agent: UCX reads them when it loads. An operator's
    own ``UCX_LOG_FILE`` or ``UCX_PROTO_INFO=n`` is left alone (the check then
    reads that file, or says it cannot tell).
    """
    wanted = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(directory, "ucx.%p.log"),
              "UCX_LOG_FILE_SIZE": "4m", "UCX_LOG_FILE_ROTATE": "1"}
    return {name: value for name, value in wanted.items() if name not in environ}


class UcxLog:
    """Reads what UCX wrote to the log files of this process and its workers (``ucx.<pid>.log``), since last time.

    Each file is read from where the last call stopped, whole lines only;
    a file that shrank (UCX rotated it) is read again from its start.
    """

    MAX_READ_BYTES = 1 << 20  # per file per call: a flood of UCX lines cannot stall the caller

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern  # UCX_LOG_FILE's value, %p for the pid
        self._offsets: dict[str, tuple[int, int]] = {}  # file -> (its inode, bytes read)
        self.selections: dict[tuple[int, str, str, int, str], ReadPath] = {}  # (pid, worker, locality, cfg, memory)

    def _files(self) -> list[tuple[int, str]]:
        directory, name = os.path.split(self.pattern)
        if "%p" not in name:
            return [(os.getpid(), self.pattern)] if os.path.exists(self.pattern) else []
        head, tail = name.split("%p", 1)
        found = []
        try:
            entries = os.listdir(directory or ".")
        except OSError:
            return []
        for entry in entries:
            pid = entry[len(head):len(entry) - len(tail)] if entry.startswith(head) and entry.endswith(tail) else ""
            if pid.isdigit():
                found.append((int(pid), os.path.join(directory, entry)))
        return sorted(found)

    def forget_exited(self, alive=lambda pid: os.path.exists(f"/proc/{pid}")) -> bool:
        """Drop the selections and files of processes that exited (replaced workers); whether any went."""
        gone = [k for k in self.selections if k[0] != os.getpid() and not alive(k[0])]
        for key in gone:
            del self.selections[key]
        for path in [p for p in self._offsets if not os.path.exists(p)]:
            del self._offsets[path]
        return bool(gone)

    def read(self) -> tuple[list[tuple[int, ReadPath]], list[tuple[int, str, str]]]:
        """New READ selections (pid, path) and new UCX warnings and errors (pid, level, text)."""
        new, messages = [], []
        for pid, path in self._files():
            text = self._read_new(path)
            if not text:
                continue
            found, said = parse(text)
            messages.extend((pid, level, line) for level, line in said)
            for selection in found:
                key = (pid, selection.worker, selection.locality, selection.config, selection.memory)
                if self.selections.get(key) != selection:
                    self.selections[key] = selection
                    new.append((pid, selection))
        return new, messages

    def _read_new(self, path: str) -> str:
        inode, offset = self._offsets.get(path, (0, 0))
        try:
            with open(path, "rb") as file:
                status = os.fstat(file.fileno())
                if status.st_ino != inode or status.st_size < offset:
                    inode, offset = status.st_ino, 0  # a new file (UCX rotated it): from its start
                file.seek(offset)
                data = file.read(min(status.st_size - offset, self.MAX_READ_BYTES))
        except OSError:
            return ""
        # Whole lines only, and not a table still being written: the rest is read next time. Decoded
        # byte for byte (surrogateescape), so the offset counts the file's bytes whatever they are.
        text = data[:data.rfind(b"\n") + 1].decode("utf-8", "surrogateescape")
        text = text[:_last_complete(text)]
        self._offsets[path] = (inode, offset + len(text.encode("utf-8", "surrogateescape")))
        return text


def _last_complete(text: str) -> int:
    """Where the text stops being complete: after the last line that is not inside an open table.

    A table is its title (worker and operation: two rows), a rule, the column
    names, a rule, its rows and a closing rule: the rule after the fourth row
    or later ends it. A stretch that ends inside one is left for the next read.
    """
    lines = text.splitlines(keepends=True)
    position, complete, inside, rows = 0, 0, False, 0
    for line in lines:
        position += len(line)
        body = _PREFIX.sub("", line).strip()
        if body.startswith("|"):
            inside = True
            rows += 1
        elif body.startswith("+"):
            if inside and rows >= 4:  # title, column names and a row at least: this rule closes it
                complete, inside, rows = position, False, 0
            continue
        else:
            inside, rows = False, 0
            complete = position
    return complete if inside else len(text)
