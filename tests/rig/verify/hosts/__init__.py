"""Tests of the namespace-host rig (kvxferd/rig/verify/hosts) and of what runs on it (root only; skipped with the reason elsewhere)."""
