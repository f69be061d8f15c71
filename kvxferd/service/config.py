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
import pathlib
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource,
                               YamlConfigSettingsSource)

from kvxferd.errors import InvalidArgumentError

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class DaemonConfig(BaseSettings):
    """Settings of ``kvxferd serve``."""

    model_config = SettingsConfigDict(env_prefix="KVXFERD_", extra="forbid", validate_default=True, allow_inf_nan=False)

    daemon_id: str = Field("kvxferd", description="name of this daemon in logs and NIXL agent names")
    engine_socket: str = Field("/tmp/kvxferd-engine.sock", description="UNIX socket of the engine-facing gRPC service")
    engine_tcp: str | None = Field(None, description="optional host:port for the engine service over TCP")
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
    max_deadline_s: float = Field(600.0, gt=0, description="longest read deadline an engine may ask for (s)")
    drain_timeout_s: float = Field(10.0, ge=0, description="on SIGTERM, how long in-flight reads may finish (s)")
    max_message_bytes: int = Field(16 << 20, ge=1 << 16, description="largest gRPC message accepted (bytes)")
    event_history: int = Field(100_000, ge=1, description="notify-bus events kept for subscribers that missed some")
    handshake_timeout_s: float = Field(10.0, gt=0, description="timeout of each call to a peer daemon (s)")
    peer_check_s: float = Field(2.0, gt=0, description="how often connected peers are probed for a restart (s)")
    poll_interval_s: float = Field(500e-6, gt=0, le=0.1, description="longest sleep of the data-plane thread between NIXL polls (s)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: str = Field("json", description="json (one object per line) or text")

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

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> "DaemonConfig":
        if self.lease_s > self.max_lease_s or self.deadline_s > self.max_deadline_s:
            raise ValueError(f"lease_s ({self.lease_s:g}) and deadline_s ({self.deadline_s:g}) must not exceed "
                             f"max_lease_s ({self.max_lease_s:g}) and max_deadline_s ({self.max_deadline_s:g})")
        return self

    @model_validator(mode="after")
    def _routable_peer_address(self) -> "DaemonConfig":
        if self.peer_host in WILDCARD_HOSTS and not self.advertise_host:
            raise ValueError(f"peer_host {self.peer_host!r} listens on every interface: set advertise_host to the "
                             "address peers should use (e.g. the pod IP)")
        return self

    @property
    def peer_address(self) -> str:
        """What peers dial (host:port); the port is the configured one."""
        host = self.advertise_host or self.peer_host
        return f"[{host}]:{self.peer_port}" if _is_ipv6(host) else f"{host}:{self.peer_port}"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, _FileSource(settings_cls)


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


def first_error(err: ValidationError) -> tuple[str, str]:
    """``(dotted location, message)`` of a pydantic error's first problem, for one-line errors."""
    first = err.errors()[0]
    return ".".join(str(part) for part in first["loc"]), first["msg"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per schema field (``--peer-port``), help and default from the schema."""
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML file with any of the options below")
    for name, field in DaemonConfig.model_fields.items():
        kind = {int: int, float: float}.get(field.annotation, str)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                            help=f"{field.description} (default: {field.default}; env KVXFERD_{name.upper()})")


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    flags = {name: getattr(args, name, None) for name in DaemonConfig.model_fields}
    return load_config(flags, args.config)
