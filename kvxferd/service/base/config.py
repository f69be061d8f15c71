"""The daemon's configuration: one schema for flags, environment and file.

Precedence, highest first: command-line flags, ``KVXFERD_*`` environment
variables, the ``--config`` file (TOML or YAML),
the defaults below. ``kvxferd serve --help`` is generated from this schema,
so every option is documented once, here.

Peers must reach the peer service at a routable address: when it listens on
a wildcard address the daemon refuses to start unless ``advertise_host`` is
set (in a pod: the pod IP), rather than advertising localhost by mistake.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pathlib
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource,
                               YamlConfigSettingsSource)

from kvxferd.errors import InvalidArgumentError, first_error
from kvxferd.service.base.identities import parse_pattern
from kvxferd.wire.names import ENV_PREFIX, default_engine_socket, env_name
from kvxferd.wire.peerauth import default_peer_secret_file

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class DaemonConfig(BaseSettings):
    """Settings of ``kvxferd serve``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, allow_inf_nan=False)

    daemon_id: str = Field("kvxferd", description="name of this daemon in logs and NIXL agent names")
    runtime_dir: str | None = Field(None, description="private directory of the daemon's sockets (default: "
                                    "$XDG_RUNTIME_DIR/kvxferd, /run/kvxferd when writable, else /tmp/kvxferd-<uid>)")
    engine_socket: str | None = Field(None, description="UNIX socket of the engine-facing gRPC service "
                                      "(default: <runtime_dir>/<daemon_id>.sock)")
    engine_socket_group: str | None = Field(None, description="group (name or gid) that may use the engine and fd "
                                            "sockets too (mode 0660); default: only the daemon's user (0600)")
    allowed_uids: list[int] = Field([], description="more uids the fd socket accepts (SO_PEERCRED), comma-separated; "
                                    "the daemon's own uid and root always may")
    engine_tcp: str | None = Field(None, description="optional host:port for the engine service over TCP "
                                   "(needs tls_cert, tls_key and engine_token_file)")
    engine_token_file: str | None = Field(None, description="file holding the bearer token engines present over engine_tcp")
    tls_cert: str | None = Field(None, description="PEM certificate of this daemon: turns on mutual TLS on the peer "
                                 "port (reloaded when the file changes)")
    tls_key: str | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: str | None = Field(None, description="PEM CA bundle that peers' certificates must chain to")
    peer_allowed_ids: list[str] = Field([], description="peer identities allowed on the peer port, comma-separated: "
                                        "typed patterns uri:<URI>, dns:<name>, ip:<address> or cn:<common name>, "
                                        "each matching that type of the certificate's names only; an untyped "
                                        "pattern with a scheme (spiffe://...) is a URI, CN=<name> is cn:<name>, any "
                                        "other untyped one is refused; * and ? never cross /")
    peer_server_name: str = Field("kvxferd-peer", description="DNS name every peer's certificate carries; checked "
                                  "when this daemon dials a peer")
    notify_curve_secret_key: str | None = Field(None, description="Z85 CURVE secret key of the notify bus: turns on "
                                                "CURVE encryption and client authentication")
    notify_client_keys: list[str] = Field([], description="Z85 CURVE public keys of subscribers allowed on the "
                                          "notify bus, comma-separated")
    peer_secret_file: str | None = Field(None, description="the host-local secret this host's daemons share (created "
                                         "0600 if missing; default: <runtime_dir>/peer.secret): without TLS it "
                                         "authenticates them on the loopback peer port; with TLS it only proves a "
                                         "peer runs on this host, for same_host_reads")
    insecure: bool = Field(False, description="allow peer port, notify bus or engine TCP on non-loopback addresses "
                           "without TLS/CURVE (development only; warns and sets kvxferd_insecure_listeners)")
    reflection: bool | None = Field(None, description="gRPC server reflection (default: on without TLS, off with TLS)")
    ucx_net_devices: str | None = Field(None, description="UCX network devices NIXL may use (UCX_NET_DEVICES); "
                                        "default: the interface of the advertised peer address ('lo' for loopback)")
    ucx_tcp_port_range: str | None = Field(None, description="LOW-HIGH (1024-65535): the TCP ports UCX's tcp transport "
                                           "listens on for the data plane (UCX_TCP_PORT_RANGE), so a firewall or "
                                           "NetworkPolicy can admit exactly them; default: ports the OS picks")
    peer_host: str = Field("127.0.0.1", description="listen host of the peer service (daemon to daemon)")
    peer_port: int = Field(47100, ge=0, le=65535, description="listen port of the peer service; 0 picks a free port")
    advertise_host: str | None = Field(None, description="address peers use to reach this daemon (required with a wildcard peer_host)")
    notify_host: str = Field("127.0.0.1", description="listen host of the ZMQ notify bus (PUB)")
    notify_port: int = Field(47200, ge=0, le=65535, description="listen port of the notify bus; 0 picks a free port")
    metrics_host: str = Field("127.0.0.1", description="listen host of the Prometheus metrics endpoint")
    metrics_port: int = Field(9464, ge=0, le=65535, description="port of the metrics endpoint; 0 picks a free port")
    lease_s: float = Field(30.0, gt=0, description="default lease of held blocks and of engine registrations (s)")
    deadline_s: float = Field(30.0, gt=0, description="default deadline of a read (s)")
    max_lease_s: float = Field(600.0, gt=0, description="longest lease an engine or peer may ask for (holds, registrations, renewals) (s)")
    max_hold_s: float = Field(1800.0, gt=0, description="longest a request's blocks may stay held in all, renewals "
                              "included (s); then the hold ends EXPIRED")
    max_deadline_s: float = Field(600.0, gt=0, description="longest read deadline an engine may ask for (s)")
    push_targets: bool = Field(True, description="push (issue #57). Prefill side: load the agent of a reader "
                               "that names its rank as a write target at its handshake, to write into it. Decode "
                               "side: name this daemon's ranks as write targets at their handshakes (the holder "
                               "learns their data agent's metadata). Off: neither, and no push runs through here")
    require_digests: bool = Field(False, description="integrity (issue #59), decode side: refuse "
                                  "(FAILED_PRECONDITION, nothing written) a read that carries no holds' digests, "
                                  "so every read this daemon completes was checked against what its holders held, "
                                  "whatever its engines' settings (the vLLM connector's verify_share must then be "
                                  "1 on the prefill side). Off: reads are checked when their engine sends digests. "
                                  "Pushes are not checked yet and are refused too when on, and so are reads into "
                                  "GPU memory (no digest kernel yet)")
    push_settle_s: float = Field(5.0, ge=0, le=60, description="push (decode side): how long at most a failed "
                                 "push's blocks stay away from the engine after its expectation ended, waiting for "
                                 "the writers that had not reported (each says so once its WRITE drained; a writer "
                                 "that never held, at its deadline) (s)")
    max_engines: int = Field(64, ge=1, description="engine ranks registered on this daemon at once")
    max_holds_per_engine: int = Field(100_000, ge=1, le=10_000_000, description="requests one engine rank may hold at "
                                      "once; sizes its hold board (16-32 bytes of registered memory per hold)")
    max_expectations_per_reader: int = Field(10_000, ge=1, le=10_000_000, description="push, prefill side: "
                                             "expectations one reader identity (a decode daemon) may keep waiting "
                                             "or being written on one engine rank at once, so one reader cannot "
                                             "take the rank's whole max_holds_per_engine from the others")
    max_registered_bytes: int = Field(1 << 40, ge=1, description="bytes of engine memory registered on this daemon in all")
    dataplane_workers: bool = Field(False, description="serve each host-memory engine rank's cache to peers from a "
                                    "worker process that holds no secret, restarted when it dies (issue #55, "
                                    "docs/dataplane.md; GPU caches stay in-process, and the rank's own reads unless "
                                    "dataplane_reader_workers)")
    dataplane_reader_workers: bool = Field(False, description="with dataplane_workers, also post each such rank's "
                                           "own READs from a worker of its own (a reader worker: no NIXL agent "
                                           "left in the daemon; each read crosses to it and back, measured in "
                                           "docs/benchmarks.md)")
    reader_worker_sessions: bool = Field(True, description="with dataplane_reader_workers, hand each engine's "
                                         "reads session (the reads socket) to its reader worker once the daemon "
                                         "checked it: the reads and their completions never pass through the "
                                         "daemon (off: each read crosses to the worker and back)")
    worker_retire_grace_s: float = Field(10.0, ge=0, le=600, description="with dataplane_workers, how long a "
                                         "replaced worker serves on after its successor is up, so readers "
                                         "handshake again at their probe before its metadata stops working (s)")
    worker_replace_interval_s: float = Field(30.0, ge=0, le=3600, description="with dataplane_workers, the least "
                                             "time between two replacements of one rank's worker (when a CA, an "
                                             "expiring certificate or an ended introduction ends trust in the "
                                             "metadata peers were handed; each makes every reader handshake "
                                             "again) (s)")
    populate_host_memory: bool = Field(True, description="fault in every page of a host-memory cache when it is "
                                       "registered (about 0.2 ms per MiB here), not in its first reads")
    max_readers_per_engine: int = Field(1024, ge=1, description="reader agents introduced to one engine rank at once")
    max_readers_per_identity: int = Field(256, ge=1, description="reader agents one peer identity (a certificate "
                                          "identity; without TLS all daemons of the host are one) may have "
                                          "introduced to one engine rank at once: past it, and past "
                                          "max_readers_per_engine, only a reader idle for reader_idle_s gives up "
                                          "its place, else RESOURCE_EXHAUSTED")
    reader_idle_s: float = Field(600.0, gt=0, description="how long an introduced reader keeps its place without "
                                 "activity (an introduction, or a notice sealed for a live hold); its notices still "
                                 "count until a new reader needs the place (s)")
    max_reads_per_engine: int = Field(8192, ge=1, description="reads of one engine rank in flight or with a completion "
                                                               "it has not acked yet")
    max_reads_per_batch: int = Field(1024, ge=1, description="reads in one batch of the Reads stream")
    max_concurrent_streams: int = Field(256, ge=1, description="concurrent gRPC calls per client (one TCP connection, or "
                                        "one engine session on the engine socket); more are answered RESOURCE_EXHAUSTED")
    max_fds_per_token: int = Field(1024, ge=1, le=4096, description="file descriptors one fd-socket message may carry")
    max_fd_tokens: int = Field(256, ge=1, description="fd-socket deliveries waiting for their Register at once")
    max_fds_waiting: int = Field(4096, ge=1, description="file descriptors waiting for their Register at once, "
                                 "all fd-socket deliveries together (at least max_fds_per_token)")
    reads_socket: bool = Field(True, description="also take engines' read batches on <engine_socket>.reads (the "
                               "engine's fast path; the gRPC Reads stream stays)")
    fd_recv_timeout_s: float = Field(2.0, gt=0, le=60, description="how long the fd socket waits for a client's message (s)")
    drain_timeout_s: float = Field(10.0, ge=0, description="on SIGTERM, how long in-flight reads may finish; on an engine's Deregister, how long its holds may still be read and its own reads in flight run out (s)")
    abort_drain_s: float = Field(30.0, ge=0, le=3600, description="how long a read that failed (deadline, "
                                 "re-handshake) waits for its NIXL transfers still in flight before its completion "
                                 "goes out: UCX cannot stop a READ, whose bytes land when they arrive (over TCP, "
                                 "once a broken link is back). Past it the completion says its blocks may still "
                                 "be written (s)")
    max_message_bytes: int = Field(16 << 20, ge=1 << 16, description="largest gRPC message accepted (bytes)")
    max_peer_request_bytes: int = Field(1 << 20, ge=1 << 16, description="largest request accepted on the peer port "
                                        "(bytes): peers send introductions, renewals and probes, all small")
    max_peer_connections_per_source: int = Field(64, ge=1, description="connections the peer port keeps per "
                                                 "source (a remote address; on loopback the uid that connects): the "
                                                 "newest past it are closed within a second")
    event_history: int = Field(100_000, ge=1, description="notify-bus events kept for subscribers that missed some")
    max_bus_subscriptions: int = Field(1024, ge=1, description="what all notify-bus subscribers together may "
                                       "send, in subscriptions of 512 bytes (each connection counted 512 more): past "
                                       "it the connections of the sources that sent most are closed and those sources "
                                       "refused for a while (a connection past 16 KiB alone is too); where the kernel "
                                       "cannot say who sent what, the bus starts over instead, dropping every "
                                       "subscriber. Keep it well above the number of subscribers (one per engine rank)")
    handshake_timeout_s: float = Field(10.0, gt=0, description="timeout of each call to a peer daemon (s)")
    peer_check_s: float = Field(2.0, gt=0, description="how often connected peers are probed for a restart (s)")
    poll_interval_s: float = Field(1e-3, gt=0, le=0.1, description="sleep of the data-plane thread between NIXL polls "
                                   "while some reader may need this daemon's progress: its READs waited for "
                                   "it in the last 10 s (UCX over TCP; its notices say so), or it was "
                                   "introduced in the last 0.5 s and has not read alone yet, and the agent "
                                   "cannot wake the thread itself (UCX's tcp sockets do when found: then a "
                                   "reader's request is served as it arrives, docs/costs.md) (s)")
    notice_poll_interval_s: float = Field(1e-2, gt=0, le=1.0, description="sleep of the data-plane thread between "
                                          "NIXL polls while requests are held and no reader needs this daemon's "
                                          "progress (shared memory on one host): how soon the last reader's "
                                          "notice is counted and the hold ends CONSUMED (s)")
    transport_check: bool = Field(True, description="ask UCX to report which path (shared memory, CMA, cuda_ipc, "
                                  "RDMA, TCP, or emulation over messages) each kind of READ takes, into a private "
                                  "log file per process, and say it: kvxferd_transport_paths, a log line per new "
                                  "path (a warning for TCP or emulation), the handshake's log line; UCX's own "
                                  "warnings are relayed to the daemon's log (docs/gpu.md)")
    require_rdma_capable_vram: bool = Field(False, description="refuse (FAILED_PRECONDITION) to register GPU "
                                            "memory a NIC cannot read: cudaMalloc memory shared by IPC handle, or "
                                            "VMM memory made without gpuDirectRDMACapable; by default such a "
                                            "registration is a warning and kvxferd_vram_regions counts it "
                                            "(reads from other hosts are then emulated over TCP; docs/gpu.md)")
    same_host_reads: bool = Field(True, description="read a holder on this host by opening its engine's memory "
                                  "and copying the planned spans here instead of over NIXL: host memory (by shm name, "
                                  "or an fd the engine passed, through the holder's copy /proc/<pid>/fd/<n>) mapped "
                                  "read-only and copied in the kernel (process_vm_readv), GPU "
                                  "memory shared by CUDA IPC handle opened and copied in batches on the device; "
                                  "board checks, notices and deadlines stay. Used when the reader proves it "
                                  "shares the holder's host (the host secret, peer_secret_file, and boot id; with "
                                  "TLS only daemons that share that file) and can open the memory (the same "
                                  "/dev/shm or IPC namespace; the holder's GPU visible); else NIXL")
    same_host_writes: bool = Field(True, description="push (issue #57) on one host: a decode rank names its engine's "
                                   "shared memory to the prefill daemons it names itself to as a write target, and "
                                   "a prefill daemon maps a target's memory read-write and copies its pushes in the "
                                   "kernel instead of a NIXL WRITE; only where the target proved it shares this "
                                   "host (the same proof as same_host_reads, which must be on) and for host "
                                   "memory (GPU targets: NIXL). Off on either side: NIXL WRITEs")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: str = Field("json", description="json (one object per line) or text")
    audit_window_s: float = Field(10.0, gt=0, le=3600, description="the audit log's refusal window: per caller "
                                  "(a peer's address and identity, a local uid, an engine) and outcome, the first "
                                  "audit_lines_per_window refusals of a window are written, the rest counted in one "
                                  "line when it ends")
    audit_lines_per_window: int = Field(5, ge=1, le=1000, description="refusal lines per caller and outcome written "
                                        "in each audit_window_s (at most 50 for all callers together)")

    @field_validator("allowed_uids", "peer_allowed_ids", "notify_client_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):  # a flag or a plain environment value
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("peer_allowed_ids")
    @classmethod
    def _typed_identity_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:  # refused at start, not at the first peer call: parse_pattern says how to write it
            try:
                parse_pattern(pattern)
            except InvalidArgumentError as err:
                raise ValueError(err.message) from None
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"must be DEBUG, INFO, WARNING or ERROR, got {value!r}")
        return value.upper()

    @field_validator("log_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value not in ("json", "text"):
            raise ValueError(f"must be json or text, got {value!r}")
        return value

    @field_validator("ucx_tcp_port_range")
    @classmethod
    def _port_range(cls, value: str | None) -> str | None:
        if value is None:
            return None
        low, sep, high = (part.strip() for part in value.partition("-"))
        if not (sep and all(part.isascii() and part.isdigit() for part in (low, high))):
            raise ValueError(f"must be LOW-HIGH (two port numbers), got {value!r}")
        low_port, high_port = int(low), int(high)
        if not 1024 <= low_port <= high_port <= 65535:
            raise ValueError(f"must satisfy 1024 <= LOW <= HIGH <= 65535, got {value!r}")
        return f"{low_port}-{high_port}"

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> "DaemonConfig":
        if self.lease_s > self.max_lease_s or self.deadline_s > self.max_deadline_s:
            raise ValueError(f"lease_s ({self.lease_s:g}) and deadline_s ({self.deadline_s:g}) must not exceed "
                             f"max_lease_s ({self.max_lease_s:g}) and max_deadline_s ({self.max_deadline_s:g})")
        return self

    @model_validator(mode="after")
    def _bounds_fit_their_parts(self) -> "DaemonConfig":
        if self.max_fds_waiting < self.max_fds_per_token:
            raise ValueError(f"max_fds_waiting ({self.max_fds_waiting}) must be at least max_fds_per_token "
                             f"({self.max_fds_per_token}): one delivery of that many must fit")
        if self.max_bus_subscriptions < 2 * self.max_engines:  # else resubscribing engines restart the bus again
            raise ValueError(f"max_bus_subscriptions ({self.max_bus_subscriptions}) must be at least twice "
                             f"max_engines ({self.max_engines})")
        return self

    @model_validator(mode="after")
    def _digests_checked_where_required(self) -> "DaemonConfig":
        if self.require_digests and self.dataplane_workers and self.dataplane_reader_workers:
            raise ValueError("require_digests with dataplane_reader_workers: a reader worker checks no digests "
                             "yet, so every read would be refused")
        return self

    @model_validator(mode="after")
    def _routable_peer_address(self) -> "DaemonConfig":
        if self.peer_host in WILDCARD_HOSTS and not self.advertise_host:
            raise ValueError(f"peer_host {self.peer_host!r} listens on every interface: set advertise_host to the "
                             "address peers should use (e.g. the pod IP)")
        return self

    @model_validator(mode="after")
    def _complete_security_settings(self) -> "DaemonConfig":
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("tls_cert, tls_key and tls_ca go together: set all three or none")
        if all(tls) and not self.peer_allowed_ids:
            raise ValueError("peer_allowed_ids: with TLS on, name the peer identities allowed on the peer port")
        if self.engine_tcp and not (all(tls) and self.engine_token_file):
            raise ValueError("engine_tcp needs tls_cert, tls_key, tls_ca and engine_token_file (TLS and a token)")
        if self.notify_client_keys and not self.notify_curve_secret_key:
            raise ValueError("notify_client_keys need notify_curve_secret_key")
        advertised = self.advertise_host or self.peer_host
        if not all(tls) and advertised not in WILDCARD_HOSTS and not _is_ip(advertised):
            # The challenge proves the secret over the address *string*: a name such as localhost may reach
            # ::1 or 127.0.0.1, and another local user can bind the one this daemon does not (issue 53).
            raise ValueError(f"without TLS the peer address must be an IP address, not {advertised!r} (a name may "
                             "resolve to an address another local user listens on): e.g. 127.0.0.1")
        return self

    @property
    def tls(self) -> bool:
        """Mutual TLS on the peer port (and TLS on engine_tcp)."""
        return self.tls_cert is not None

    @property
    def socket_dir(self) -> str:
        """The directory of the engine socket (the daemon's private one unless engine_socket says otherwise)."""
        return os.path.dirname(self.engine_socket_path)

    @property
    def engine_socket_path(self) -> str:
        return self.engine_socket or default_engine_socket(self.daemon_id, self.runtime_dir)

    @property
    def peer_secret_path(self) -> str:
        return self.peer_secret_file or default_peer_secret_file(self.runtime_dir)

    @property
    def peer_address(self) -> str:
        """What peers dial (host:port); the port is the configured one."""
        host = self.advertise_host or self.peer_host
        return f"[{host}]:{self.peer_port}" if _is_ipv6(host) else f"{host}:{self.peer_port}"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, _FileSource(settings_cls)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


class _FileSource(PydanticBaseSettingsSource):
    """Values from the file named by ``load_config(config_file=...)``."""

    path: pathlib.Path | None = None

    def get_field_value(self, field, field_name):  # pragma: no cover - unused, __call__ reads the whole file
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _FileSource.path
        if path is None:
            return {}
        if path.suffix == ".toml":
            return TomlConfigSettingsSource(self.settings_cls, toml_file=path)()
        if path.suffix in (".yaml", ".yml"):
            return YamlConfigSettingsSource(self.settings_cls, yaml_file=path)()
        raise InvalidArgumentError("config", f"{path}: use a .toml or .yaml file")


def load_config(flags: dict[str, Any] | None = None, config_file: str | None = None) -> DaemonConfig:
    """Build the config; errors become :class:`InvalidArgumentError` naming the option."""
    if config_file is not None and not pathlib.Path(config_file).is_file():
        raise InvalidArgumentError("config", f"no such file: {config_file}")
    _FileSource.path = pathlib.Path(config_file) if config_file else None
    try:
        return DaemonConfig(**{k: v for k, v in (flags or {}).items() if v is not None})
    except ValidationError as err:
        option, message = first_error(err)
        raise InvalidArgumentError(option or "config", message) from None
    finally:
        _FileSource.path = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per schema field (``--peer-port``), help and default from the schema."""
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML file with any of the options below")
    for name, field in DaemonConfig.model_fields.items():
        flag, text = f"--{name.replace('_', '-')}", f"{field.description} (default: {field.default}; env {env_name(name)})"
        if field.annotation in (bool, bool | None):  # --x sets it, --no-x clears it (None: not given)
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        kind = {int: int, float: float}.get(field.annotation, str)
        parser.add_argument(flag, dest=name, type=kind, default=None, help=text)


def attach_values(argv: list[str]) -> list[str]:
    """``argv`` with each text option's value attached (``--notify-curve-secret-key=-x...``) where it begins
    with ``-``: argparse takes such a value for an option and refuses it ("expected one argument"), and a
    generated key or token may begin with one (a Z85 CURVE key, 1 in 85). Every option of the schema
    starts with ``--``; a value that is exactly one of them stays an option."""
    text_flags = {f"--{name.replace('_', '-')}" for name, field in DaemonConfig.model_fields.items()
                  if field.annotation not in (bool, bool | None, int, float)} | {"--config"}
    every_flag = {f"--{name.replace('_', '-')}" for name in DaemonConfig.model_fields} | {"--config", "--help"}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in text_flags and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1].split("=", 1)[0] not in every_flag and argv[i + 1] != "-h":
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    flags = {name: getattr(args, name, None) for name in DaemonConfig.model_fields}
    return load_config(flags, args.config)
