"""The README's main command and its error handling."""

import json
import subprocess
import sys

from kvxferd.cli import build_parser, main
from kvxferd.service.base.config import config_from_args
from kvxferd.service.net.exposure import refusal
from kvxferd.service.peers.tls import TlsFiles


def kvxferd(*args):
    return subprocess.run([sys.executable, "-m", "kvxferd.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_verifies_every_preset_through_daemons():
    run = kvxferd("demo", "--json", "--requests", "2", "--prefill-tp", "2", "--decode-tp", "1", "--num-layers", "2",
                  "--head-size", "64", "--num-tokens", "200")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["ok"] and summary["requests"] == 10 and summary["bytes"] > 0
    assert summary["verified_bytes"] > summary["bytes"] and summary["mismatched_bytes"] == 0
    assert summary["failed_requests"] == 0 and summary["lost_events"] == 0 and summary["stray_events"] == 0
    # one CONSUMED per prefill rank and request, each preset's untimed warm-up read included
    assert summary["consumed"] == summary["holds"] == (10 + 5) * 2
    assert {row["model"] for row in summary["rows"]} == {"gqa", "fp8", "mla", "swa", "hybrid"}
    # issue #59: each preset's warm-up read, and none of the timed ones (--verify-share 0), checked by the
    # decode daemon against the holds' digests (the warm-ups' bytes, by its own counter)
    assert 0 < summary["digest_checked_bytes"] < summary["bytes"]
    for row in summary["rows"]:
        assert row["pairing"] == "2->1" and not row["problems"]
        assert row["raw_bytes"] == row["bytes"] and row["raw_gbps"] > 0 and 0 < row["ratio"]
        # raw NIXL is timed only once its connections are open: the last warm-up round was fast
        warm_up_ms = row["raw_warm_up_ms"]
        assert 2 <= len(warm_up_ms) <= 8 and (warm_up_ms[-1] < 50 or len(warm_up_ms) == 8), warm_up_ms
        assert row["latency_p99_ms"] >= row["latency_p50_ms"] > 0 and row["warm_up_ms"] > 0
        stages = row["stage_p50_ms"]  # where the time went, from the daemon's and the engine's clocks
        assert set(stages) == {"to_daemon", "plan", "post", "transfer", "check", "to_engine"}
        assert stages["plan"] > 0 and stages["post"] > 0 and sum(stages.values()) <= 2 * row["latency_p99_ms"]


def test_demo_table_with_overrides():
    run = kvxferd("demo", "--model", "gqa", "--prefill-tp", "3", "--decode-tp", "2", "--num-kv-heads", "7",
                  "--layout", "legacy", "--kernel-block-size", "8", "--prefill-block-size", "32",
                  "--decode-block-size", "16", "--num-layers", "3", "--num-tokens", "100", "--requests", "2")
    assert run.returncode == 0, run.stderr
    assert "byte-exact" in run.stdout and "3->2" in run.stdout and "0 bytes wrong" in run.stdout
    assert "9/9" in run.stdout  # CONSUMED / holds: 3 prefill ranks x (2 requests + the warm-up)
    assert "5 kvxferd daemons" in run.stderr


def exit_code(argv: list[str]) -> int:
    """``main(argv)`` as the process would exit (argparse exits by itself)."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


def test_bad_arguments_exit_2_with_one_line(capsys):
    # In-process (each case as a subprocess cost a second of imports); test_demo_exits_1_when_reads_fail
    # and the other demo tests run the real command.
    for args, needle in [(("--kernel-block-size", "5"), "kernel_block_size"),
                         (("--prefill-block-size", "24"), "block_size"),
                         (("--decode-tp", "0"), "--decode-tp"),
                         (("--prefill-tp", "12", "--decode-tp", "5"), "at most 16"),
                         (("--num-layers", "0"), "num_layers"),
                         (("--layout", "hnd"), "--layout"),
                         (("--num-tokens", "5000"), "--num-blocks"),
                         (("--hosts", "1"), "--hosts must be 2..8"),
                         (("--hosts", "3", "--prefill-tp", "4", "--decode-tp", "8"), "at most 16")]:
        code = exit_code(["demo", "--model", "gqa", *args])
        stderr = capsys.readouterr().err
        assert code == 2, (args, stderr)
        assert needle in stderr, (args, stderr)
        assert stderr.strip().count("\n") == 0 or args[0] == "--layout", (args, stderr)  # argparse: usage + error


def test_bench_layout_subcommand():
    run = kvxferd("bench", "layout", "--num-layers", "2", "--num-blocks", "100", "--repeat", "1", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["scattered"]["spans_in"] == 2 * 100 * 2


def test_bench_xfer_subcommand():
    run = kvxferd("bench", "xfer", "--rounds", "1", "--bulk-layers", "2", "--bulk-blocks", "8", "--build-layers", "2",
                  "--build-blocks", "100", "--planning-layers", "2", "--planning-blocks", "10", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["bulk_contiguous"]["merged_descriptors"] == 2  # one per layer
    assert figures["plan_build"]["descriptors_per_side"] == 2 * 2 * 100  # two prefill ranks read


def test_bench_push_subcommand():
    """Push vs pull on the data plane: both directions verified, each against its raw NIXL floor."""
    run = kvxferd("bench", "push", "--rounds", "1", "--small-blocks", "1", "--bulk-blocks", "2", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["bulk"]["bytes"] == 16 * 2 * 64 * 1024  # 16 layers x 2 blocks of 64 KiB, every byte moved
    assert figures["push_bulk_ratio"] > 0 and figures["read_bulk_ratio"] > 0


def test_bench_layers_subcommand():
    """A push layer by layer vs one batch through daemons: both kinds complete ok (else it exits 1), tails printed."""
    run = kvxferd("bench", "layers", "--quick", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert [(c["num_blocks"], c["layer_ms"]) for c in figures["cases"]] == [(4, 1.0), (64, 1.0)]
    assert all(c["batch_tail_ms"] > 0 and c["layered_tail_ms"] > 0 for c in figures["cases"])


def test_demo_exits_1_when_reads_fail():
    # A 100 us deadline cannot be met: every read fails (as data); the engine releases its holds.
    run = kvxferd("demo", "--json", "--model", "gqa", "--prefill-tp", "1", "--decode-tp", "1", "--requests", "2",
                  "--timeout-s", "0.0001")
    assert run.returncode == 1, run.stderr
    summary = json.loads(run.stdout)
    assert not summary["ok"] and summary["failed_requests"] == 2 and summary["lost_events"] == 0
    assert "deadline" in summary["rows"][0]["problems"][0]


def test_bench_runs_every_suite_into_one_markdown_table(tmp_path):
    output = tmp_path / "bench.md"
    run = kvxferd("bench", "--quick", "--output", str(output))
    assert run.returncode == 0, run.stderr
    table = output.read_text()
    assert table == run.stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| suite")]
    assert {row.split(" | ")[0][2:] for row in rows} == {"layout", "xfer", "daemon"}
    assert all(len(row.split("|")) == 7 for row in rows)  # five cells each
    ratios = [float(row.split("|")[5]) for row in rows if row.split("|")[5].strip()]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)


def test_dev_certs_writes_what_serve_accepts(tmp_path, capsys):
    assert main(["dev-certs", str(tmp_path), "--name", "node-a"]) == 0
    flags = capsys.readouterr().out.splitlines()[0].split()
    config = config_from_args(build_parser(["serve"]).parse_args(["serve", "--peer-host", "0.0.0.0", "--advertise-host", "10.0.0.5",
                                                         *flags]))
    assert config.tls and refusal(config) is None  # exposed, but authenticated
    assert TlsFiles(config.tls_cert, config.tls_key, config.tls_ca).current().generation == 0


def test_demo_on_hosts_without_netns_says_why(monkeypatch, capsys):
    from kvxferd.rig.verify.hosts import policy

    monkeypatch.setattr(policy.fabric_rig, "unavailable", lambda: "network namespaces need root (run as root, as CI does)")
    code = exit_code(["demo", "--hosts", "2", "--model", "gqa", "--requests", "1"])
    assert code == 2 and "--hosts cannot run here: network namespaces need root" in capsys.readouterr().err


def test_demo_on_hosts_without_helms_engine_says_why(monkeypatch, capsys):
    """The rig renders the chart's NetworkPolicy with Helm's engine (a test extra)."""
    from kvxferd.rig.verify import chart
    from kvxferd.rig.verify.hosts import policy

    monkeypatch.setattr(policy.fabric_rig, "unavailable", lambda: None)
    monkeypatch.setitem(sys.modules, "helm_python", None)  # as if not installed
    assert "helm-python-sdk" in chart.unavailable()
    code = exit_code(["demo", "--hosts", "2", "--model", "gqa", "--requests", "1"])
    assert code == 2 and "--hosts cannot run here: rendering the chart needs helm-python-sdk" in capsys.readouterr().err
