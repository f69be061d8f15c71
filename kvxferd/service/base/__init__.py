"""The daemon's base layer: status codes, logs and the audit log, configuration, metrics, local sockets, peer identities.

Imports nothing of the service's other layers (tests/test_purity.py)."""
