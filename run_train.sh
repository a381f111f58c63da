#!/usr/bin/env bash
# Launch torchtitan_ext training with torchrun, following torchtitan's run_train.sh.
#
# Environment (all optional):
#   NGPU           ranks per node (default 1; on a CPU-only machine, gloo processes)
#   LOG_RANK       ranks whose output is shown, e.g. 0,1 (default 0)
#   CONFIG_FILE    a TOML job file, e.g. train_configs/cp2.toml
#   MODULE/CONFIG  a registry module and function instead of CONFIG_FILE
#                  (default torchtitan_ext.muse_glimmer / muse_glimmer_debugmodel_mm_quickstart)
#   TRAIN_FILE     the entry module (default torchtitan_ext.train), as upstream
#   NNODES         number of nodes (default 1); with NNODES > 1 also set
#   NODE_RANK      this node's rank, 0..NNODES-1, and
#   RDZV_ENDPOINT  host:port of the rendezvous, the same on every node
# Extra arguments are passed to the trainer and win over the config:
#   NGPU=2 CONFIG_FILE=train_configs/cp2.toml ./run_train.sh --training.steps 5
set -euo pipefail

repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
"$repo_root/scripts/bootstrap.sh"

NGPU=${NGPU:-1}
export LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}

if [[ -n "${CONFIG_FILE:-}" ]]; then
    job_args=(--job.config_file "$CONFIG_FILE")
else
    job_args=(--module "${MODULE:-torchtitan_ext.muse_glimmer}"
              --config "${CONFIG:-muse_glimmer_debugmodel_mm_quickstart}")
fi

# torchrun gives each rank one OpenMP thread only when a node runs several;
# decided by the world size instead, a job computes the same on any node split.
if (( NNODES * NGPU > 1 )); then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

if (( NNODES > 1 )); then
    # Static rendezvous: ranks follow NODE_RANK, so a run is reproducible.
    rdzv_args=(--nnodes "$NNODES" --node_rank "$NODE_RANK"
               --rdzv_backend static --rdzv_endpoint "$RDZV_ENDPOINT")
else
    rdzv_args=(--rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT")
fi

PYTORCH_ALLOC_CONF="expandable_segments:True" \
"$repo_root/.venv/bin/python" -m torch.distributed.run \
    --nproc_per_node "$NGPU" "${rdzv_args[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "${TRAIN_FILE:-torchtitan_ext.train}" "${job_args[@]}" "$@"
