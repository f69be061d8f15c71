"""``kvxferd demo``: prefill -> decode over real daemons and real NIXL, every byte checked.

It starts one ``kvxferd serve`` process per TP rank (prefill TP=p, decode
TP=d) and, per model preset, a prefill engine process and a decode engine
process. The engines allocate their KV caches in POSIX shared memory, fill
the prefill caches with coordinate-tagged data and register them with
their daemons over gRPC. Each request is held on every prefill rank, read
by every decode rank through its daemon (gRPC -> NIXL over UCX on
loopback), checked byte for byte against the oracle on decode, and must
end with one CONSUMED event per prefill rank on the notify bus. Then the
decode engine moves the same transfers over raw NIXL, and the summary
gives both speeds and their ratio.

Exit status: 0 when everything matched, 1 on a wrong byte, a failed
request, a lost or stray event, 2 on bad arguments or when /dev/shm has
too little room for the caches (a container: ``docker run --shm-size=1g``).
"""

from kvxferd.rig.demo.main import add_arguments, run

__all__ = ["add_arguments", "run"]
