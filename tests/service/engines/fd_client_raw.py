"""An engine written from docs/protocol.md alone: the fd socket from raw sockets, gRPC from the .proto files.

Run by ``test_fd_socket_raw.py`` as ``python -I fd_client_raw.py GEN_DIR SOCKET SPEC``: ``GEN_DIR`` holds
modules protoc generated from ``protos/`` (they are named ``kvxferd.proto.v1`` by the protos' paths),
and this process imports nothing else of kvxferd. ``SPEC`` (JSON): ``engine`` (a serialized
``EngineRank`` whose regions name fd 0 of the delivery), ``fd`` (the memfd, inherited), ``token``.
It prints one JSON line of what the daemon answered, then serves ``hold <request_id> <block ids JSON>``
lines from stdin (answering ``capability <hex>``) until ``stop``.
"""

import array
import json
import os
import socket
import struct
import sys

gen_dir, engine_socket, spec_path = sys.argv[1:4]
sys.path.insert(0, gen_dir)

import grpc  # noqa: E402

from kvxferd.proto.v1 import engine_service_pb2_grpc, kvxfer_pb2  # noqa: E402  (generated in gen_dir)

ANSWER_MAX_BYTES = 256


def deliver(path: str, token: bytes, fds: list[int]) -> bytes:
    """One delivery: check who listens, one sendmsg of the token with SCM_RIGHTS, read the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(path)
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise SystemExit(f"{path} is served by uid {uid}, not by our daemon's")
        conn.sendmsg([token], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        answer = b""
        while chunk := conn.recv(ANSWER_MAX_BYTES):  # the daemon closes after its answer
            answer += chunk
        return answer


def refusal(call) -> str:
    try:
        call()
    except grpc.RpcError as err:
        return f"{err.code().name} {err.details()}"
    return "accepted"


spec = json.loads(open(spec_path).read())
engine = kvxfer_pb2.EngineRank.FromString(bytes.fromhex(spec["engine"]))
token, fd = spec["token"].encode(), spec["fd"]
fds_path = engine_socket + ".fds"
report = {"kvxferd_modules": sorted(name for name, module in sys.modules.items() if name.startswith("kvxferd")
                                     and not (getattr(module, "__file__", None) or "").startswith(gen_dir)),
          "generated_from": sys.modules["kvxferd.proto.v1.kvxfer_pb2"].__file__}
report["malformed"] = deliver(fds_path, b"two\nlines", [fd]).decode()
report["first"] = deliver(fds_path, token, [fd]).decode()
report["again"] = deliver(fds_path, token, [fd]).decode()  # the same token while it waits
os.close(fd)  # the daemon holds its own copy from here on

channel = grpc.insecure_channel(f"unix:{engine_socket}")
stub = engine_service_pb2_grpc.EngineServiceStub(channel)
unknown = kvxfer_pb2.EngineRank()
unknown.CopyFrom(engine)
unknown.engine_id = engine.engine_id + "-x"
report["unknown_token"] = refusal(lambda: stub.Register(kvxfer_pb2.RegisterRequest(engine=unknown, fd_token="never-sent"),
                                                       timeout=30))
reply = stub.Register(kvxfer_pb2.RegisterRequest(engine=engine, fd_token=token.decode()), timeout=30)
session = (("kvxferd-session", reply.session),)
report["registered"] = bool(reply.incarnation)
report["token_taken"] = refusal(lambda: stub.Register(kvxfer_pb2.RegisterRequest(engine=unknown,
                                                                                 fd_token=token.decode()), timeout=30))
print(json.dumps(report), flush=True)

for line in sys.stdin:
    verb, *rest = line.split(" ", 2)
    if verb.strip() == "stop":
        break
    request_id, block_ids = rest[0], json.loads(rest[1])
    hold = kvxfer_pb2.HoldRequest(engine_id=engine.engine_id, request_id=request_id,
                                  block_ids=[kvxfer_pb2.BlockIds(ids=ids) for ids in block_ids])
    print("capability", stub.Hold(hold, timeout=10, metadata=session).capability.hex(), flush=True)
stub.Deregister(kvxfer_pb2.DeregisterRequest(engine_id=engine.engine_id), timeout=10, metadata=session)
