"""A data-plane worker: one engine rank's cache and NIXL agents in a process that holds no secret.

Started by the control plane's supervisor (:mod:`kvxferd.service.workers`)
as a fresh interpreter, never a fork (docs/dataplane.md). It imports NIXL
execution and the wire formats, never the daemon's services: no gRPC server,
no TLS, no configuration of the daemon's own.
"""
