#!/usr/bin/env bash
# System packages some tests need beyond Python: iptables (its legacy backend) for the
# namespace hosts (tests/verify/hosts, `kvxferd demo --hosts`, `kvxferd soak --hosts`),
# which mirror the chart's NetworkPolicy as packet filters and inject network faults.
# Installed only where it can be: as root, with apt-get. Elsewhere those tests skip and
# say why; nothing else needs it.
set -euo pipefail
if command -v iptables-legacy >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: iptables-legacy missing and not installable here (needs root and apt-get);" \
         "the namespace-host tests will skip" >&2
    exit 0
fi
echo "system-deps: installing iptables (for the namespace-host tests)" >&2
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null 2>&1 \
        || echo "system-deps: apt-get install iptables failed; the namespace-host tests will skip" >&2
fi
