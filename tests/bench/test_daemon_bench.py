"""``kvxferd bench daemon`` at tiny sizes: both modes run, and the TLS run really used TLS."""

import pytest

from kvxferd.bench import daemon

pytestmark = pytest.mark.slow  # four daemon clusters: about a minute on 2 cores


def test_daemon_bench_runs_plain_and_mutual_tls():
    figures = daemon.run(rounds=1, bulk_layers=2, bulk_blocks=16, rate_per_s=200.0, num_requests=20, mtls=True)
    for mode in (figures, figures["mtls"]):
        assert mode["overhead"]["failed"] == 0 and mode["overhead"]["requests"] == 20
        assert 0 < mode["bulk"]["ratio"] < 2 and mode["bulk"]["handshake_ms"] > 0
    text = daemon.format_table(figures)
    assert "with mutual TLS on the peer ports" in text and "mTLS vs plain" in text
