"""The committed generated code matches protos/ (regenerate with scripts/gen_protos.sh)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "kvxferd/proto/v1"
MAX_LINES = 600  # the limit every file of the package keeps, generated ones too


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    fresh = {p.name: p.read_text() for p in (tmp_path / "kvxferd/proto/v1").iterdir()}
    committed = {p.name: p.read_text() for p in GENERATED.iterdir() if p.is_file() and p.name != "__init__.py"}
    assert fresh.keys() == committed.keys(), "generated files differ from the committed ones: run scripts/gen_protos.sh"
    for name, text in fresh.items():
        assert text == committed[name], f"kvxferd/proto/v1/{name} is stale: run scripts/gen_protos.sh"


def test_each_generated_file_stays_under_the_size_limit():
    sizes = {p.name: len(p.read_text().splitlines()) for p in GENERATED.glob("*.py*")}
    assert sizes and all(n <= MAX_LINES for n in sizes.values()), sizes


def test_services_are_importable_under_their_wire_names():
    from kvxferd.proto.v1 import (engine_service_pb2, engine_service_pb2_grpc, kvxfer_pb2, peer_service_pb2,
                                  peer_service_pb2_grpc)

    assert kvxfer_pb2.DESCRIPTOR.package == "kvxfer.v1"
    assert engine_service_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name == "kvxfer.v1.EngineService"
    assert peer_service_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name == "kvxfer.v1.PeerService"
    assert hasattr(engine_service_pb2_grpc, "EngineServiceServicer") and hasattr(peer_service_pb2_grpc, "PeerServiceStub")
