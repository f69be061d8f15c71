"""The Dockerfile's promises, read from the file (no Docker engine runs on the build machines)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _instructions():
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _stages():
    stages = []
    for op, args in _instructions():
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, args))
    return stages


def test_multi_stage_non_root_daemon_with_health_check():
    build, runtime = _stages()
    assert "AS build" in build[0][1] and "AS runtime" in runtime[0][1]
    assert any(op == "COPY" and args.startswith("--from=build /opt/kvxferd") for op, args in runtime)
    users = [args for op, args in runtime if op == "USER"]
    assert users and not re.match(r"(root|0)(:|$)", users[-1])
    assert ("ENTRYPOINT", '["kvxferd"]') in runtime and ("CMD", '["serve"]') in runtime
    (health,) = [args for op, args in runtime if op == "HEALTHCHECK"]
    assert '"kvxferd", "health"' in health
    # the default target is the engine socket the image's environment names, never the (TLS) peer port
    assert "KVXFERD_ENGINE_SOCKET=/run/kvxferd/engine.sock" in (ROOT / "Dockerfile").read_text() and "47100" not in health
    # torch comes from the chosen index before the package, never the CUDA build by accident.
    runs = [args for op, args in build if op == "RUN"]
    torch_step = next(i for i, args in enumerate(runs) if "torch==" in args)
    assert "--index-url" in runs[torch_step] and any("install ." in args for args in runs[torch_step + 1:])


def test_exposed_ports_are_the_config_defaults():
    from kvxferd.service.config import DaemonConfig

    (exposed,) = [args for op, args in _instructions() if op == "EXPOSE"]
    fields = DaemonConfig.model_fields
    assert set(exposed.split()) == {str(fields[name].default) for name in ("peer_port", "notify_port", "metrics_port")}


def test_the_build_context_keeps_what_the_build_copies():
    ignored = (ROOT / ".dockerignore").read_text().split()
    copied = [args.split()[:-1] for op, args in _instructions() if op == "COPY" and not args.startswith("--from")]
    for sources in copied:
        assert not any(source in ignored for source in sources), sources
