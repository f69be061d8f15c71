"""The README's main command and its error handling."""

import json
import subprocess
import sys


def kvxferd(*args):
    return subprocess.run([sys.executable, "-m", "kvxferd.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_verifies_every_preset():
    run = kvxferd("demo", "--json", "--requests", "1", "--num-blocks", "16", "--blocks-per-request", "5")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["mismatched_groups"] == 0 and summary["verified_bytes"] > 0
    models = {row["model"] for row in summary["rows"]}
    assert models == {"gqa", "fp8", "mla", "swa", "hybrid"}
    assert all(row["requests"] == 1 and not row["mismatches"] for row in summary["rows"])


def test_demo_table_with_overrides():
    run = kvxferd("demo", "--model", "gqa", "--prefill-tp", "3", "--decode-tp", "5", "--num-kv-heads", "7",
                  "--layout", "legacy", "--kernel-block-size", "8", "--requests", "1")
    assert run.returncode == 0, run.stderr
    assert "byte-exact" in run.stdout and "packed_HND->legacy" in run.stdout


def test_bad_arguments_exit_2_with_one_line():
    run = kvxferd("demo", "--model", "gqa", "--kernel-block-size", "5")
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "kernel_block_size" in run.stderr
    run = kvxferd("demo", "--prefill-tp", "2")
    assert run.returncode == 2 and "--decode-tp" in run.stderr
    run = kvxferd("demo", "--model", "gqa", "--prefill-tp", "2", "--decode-tp", "0")
    assert run.returncode == 2 and "tp_size" in run.stderr


def test_bench_layout_subcommand():
    run = kvxferd("bench", "layout", "--num-layers", "2", "--num-blocks", "100", "--repeat", "1", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["scattered"]["spans_in"] == 2 * 100 * 2
