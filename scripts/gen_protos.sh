#!/usr/bin/env bash
# Regenerate the Python code of protos/ into kvxferd/proto/ (committed;
# tests/proto/test_generated.py fails when it is stale).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" protos/kvxferd/proto/v1/kvxfer.proto
