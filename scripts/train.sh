#!/usr/bin/env bash
# Train GEM (installs the CPU stack into .venv on first use). Works from any directory.
#   scripts/train.sh                              embedded default: 2 ranks on CPU (experiment=tiny_cpu)
#   scripts/train.sh train.steps=600 model.tower.num_blocks=4     Hydra overrides pass through
#   scripts/train.sh --nproc 1 experiment=gpu_base                rank count (or NPROC=...); 1 = plain python
#   scripts/train.sh --help                                       how to run it, the config groups
for a in "$@"; do  # help before any setup, in one process
    case "$a" in
        -h|--help) exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/../gem/train/help.py" \
                       "${GEM_CONFIG_DIR:-$(dirname "${BASH_SOURCE[0]}")/../configs}" ;;
    esac
done
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"

NPROC=${NPROC:-2}
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) NPROC="$2"; shift 2 ;;
        --nproc=*) NPROC="${1#--nproc=}"; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
case "$NPROC" in ''|*[!0-9]*|0) echo "train.sh: --nproc must be a positive integer, got '$NPROC'" >&2; exit 2 ;; esac

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Check the config in one process first: a bad key gives one line and exit 2, not one report per rank. Its notes
# (e.g. a clamped warmup) are shown only if it fails: rank 0 says them again when training starts.
status=0
notes=$(WORLD_SIZE="$NPROC" python -m gem.train --check "${ARGS[@]+"${ARGS[@]}"}" 2>&1 >/dev/null) || status=$?
if [ "$status" -ne 0 ]; then
    printf '%s\n' "$notes" >&2
    exit "$status"
fi

if [ "$NPROC" -eq 1 ]; then
    exec python -m gem.train "${ARGS[@]+"${ARGS[@]}"}"
fi
# torchrun leaves torchelastic_* scratch directories in TMPDIR: keep them in a private temp dir.
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/gem-train.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
# A rank that stops on a user error (already printed) leaves this file: exit 2, as a single process does.
GEM_ERROR_FILE="$SCRATCH/error" TMPDIR="$SCRATCH" python -m torch.distributed.run --standalone \
    --nproc_per_node="$NPROC" -m gem.train "${ARGS[@]+"${ARGS[@]}"}" || status=$?
if [ "$status" -ne 0 ] && [ -s "$SCRATCH/error" ]; then
    exit 2
fi
exit "$status"
