#!/usr/bin/env bash
# Multi-node training with torchrun: run this once on every node, with the same arguments and environment.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       scripts/launch_multinode.sh experiment=gpu_base parallel=full_5d parallel.dp_replicate=2
#   ... scripts/launch_multinode.sh --bench --warmup 10 --steps 30 experiment=gpu_base ...   (scripts/bench_train.py)
#   ... scripts/launch_multinode.sh --dry-run ...                                            (print the command)
#   ... scripts/launch_multinode.sh --log-all-ranks ...                    (every rank's output on the console)
#
# Required environment: NNODES, NODE_RANK (0..NNODES-1), MASTER_ADDR, MASTER_PORT (rendezvous host and port, one
# for all nodes), NPROC_PER_NODE (GPUs per node). Optional: RDZV_BACKEND (c10d, the default, or static),
# RDZV_ID (default gem), PYTHON (default python3), RANK_LOG_DIR (default outputs/rank_logs) and NCCL's own variables
# (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...).
# Only global rank 0 writes to the console: every other rank's output goes to RANK_LOG_DIR/rank<N>.log on its node,
# and the end of that file is printed if the rank fails. --log-all-ranks (or GEM_LOG_ALL_RANKS=1) shows them all.
# Under c10d the rendezvous picks the node order (NODE_RANK names this node's log only); each node's ranks are
# consecutive either way, which is what the host-local mesh layouts rely on. docs/PARALLELISM.md says which mesh dims to
# keep inside a node.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python3}

die() { echo "launch_multinode.sh: $*" >&2; exit 2; }

need_int() {  # need_int NAME MIN: the variable must be set and an integer >= MIN
    local name=$1 min=$2 value
    value=${!name-}
    [ -n "$value" ] || die "$name is not set (required: NNODES NODE_RANK MASTER_ADDR MASTER_PORT NPROC_PER_NODE)"
    [[ $value =~ ^[0-9]+$ ]] || die "$name=$value: expected a non-negative integer"
    (( value >= min )) || die "$name=$value: must be >= $min"
}

MODE=train
DRY=0
ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --bench) MODE=bench; shift ;;
        --dry-run) DRY=1; shift ;;
        --log-all-ranks) GEM_LOG_ALL_RANKS=1; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

need_int NNODES 1
need_int NODE_RANK 0
need_int NPROC_PER_NODE 1
need_int MASTER_PORT 1
(( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK: must be < NNODES=$NNODES"
(( MASTER_PORT <= 65535 )) || die "MASTER_PORT=$MASTER_PORT: not a port number"
[ -n "${MASTER_ADDR-}" ] || die "MASTER_ADDR is not set (the rendezvous host, reachable from every node)"
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
case $RDZV_BACKEND in c10d|static) ;; *) die "RDZV_BACKEND=$RDZV_BACKEND: expected c10d or static" ;; esac
WORLD=$(( NNODES * NPROC_PER_NODE ))

if command -v nvidia-smi > /dev/null 2>&1; then
    GPUS=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
    if (( GPUS > 0 && GPUS < NPROC_PER_NODE )); then
        die "NPROC_PER_NODE=$NPROC_PER_NODE: this node shows only $GPUS GPUs"
    fi
fi

# NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer ends the job
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$MODE" = train ]; then
    # Check the config against the whole world once, before the rendezvous: a bad layout gives one line here.
    WORLD_SIZE=$WORLD "$PY" -m gem.train --check ${ARGS[@]+"${ARGS[@]}"} > /dev/null || exit $?
    ENTRY=(-m gem.train)
else
    ENTRY=("$ROOT/scripts/bench_train.py")
fi

# The rendezvous decides which node holds rank 0, so each worker decides for itself where its output goes.
# (torchrun signals the worker's whole process group, so the wrapping shell does not outlive its worker.)
WORKER=("$PY" -u)
if [ "${GEM_LOG_ALL_RANKS:-0}" != 1 ]; then
    export RANK_LOG_DIR=${RANK_LOG_DIR:-outputs/rank_logs}
    case $RANK_LOG_DIR in /*) ;; *) RANK_LOG_DIR=$PWD/$RANK_LOG_DIR ;; esac
    # the wrapping shell outlives a stop signal (a no-op trap), so its worker can write the stop checkpoint
    QUIET='[ "$RANK" = 0 ] && exec "$@"
trap : TERM INT USR1
log="$RANK_LOG_DIR/rank$RANK.log"
"$@" > "$log" 2>&1 && exit 0
code=$?
{ echo "[rank $RANK] exited with status $code; the end of $log:"; tail -n 30 "$log"; } >&2
exit $code'
    WORKER=(bash -c "$QUIET" gem-worker "$PY" -u)
fi

RUN=(torch.distributed.run --no-python --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --max_restarts=0
     --rdzv_backend="$RDZV_BACKEND" --rdzv_id="${RDZV_ID:-gem}")
if [ "$RDZV_BACKEND" = static ]; then
    RUN+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
else
    RUN+=(--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT")
fi

echo "[node $NODE_RANK/$NNODES] world $WORLD ($NPROC_PER_NODE per node), rendezvous $RDZV_BACKEND at $MASTER_ADDR:$MASTER_PORT" >&2
if (( DRY )); then
    printf '%q ' "$PY" -m "${RUN[@]}" "${WORKER[@]}" "${ENTRY[@]}" ${ARGS[@]+"${ARGS[@]}"}
    echo
    exit 0
fi
[ "${GEM_LOG_ALL_RANKS:-0}" = 1 ] || mkdir -p "$RANK_LOG_DIR"
exec "$PY" -m "${RUN[@]}" "${WORKER[@]}" "${ENTRY[@]}" ${ARGS[@]+"${ARGS[@]}"}
