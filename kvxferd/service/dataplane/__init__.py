"""The daemon's data-plane thread: it posts and polls every read's NIXL work and the holders' notices."""
