#!/usr/bin/env bash
# Single-node fine-tuning: one torchrun --standalone (all processes on this node).
#
#   mkdir -p logs      # Slurm does not create the --output dir; a missing one fails the job silently
#   sbatch slurm/single_node.sh configs/X.yaml key.sub=value ...
#   sbatch --gpus-per-node=8 --cpus-per-task=64 slurm/single_node.sh configs/X.yaml
#   bash slurm/single_node.sh configs/X.yaml ...     # outside Slurm: same launch, no requeue
#
# Same conventions as slurm/multinode.sh: submit from the repo root (or set LLMTRAIN_ROOT); the
# #SBATCH lines are defaults that sbatch's command line overrides; GPUs are requested on the command
# line, never here (a GPU request is rejected outright on a cluster without GPUs); environment knobs
# and the preemption logic (SIGUSR1 -> checkpoint -> `scontrol requeue`) are in slurm/common.sh.
# Requeue is decided by "this shell got USR1 and training had not finished (launcher rc != 0)", never by
# torchrun's exit code: torchrun exits 1 whether a rank crashed or saved and exited 42 (to be requeued).
# What a wrapper of your own should look at: docs/multinode.md (How requeue is decided).
#
#SBATCH --job-name=llmtrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

set -euo pipefail

(( $# >= 1 )) || { echo "usage: sbatch slurm/single_node.sh CONFIG [key=value ...]" >&2; exit 2; }
CONFIG=$1
shift

if [[ -n ${SLURM_JOB_ID:-} ]]; then
    LLMTRAIN_ROOT=${LLMTRAIN_ROOT:-$SLURM_SUBMIT_DIR}
else
    LLMTRAIN_ROOT=${LLMTRAIN_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
fi
# shellcheck source=slurm/common.sh
source "$LLMTRAIN_ROOT/slurm/common.sh" || { echo "cannot find slurm/common.sh under $LLMTRAIN_ROOT" >&2; exit 2; }
llmtrain_setup

LAUNCH=()
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    # A job step, so that `scancel`/accounting see it; --cpus-per-task explicitly because Slurm
    # 22.05 srun does not inherit it from sbatch.
    LAUNCH=(srun --nodes=1 --ntasks=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"})
fi
llmtrain_log "job ${SLURM_JOB_ID:-<none>} restart ${SLURM_RESTART_COUNT:-0} on ${SLURMD_NODENAME:-$(hostname)}:" \
    "$NPROC_PER_NODE procs, OMP_NUM_THREADS=$OMP_NUM_THREADS, torchrun=$TORCHRUN, recipe=$RECIPE --config $CONFIG $*"

llmtrain_torchrun_common_args
llmtrain_run_preemptible "${LAUNCH[@]}" \
    "$TORCHRUN" --standalone --nnodes 1 "${LLMTRAIN_TORCHRUN_ARGS[@]}" \
        "$RECIPE" --config "$CONFIG" "$@"
