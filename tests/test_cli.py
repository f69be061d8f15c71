"""The README's main command and its error handling."""

import json
import subprocess
import sys


def kvxferd(*args):
    return subprocess.run([sys.executable, "-m", "kvxferd.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_verifies_every_preset_over_nixl():
    run = kvxferd("demo", "--json", "--requests", "2", "--prefill-tp", "2", "--decode-tp", "3", "--num-layers", "2")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["requests"] == 10 and summary["bytes"] > 0
    assert summary["verified_bytes"] > 0 and summary["mismatched_bytes"] == 0
    assert summary["failed_requests"] == 0 and summary["unreleased"] == 0
    assert {row["model"] for row in summary["rows"]} == {"gqa", "fp8", "mla", "swa", "hybrid"}
    assert all(not row["mismatches"] for row in summary["rows"])


def test_demo_table_with_overrides():
    run = kvxferd("demo", "--model", "gqa", "--prefill-tp", "3", "--decode-tp", "5", "--num-kv-heads", "7",
                  "--layout", "legacy", "--kernel-block-size", "8", "--prefill-block-size", "32", "--requests", "2")
    assert run.returncode == 0, run.stderr
    assert "byte-exact" in run.stdout and "3->5" in run.stdout and "0 bytes wrong" in run.stdout


def test_bad_arguments_exit_2_with_one_line():
    for args, needle in [(("--kernel-block-size", "5"), "kernel_block_size"),
                         (("--prefill-block-size", "24"), "block_size"),
                         (("--prefill-tp", "2"), "--decode-tp"),
                         (("--prefill-tp", "2", "--decode-tp", "0"), "tp_size"),
                         (("--num-tokens", "5000"), "--num-blocks")]:
        run = kvxferd("demo", "--model", "gqa", *args)
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.strip().count("\n") == 0 and needle in run.stderr, (args, run.stderr)


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
