#!/usr/bin/env bash
# Regenerate the Python code of protos/ into kvxferd/proto/ (committed;
# tests/proto/test_generated.py fails when it is stale). The messages live in
# kvxfer.proto (kvxfer_pb2); each service has its own file, with its own *_pb2_grpc
# module (stubs and servicers) and *_pb2 module (its descriptor, for gRPC reflection),
# which keeps every generated file small.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
python=${PYTHON:-.venv/bin/python}
dir=protos/kvxferd/proto/v1
"$python" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" "$dir/kvxfer.proto"
"$python" -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" "$dir/engine_service.proto" "$dir/peer_service.proto"
