#!/usr/bin/env bash
# System packages some tests need beyond Python:
# * iptables (its legacy backend) for the namespace hosts (tests/rig/verify/hosts,
#   `kvxferd demo --hosts`, `kvxferd soak --hosts`), which mirror the chart's
#   NetworkPolicy as packet filters and inject network faults;
# * prometheus (/usr/bin/prometheus and /usr/bin/promtool) for tests/deploy/test_prometheus.py,
#   which lints the daemon's metrics and runs every dashboard query against a real server.
# Installed only where it can be: as root, with apt-get. Elsewhere those tests skip and
# say why; nothing else needs them.
set -euo pipefail

missing=()  # "package:command:the tests that need it"
command -v iptables-legacy >/dev/null 2>&1 || missing+=("iptables:iptables-legacy:the namespace-host tests")
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    || missing+=("prometheus:prometheus:the Prometheus tests")
if [ ${#missing[@]} = 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    for item in "${missing[@]}"; do
        IFS=: read -r package command tests <<<"$item"
        echo "system-deps: $command missing and not installable here (needs root and apt-get); $tests will skip" >&2
    done
    exit 0
fi

# The prometheus package's postinst would start a server on :9090 (and a node exporter, a
# recommended package, on :9100): the tests start their own on free ports and want no other.
# A policy-rc.d that answers 101 tells invoke-rc.d not to start any service; an existing one
# (container images ship one) is left as it is.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
fi

install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
}

packages=()
for item in "${missing[@]}"; do
    packages+=("${item%%:*}")
done
echo "system-deps: installing ${packages[*]}" >&2
if ! install "${packages[@]}"; then
    apt-get update -qq >/dev/null 2>&1 || true
    for item in "${missing[@]}"; do
        IFS=: read -r package command tests <<<"$item"
        install "$package" || echo "system-deps: apt-get install $package failed; $tests will skip" >&2
    done
fi
