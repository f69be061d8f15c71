"""The committed generated code matches protos/ (regenerate with scripts/gen_protos.sh)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "protos/kvxferd/proto/v1/kvxfer.proto")], check=True)
    for name in ("kvxfer_pb2.py", "kvxfer_pb2.pyi", "kvxfer_pb2_grpc.py"):
        fresh = (tmp_path / "kvxferd/proto/v1" / name).read_text()
        committed = (ROOT / "kvxferd/proto/v1" / name).read_text()
        assert fresh == committed, f"kvxferd/proto/v1/{name} is stale: run scripts/gen_protos.sh"


def test_services_are_importable():
    from kvxferd.proto.v1 import kvxfer_pb2, kvxfer_pb2_grpc

    assert kvxfer_pb2.DESCRIPTOR.package == "kvxfer.v1"
    assert hasattr(kvxfer_pb2_grpc, "EngineServiceServicer") and hasattr(kvxfer_pb2_grpc, "PeerServiceStub")
