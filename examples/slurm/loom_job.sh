#!/bin/bash
# Example Loom job for the Slurm backend: runs LOOM_STEPS steps, reports them, checkpoints.
#
# The agent submits it with sbatch on the nodes and GPUs Loom chose (CUDA_VISIBLE_DEVICES is set
# by Slurm) and the environment below, and follows it with the *progress file protocol*: the job
# appends one line per event to $LOOM_PROGRESS_FILE, which the agent reads while it runs:
#
#   step N               N steps of the job are done (counted from 0, over all attempts)
#   checkpoint N URI     a checkpoint of step N is at URI (the next attempt resumes from it)
#
# Lines are appended whole (one echo each); unknown lines are ignored. The agent asks for a
# checkpoint with SIGUSR1 to this script (scancel --batch --signal=USR1, also sent by Slurm before
# the time limit: sbatch --signal=B:USR1@60); the job answers with a `checkpoint` line.
#
# Environment: LOOM_JOB_ID, LOOM_ATTEMPT, LOOM_STEPS, LOOM_START_STEP (resume from here),
# LOOM_STEP_S (wall seconds per step), LOOM_CHECKPOINT_EVERY (steps; 0: only on request),
# LOOM_PROGRESS_FILE, LOOM_CHECKPOINT_DIR, and every job label as LOOM_LABEL_<NAME> (upper case,
# non-alphanumerics as _). Demo knob: a label exit_code=N makes the job exit N after its steps.
set -u
step=${LOOM_START_STEP:-0}
steps=${LOOM_STEPS:-10}
step_s=${LOOM_STEP_S:-1}
every=${LOOM_CHECKPOINT_EVERY:-0}
progress=${LOOM_PROGRESS_FILE:-progress}
ckdir=${LOOM_CHECKPOINT_DIR:-checkpoints}
mkdir -p "$ckdir"

checkpoint() {
    echo "$step" > "$ckdir/step-$step"
    echo "checkpoint $step file://$ckdir/step-$step" >> "$progress"
}

wanted=0
trap 'wanted=1' USR1
echo "job $LOOM_JOB_ID attempt ${LOOM_ATTEMPT:-1} on $(hostname) GPUs ${CUDA_VISIBLE_DEVICES:-none}"

while [ "$step" -lt "$steps" ]; do
    sleep "$step_s" &
    pid=$!
    # `wait` returns early when a signal arrives: checkpoint, then go on waiting for the step.
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid"
        if [ "$wanted" = 1 ]; then wanted=0; checkpoint; fi
    done
    step=$((step + 1))
    echo "step $step" >> "$progress"
    if [ "$every" -gt 0 ] && [ $((step % every)) = 0 ]; then checkpoint; fi
done
if [ "$wanted" = 1 ]; then checkpoint; fi
exit "${LOOM_LABEL_EXIT_CODE:-0}"
