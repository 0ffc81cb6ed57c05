#!/usr/bin/env bash
# Two queues of steps side by side on GPUs 0 and 1: gpu_pair.sh "Q0" "Q1", each queue a
# ";"-separated list of "LIMIT_S NAME CMD..." steps (a CMD cannot contain ";"); each step's output goes to
# $OUT/NAME.log, and a start line and an "rc=N: <last pytest summary line>" line per step to stdout.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/outputs/gpu_pair}
mkdir -p "$OUT"; export OUT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TRITON_CACHE_DIR="$ROOT/outputs/triton-cache"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
queue() {  # queue GPU "steps"
    local gpu=$1 step limit name cmd rc
    IFS=';' read -ra steps <<< "$(printf '%s' "$2" | tr '\n' ';')"  # a newline separates steps too
    for step in "${steps[@]}"; do
        read -r limit name cmd <<< "$step"
        [ -z "${limit:-}" ] && continue
        echo "[gpu$gpu $(( $(date +%s) - T0 ))s] start $name (limit ${limit}s)"
        (cd "$ROOT" && CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" bash -c "$cmd") > "$OUT/$name.log" 2>&1
        rc=$?
        echo "[gpu$gpu $(( $(date +%s) - T0 ))s] $name rc=$rc: $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1)"
    done
}
queue 0 "$1" & queue 1 "${2:-}" & wait
