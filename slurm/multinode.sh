#!/usr/bin/env bash
# Multi-node fine-tuning: one torchrun per node, c10d rendezvous on the first node of the job.
#
#   mkdir -p logs      # Slurm does not create the --output dir; a missing one fails the job silently
#   sbatch slurm/multinode.sh configs/X.yaml key.sub=value ...
#   sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=64 --time=2-00:00:00 slurm/multinode.sh configs/X.yaml
#   NCCL_DEBUG=INFO NPROC_PER_NODE=4 sbatch slurm/multinode.sh configs/X.yaml
#
# Submit from the repo root (or set LLMTRAIN_ROOT). Every #SBATCH line below is a default that the
# same option on the sbatch command line overrides. GPUs are not requested here on purpose: a
# --gpus-per-node/--gres line is rejected outright on a cluster (or partition) without GPUs, so
# ask for them on the command line (`sbatch --gpus-per-node=8 ...`). Other knobs (python, process
# count, ports, NCCL) are environment variables: see slurm/common.sh.
#
# Preemption: 120 s before the time limit (or on `scancel --batch --signal=USR1 <jobid>`) this
# script tells the training processes to checkpoint and exit, then requeues the job, which resumes
# from the checkpoint. Details and the reasons for B: in slurm/common.sh.
# Requeue is decided by "this shell got USR1 and training had not finished (launcher rc != 0)", never by
# torchrun's exit code: torchrun exits 1 whether a rank crashed or saved and exited 42 (to be requeued).
# What a wrapper of your own should look at: docs/multinode.md (How requeue is decided).
#
#SBATCH --job-name=llmtrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
# (--open-mode=append: a requeued job writes to the same file; the default truncates it and the
#  log of the preempted run would be lost.)

set -euo pipefail

[[ -n ${SLURM_JOB_ID:-} ]] || { echo "submit with sbatch: sbatch $0 CONFIG [key=value ...]" >&2; exit 2; }
(( $# >= 1 )) || { echo "usage: sbatch slurm/multinode.sh CONFIG [key=value ...]" >&2; exit 2; }
CONFIG=$1
shift

LLMTRAIN_ROOT=${LLMTRAIN_ROOT:-$SLURM_SUBMIT_DIR}
# shellcheck source=slurm/common.sh
source "$LLMTRAIN_ROOT/slurm/common.sh" || { echo "cannot find slurm/common.sh under $LLMTRAIN_ROOT" >&2; exit 2; }
llmtrain_setup

# The batch script runs on the first node of the allocation; its name (Slurm's NodeName, which
# must resolve on every node) is the rendezvous host. Never assume hostname == NodeName.
HEAD=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)  # no SIGPIPE failure
[[ -n $HEAD ]] || llmtrain_die "cannot expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
MASTER_PORT=${MASTER_PORT:-$(( 29500 + SLURM_JOB_ID % 10000 ))}

llmtrain_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES nodes ($SLURM_JOB_NODELIST)," \
    "$NPROC_PER_NODE procs/node, rendezvous $HEAD:$MASTER_PORT, OMP_NUM_THREADS=$OMP_NUM_THREADS," \
    "torchrun=$TORCHRUN, recipe=$RECIPE --config $CONFIG $*"

llmtrain_torchrun_common_args
# One srun task per node, each a torchrun agent. srun gets --cpus-per-task explicitly: Slurm 22.05
# srun no longer inherits it from sbatch, and the step would be confined to 1 CPU under task/affinity.
# No --kill-on-bad-exit: on preemption the nodes' torchruns exit one after the other, and killing
# the rest as soon as the first exits could cut off a rank still finishing the checkpoint (with
# torch.distributed.checkpoint rank 0 writes the metadata last). The price: after a crash on one
# node the others wait in a collective until the NCCL timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# makes them abort then instead of hanging). SLURM_KILL_BAD_EXIT=1 in the environment turns it on.
# The bash -c wrapper only prints which node is starting ($SLURMD_NODENAME: Slurm's name of the node
# this task runs on) and then execs torchrun, so signals reach torchrun directly.
llmtrain_run_preemptible \
    srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 \
        ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
    bash -c 'echo "[llmtrain] node $SLURMD_NODENAME (node rank $SLURM_NODEID): starting torchrun"; exec "$@"' llmtrain \
    "$TORCHRUN" \
        --nnodes "$SLURM_NNODES" \
        --rdzv_backend c10d --rdzv_endpoint "$HEAD:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
        "${LLMTRAIN_TORCHRUN_ARGS[@]}" \
        "$RECIPE" --config "$CONFIG" "$@"
