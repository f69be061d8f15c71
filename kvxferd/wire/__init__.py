"""What crosses a socket: protobuf <-> domain conversion with validation, peer info, names.

Both sides import it: the daemon (``kvxferd.service``) and the engine SDK
(``kvxferd.client``), so the SDK never imports the daemon's modules.
"""
