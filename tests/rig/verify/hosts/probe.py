"""A client on one host of the namespace rig, run there as its own process (``ip netns exec``).

    probe.py tcp ADDRESS PORT                    -> connected | timeout | refused | unreachable
    probe.py grpc ADDRESS [CA CERT KEY]          -> the status of GetIncarnation on a peer port (OK, UNAVAILABLE, ...)
    probe.py serve ADDRESS PORT                  -> echoes one connection's bytes back ("ready" once listening)
    probe.py rtt ADDRESS PORT N                  -> median round trip of N one-byte ping-pongs (ms)
    probe.py sink ADDRESS PORT                   -> sha256 of everything one connection sends ("ready" first)
    probe.py send ADDRESS PORT NUM_BYTES         -> sha256 of NUM_BYTES of random bytes it sent

Without CA/CERT/KEY the gRPC call is plaintext.
"""

import socket
import sys

import grpc


def tcp(address: str, port: int) -> str:
    try:
        socket.create_connection((address, port), timeout=2.0).close()
        return "connected"
    except socket.timeout:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return f"unreachable ({err})"


def call(address: str, files: list[str]) -> str:
    from kvxferd.proto.v1 import kvxfer_pb2 as pb
    from kvxferd.proto.v1 import peer_service_pb2_grpc as peer_grpc

    if files:
        ca, cert, key = (open(path, "rb").read() for path in files)
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert),
                                      options=[("grpc.ssl_target_name_override", "kvxferd-peer")])
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            peer_grpc.PeerServiceStub(channel).GetIncarnation(pb.IncarnationRequest(), timeout=5)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name


def serve(address: str, port: int, echo: bool) -> str:
    import hashlib

    with socket.create_server((address, port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        digest = hashlib.sha256()
        with conn:
            while data := conn.recv(1 << 16):
                if echo:
                    conn.sendall(data)
                digest.update(data)
    return digest.hexdigest()


def rtt(address: str, port: int, count: int) -> str:
    import statistics
    import time

    with socket.create_connection((address, port), timeout=60) as conn:  # loss: TCP's retransmissions back off
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            samples.append((time.perf_counter() - start) * 1e3)
    return f"{statistics.median(samples):.3f}"


def send(address: str, port: int, num_bytes: int) -> str:
    import hashlib
    import os

    digest = hashlib.sha256()
    with socket.create_connection((address, port), timeout=30) as conn:
        for _ in range(0, num_bytes, 1 << 20):
            chunk = os.urandom(min(1 << 20, num_bytes))
            digest.update(chunk)
            conn.sendall(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "tcp":
        print(tcp(rest[0], int(rest[1])))
    elif kind == "grpc":
        print(call(rest[0], rest[1:]))
    elif kind in ("serve", "sink"):
        print(serve(rest[0], int(rest[1]), echo=kind == "serve"))
    elif kind == "rtt":
        print(rtt(rest[0], int(rest[1]), int(rest[2])))
    elif kind == "send":
        print(send(rest[0], int(rest[1]), int(rest[2])))
