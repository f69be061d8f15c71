"""The daemon's other daemons: handshakes and links, mutual TLS."""
