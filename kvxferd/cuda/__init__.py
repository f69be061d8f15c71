"""CUDA through ctypes, shared by the engine side (client/) and the daemon (service/)."""
