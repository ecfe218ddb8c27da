#!/usr/bin/env bash
# --balance under SLURM: scripts/slurm/train.sbatch, submitted unchanged to a real one-node
# SLURM cluster with --global-batch-size and --balance auto; srun's 2 tasks time their steps,
# agree on every split through their per-step exchange and finish.
#   usage: test_balance_sbatch.sh <dir with mtrain-train> <source dir>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/slurm_cluster.sh"
source "$here/slurm_job.sh"
slurm_test_args "$1" "$2"

slurm_cluster_start
export MTRAIN_TRAIN=$bin/mtrain-train MTRAIN_MODEL=lenet MTRAIN_DATA_DIR=$src/data/fashion-mnist-mini \
  MTRAIN_BACKEND=gloo MTRAIN_ARGS="--max-steps 24 --global-batch-size 64 --balance auto --log-every 4 --no-eval"
slurm_run_batch balance-sbatch 60 --ntasks-per-node=2 "$src/scripts/slurm/train.sbatch"

expect_output "\[info\] world: 2 ranks from SLURM variables, this is rank 0" "rank 0 found a world of 2 in SLURM's variables"
expect_output "\[info\] --balance auto: shares 32,32, then in proportion" "the split started even"
expect_two_rank_training gloo 24
# Every step checked that the ranks' batches tiled the global batch (BatchResplitter); the summary
# counts the steps every rank measured.
expect_output "\[info\] balance: shares [0-9]+,[0-9]+ \([0-9]+ changes?\); over [0-9]+ measured steps" \
  "rank 0 summarised the split and its measurements"
echo "PASSED"
