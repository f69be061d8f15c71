"""Attacks on a daemon's NIXL side, as the rig runs them: what its metadata reaches (issue #55)."""
