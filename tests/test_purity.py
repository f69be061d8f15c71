"""The pure layers import no I/O libraries (nixl, grpc, zmq), directly or not."""

import ast
import pathlib
import subprocess
import sys

PURE = ["layout", "tp", "plan"]
FORBIDDEN = {"nixl", "grpc", "zmq"}
ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvxferd"


def test_pure_sources_do_not_import_io_libraries():
    for package in PURE:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    assert name.split(".")[0] not in FORBIDDEN, f"{path}: imports {name}"


def test_pure_modules_load_no_io_library_at_runtime():
    modules = [f"kvxferd.{p}.{m.stem}" for p in PURE for m in (ROOT / p).glob("*.py") if m.stem != "__init__"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted({{n.split('.')[0] for n in sys.modules}} & {FORBIDDEN!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Which kvxferd packages each layer may import (its own, and those below it).
ALLOWED = {
    "layout": {"errors", "layout", "tp"},
    "tp": {"errors", "tp"},
    # CUDA through ctypes, for both sides of a GPU cache: nothing of kvxferd's own.
    "cuda": {"errors", "cuda"},
    "plan": {"errors", "layout", "tp", "plan"},
    # NIXL execution; also the reader's same-host device copies (CUDA through ctypes).
    "xfer": {"errors", "layout", "tp", "plan", "cuda", "xfer"},
    "wire": {"errors", "layout", "tp", "plan", "proto", "wire"},
    "service": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "cuda", "service"},
    # A data-plane worker (issue 55): NIXL execution and the wire formats, never the daemon's services (no
    # gRPC server, TLS or configuration of the control plane's enters its address space).
    "worker": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "cuda", "worker"},
    # The engine SDK shares only the wire package with the daemon, never the daemon's own modules.
    "client": {"errors", "layout", "tp", "plan", "proto", "wire", "cuda", "client"},
    # The rig (verify, bench, soak, demo, vllm): proves and measures the product, which never imports it.
    "rig": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "cuda", "service", "client", "integrations",
            "worker", "rig"},
    # A connector is an engine: the engine SDK and the wire format, never the daemon (issue 36).
    "integrations": {"errors", "layout", "proto", "wire", "client", "integrations"},
}


def test_imports_point_one_way():
    for package, allowed in ALLOWED.items():
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvxferd."):
                    target = node.module.split(".")[1]
                    assert target in allowed, f"{path}: {package} must not import kvxferd.{target}"


def test_the_product_never_imports_the_rig():
    """Only the CLI reaches the rig, by module name when a rig command runs (importlib), so that
    ``kvxferd serve`` loads none of it."""
    assert not any(name.startswith("kvxferd.rig") for name in _kvxferd_imports(ROOT / "cli.py"))
    code = "import sys, kvxferd.cli, kvxferd.serve\nprint(sorted(m for m in sys.modules if m.startswith('kvxferd.rig')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_vllm_connector_imports_vllm():
    """kvxferd never depends on vLLM: only the connector class (loaded by vLLM itself) imports it."""
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "vllm" for name in names):
                assert path == ROOT / "integrations/vllm/connector.py", f"{path}: imports vLLM"
    modules = sorted(".".join(("kvxferd", *m.relative_to(ROOT).with_suffix("").parts)) for m in ROOT.rglob("*.py")
                     if m.stem not in ("__init__", "__main__", "connector"))
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# The daemon's own layers, bottom first: each may import its own layer and those below it, never one
# above (TYPE_CHECKING imports included). A lower layer that needs something of a higher one asks for
# it through a small protocol (engines/registry.py's SlotThread, engines/holding.py's HoldingParts,
# reads/path.py's ReadPathParts). Top-level modules (daemon.py, reference.py) sit above them all.
SERVICE_LAYERS = ["base", "workers", "engines", "dataplane", "peers", "reads", "net"]


def _kvxferd_imports(path: pathlib.Path) -> list[str]:
    """Every kvxferd module or name ``path`` imports, anywhere in the file, as dotted paths."""
    module = ".".join(("kvxferd", *path.relative_to(ROOT).with_suffix("").parts))
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("kvxferd")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("kvxferd"):
                names += [f"{base}.{a.name}" for a in node.names]
    return names


def _service_layer(dotted: str) -> int:
    part = dotted.split(".")[2] if dotted.count(".") >= 2 else ""
    return SERVICE_LAYERS.index(part) if part in SERVICE_LAYERS else len(SERVICE_LAYERS)


def test_service_layers_point_down():
    service = ROOT / "service"
    assert sorted(p.name for p in service.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(SERVICE_LAYERS)
    for path in service.rglob("*.py"):
        here = _service_layer(".".join(("kvxferd", *path.relative_to(ROOT).parts)))
        for name in _kvxferd_imports(path):
            if name.startswith("kvxferd.service."):
                assert _service_layer(name) <= here, f"{path}: imports {name}, a layer above its own"


def test_no_import_cycle_in_the_package():
    """No two kvxferd modules import each other, directly or round a circle (TYPE_CHECKING imports too)."""
    modules = {".".join(("kvxferd", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}

    def module_of(name: str) -> str:
        while name not in modules:
            name = name.rsplit(".", 1)[0]
        return name
    graph = {m: {module_of(n) for n in _kvxferd_imports(p)} - {m} for m, p in modules.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)
    for module in sorted(graph):
        visit(module, [])


def test_the_rig_has_one_engines_daemons_and_hosts_module():
    """Issue #54: verify, bench, soak and demo share the rig's engine processes, daemons and namespace hosts
    (``rig/engines.py``, ``rig/daemons.py``, ``rig/hosts.py``) instead of keeping one each."""
    rig = ROOT / "rig"
    for name in ("engines.py", "daemons.py", "hosts.py"):
        assert sorted(p.relative_to(rig).as_posix() for p in rig.rglob(name)) == [name]
