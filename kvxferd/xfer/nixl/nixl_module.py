"""Import NIXL's Python API without importing torch where torch would only say "no CUDA".

The ``nixl`` meta package picks its backend wheel (``nixl_cu13``,
``nixl_cu12``, ...) by torch's CUDA version. With torch's CPU build it reads
``torch/version.py`` from disk, finds no CUDA version, and then imports
torch itself (about 2 s of CPU) only to learn the same; afterwards it takes
the first backend wheel installed. A daemon, an engine process and every
test process paid those 2 s at start. Here the same choice is made without
the torch import: when torch is already loaded, or its build names a CUDA
version, the meta package decides as usual.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import re
import sys
from types import ModuleType

BACKEND_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")  # the meta package's order without CUDA


def torch_cuda_on_disk() -> str | None:
    """torch's build CUDA version from its ``version.py`` ("" for a CPU build, None if unreadable)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return ""  # no torch: no CUDA version to read
    if spec is None:
        return ""
    if not spec.origin:
        return None
    try:
        text = (pathlib.Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(None|['\"]([^'\"]*)['\"])", text, re.MULTILINE)
    if match is None:
        return None
    return match.group(2) or ""


@functools.cache  # decided once per process: every agent uses the same wheel, and torch's file is read once
def nixl_api() -> tuple[ModuleType, ModuleType]:
    """``(_api, _bindings)`` of the NIXL backend wheel the meta package would choose."""
    if "torch" not in sys.modules and "nixl" not in sys.modules and torch_cuda_on_disk() == "":
        for name in BACKEND_WHEELS:
            try:
                return importlib.import_module(f"{name}._api"), importlib.import_module(f"{name}._bindings")
            except ModuleNotFoundError as err:
                if err.name != name:
                    raise
    import nixl  # CUDA build of torch, torch already loaded, or an unusual install: the meta package decides

    return nixl._api, nixl._bindings
