#!/usr/bin/env bash
# Launch overhead of mtrain-launch (and torchrun, when PyTorch is importable):
#   noop     wall time of `mtrain-launch --nproc_per_node=N true`
#   barrier  wall time of the whole command when every worker joins a store barrier
#            (tests/launcher/launch_test_worker `barrier`), and the time from the
#            start of the command until the last worker has passed the barrier
# Medians over RUNS runs (default 20) for N in NPROCS (default "2 8").
#
#   scripts/bench-launch.sh [BUILD_DIR]          (default: build)
#   RUNS=50 NPROCS="2 4 8" scripts/bench-launch.sh build-release
#
# Needs the targets mtrain-launch and launch_test_worker. This is a benchmark, not a
# test: it asserts nothing about speed. Results go in docs/benchmarks.md with this
# command line.
set -euo pipefail

build_dir=${1:-build}
runs=${RUNS:-20}
nprocs=${NPROCS:-"2 8"}
launcher="$build_dir/bin/mtrain-launch"
worker="$build_dir/tests/launch_test_worker"
for f in "$launcher" "$worker"; do
  if [[ ! -x $f ]]; then
    echo "bench-launch: $f not found; build it first:" >&2
    echo "  cmake --build $build_dir --target mtrain-launch launch_test_worker" >&2
    exit 2
  fi
done

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

now_ns() { date +%s%N; }

# median of the numbers on stdin (milliseconds, 1 decimal)
median_ms() {
  sort -n | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "n/a"; exit }
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.1f", m / 1e6 }'
}

# time_runs OUT_FILE CMD...: appends one wall time (ns) per run; fails on a failed run
time_runs() {
  local out=$1
  shift
  for ((i = 0; i < runs; i++)); do
    local t0 t1
    t0=$(now_ns)
    "$@" >/dev/null 2>"$scratch/stderr" || {
      echo "bench-launch: run failed: $*" >&2
      cat "$scratch/stderr" >&2
      exit 1
    }
    t1=$(now_ns)
    echo $((t1 - t0)) >>"$out"
  done
}

# barrier_runs WALL_FILE PASS_FILE N CMD...: the command's workers write stamp files
# into $scratch/stamps after the barrier; PASS is (latest stamp - start).
barrier_runs() {
  local wall=$1 pass=$2 n=$3
  shift 3
  for ((i = 0; i < runs; i++)); do
    rm -rf "$scratch/stamps"
    mkdir -p "$scratch/stamps"
    local t0 t1
    t0=$(now_ns)
    "$@" >/dev/null 2>"$scratch/stderr" || {
      echo "bench-launch: run failed: $*" >&2
      cat "$scratch/stderr" >&2
      exit 1
    }
    t1=$(now_ns)
    echo $((t1 - t0)) >>"$wall"
    local count latest
    count=$(find "$scratch/stamps" -type f | wc -l)
    if [[ $count -ne $n ]]; then
      echo "bench-launch: expected $n barrier stamps, found $count" >&2
      exit 1
    fi
    latest=$(cat "$scratch"/stamps/* | sort -n | tail -1)
    echo $((latest - t0)) >>"$pass"
  done
}

have_torch=0
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  have_torch=1
  torch_version=$(/usr/bin/python3 -c 'import torch; print(torch.__version__)')
fi

echo "# mtrain-launch launch overhead: median of $runs runs, $(nproc) CPUs, $(date -u +%F)"
echo "# command: RUNS=$runs NPROCS=\"$nprocs\" scripts/bench-launch.sh $build_dir"
if [[ $have_torch -eq 1 ]]; then
  echo "# torchrun: /usr/bin/python3 -m torch.distributed.run (torch $torch_version)"
else
  echo "# torchrun: not measured: /usr/bin/python3 cannot import torch (python3-torch is not installed)"
fi
printf '%-10s %4s %14s %14s %16s\n' launcher N noop_ms barrier_ms barrier_pass_ms

# torchrun on Debian 12's Python 3.11 crashes at start unless --redirects and --tee are
# non-zero; its workers here are Python, joining a gloo barrier through torchrun's store.
torch_barrier_worker='
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
open(os.path.join(os.environ["STAMP_DIR"], "stamp_rank" + os.environ["RANK"]), "w").write(str(time.time_ns()) + "\n")
dist.destroy_process_group()
'

for n in $nprocs; do
  noop="$scratch/noop_$n" wall="$scratch/wall_$n" pass="$scratch/pass_$n"
  : >"$noop"; : >"$wall"; : >"$pass"
  time_runs "$noop" "$launcher" --nproc_per_node="$n" true
  barrier_runs "$wall" "$pass" "$n" \
    "$launcher" --nproc_per_node="$n" "$worker" barrier "stamp=$scratch/stamps"
  printf '%-10s %4s %14s %14s %16s\n' mtrain "$n" "$(median_ms <"$noop")" \
    "$(median_ms <"$wall")" "$(median_ms <"$pass")"

  if [[ $have_torch -eq 1 ]]; then
    tnoop="$scratch/tnoop_$n" twall="$scratch/twall_$n" tpass="$scratch/tpass_$n"
    : >"$tnoop"; : >"$twall"; : >"$tpass"
    torchrun=(/usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1
              --log_dir "$scratch/torchrun_logs" --nproc_per_node="$n"
              --master_port="$(shuf -i 20000-60000 -n 1)")
    time_runs "$tnoop" "${torchrun[@]}" --no_python true
    STAMP_DIR="$scratch/stamps" barrier_runs "$twall" "$tpass" "$n" \
      env STAMP_DIR="$scratch/stamps" "${torchrun[@]}" --no_python /usr/bin/python3 -c \
      "$torch_barrier_worker"
    printf '%-10s %4s %14s %14s %16s\n' torchrun "$n" "$(median_ms <"$tnoop")" \
      "$(median_ms <"$twall")" "$(median_ms <"$tpass")"
  fi
done
