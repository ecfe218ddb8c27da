# Submitting a batch script to the test cluster (slurm_cluster.sh) and checking what
# the job did. Sourced after slurm_cluster.sh, once slurm_cluster_start has run.

SLURM_JOB_OUTPUT=""   # the output file of the last job submitted
SLURM_LAST_JOB_ID=""  # and its id

# slurm_submit <name> <sbatch arguments...>: submits with the output in the cluster
# directory (appended to, so that a requeued job's runs all stay in it) and sets
# SLURM_LAST_JOB_ID and SLURM_JOB_OUTPUT. The submitting environment is the job's
# (sbatch exports it), which is how the tests configure the templates.
# The arguments every test takes: the directory with the built binaries and the source
# directory. Sets $bin and $src; fails unless each named tool (default mtrain-train) is built.
slurm_test_args() {
  bin=$(cd "$1" && pwd) src=$(cd "$2" && pwd)
  shift 2
  local tool
  for tool in "${@:-mtrain-train}"; do
    [[ -x $bin/$tool ]] || slurm_fail "no $tool in $bin: build it first"
  done
}

slurm_submit() {
  local name=$1
  shift
  SLURM_JOB_OUTPUT=$SLURM_CLUSTER_DIR/jobs/$name.out
  local jid
  jid=$(sbatch --parsable --job-name="$name" --output="$SLURM_JOB_OUTPUT" --open-mode=append \
    --chdir="$SLURM_CLUSTER_DIR/jobs" "$@") || slurm_fail "sbatch $* was refused"
  SLURM_LAST_JOB_ID=${jid%%;*}  # "id;cluster" on federated setups
}

# slurm_finish_job <timeout s>: waits for the last submitted job, prints its output,
# and fails the test unless it COMPLETED with exit code 0:0.
slurm_finish_job() {
  local jid=$SLURM_LAST_JOB_ID state exit_code t0=$SECONDS
  state=$(slurm_wait_job "$jid" "$1") || true
  exit_code=$(slurm_job_exit_code "$jid")
  echo "---- job $jid: $state, exit code $exit_code, $((SECONDS - t0)) s; output:"
  cat "$SLURM_JOB_OUTPUT" 2>/dev/null || echo "(no output file $SLURM_JOB_OUTPUT)"
  echo "----"
  [[ $state == COMPLETED ]] || slurm_fail "job $jid ended $state (exit code $exit_code), expected COMPLETED"
  [[ $exit_code == 0:0 ]] || slurm_fail "job $jid exit code $exit_code, expected 0:0"
}

# slurm_run_batch <name> <timeout s> <sbatch arguments...>: both of the above.
slurm_run_batch() {
  local name=$1 timeout=$2
  shift 2
  slurm_submit "$name" "$@"
  slurm_finish_job "$timeout"
}

# expect_output <extended regex> <what it proves>: the last job's output must match.
expect_output() {
  grep -Eq -- "$1" "$SLURM_JOB_OUTPUT" ||
    slurm_fail "$2: no line of $SLURM_JOB_OUTPUT matches /$1/"
  echo "ok: $2"
}

# expect_count <n> <extended regex> <what it proves>: exactly n lines match.
expect_count() {
  local found
  found=$(grep -Ec -- "$2" "$SLURM_JOB_OUTPUT" || true)
  ((found == $1)) || slurm_fail "$3: expected $1 line(s) matching /$2/ in $SLURM_JOB_OUTPUT, found $found"
  echo "ok: $3"
}

# Checks shared by every training job: it trained on 2 ranks and finished. Rank 0 alone
# logs at info level, so rank 1's part shows through the collectives: the process group
# cannot form, nor the epoch line be computed (its loss and accuracy are all-reduced),
# without it.
expect_two_rank_training() {
  local backend=$1 steps=$2
  expect_output "\[info\] process group: $backend backend, 2 ranks" "a $backend process group of 2 ranks formed"
  expect_output "\[info\] epoch 1 step $steps/[0-9]+ \(total $steps\)" "rank 0 reached step $steps"
  expect_count 1 "\[info\] epoch 1, loss [0-9.]+, train acc [0-9.]+, .* on \[cpu:0, cpu:1\]" \
    "the epoch finished on both ranks (final line)"
  expect_count 0 "\[(error|critical)\]" "no rank logged an error"
}

# The store port a job's workers derive from its id when MASTER_PORT is unset
# (docs/slurm.md); the launch-per-node template derives the same one.
job_store_port() {
  echo $((10000 + $1 % 20000))
}
