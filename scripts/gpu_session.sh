#!/usr/bin/env bash
# One GPU session in a few device calls: each argument is a stage, run in order; "a+b" runs stage a on GPU 0 and
# stage b on GPU 1 at the same time; "a,b" runs a then b. Every step has a time limit inside one overall deadline,
# so the run ends (and prints its summary table) before the device's 10-minute limit. Full output: $OUT/<stage>.log; stdout: each
# step's status and key lines, then the summary (also kept in $OUT/session.log).
#
#   scripts/gpu_session.sh stack1 kernels+probe    (docs/GPU.md lists the exact calls)
#
# Stages
#   stack1..stack4   stage the GPU stack from .gpu-stack/cN (built here by ../shared/tools/gpu-stack; N = 1..4,
#                    one per call, on the same machine, in order); stack4 installs torchrec/fbgemm/hydra into
#                    /tmp/gpu-site and checks the imports
#   kernels          pytest -m gpu tests/ops (a time limit per file), then bench_attention.py --quick
#   kernel-tests     pytest -m gpu tests/ops alone
#   kt-NAME          pytest -m gpu tests/ops/test_NAME.py alone (e.g. kt-jfa,kt-rope+kt-block,kt-gdpa)
#   jfa-faults       tools/jfa_fault_matrix.py: JFA fwd+bwd cases, each in its own process (a device fault
#                    kills the CUDA context), to find which shape/backward form faults
#   bench            bench_attention.py, all sections, full shapes ($BENCH_ARGS adds flags)
#   probe            tools/kernel_probe.py: per-kernel device time of each op call beside its event time
#   train1-tests     pytest -m gpu tests/data tests/model                      (needs the GPU stack)
#   train1-bench     bench_train.py on one GPU, experiment=gpu_base ($TRAIN_EXPERIMENT)  (needs the GPU stack)
#   train1-profile   the same with --warmup 10 --steps 20 --profile-steps 5: top ops and device-time buckets of
#                    the last 5 steps (train1_profile.json)                     (needs the GPU stack)
#   train1           train1-tests, then train1-bench
#   train2           bench_train.py on 2 GPUs under torchrun ($TRAIN2_PARALLEL), scaling ratio vs train1's
#                    figure, then tests/dist/gpu_check.py                      (needs the GPU stack, 2 GPUs)
#   train1-sweep     bench_train (5 + 15 steps) once per override set in $TRAIN1_SWEEP (";"-separated; default
#                    grouped-GEMM MoE; compiled blocks), one GPU
#   train2-sweep     the same on 2 GPUs with $TRAIN2_PARALLEL, sets from $TRAIN2_SWEEP (default no reshard after
#                    forward; ep 1; grouped-GEMM MoE), scaling vs train1.json or $SINGLE_GPU_TFLOPS
#   env              versions and devices (runs first in every invocation anyway)
#
# Environment: GPU_SESSION_DEADLINE (seconds for the whole invocation, default 560), PYTHON (default python3),
# TRAIN_STEPS ("--warmup 10 --steps 30"), TRAIN_EXPERIMENT (gpu_base), TRAIN2_PARALLEL (2-GPU layout overrides),
# SINGLE_GPU_TFLOPS (1-GPU reference when train1 did not run on this machine), BENCH_ARGS, TRAIN1_LIMIT (train1's
# benchmark time limit, 480 s).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
WORK="$ROOT/outputs/gpu_session"
OUT=${OUT:-$WORK/out}
DEADLINE_S=${GPU_SESSION_DEADLINE:-560}
START_S=$(date +%s)
SITE=${GPU_SITE:-/tmp/gpu-site}  # where stack4 installs torchrec/fbgemm/hydra
TRAIN_STEPS=${TRAIN_STEPS:-"--warmup 10 --steps 30"}
TRAIN_EXPERIMENT=${TRAIN_EXPERIMENT:-gpu_base}
# full_5d cut to 2 GPUs: FSDP over dp_shard=2 with experts over ep=2, tables sharded over both ranks (one
# embedding group). Params stay fp32 under bf16 autocast, as in the 1-GPU reference, so the ratio compares like
# with like.
TRAIN2_PARALLEL=${TRAIN2_PARALLEL:-"parallel=full_5d parallel.dp_replicate=1"}
LOG_CAP=15000000  # bytes: files under $OUT come back only up to 16 MiB

mkdir -p "$WORK/steps" "$OUT" || exit 1
RUN_ID="$START_S.$$"
ROWS="$WORK/rows.$RUN_ID"
: > "$ROWS"

export TRITON_CACHE_DIR="$ROOT/outputs/triton-cache"  # lives on that machine only; a fresh machine compiles again
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NVLink multicast stays off on the GPU machines (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

elapsed() { echo $(( $(date +%s) - START_S )); }

# say STAGE MSG: a progress line on stdout (tagged with the stage when stages run side by side)
say() { printf '[%s %4ss] %s\n' "$1" "$(elapsed)" "$2"; }

# step STAGE NAME BUDGET_S DETAIL_RE SHOW_RE CMD...
#   Runs CMD under a time limit (BUDGET_S, cut to what the deadline leaves), appends its output to
#   $OUT/STAGE.log, prints the lines matching SHOW_RE (all of the last 25 lines on failure) and records a summary
#   row whose detail is the last line matching DETAIL_RE. Returns CMD's status (124: time limit).
step() {
    local stage=$1 name=$2 budget=$3 detail_re=$4 show_re=$5
    shift 5
    local left=$(( DEADLINE_S - $(elapsed) - 10 ))
    if (( left < 20 )); then
        say "$stage" "SKIP $name: deadline reached"
        printf '%s\t%s\tSKIP\t0\tdeadline reached\n' "$stage" "$name" >> "$ROWS"
        return 124
    fi
    (( budget > left )) && budget=$left
    local log="$OUT/$stage.log" txt
    case $stage in env|stack*) log="$OUT/session.log" ;; esac
    txt="$WORK/steps/$RUN_ID.$stage.$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_').txt"
    say "$stage" "start $name (limit ${budget}s)"
    local t0 rc dt status detail
    t0=$(date +%s)
    # timeout signals the whole process group (torchrun workers, pytest children) and SIGKILLs 15 s later.
    timeout -k 15 "$budget" "$@" > "$txt" 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    { printf '\n### %s (limit %ss, %ss, rc %s): %s\n' "$name" "$budget" "$dt" "$rc" "$*"; cat "$txt"; } >> "$log"
    case $rc in
        0) status=ok ;;
        124|137) status=TIMEOUT ;;
        *) status="FAIL($rc)" ;;
    esac
    detail=$(grep -E -- "$detail_re" "$txt" | tail -n 1)
    [ -n "$detail" ] || [ "$status" = ok ] || detail=$(grep -E 'Error|error:' "$txt" | tail -n 1)
    [ -n "$detail" ] || detail=$(grep -v '^[[:space:]]*$' "$txt" | tail -n 1)
    detail=$(printf '%s' "$detail" | tr -d '\r' | tr '\t|' '  ' | tr -s ' ' | sed 's/^[[:space:]=]*//; s/^bench_train summary: //' | cut -c1-140)
    [ "$status" = TIMEOUT ] && detail="time limit ${budget}s hit${detail:+; $detail}"
    # a GPU test file whose tests all skipped (no CUDA seen) is not a pass
    if [[ $name == pytest* && $status == ok && $detail != *passed* ]]; then status=NO-PASS; fi
    if [ -n "$show_re" ]; then
        grep -E -- "$show_re" "$txt" | head -n 80
    fi
    if [ "$status" != ok ]; then
        echo "---- last lines of $name ----"
        tail -n 25 "$txt"
        echo "----"
    fi
    say "$stage" "$status $name (${dt}s): $detail"
    printf '%s\t%s\t%s\t%s\t%s\n' "$stage" "$name" "$status" "$dt" "$detail" >> "$ROWS"
    return "$rc"
}

note() {  # note STAGE NAME STATUS DETAIL: a summary row for something that did not run
    say "$1" "$3 $2: $4"
    printf '%s\t%s\t%s\t0\t%s\n' "$1" "$2" "$3" "$4" >> "$ROWS"
}

gpu_count() {
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
    elif command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi -L 2> /dev/null | grep -c '^GPU'
    else
        "$PY" -c 'import torch; print(torch.cuda.device_count())' 2> /dev/null || echo 0
    fi
}

need_stack() {  # need_stack STAGE: the torchrec/fbgemm/hydra install from the stack stages
    if [ ! -d "$SITE/torchrec" ] || [ ! -d "$SITE/fbgemm_gpu" ]; then
        note "$1" "GPU stack" FAIL "$SITE lacks torchrec/fbgemm_gpu: run stack1..stack4 on this machine first"
        return 1
    fi
    export PYTHONPATH="$SITE:$ROOT"
}

PYTEST_RE='(passed|failed|error|no tests ran|deselected|skipped)'
PYTEST_SHOW='^(FAILED|ERROR) '
BENCH_SHOW='^(\||## |measured|warning|note|bench_train|rows written|plot written|results written)'

# ---------------------------------------------------------------------------------------------- stages

ENV_PY='
import importlib, sys
import torch, triton
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "| GPUs", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB {p.multi_processor_count} SMs")
sys.path.insert(0, sys.argv[1])
for m in ("torchrec", "fbgemm_gpu", "hydra"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "not importable:", type(e).__name__)
'

stage_env() {
    step env "versions" 90 'torch ' '^(python|  cuda)' "$PY" -c "$ENV_PY" "$SITE"
}

stage_stack() {  # stage_stack N
    local n=$1 dir=".gpu-stack/c$1" i
    if [ ! -d "$dir" ]; then
        note "stack$n" "stage c$n" FAIL "$dir missing here: carry it (run ../shared/tools/gpu-stack on the dev machine first)"
        return 1
    fi
    for (( i = 0; i < n - 1; i++ )); do
        if [ ! -e "/tmp/gpu-parts/part.$i" ]; then
            note "stack$n" "stage c$n" FAIL "part.$i missing: this is a fresh machine, start again at stack1"
            return 1
        fi
    done
    if (( n < 4 )); then
        step "stack$n" "stage c$n" 120 'staged' '' bash "$dir/stage.sh"
    else
        step stack4 "install GPU stack" 300 'installed|already' '' "$PY" "$dir/install.py" || return 1
        step stack4 "import check" 120 'ok' '' env PYTHONPATH="$SITE:$ROOT" "$PY" -c \
            "import torch, torchrec, fbgemm_gpu, hydra, omegaconf; print('gpu stack ok: torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '?', 'fbgemm_gpu', fbgemm_gpu.__version__)"
    fi
}

kernel_tests() {  # kernel_tests STAGE [NAME...]: tests/ops/test_NAME.py (all with a gpu test by default), one
                 # time limit per file, so one slow file cannot eat the others' time
    local f budget files=()
    if (( $# > 1 )); then
        for f in "${@:2}"; do files+=("tests/ops/test_$f.py"); done
    else
        for f in tests/ops/test_*.py; do grep -q 'mark\.gpu' "$f" && files+=("$f"); done
    fi
    for f in "${files[@]}"; do
        case $f in
            *test_rope.py) budget=50 ;;
            *test_jfa.py) budget=${KERNEL_TEST_BUDGET:-330} ;;  # > 240 s on a machine that compiles afresh
            *test_block.py) budget=${KERNEL_TEST_BUDGET:-330} ;;  # > 240 s cold since the split loops (session 10)
            *) budget=${KERNEL_TEST_BUDGET:-100} ;;
        esac
        # Correctness runs on each kernel's first config (the tuners compile every config per new shape key; the
        # JFA file still checks every config once, explicitly). The benchmark tunes as users do.
        step "$1" "pytest $(basename "$f")" "$budget" "$PYTEST_RE" "$PYTEST_SHOW" \
            env GEM_AUTOTUNE=0 \
            "$PY" -m pytest -q -m gpu -p no:cacheprovider "$f"
    done
}

stage_kernels() {
    [ -d "$SITE/fbgemm_gpu" ] && export PYTHONPATH="$SITE:$ROOT"  # adds the FBGEMM sll anchor when present
    kernel_tests kernels
    step kernels "bench_attention --quick" 400 'rows written' "$BENCH_SHOW" \
        "$PY" scripts/bench_attention.py --quick --json "$OUT/bench.json" --plot "$OUT/bench.png"
}

stage_bench() {
    [ -d "$SITE/fbgemm_gpu" ] && export PYTHONPATH="$SITE:$ROOT"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    step bench "bench_attention" 540 'rows written' "$BENCH_SHOW" \
        "$PY" scripts/bench_attention.py ${BENCH_ARGS:-} --json "$OUT/bench_full.json" --plot "$OUT/bench_full.png"
}

stage_train1_tests() {
    need_stack train1-tests || return 1
    step train1-tests "pytest -m gpu tests/data" 90 "$PYTEST_RE" "$PYTEST_SHOW" \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/data
    step train1-tests "pytest -m gpu tests/model" 180 "$PYTEST_RE" "$PYTEST_SHOW" \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/model
}

stage_train1_bench() {
    need_stack train1 || return 1
    # shellcheck disable=SC2086  # TRAIN_STEPS is a list of flags
    step train1 "bench_train 1 GPU $TRAIN_EXPERIMENT" "${TRAIN1_LIMIT:-480}" '^bench_train summary' "$BENCH_SHOW" \
        env GEM_DUMP_STACKS_AFTER=$(( ${TRAIN1_LIMIT:-480} - 30 )) "$PY" scripts/bench_train.py $TRAIN_STEPS --json "$OUT/train1.json" experiment="$TRAIN_EXPERIMENT" \
        && cp "$OUT/train1.json" "$WORK/train1.json"  # the reference for train2 on this machine
}

# train_sweep STAGE NPROC VARIANTS: a short bench_train run per variant (";"-separated override sets), to compare
# knobs within one machine: the scaling / MFU targets need choices that only a timed run can make.
train_sweep() {
    local stage=$1 nproc=$2 v i=0 scratch ref=()
    local -a sets
    IFS=';' read -ra sets <<< "$3"
    [ -n "${SINGLE_GPU_TFLOPS:-}" ] && ref=(--single-gpu-tflops "$SINGLE_GPU_TFLOPS")
    [ -f "$WORK/train1.json" ] && ref=(--single-gpu-json "$WORK/train1.json")
    for v in "${sets[@]}"; do
        i=$((i + 1))
        scratch=$(mktemp -d "${TMPDIR:-/tmp}/gem-bench.XXXXXX")
        # shellcheck disable=SC2086  # the variant is a list of overrides
        if (( nproc == 1 )); then
            step "$stage" "variant $i: $v" 200 '^bench_train summary' '^bench_train summary' \
                "$PY" scripts/bench_train.py --warmup 5 --steps 15 --json "$OUT/$stage-$i.json" \
                experiment="$TRAIN_EXPERIMENT" $v
        else
            step "$stage" "variant $i: $v" 240 '^bench_train summary' '^bench_train summary' env TMPDIR="$scratch" \
                GEM_DIST_TIMEOUT_S=${GEM_DIST_TIMEOUT_S:-120} "$PY" -m torch.distributed.run --standalone \
                --nproc_per_node="$nproc" scripts/bench_train.py --warmup 5 --steps 15 ${ref[@]+"${ref[@]}"} \
                --json "$OUT/$stage-$i.json" experiment="$TRAIN_EXPERIMENT" $TRAIN2_PARALLEL $v
        fi
        rm -rf "$scratch"
    done
}

stage_train1_profile() {
    need_stack train1-profile || return 1
    step train1-profile "bench_train profile 1 GPU $TRAIN_EXPERIMENT" 240 '^bench_train summary' "$BENCH_SHOW" \
        env GEM_DUMP_STACKS_AFTER=210 "$PY" scripts/bench_train.py --warmup 10 --steps 20 --profile-steps 5 \
        --json "$OUT/train1_profile.json" experiment="$TRAIN_EXPERIMENT"
}

stage_train2() {
    need_stack train2 || return 1
    local n
    n=$(gpu_count)
    if (( n < 2 )); then
        note train2 "bench_train 2 GPUs" FAIL "needs 2 GPUs, this machine shows $n (use kind nvidia-h200-x2)"
        return 1
    fi
    local ref=()
    if [ -f "$WORK/train1.json" ]; then
        ref=(--single-gpu-json "$WORK/train1.json")
    elif [ -n "${SINGLE_GPU_TFLOPS:-}" ]; then
        ref=(--single-gpu-tflops "$SINGLE_GPU_TFLOPS")
    else
        # shellcheck disable=SC2086
        step train2 "bench_train 1 GPU reference" 300 '^bench_train summary' "$BENCH_SHOW" env CUDA_VISIBLE_DEVICES=0 \
            "$PY" scripts/bench_train.py $TRAIN_STEPS --json "$WORK/train1.json" experiment="$TRAIN_EXPERIMENT" \
            && ref=(--single-gpu-json "$WORK/train1.json")
    fi
    local scratch
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/gem-bench.XXXXXX")  # torchrun's torchelastic_* scratch
    # shellcheck disable=SC2086  # TRAIN_STEPS / TRAIN2_PARALLEL are lists
    # A hang shows up as a collective timeout (120 s) and a stack dump of every rank, not as the step's time limit.
    step train2 "bench_train 2 GPUs" 330 '^bench_train summary' "$BENCH_SHOW" env TMPDIR="$scratch" \
        GEM_DIST_TIMEOUT_S=${GEM_DIST_TIMEOUT_S:-120} GEM_DUMP_STACKS_AFTER=${GEM_DUMP_STACKS_AFTER:-200} \
        "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 scripts/bench_train.py $TRAIN_STEPS \
        ${ref[@]+"${ref[@]}"} --json "$OUT/train2.json" experiment="$TRAIN_EXPERIMENT" $TRAIN2_PARALLEL
    rm -rf "$scratch"
    step train2 "tests/dist/gpu_check.py" 400 '.' '' "$PY" tests/dist/gpu_check.py "$WORK/gpu_check"
    if [ -f "$WORK/gpu_check/summary.json" ]; then
        cp "$WORK/gpu_check/summary.json" "$OUT/gpu_check.json"
        cat "$OUT/gpu_check.json"
    fi
    # every launch's full output, for the failures the summary only excerpts
    for f in "$WORK"/gpu_check/*.log; do
        [ -f "$f" ] && { echo "#### $(basename "$f")"; tail -c 2000000 "$f"; }
    done > "$OUT/gpu_check_logs.log" 2> /dev/null
}

run_stage() {
    case $1 in
        env) stage_env ;;
        stack[1-4]) stage_stack "${1#stack}" ;;
        kernels) stage_kernels ;;
        kernel-tests) [ -d "$SITE/fbgemm_gpu" ] && export PYTHONPATH="$SITE:$ROOT"; kernel_tests kernels ;;
        kt-*) kernel_tests kernels "${1#kt-}" ;;
        jfa-faults) step jfa-faults "jfa_fault_matrix" 240 '^(ok|FAULT|WRONG)' '^(FAULT|WRONG)' \
            "$PY" tools/jfa_fault_matrix.py ;;
        probe) step probe "kernel_probe" 300 '^## ' '^(## |fwd)' "$PY" tools/kernel_probe.py ;;
        bench) stage_bench ;;
        train1-tests) stage_train1_tests ;;
        train1-bench) stage_train1_bench ;;
        train1-profile) stage_train1_profile ;;
        train1) stage_train1_tests; stage_train1_bench ;;
        train2) stage_train2 ;;
        train1-sweep) need_stack train1-sweep && train_sweep train1-sweep 1 "${TRAIN1_SWEEP:-model.moe.grouped_mm=true;parallel.compile=true}" ;;
        train2-sweep) need_stack train2-sweep && train_sweep train2-sweep 2 \
            "${TRAIN2_SWEEP:-parallel.reshard_after_forward=false;parallel.ep=1;model.moe.grouped_mm=true}" ;;
        *) note "$1" "stage" FAIL "unknown stage (see the head of scripts/gpu_session.sh)"; return 2 ;;
    esac
}

run_chain() {  # "a,b": stage a, then stage b
    local chain s
    IFS=, read -ra chain <<< "$1"
    for s in "${chain[@]}"; do run_stage "$s"; done
}

run_group() {  # "a+b": stage a on GPU 0 and stage b on GPU 1, side by side (each may be a chain "a,b")
    local group=$1 parts n i pids=()
    IFS=+ read -ra parts <<< "$group"
    if (( ${#parts[@]} == 1 )); then
        run_chain "$group"
        return
    fi
    n=$(gpu_count)
    if (( n < ${#parts[@]} )); then
        note "$group" "side by side" FAIL "needs ${#parts[@]} GPUs, this machine shows $n"
        return 1
    fi
    for i in "${!parts[@]}"; do
        ( export CUDA_VISIBLE_DEVICES=$i; run_chain "${parts[$i]}" ) &
        pids+=($!)
    done
    wait "${pids[@]}"
}

if [ $# -eq 0 ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
fi
for g in "$@"; do  # reject a typo before spending device time
    IFS='+,' read -ra ps <<< "$g"
    for s in "${ps[@]}"; do
        case $s in
            env|stack[1-4]|kernels|kernel-tests|jfa-faults|bench|probe|train1|train1-tests|train1-bench|train1-profile|train2|train1-sweep|train2-sweep) ;;
            kt-*) [ -f "tests/ops/test_${s#kt-}.py" ] || { echo "gpu_session.sh: no tests/ops/test_${s#kt-}.py" >&2; exit 2; } ;;
            *) echo "gpu_session.sh: unknown stage '$s' (see the head of this script)" >&2; exit 2 ;;
        esac
    done
done

stage_env
for g in "$@"; do
    [ "$g" = env ] && continue
    run_group "$g"
done

# Keep each log under the size that comes back (the end is where the results are).
for f in "$OUT"/*.log; do
    [ -f "$f" ] || continue
    if [ "$(stat -c %s "$f")" -gt "$LOG_CAP" ]; then
        tail -c "$LOG_CAP" "$f" > "$f.tmp" && mv "$f.tmp" "$f"
    fi
done

{
    echo
    echo "## gpu_session $* ($(elapsed) s, deadline ${DEADLINE_S} s)"
    echo "| stage | step | status | s | detail |"
    echo "|---|---|---|---|---|"
    awk -F'\t' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$ROWS"
    echo "files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} | tee -a "$OUT/session.log"
# exit status: 0 only when every step ran and passed
awk -F'\t' '$3 != "ok" { bad = 1 } END { exit bad }' "$ROWS"
