"""Configuration: flags over environment over file over defaults; errors name the option."""

import argparse

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base.config import DaemonConfig, add_arguments, config_from_args, load_config


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_listen_on_loopback():
    config = load_config()
    assert config.peer_address == "127.0.0.1:47100" and config.notify_port == 47200 and config.lease_s == 30


def test_precedence_flag_env_file(tmp_path, monkeypatch):
    path = tmp_path / "kvxferd.toml"
    path.write_text('peer_port = 5000\nnotify_port = 5001\nmetrics_port = 5002\n')
    monkeypatch.setenv("KVXFERD_NOTIFY_PORT", "6001")
    monkeypatch.setenv("KVXFERD_METRICS_PORT", "6002")
    config = parse("--config", str(path), "--metrics-port", "7002")
    assert (config.peer_port, config.notify_port, config.metrics_port) == (5000, 6001, 7002)


def test_boolean_flags_set_clear_or_leave_the_option(monkeypatch):
    """--x sets it, --no-x clears it (also a default-on option), and leaving both out keeps the
    environment's or the default."""
    assert parse().populate_host_memory is True and parse().insecure is False
    assert parse("--no-populate-host-memory").populate_host_memory is False
    monkeypatch.setenv("KVXFERD_POPULATE_HOST_MEMORY", "false")
    assert parse().populate_host_memory is False and parse("--populate-host-memory").populate_host_memory is True


def test_yaml_file(tmp_path):
    path = tmp_path / "kvxferd.yaml"
    path.write_text("daemon_id: decode-3\ndeadline_s: 2.5\n")
    config = parse("--config", str(path))
    assert config.daemon_id == "decode-3" and config.deadline_s == 2.5
    path.write_text("bogus_option: 1\n")
    with pytest.raises(InvalidArgumentError) as err:
        parse("--config", str(path))
    assert err.value.field == "bogus_option"


def test_wildcard_peer_host_needs_an_advertised_address():
    with pytest.raises(InvalidArgumentError) as err:
        parse("--peer-host", "0.0.0.0")
    assert "advertise_host" in err.value.message
    assert parse("--peer-host", "0.0.0.0", "--advertise-host", "10.1.2.3").peer_address == "10.1.2.3:47100"
    assert parse("--peer-host", "::1").peer_address == "[::1]:47100"


@pytest.mark.parametrize("argv, option", [
    (("--peer-port", "70000"), "peer_port"),
    (("--lease-s", "0"), "lease_s"),
    (("--log-level", "LOUD"), "log_level"),
    (("--config", "/nonexistent.toml"), "config"),
])
def test_bad_options_name_the_option(argv, option):
    with pytest.raises(InvalidArgumentError) as err:
        parse(*argv)
    assert err.value.field == option


def test_every_field_has_a_flag_with_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for name, field in DaemonConfig.model_fields.items():
        assert f"--{name.replace('_', '-')}" in text and field.description


def test_kvxferd_health_reads_the_environment_serve_reads(tmp_path, monkeypatch):
    from kvxferd.client.health import default_target

    socket = str(tmp_path / "d.sock")
    monkeypatch.setenv("KVXFERD_ENGINE_SOCKET", socket)
    assert parse().engine_socket_path == socket
    assert default_target() == f"unix:{socket}"
    monkeypatch.delenv("KVXFERD_ENGINE_SOCKET")
    monkeypatch.setenv("KVXFERD_DAEMON_ID", "d7")
    monkeypatch.setenv("KVXFERD_RUNTIME_DIR", str(tmp_path))
    assert default_target() == f"unix:{parse().engine_socket_path}"
    assert default_target() == f"unix:{tmp_path / 'd7.sock'}"
