"""The Dockerfile's promises, read from the file (tests/deploy/test_image.py builds and runs it, marker ``image``)."""

import fnmatch
import ipaddress
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
    deps, build, runtime = _stages()
    (base,) = [args for op, args in _instructions() if op == "ARG" and args.startswith("BASE=")]
    assert base == "BASE=python:3.11-slim"  # a registry's; scripts/build_image.sh passes its debootstrap base
    assert [stage[0][1] for stage in (deps, build, runtime)] == ["${BASE} AS deps", "deps AS build", "${BASE} AS runtime"]
    # the environment from `deps` (cached), kvxferd as a wheel from `build`: a source change is a small layer
    assert [args for op, args in runtime if op == "COPY"] == ["--from=deps /opt/kvxferd /opt/kvxferd",
                                                               "--from=build /dist /tmp/dist"]
    assert any(op == "RUN" and "pip install --no-deps" in args and "/tmp/dist/kvxferd-*.whl" in args
               for op, args in runtime)
    users = [args for op, args in runtime if op == "USER"]
    assert users and not re.match(r"(root|0)(:|$)", users[-1])
    assert ("ENTRYPOINT", '["kvxferd"]') in runtime and ("CMD", '["serve"]') in runtime
    (health,) = [args for op, args in runtime if op == "HEALTHCHECK"]
    assert '"kvxferd", "health"' in health
    # Issue 39: no fixed engine socket in the environment (the chart passes --engine-socket); `kvxferd health`
    # finds the daemon's own record. Never the (TLS) peer port.
    envs = " ".join(args for op, args in runtime if op == "ENV")
    assert "KVXFERD_ENGINE_SOCKET" not in envs and "47100" not in health
    # Issue #60: no torch anywhere (the daemon imports none), and the build checks that none came in.
    assert "torch" not in " ".join(args for op, args in deps + runtime if op in ("ARG", "RUN", "ENV")).lower()
    (check,) = [args for op, args in build if op == "RUN" and "find_spec('torch')" in args]
    assert "torch came into the image" in check
    # The build's NIXL check imports modules by name: they exist (a moved module broke the image unseen).
    for module in re.findall(r"from (kvxferd[\w.]*) import", check):
        path = ROOT / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_one_nixl_wheel_per_image():
    """The `nixl` meta package pulls nixl-cu12 and nixl-cu13 (~430 MB): NIXL_VARIANT picks one."""
    deps = _stages()[0]
    args = {args.split("=", 1)[0]: args.split("=", 1)[1] for op, args in deps if op == "ARG"}
    assert args["NIXL_VARIANT"] == "cpu"
    (step,) = [args for op, args in deps if op == "RUN" and "NIXL_VARIANT" in args]
    assert "cu12) wheel=nixl-cu12" in step and "cu13) wheel=nixl-cu13" in step and "cpu) wheel=nixl-cu13" in step
    # NIXL's wheels require torch: they go in without their dependencies, the requirements without `nixl`
    assert 'pip install --no-deps "$wheel"' in step and 'pip install --no-deps "nixl==' in step
    assert "rm -rf /opt/kvxferd/lib/python3*/site-packages/nixl_ep*" in step


def test_the_cuda_variants_bring_the_cuda_runtime_onto_the_loaders_path():
    """libcudart came with a CUDA torch; now from NVIDIA's runtime wheel (cu variants), its directory in
    ld.so.conf.d (tests/deploy/test_image.py checks the loader resolves it in the built images)."""
    deps, _, runtime = _stages()
    (step,) = [args for op, args in deps if op == "RUN" and "NIXL_VARIANT" in args]
    assert "cudart=nvidia-cuda-runtime-cu12" in step and 'cudart="nvidia-cuda-runtime>=13,<14"' in step
    assert "cpu) wheel=nixl-cu13 cudart= ;;" in step and "cuda-runtime.conf" in step
    assert any(op == "RUN" and "/etc/ld.so.conf.d/kvxferd-cuda-runtime.conf" in args and "ldconfig" in args
               for op, args in runtime)


def test_only_ports_that_listen_beyond_loopback_by_default_are_exposed():
    from kvxferd.service.base.config import DaemonConfig

    fields = DaemonConfig.model_fields
    beyond_loopback = {str(fields[f"{name}_port"].default) for name in ("peer", "notify", "metrics")
                       if not ipaddress.ip_address(fields[f"{name}_host"].default).is_loopback}
    exposed = {port for op, args in _instructions() if op == "EXPOSE" for port in args.split()}
    assert exposed == beyond_loopback  # today none: every listener defaults to 127.0.0.1


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a folder above it decides; ``!`` keeps."""
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch("/".join(parts[:n]), pattern) or (pattern.startswith("**/")
               and fnmatch.fnmatch(parts[n - 1], pattern[3:])) for n in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_the_build_context_keeps_what_the_build_copies_and_nothing_big():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [args.split()[:-1] for op, args in _instructions() if op == "COPY" and not args.startswith("--from")]
    for source in [s for sources in copied for s in sources]:
        assert not _ignored(source, patterns), source
    assert not _ignored("kvxferd/service/daemon.py", patterns)
    for path in (".venv", ".venv-vllm", ".git", "kvxferd.egg-info", "build", "dist", "tests", "docs",
                 "kvxferd/__pycache__", "kvxferd/service/__pycache__/daemon.cpython-311.pyc"):
        assert _ignored(path, patterns), path
