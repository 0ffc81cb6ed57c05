#!/usr/bin/env bash
# Run the test suite (installs the CPU stack into .venv on first use). Extra args go to pytest;
# --extended runs the extended tier (tests marked slow) instead of the default suite.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
if [[ "${1:-}" == "--extended" ]]; then  # the tests marked slow (multi-rank layouts, compile check)
  shift
  exec python -m pytest -q -m "slow and not gpu" "$@"
fi
exec python -m pytest -q "$@"
