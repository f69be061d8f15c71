"""The daemon's what listens: the gRPC services, the reads socket and its frames, sockets and their checks, the notify bus."""
