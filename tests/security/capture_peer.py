"""An attacker's peer listener: records every call a daemon makes to it, and answers challenges as it can.

Run as a child (``python -m tests.security.capture_peer``) so it may drop to
another uid first (a second local user) and start listening late (a port
that a restarting daemon left free). Each call it receives is one JSON line
on stdout: the method, its metadata and the secrets its request carried.
It answers ``Challenge`` with a random nonce and either a random proof or,
given a key and certificate, a real signature by them (a peer whose
certificate the same CA signed, for another identity).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent import futures

import grpc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0, help="listen only after this long")
    parser.add_argument("--uid", type=int, help="drop to this uid (and gid) before listening")
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"), help="serve TLS with these files")
    parser.add_argument("--sign", action="store_true", help="sign challenges with the --tls key and send its cert")
    parser.add_argument("--cert-to-send", help="send this certificate instead of our own with each signature")
    args = parser.parse_args()
    # Everything imported and read first: another uid may not read this interpreter's files.
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from kvxferd.proto.v1 import kvxfer_pb2 as pb
    from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc
    try:
        from kvxferd.wire.challenge import Nonces, signed_message
    except ImportError:  # a daemon from before challenges (issue 53), which never asks for one
        Nonces = signed_message = None

    files = [open(p, "rb").read() for p in args.tls] if args.tls else None
    cert_to_send = open(args.cert_to_send, "rb").read() if args.cert_to_send else None

    def record(method: str, request, context) -> None:
        secrets = {"reader_agent_metadata": bool(getattr(request, "reader_agent_metadata", b"")),
                   "same_host_token": bool(getattr(request, "same_host_token", ""))}
        print(json.dumps({"method": method, "metadata": dict(context.invocation_metadata()), "secrets": secrets}),
              flush=True)

    class Capture(peer_grpc.PeerServiceServicer):
        def Challenge(self, request, context):  # noqa: N802 - gRPC's names
            record("Challenge", request, context)
            server_nonce = os.urandom(16)
            if not args.sign:
                return pb.ChallengeReply(protocol_version=request.protocol_version, server_nonce=server_nonce,
                                         proof=os.urandom(32))
            key = serialization.load_pem_private_key(files[1], password=None)
            signature = key.sign(signed_message(Nonces(request.client_nonce, server_nonce)), ec.ECDSA(hashes.SHA256()))
            cert = cert_to_send or files[0]
            return pb.ChallengeReply(protocol_version=request.protocol_version, server_nonce=server_nonce,
                                     proof=signature, certificate=cert)

        def GetEngineInfo(self, request, context):  # noqa: N802
            record("GetEngineInfo", request, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "captured")

        def GetIncarnation(self, request, context):  # noqa: N802
            record("GetIncarnation", request, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "captured")

        def RenewLeases(self, request, context):  # noqa: N802
            record("RenewLeases", request, context)
            context.abort(grpc.StatusCode.UNAVAILABLE, "captured")

    server = grpc.server(futures.ThreadPoolExecutor(4))
    peer_grpc.add_PeerServiceServicer_to_server(Capture(), server)
    if args.uid is not None:
        os.setgid(args.uid)
        os.setuid(args.uid)
    time.sleep(args.delay_s)
    address = f"{args.host}:{args.port}"
    if files:
        credentials = grpc.ssl_server_credentials([(files[1], files[0])], files[2], require_client_auth=True)
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    server.start()
    print(json.dumps({"listening": port}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop(0)


if __name__ == "__main__":
    main()
