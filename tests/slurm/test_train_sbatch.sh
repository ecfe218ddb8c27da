#!/usr/bin/env bash
# scripts/slurm/train.sbatch, submitted unchanged to a real one-node SLURM cluster: srun
# starts 2 mtrain-train tasks that find their ranks in SLURM's variables and rendezvous
# through the store rank 0 hosts, then train a few Gloo steps.
#   usage: test_train_sbatch.sh <dir with mtrain-train> <source dir>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/slurm_cluster.sh"
source "$here/slurm_job.sh"
slurm_test_args "$1" "$2"

slurm_cluster_start
final=$SLURM_CLUSTER_DIR/jobs/final.safetensors
export MTRAIN_TRAIN=$bin/mtrain-train MTRAIN_MODEL=mlp MTRAIN_DATA_DIR=$src/data/fashion-mnist-mini \
  MTRAIN_BACKEND=gloo MTRAIN_ARGS="--max-steps 8 --batch-size 32 --log-every 4 --no-eval --save-final $final"
slurm_run_batch train-sbatch 60 --ntasks-per-node=2 "$src/scripts/slurm/train.sbatch"

expect_output "train.sbatch: job [0-9]+ \(restart 0\), 2 ranks on 1 node" "the template ran srun with 2 tasks"
expect_output "\[info\] world: 2 ranks from SLURM variables, this is rank 0 \(local rank 0 of 2, node 0\)" \
  "rank 0 found a world of 2 in SLURM_PROCID/SLURM_NTASKS/SLURM_NTASKS_PER_NODE"
expect_output "\[info\] rendezvous store: hosted by rank 0 at [^ ]+:$(job_store_port "$SLURM_LAST_JOB_ID") \(MASTER_ADDR=$(hostname -s)\)" \
  "rank 0 hosted the store on the first host of the node list, at the port derived from SLURM_JOB_ID"
expect_two_rank_training gloo 8
expect_output "\[info\] saved final weights \(8 steps\) to $final" "rank 0 saved the final weights"
[[ -s $final ]] || slurm_fail "$final is missing or empty"
echo "PASSED"
