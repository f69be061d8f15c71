"""The daemon's what listens: the gRPC services, sockets and their checks, the notify bus, the metrics endpoint."""
