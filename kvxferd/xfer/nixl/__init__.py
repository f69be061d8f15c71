"""NIXL itself: the agent wrapper, its module check, a rank's NIXL READ, and the board checks' area."""
