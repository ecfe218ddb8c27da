#!/usr/bin/env bash
# Preemption through train.sbatch: SIGUSR1 to the job's tasks (what --signal=USR1@T
# sends before the time limit) makes both workers stop after the same step, checkpoint
# and exit 75; the template requeues the job, and the second run resumes from the
# checkpoint and finishes the remaining steps.
#   usage: test_requeue_after_signal.sh <dir with mtrain-train> <source dir>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/slurm_cluster.sh"
source "$here/slurm_job.sh"
slurm_test_args "$1" "$2"
# The help is read whole before it is searched: `--help | grep -q` under pipefail fails
# whenever grep exits before the writer's last write (SIGPIPE), i.e. by timing.
help=$("$bin/mtrain-train" --help)
grep -q -- --checkpoint-dir <<<"$help" ||
  slurm_fail "$bin/mtrain-train has no --checkpoint-dir option"

slurm_cluster_start
checkpoints=$SLURM_CLUSTER_DIR/jobs/checkpoints
mkdir -p "$checkpoints"
steps=600  # about 4 s on 2 ranks: the signal below comes after step 20
export MTRAIN_TRAIN=$bin/mtrain-train MTRAIN_MODEL=mlp MTRAIN_DATA_DIR=$src/data/fashion-mnist-mini \
  MTRAIN_BACKEND=gloo MTRAIN_CHECKPOINT_DIR=$checkpoints \
  MTRAIN_ARGS="--epochs 20 --max-steps $steps --batch-size 32 --log-every 10 --no-eval --save-final $checkpoints/final.safetensors"
slurm_submit requeue --ntasks-per-node=2 "$src/scripts/slurm/train.sbatch"
jid=$SLURM_LAST_JOB_ID

slurm_poll 40 grep -q "step 20/" "$SLURM_JOB_OUTPUT" || slurm_fail "job $jid never logged step 20"
# Like Slurm's own --signal without B:, this reaches every task of the job's steps and
# not the batch shell, which must stay alive to requeue.
scancel --signal=USR1 "$jid"
slurm_finish_job 60

expect_output "rank [01] received SIGUSR1: stopped after step [0-9]+ \(epoch [0-9]+\), checkpoint written to $checkpoints/checkpoint.safetensors" \
  "the workers stopped on SIGUSR1 and checkpointed"
stopped=$(grep -Eo "\[info\] checkpoint \(stop signal\): step [0-9]+" "$SLURM_JOB_OUTPUT" | grep -Eo '[0-9]+$') ||
  slurm_fail "no 'checkpoint (stop signal)' line from rank 0"
((stopped < steps)) || slurm_fail "the run stopped after step $stopped, not before step $steps: the signal came too late"
# Rank 0 speaks for the gang; the others exit with it. Both exiting 75 means both passed
# the barrier that follows the agreed stop, which ranks stopped at different steps
# could not (their collectives would no longer pair up).
expect_count 1 "stopped after step $stopped \(" "rank 0 reports the step all ranks agreed on ($stopped)"
expect_output "srun: error: [^:]+: tasks 0-1: Exited with exit code 75" "both ranks exited 75 (stopped, resumable)"
expect_output "train.sbatch: the workers stopped early and checkpointed; requeueing job $jid \(restart 1 of at most 3\)" \
  "the template requeued the job on exit status 75"
expect_output "train.sbatch: job $jid \(restart 1\), 2 ranks" "the requeued job ran again"
expect_output "\[info\] resuming from $checkpoints/checkpoint.safetensors: epoch [0-9]+.*, $stopped steps in total" \
  "the second run resumed from the checkpoint of step $stopped"
expect_output "\[info\] saved final weights \($steps steps\)" "the second run finished all $steps steps"
restarts=$(scontrol show job "$jid" -o | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
[[ $restarts == 1 ]] || slurm_fail "Slurm counts $restarts restarts of job $jid, expected 1"
echo "PASSED"
