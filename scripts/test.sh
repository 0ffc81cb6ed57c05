#!/usr/bin/env bash
# Run the test suite (installs the CPU stack into .venv on first use). Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec python -m pytest -q "$@"
