# Sourced by the job scripts: run_ranks OUT CMD... starts the ranks (under srun inside a SLURM job) so that a
# time limit or a pre-emption loses nothing, and so that a configuration error is exit code 2.
#
#   #SBATCH --signal=B:USR1@120   SLURM warns this script 120 s before the time limit (or a pre-emption);
#                                 the ranks get SIGTERM, finish their step, write a mid-epoch checkpoint
#                                 and OUT/preempted.json; the job then requeues itself and --resume continues
#   #SBATCH --requeue             lets it be requeued
#   SIGTERM (scancel, pre-emption, the time limit) also ends the ranks with a checkpoint; only the warning
#   requeues (a cancelled job stays cancelled; PreemptMode=REQUEUE partitions requeue by themselves).
#
# CMD is usually `python -m labkit.dist.torchrun ...` (torchrun that ends a configuration error with labkit's one
# line and exit 2, not torchrun's error block) or `python -m labkit ...` for one process. Inside a job it runs
# as one srun step with one task per node on $run_nodes nodes (default 1; the multi-node script sets it).
#
# Sets resume=(--resume) on a requeued run (SLURM_RESTART_COUNT > 0) or with RESUME=1, for the scripts to
# pass to labkit; a resumed OUT that already holds a finished run (summary.json) is not run again.
# Returns the ranks' exit code (2 when labkit reported a configuration error, 75 when they stopped with a
# checkpoint and the job was not requeued); exits the script after a requeue.
resume=()
if (( ${SLURM_RESTART_COUNT:-0} > 0 )) || [[ "${RESUME:-0}" != 0 ]]; then
    resume=(--resume)
fi

# SIGTERM to the ranks. In a job, to its steps: srun itself answers SIGTERM by killing its step at once.
stop_ranks() {
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
    else
        kill -TERM "$pid" 2>/dev/null || true
    fi
}

run_ranks() {
    local out="$1"
    shift
    if (( ${#resume[@]} )) && [[ -f "$out/summary.json" && ! -f "$out/preempted.json" ]]; then
        echo "$out already finished; not run again"
        return 0
    fi
    rm -f "$out/preempted.json"  # from the stop this run continues; a new stop writes a new one
    local launcher=()
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        launcher=(srun --nodes="${run_nodes:-1}" --ntasks-per-node=1 --kill-on-bad-exit=1
                  ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"})
    fi
    LABKIT_ERROR_FILE="$(mktemp)"
    export LABKIT_ERROR_FILE
    local rc=0
    warned=0
    "${launcher[@]}" "$@" &
    pid=$!
    # bash runs a trap only between commands, hence the background launch and wait
    trap 'warned=1; stop_ranks' USR1
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        trap ':' TERM  # SLURM signals the ranks itself; keep waiting for them to write their checkpoint
    else
        trap 'stop_ranks' TERM
    fi
    while true; do
        rc=0
        wait "$pid" || rc=$?
        kill -0 "$pid" 2>/dev/null || break  # wait also returns when a trapped signal arrives
    done
    trap - USR1 TERM
    if [[ -s "$LABKIT_ERROR_FILE" ]]; then
        rc=2
    fi
    rm -f "$LABKIT_ERROR_FILE"
    if [[ -f "$out/preempted.json" ]]; then
        echo "stopped early, checkpoint in $out: $(cat "$out/preempted.json")"
        if (( warned )) && [[ -n "${SLURM_JOB_ID:-}" ]] && scontrol requeue "$SLURM_JOB_ID"; then
            echo "requeued job $SLURM_JOB_ID: it continues from the checkpoint when it runs again"
            exit 0  # the whole script: its later runs happen after the requeue
        fi
        echo "continue it with the same command and --resume (sbatch: the same script, RESUME=1)"
        return 75
    fi
    return "$rc"
}
