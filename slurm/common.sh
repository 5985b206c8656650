# Shared by slurm/multinode.sh and slurm/single_node.sh; sourced, not run.
# sbatch copies the batch script into its spool dir, so the scripts find this file through the repo
# root (LLMTRAIN_ROOT, else the sbatch submit dir), not through $0.
#
# Environment knobs (all optional; sbatch passes the submitting shell's environment through):
#   LLMTRAIN_PYTHON_BIN  dir holding the python/torchrun to use   [<repo>/.venv/bin if present, else PATH]
#   LLMTRAIN_RECIPE      script torchrun launches, relative to the repo root   [recipes/finetune.py]
#   NPROC_PER_NODE       training processes per node   [GPUs allocated on the node, else 1 (CPU)]
#   MAX_RESTARTS         torchrun --max-restarts   [0: a crashing worker usually crashes again; node
#                        failures are Slurm's business (--requeue)]
#   MASTER_PORT          rendezvous port on the head node   [29500 + job id % 10000]
#   OMP_NUM_THREADS      [cpus-per-task / NPROC_PER_NODE, at least 1]
#   NCCL_DEBUG           not set by us; export NCCL_DEBUG=INFO (or WARN) before sbatch to get it
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun waits for workers after forwarding a signal
#                        before SIGKILL   [90: must fit in the 120 s of --signal=B:USR1@120]
#   LLMTRAIN_EXIT_FILE   an existing file the ranks of this node append their exit codes to   [a mktemp
#                        file, removed after]: the template exits 2 when a rank refused its input

llmtrain_die() { echo "[llmtrain] error: $*" >&2; exit 2; }
llmtrain_log() { echo "[llmtrain $(date +%H:%M:%S)] $*"; }

# What recipes/finetune.py exits with after its preemption checkpoint (llmtrain.distributed.
# PREEMPTED_EXIT_CODE; tests/run/test_slurm_cluster.py checks they agree). torchrun does not pass it
# through (it exits 1), so this shell exits with it itself when preempted outside Slurm.
PREEMPT_EXIT_CODE=42

llmtrain_setup() {
    cd "$LLMTRAIN_ROOT" || llmtrain_die "cannot cd to repo root $LLMTRAIN_ROOT"
    RECIPE=${LLMTRAIN_RECIPE:-recipes/finetune.py}
    [[ -f $RECIPE ]] || llmtrain_die "$RECIPE not found under $LLMTRAIN_ROOT (submit from the repo root or set LLMTRAIN_ROOT)"
    [[ -f $CONFIG ]] || llmtrain_die "config $CONFIG not found under $LLMTRAIN_ROOT"

    if [[ -n ${LLMTRAIN_PYTHON_BIN:-} ]]; then
        export PATH="$LLMTRAIN_PYTHON_BIN:$PATH"
    elif [[ -x $LLMTRAIN_ROOT/.venv/bin/python ]]; then
        export PATH="$LLMTRAIN_ROOT/.venv/bin:$PATH"
    fi
    TORCHRUN=$(command -v torchrun) || llmtrain_die "torchrun not found (set LLMTRAIN_PYTHON_BIN or create .venv)"

    if [[ -z ${NPROC_PER_NODE:-} ]]; then
        # What Slurm allocated on this node if GPUs were requested (nvidia-smi lists every GPU of a
        # shared node, not just ours), else every GPU nvidia-smi sees, else 1 process on CPU.
        if [[ -n ${SLURM_GPUS_ON_NODE:-} && ${SLURM_GPUS_ON_NODE} -gt 0 ]]; then
            NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
        elif command -v nvidia-smi >/dev/null && (( $(nvidia-smi -L 2>/dev/null | wc -l) > 0 )); then
            NPROC_PER_NODE=$(nvidia-smi -L | wc -l)
        else
            NPROC_PER_NODE=1
        fi
    fi
    export NPROC_PER_NODE

    local cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))}
    # A rank that hits a NCCL error/timeout aborts instead of hanging the job until the time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-90}
    export PYTHONUNBUFFERED=1
    MAX_RESTARTS=${MAX_RESTARTS:-0}
}

# Preemption.
# Slurm sends SIGUSR1 to the batch shell alone (--signal=B:USR1@120, or by hand:
# `scancel --batch --signal=USR1 <jobid>`). Why B: and not the plain form: plain --signal=USR1
# goes to the job steps (torchrun) but not to this shell, which then cannot tell a preemption
# from a crash and would not requeue. So this shell traps USR1 and forwards it once to srun, which
# hands it to its tasks (the torchrun agent on every node); torchrun forwards signals named in
# --signals-to-handle (we add SIGUSR1; by default USR1 would kill torchrun outright) to its
# workers; the recipe saves a checkpoint and exits with PREEMPT_EXIT_CODE. torchrun itself then
# exits 1 (it does not pass worker exit codes through), so the decision to requeue rests on "this
# shell got USR1", not on the exit code. Then `scontrol requeue` puts the job back in the queue;
# it restarts this script from the top (SLURM_RESTART_COUNT=1,2,...), and the recipe resumes from
# its latest checkpoint by itself (checkpoint.resume=auto). Slurm holds a requeued job for
# cred_expire seconds (AuthInfo, default 120 s) before it may start again.
# Do not use `scancel --full --signal=USR1`: it signals this shell and srun/torchrun as well, so
# torchrun gets USR1 twice; the second one interrupts its graceful shutdown and it SIGTERMs the
# workers at once (seen: no checkpoint written). Plain `scancel --signal=USR1` reaches torchrun
# only: the ranks checkpoint and exit, but this shell never hears of it and does not requeue.
llmtrain_run_preemptible() {
    local rc=0 codes=
    # torchrun exits 1 whatever its workers exit with; each rank appends its own code to this file (only where
    # it exists: the ranks on this node), so the shell can exit with 2 (bad input) or 42 (preempted) itself.
    export LLMTRAIN_EXIT_FILE=${LLMTRAIN_EXIT_FILE:-$(mktemp "${TMPDIR:-/tmp}/llmtrain-exit.XXXXXX")}
    if (( ! _llmtrain_preempted )); then  # USR1 during setup: nothing trained yet, just requeue
        "$@" &
        _llmtrain_child=$!
        # USR1 between the launch and the line above was only recorded: forward it now.
        if (( _llmtrain_preempted && ! _llmtrain_forwarded )); then _llmtrain_forward; fi
        while :; do
            _llmtrain_interrupted=0
            rc=0
            wait "$_llmtrain_child" || rc=$?
            # A trapped signal makes `wait` return early (rc 138); wait again for the real status.
            (( _llmtrain_interrupted )) || break
        done
    fi
    trap '' USR1  # training is over either way; a late USR1 must not kill this shell
    codes=$(sort -u "$LLMTRAIN_EXIT_FILE" 2>/dev/null | tr '\n' ' ') || true
    rm -f "$LLMTRAIN_EXIT_FILE"
    if (( rc != 0 )) && [[ " $codes" == *" 2 "* ]]; then
        llmtrain_log "a rank refused its input (exit 2; the error line above says why): exiting 2"
        return 2
    fi
    if (( _llmtrain_preempted )); then
        if (( rc == 0 )) && [[ -n ${_llmtrain_child} ]]; then
            llmtrain_log "got SIGUSR1 but training finished (rc 0): not requeueing"
            return 0
        fi
        if [[ -n ${SLURM_JOB_ID:-} ]]; then
            llmtrain_log "preempted (launcher rc $rc): requeueing job $SLURM_JOB_ID"
            # Kills this script as well; the requeued job starts it again from the top.
            scontrol requeue "$SLURM_JOB_ID" || llmtrain_log "scontrol requeue failed: resubmit by hand"
        else
            llmtrain_log "preempted (launcher rc $rc); not a Slurm job, so nothing to requeue"
        fi
        exit "$PREEMPT_EXIT_CODE"
    fi
    if (( rc != 0 )) && [[ " $codes" == *" $PREEMPT_EXIT_CODE "* ]]; then
        # The ranks were signalled directly (not through this shell): they saved; say so with the code.
        llmtrain_log "the ranks saved a checkpoint and exited $PREEMPT_EXIT_CODE (signalled, not through this shell)"
        return "$PREEMPT_EXIT_CODE"
    fi
    return "$rc"
}

_llmtrain_preempted=0 _llmtrain_forwarded=0 _llmtrain_interrupted=0 _llmtrain_child=
# Every path returns 0 explicitly: under set -e a trap handler returning non-zero kills the shell,
# and a bare `return` in a trap handler returns the status of the interrupted command (`wait`: 138).
_llmtrain_on_usr1() {
    _llmtrain_interrupted=1
    if (( _llmtrain_preempted )); then return 0; fi  # forward once
    _llmtrain_preempted=1
    if [[ -n $_llmtrain_child ]]; then _llmtrain_forward; else llmtrain_log "SIGUSR1 before launch"; fi
    return 0
}
_llmtrain_forward() {
    _llmtrain_forwarded=1
    llmtrain_log "SIGUSR1: asking the training processes to checkpoint and exit"
    kill -USR1 "$_llmtrain_child" 2>/dev/null || true
}
# Trap from the moment this file is sourced: USR1's default action would kill the shell.
trap '_llmtrain_on_usr1' USR1

# torchrun flags both templates share. SIGUSR1 must be in --signals-to-handle (see above).
llmtrain_torchrun_common_args() {
    LLMTRAIN_TORCHRUN_ARGS=(
        --nproc_per_node "$NPROC_PER_NODE"
        --max-restarts "$MAX_RESTARTS"
        --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    )
}
