# A throw-away one-node SLURM cluster for tests: munged, slurmctld and slurmd, all as
# root, all under one fresh temporary directory, stopped by PID when the test exits.
# Sourced by the tests in this folder (bash, `set -euo pipefail`):
#
#   source slurm_cluster.sh
#   slurm_cluster_start                 # exits 77 (skipped) when no cluster can exist here
#   jid=$(sbatch --parsable ...)        # SLURM_CONF points at the cluster
#   slurm_wait_job "$jid" 60            # prints the final state; 0 iff COMPLETED
#
# Note [A private SLURM cluster per test]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Nothing in /etc is read or written: clients find the cluster through SLURM_CONF (which
# sbatch exports into the job, so srun inside a batch script finds it too) and munge
# through AuthInfo=socket=. Each test starts its own cluster (about half a second) on
# ports that were free a moment before, so tests may run side by side under `ctest -j`
# and beside a developer's other clusters. FirstJobId is chosen for the same reason:
# the store port a job uses without MASTER_PORT derives from its id (docs/slurm.md), and
# every fresh cluster would otherwise number its first job 1, so concurrent tests would
# all pick one port. It is random and maps to a port free at start-up; the tests check
# that the workers used exactly that port. No cgroup plugins (proctrack/linuxproc, task/none):
# they would write into the host's /sys/fs/cgroup. A requeued job waits cred_expire
# (default 120 s) before it may start again and then for the next scheduling pass
# (backfill every 30 s by default): 5 s and 1-2 s passes keep the requeue test short.
#
# Stopping: jobs still alive are cancelled and waited for first, because killing slurmd
# does not kill the slurmstepd processes that own running steps; then slurmd,
# slurmctld and munged get SIGTERM (SIGKILL after 10 s), each by the PID recorded when
# it was started in the foreground (-D / -F), never by name. The EXIT trap does this on
# success, failure and `set -e` exits alike. Set MTRAIN_SLURM_KEEP=1 to keep the
# directory (config, logs, job output) for a post-mortem.

SLURM_CLUSTER_DIR=""
SLURM_CLUSTER_DAEMONS=()  # "name:pid", in start order
SLURM_CLUSTER_FAILED=0    # set by slurm_fail: dump the daemon logs when stopping

slurm_skip() {
  echo "SKIPPED: $*"
  exit 77
}

slurm_fail() {
  echo "FAILED: $*" >&2
  SLURM_CLUSTER_FAILED=1
  exit 1
}

# slurm_pick_port <lo> <hi>: a TCP port in [lo, hi) nobody on this host uses right now.
# /proc/net/tcp{,6} lists every socket's local and remote endpoint as hex; a port seen
# anywhere there is avoided.
slurm_pick_port() {
  local lo=$1 hi=$2 port hex
  for _ in $(seq 200); do
    port=$((lo + (RANDOM * 32768 + RANDOM) % (hi - lo)))
    hex=$(printf ':%04X ' "$port")
    if ! grep -qF "$hex" /proc/net/tcp /proc/net/tcp6 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  slurm_fail "no free TCP port found in [$lo, $hi)"
}

slurm_require_tools() {
  local missing=()
  for tool in munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    slurm_skip "SLURM is not installed (missing: ${missing[*]}); scripts/setup.sh --tests installs slurm-wlm and munge"
  fi
  if [[ $(id -u) -ne 0 ]]; then
    slurm_skip "the test cluster runs slurmd, which starts jobs, and it must be root to do so (running as $(id -un))"
  fi
}

# Waits up to $2 seconds (in 0.1 s polls) for the command in $3... to succeed.
slurm_poll() {
  local tries=$(($1 * 10))
  shift
  for _ in $(seq "$tries"); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  return 1
}

slurm_node_idle() {
  [[ $(sinfo -h -N -o '%T' 2>/dev/null | head -n1) == idle ]]
}

slurm_write_config() {
  local dir=$1 host=$2 ctld_port=$3 slurmd_port=$4
  # A job's store port, unless MASTER_PORT says otherwise, is 10000 + id % 20000
  # (docs/slurm.md): number the first job so that its port is free now.
  local first_job_id=$((20000 * (1 + RANDOM % 20) + $(slurm_pick_port 10000 30000) - 10000))
  # The node's real layout (`slurmd -C`), so slurmd does not reject or reshape it; memory
  # a little below the truth, since a node reporting less than configured is drained.
  local node_line mem
  node_line=$(slurmd -C | sed -n 1p)
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
  [[ -n $mem ]] || slurm_fail "could not read RealMemory from 'slurmd -C': $node_line"
  node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem > 1024 ? mem - 512 : mem))/" <<<"$node_line")
  cat >"$dir/slurm.conf" <<EOF
ClusterName=mtraintest
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/sock/munge.socket.2,cred_expire=5
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
FirstJobId=$first_job_id
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.daemon.pid
SlurmdPidFile=$dir/run/slurmd.daemon.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

slurm_start_daemon() {
  local name=$1
  shift
  "$@" >"$SLURM_CLUSTER_DIR/log/$name.out" 2>&1 &
  SLURM_CLUSTER_DAEMONS+=("$name:$!")
}

slurm_cluster_start() {
  slurm_require_tools
  # Run from inside an allocation (a developer's salloc), the inherited SLURM_JOB_ID and
  # SBATCH_/SRUN_ defaults would make sbatch and srun talk about a job this cluster has
  # never seen; a rank or master variable would leak into the jobs' workers.
  local var
  for var in $(compgen -e); do
    case $var in
      SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | PMIX_* | OMPI_* | MTRAIN_STORE_* | MASTER_ADDR | MASTER_PORT | \
        RANK | WORLD_SIZE | LOCAL_RANK | LOCAL_WORLD_SIZE | GROUP_RANK) unset "$var" ;;
    esac
  done
  trap slurm_cluster_stop EXIT
  SLURM_CLUSTER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/mtrain-slurm.XXXXXX")
  local dir=$SLURM_CLUSTER_DIR host
  host=$(hostname -s)
  mkdir -p "$dir"/{munge,sock,state,spool,log,run,jobs}
  # munged refuses a key others can read, and warns unless its socket directory is
  # world-searchable: the key and the socket live in different directories.
  chmod 755 "$dir" "$dir/sock" "$dir/jobs"
  chmod 700 "$dir/munge"
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$dir/munge/munge.key"
  # Daemon ports above the job ports and below the ephemeral range (32768+) that
  # connect() draws from.
  slurm_write_config "$dir" "$host" "$(slurm_pick_port 30000 32768)" "$(slurm_pick_port 30000 32768)"
  export SLURM_CONF=$dir/slurm.conf

  slurm_start_daemon munged munged -F -f --socket="$dir/sock/munge.socket.2" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/log/munged.log" --pid-file="$dir/run/munged.daemon.pid" --seed-file="$dir/munge/munged.seed"
  slurm_poll 10 test -S "$dir/sock/munge.socket.2" || slurm_fail "munged did not create its socket within 10 s"
  slurm_start_daemon slurmctld slurmctld -D -i -f "$SLURM_CONF"
  slurm_poll 20 scontrol ping || slurm_fail "slurmctld did not answer 'scontrol ping' within 20 s"
  slurm_start_daemon slurmd slurmd -D -f "$SLURM_CONF"
  slurm_poll 30 slurm_node_idle ||
    slurm_fail "node $host did not become idle within 30 s: $(sinfo -h -N -o '%T %E' 2>&1 | head -n1)"
  echo "slurm cluster up in $dir (node $host, $(sinfo -h -N -o '%c CPUs'))"
}

slurm_dump_logs() {
  local f
  # The daemons' own log files; their stdout/stderr (*.out) only where those are empty,
  # e.g. when a daemon died before it opened its log.
  for f in "$SLURM_CLUSTER_DIR"/log/*.log "$SLURM_CLUSTER_DIR"/log/*.out; do
    [[ -s $f ]] || continue
    [[ $f == *.out && -s ${f%.out}.log ]] && continue
    echo "---- last lines of $f"
    tail -n 25 "$f"
  done
}

slurm_cluster_stop() {
  local rc=$?
  trap - EXIT
  [[ -n $SLURM_CLUSTER_DIR ]] || exit "$rc"
  ((rc == 0 || rc == 77)) || SLURM_CLUSTER_FAILED=1
  if ((SLURM_CLUSTER_FAILED)); then slurm_dump_logs >&2; fi
  local jobs
  jobs=$(squeue -h -o '%i' 2>/dev/null || true)
  if [[ -n $jobs ]]; then
    # shellcheck disable=SC2086  # one argument per job id
    scancel $jobs 2>/dev/null || true
    slurm_poll 20 test -z "$(squeue -h -o '%i' 2>/dev/null)" || echo "warning: jobs still listed: $jobs" >&2
  fi
  local i entry name pid
  for ((i = ${#SLURM_CLUSTER_DAEMONS[@]} - 1; i >= 0; i--)); do
    entry=${SLURM_CLUSTER_DAEMONS[i]}
    name=${entry%%:*}
    pid=${entry#*:}
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    slurm_poll 10 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ ${MTRAIN_SLURM_KEEP:-0} == 1 ]]; then
    echo "kept $SLURM_CLUSTER_DIR (MTRAIN_SLURM_KEEP=1)"
  else
    rm -rf "$SLURM_CLUSTER_DIR"
  fi
  exit "$rc"
}

# slurm_wait_job <job id> <timeout s>: prints the job's final state; returns 0 iff it
# COMPLETED. Polls scontrol (sbatch --wait adds seconds of latency).
slurm_wait_job() {
  local jid=$1 timeout=$2 state=""
  local end=$((SECONDS + timeout))
  while ((SECONDS < end)); do
    state=$(scontrol show job "$jid" -o 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
    case $state in
      COMPLETED) echo "$state"; return 0 ;;
      FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED | BOOT_FAIL | DEADLINE)
        echo "$state"; return 1 ;;
    esac
    sleep 0.2
  done
  echo "still ${state:-unknown} after ${timeout} s"
  return 1
}

# slurm_job_exit_code <job id>: "rc:signal" as SLURM records it (ExitCode=0:0).
slurm_job_exit_code() {
  scontrol show job "$1" -o 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2
}
