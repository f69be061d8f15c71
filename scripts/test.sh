#!/usr/bin/env bash
# The test command: set up the environments if needed, then run the default test suite.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m slow`, `scripts/test.sh -m vllm`).
#
# Tests run in .venv-vllm: .venv (what the daemon needs) plus vLLM's CPU build, for
# the vLLM end-to-end tests (marker `vllm`). kvxferd itself never imports vLLM;
# tests/test_purity.py checks that. Both environments are reused between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
    # The inner loop: the pure layers and the in-process tests, in .venv alone. No daemon process,
    # no vLLM engine, no namespace host (tests/conftest.py fails a test here that starts a daemon).
    shift
    scripts/bootstrap.sh
    export KVXFERD_FAST_LANE=1
    exec .venv/bin/python -m pytest -n "${KVXFERD_TEST_WORKERS:-2}" --dist loadfile -m "not slow and not image and not vllm and not daemons" \
        tests/layout tests/tp tests/plan tests/wire tests/xfer tests/cuda tests/test_purity.py tests/test_docs.py \
        tests/service/base/test_config.py tests/service/base/test_identity_match.py tests/service/engines/test_completions.py \
        tests/service/engines/test_memory.py tests/service/dataplane tests/service/net/test_framewriter.py \
        tests/worker tests/service/workers "$@"
fi
scripts/bootstrap.sh
scripts/bootstrap.sh --vllm
scripts/system-deps.sh  # iptables for the namespace-host tests (root only; they skip otherwise)
# vLLM's CPU engines in the tests keep their KV cache small (GiB).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# Three xdist workers share the two cores: much of the suite waits (daemons starting, leases
# running out, the soak's clock), so a third worker fills that time. One test file is one unit of
# work (module fixtures start daemons and vLLM engines once), and all vLLM files are one unit
# (they run one at a time), in tests/conftest.py's order, longest first.
# KVXFERD_TEST_WORKERS=0 runs in one process; `-n N` after it wins too.
exec .venv-vllm/bin/python -m pytest -n "${KVXFERD_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
