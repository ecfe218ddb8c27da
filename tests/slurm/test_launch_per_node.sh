#!/usr/bin/env bash
# scripts/slurm/launch-per-node.sbatch on the one node: srun starts one mtrain-launch,
# which hosts the store on the first host of the allocation and starts 2 workers.
#   usage: test_launch_per_node.sh <dir with mtrain-launch and mtrain-train> <source dir>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/slurm_cluster.sh"
source "$here/slurm_job.sh"
slurm_test_args "$1" "$2" mtrain-launch mtrain-train

slurm_cluster_start
export MTRAIN_LAUNCH=$bin/mtrain-launch MTRAIN_NPROC_PER_NODE=2 MTRAIN_MODEL=mlp \
  MTRAIN_DATA_DIR=$src/data/fashion-mnist-mini MTRAIN_BACKEND=gloo \
  MTRAIN_ARGS="--max-steps 8 --batch-size 32 --log-every 4 --no-eval"
slurm_run_batch launch-per-node 60 "$src/scripts/slurm/launch-per-node.sbatch"

port=$(job_store_port "$SLURM_LAST_JOB_ID")
expect_output "launch-per-node.sbatch: job [0-9]+ \(restart 0\), 1 node\(s\) x 2 workers, store on $(hostname -s):$port:" \
  "the template put the store on the first host, at the port derived from SLURM_JOB_ID"
expect_output "\[info\] world: 2 ranks from launcher variables, this is rank 0 \(local rank 0 of 2, node 0\)" \
  "the workers took their ranks from mtrain-launch, not from SLURM_PROCID"
expect_two_rank_training gloo 8
echo "PASSED"
