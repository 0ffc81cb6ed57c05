# Sourced by train.sh / test.sh: create .venv with the CPU stack if missing (idempotent, fast when present).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.gem-stack"
REQ="$ROOT/requirements"  # the pins, shared with docker/Dockerfile.cpu and pyproject's extras
WANT="$(cat "$REQ/cpu.txt" "$REQ/cpu-no-deps.txt" "$REQ/dev.txt" "$ROOT/pyproject.toml" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[gem] setting up $VENV (CPU stack) ..." >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    PIP="$VENV/bin/pip"
    "$PIP" install -q --upgrade pip >/dev/null
    "$PIP" install -q -r "$REQ/cpu.txt" -r "$REQ/dev.txt"
    # torchrec's metadata requires the CUDA fbgemm-gpu wheel, which would overwrite fbgemm-gpu-cpu: no deps.
    "$PIP" install -q --no-deps -r "$REQ/cpu-no-deps.txt"
    "$PIP" install -q --no-deps -e "$ROOT"
    "$VENV/bin/python" -c "import torch, torchrec, fbgemm_gpu, triton, hydra; print('[gem] stack ok: torch', torch.__version__, 'torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '?')" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
