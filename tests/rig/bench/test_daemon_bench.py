"""``kvxferd bench daemon`` at tiny sizes: both engine paths, same-host copies and the TLS comparison run and report."""

import json
import subprocess
import sys

import pytest

from kvxferd.rig.bench import daemon

pytestmark = pytest.mark.slow  # ten daemon clusters: about a minute and a half on 2 cores

TINY = dict(rounds=1, bulk_layers=2, bulk_blocks=16, num_requests_300=20, num_requests_1000=20, idle_s=0.2)


def test_daemon_bench_runs_every_path_and_mutual_tls():
    figures = daemon.run(sizes=TINY, mtls=True)
    for path in (figures, figures["same_host"], figures["stream"]):
        for key, *_ in daemon.TARGETS:
            assert isinstance(path[key], float), key
        assert path["overhead"]["failed"] == 0 and path["overhead"]["requests"] == 20
        # Without dataplane_workers no part of a daemon's CPU is its workers' (the split is measured, not set).
        assert path["workers_cpu_us_per_request_decode"] == path["workers_cpu_us_per_request_prefill"] == 0.0
    for key in daemon.SAME_HOST_KEYS:  # issue 37's two flat keys
        assert isinstance(figures["same_host_" + key], float) and figures["same_host_" + key] == figures["same_host"][key]
    for mode in figures["mtls"].values():
        assert mode["bulk"]["ratio"] > 0 and mode["bulk"]["handshake_ms"] > 0
    text = daemon.format_table(figures)
    assert "socket path" in text and "same-host copies" in text and "stream path" in text and "mutual TLS on the peer ports" in text and "target (issue 12)" in text
    # Push (issue #57): its keys, and one push at a time on idle daemons in both orders.
    assert figures["push_bulk_ratio"] > 0 and isinstance(figures["push_p50_overhead_us_300"], float)
    assert figures["push_alone_p50_us"] > 0 and figures["push_alone"]["hold_first"]["p50_us"] > 0
    assert "one push at a time" in text
    # Digests (issue #59): every read of the verify pass checked and none failed (a false alarm would fail it).
    assert isinstance(figures["verify_bulk_ratio"], float) and isinstance(figures["verify_p50_overhead_us_300"], float)
    assert figures["verify"]["overhead"]["failed"] == 0 and figures["verify"]["hold_ms"] > 0
    assert "verify_bulk_ratio" in text



def test_the_bench_across_hosts_runs_at_tiny_sizes_and_names_issue_58s_keys():
    """``--hosts``: the socket path with its daemons on two namespace hosts (root; skipped elsewhere). In a
    process of its own: the bench must start before anything in its process used ZMQ."""
    from kvxferd.rig.verify.hosts.fabric import unavailable

    if unavailable():
        pytest.skip(unavailable())
    code = ("import json; from kvxferd.rig.bench import daemon; "
            f"print(json.dumps(daemon.run(sizes={TINY!r}, hosts=True, push=False)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["hosts"] is True and figures["overhead"]["failed"] == 0
    for key in daemon.HOSTS_KEYS:
        assert figures["hosts_" + key] == figures[key] and isinstance(figures[key], float)
