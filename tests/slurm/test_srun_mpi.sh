#!/usr/bin/env bash
# scripts/slurm/train.sbatch with --backend mpi and srun --mpi=pmix: srun itself starts
# the MPI ranks (no mpirun); Open MPI's MPI_Init finds the world through Slurm's PMIx
# server, and the workers need no store at all.
#   usage: test_srun_mpi.sh <dir with mtrain-train> <source dir>
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/slurm_cluster.sh"
source "$here/slurm_job.sh"
slurm_test_args "$1" "$2"

slurm_cluster_start
# Debian's Open MPI is built against PMIx only: --mpi=pmi2 or none fail in MPI_Init.
# (Read whole first: grep -q exiting early would fail a pipe under pipefail.)
mpi_plugins=$(srun --mpi=list 2>&1) || true
grep -qw pmix <<<"$mpi_plugins" ||
  slurm_skip "this Slurm has no PMIx plugin (srun --mpi=list: $(tr '\n' ' ' <<<"$mpi_plugins"))"

export MTRAIN_TRAIN=$bin/mtrain-train MTRAIN_MODEL=mlp MTRAIN_DATA_DIR=$src/data/fashion-mnist-mini \
  MTRAIN_BACKEND=mpi MTRAIN_SRUN_ARGS=--mpi=pmix MTRAIN_ARGS="--max-steps 8 --batch-size 32 --log-every 4 --no-eval"
slurm_run_batch srun-mpi 60 --ntasks-per-node=2 "$src/scripts/slurm/train.sbatch"

expect_output "\[info\] world: 2 ranks from PMIx variables, this is rank 0 \(local rank 0 of 2, node 0\)" \
  "rank 0 found its rank in PMIX_RANK and the world size in SLURM_NTASKS"
expect_count 0 "rendezvous store" "no store: MPI bootstrapped itself"
expect_two_rank_training mpi 8
echo "PASSED"
