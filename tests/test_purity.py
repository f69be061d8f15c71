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
    # The engine SDK shares only the wire package with the daemon, never the daemon's own modules.
    "client": {"errors", "layout", "tp", "plan", "proto", "wire", "cuda", "client"},
    "verify": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "client", "verify"},
    "bench": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "service", "client", "verify", "bench"},
    "demo": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "service", "client", "verify", "bench", "demo"},
    # The soak's rogue agent (forged notices) is a NIXL agent of its own.
    "soak": {"errors", "layout", "tp", "plan", "xfer", "proto", "wire", "client", "verify", "demo", "soak"},
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
