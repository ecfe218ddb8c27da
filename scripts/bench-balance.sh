#!/usr/bin/env bash
# --balance on ranks of different speed: two ranks of mtrain-train, one of them slowed in one of
# two ways (--slowdown):
#   neighbour  (default, 2 CPUs) each rank bound to its own CPU (mtrain-launch --cpu_bind cores),
#              the second CPU shared with a busy loop pinned to it, which halves whatever else
#              runs there, its communication included
#   threads    (3 CPUs) rank 0 on two CPUs with --threads 2, rank 1 on a third with --threads 1,
#              started without the launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), since
#              the launcher gives every worker the same flags
#   isa        (2 CPUs) each rank on its own CPU, rank 1 an older CPU generation: oneDNN limited
#              to --slow-isa (default SSE41: no AVX) by ONEDNN_MAX_CPU_ISA, so its convolutions
#              run slower while its communication does not; started without the launcher too
# Measures, with the same model, data and global batch:
#   solo 0   one process alone as rank 0 runs                 (batch = the global batch)
#   solo 1   one process alone as rank 1 runs (beside the busy loop)
#   pair     solo 0 and solo 1 at the same time, each on its own: what the two CPUs deliver
#            side by side with no communication (shared caches and memory bandwidth, or a
#            host's hyperthreads, slow both), the ceiling of any two-rank run here
#   even     the two ranks, torch.chunk's even split          (--balance even)
#   auto     the two ranks, split by measured speed           (--balance auto)
# The ideal is solo 0 + solo 1: every image/s each CPU can deliver on its own; the pair's sum
# is reported beside it. Per run the
# figure is global images/s in the median window of --log-every steps after the first
# --skip steps (so auto's first re-split has happened), read from rank 0's metrics (the
# global batch x steps over the window's seconds). Prints the median over --runs rounds of
# each figure and of even/ideal and auto/ideal within a round.
#
#   scripts/bench-balance.sh [--runs N] [--model simplecnn] [--global-batch-size 64]
#                            [--steps 60] [--skip 20] [--slowdown neighbour|threads|isa]
#                            [--slow-isa SSE41|AVX|...]
#                            [--bin-dir DIR] [--data-dir DIR] [--compare-bin-dir DIR]
# --compare-bin-dir DIR: each round also runs even and auto with DIR's binaries (another build,
# say the commit before a change), right after this build's, so that both meet the same drift.
#
# Results and the command go in docs/benchmarks.md.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
need_value() { [[ $# -ge 2 ]] || { echo "bench-balance.sh: $1 expects a value, found the end of the command line" >&2; exit 2; }; }

root=$(cd "$(dirname "$0")/.." && pwd)
bin_dir="$root/build/bin"
data_dir="$root/data/fashion-mnist-mini"
runs=3
model=simplecnn
global_batch=64
steps=60
skip=20
log_every=5
slowdown=neighbour
slow_isa=SSE41
compare_dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) need_value "$@"; runs=$2; shift 2 ;;
    --model) need_value "$@"; model=$2; shift 2 ;;
    --global-batch-size) need_value "$@"; global_batch=$2; shift 2 ;;
    --steps) need_value "$@"; steps=$2; shift 2 ;;
    --skip) need_value "$@"; skip=$2; shift 2 ;;
    --slowdown) need_value "$@"; slowdown=$2; shift 2 ;;
    --slow-isa) need_value "$@"; slow_isa=$2; shift 2 ;;
    --compare-bin-dir) need_value "$@"; compare_dir=$2; shift 2 ;;
    --bin-dir) need_value "$@"; bin_dir=$2; shift 2 ;;
    --data-dir) need_value "$@"; data_dir=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench-balance.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for dir in "$bin_dir" ${compare_dir:+"$compare_dir"}; do
  for tool in mtrain-train mtrain-launch; do
    [[ -x "$dir/$tool" ]] || { echo "bench-balance.sh: expected $dir/$tool (build first, or --bin-dir)" >&2; exit 2; }
  done
done

case "$slowdown" in
  neighbour) wanted=2 ;;
  threads) wanted=3 ;;
  isa) wanted=2 ;;
  *) echo "bench-balance.sh: --slowdown: expected neighbour, threads or isa, found '$slowdown'" >&2; exit 2 ;;
esac
# For neighbour, the two CPUs mtrain-launch --cpu_bind cores gives 2 workers: the first two of
# this process's affinity in (package, core, CPU) order, which for two CPUs on two cores is
# ascending.
mapfile -t cpus < <(python3 -c 'import os, sys; print("\n".join(map(str, sorted(os.sched_getaffinity(0))[:int(sys.argv[1])])))' "$wanted")
[[ ${#cpus[@]} -eq $wanted ]] || { echo "bench-balance.sh: --slowdown $slowdown expects $wanted usable CPUs, found ${#cpus[@]}" >&2; exit 2; }
rank1_env=()  # what makes rank 1 slower, besides its CPU
if [[ $slowdown == neighbour || $slowdown == isa ]]; then
  rank0_cpus=${cpus[0]} rank0_threads=1 rank1_cpus=${cpus[1]}
  [[ $slowdown == isa ]] && rank1_env=(ONEDNN_MAX_CPU_ISA=$slow_isa)
else
  rank0_cpus=${cpus[0]},${cpus[1]} rank0_threads=2 rank1_cpus=${cpus[2]}
fi

work=$(mktemp -d)
busy=""
other=""  # a process that runs beside another: rank 1 of a --slowdown threads pair, or the pair's solo 0
cleanup() {
  [[ -n "$busy" ]] && kill "$busy" 2>/dev/null && wait "$busy" 2>/dev/null
  [[ -n "$other" ]] && kill "$other" 2>/dev/null && wait "$other" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
start_busy() { [[ $slowdown == neighbour ]] || return 0; taskset -c "$rank1_cpus" bash -c 'while :; do :; done' & busy=$!; }
stop_busy() { [[ -n "$busy" ]] || return 0; kill "$busy"; wait "$busy" 2>/dev/null || true; busy=""; }

untimed_args=(--model "$model" --global-batch-size "$global_batch" --no-eval --data-dir "$data_dir"
              --log-every "$log_every" --log-level warn)
train_args=("${untimed_args[@]}" --max-steps "$steps")

# The two ranks with --balance $1, metrics to $2, the binaries in $3 (default: --bin-dir).
two_ranks() {
  local bin_dir=${3:-$bin_dir}
  if [[ $slowdown == neighbour ]]; then
    "$bin_dir/mtrain-launch" --nproc_per_node=2 --cpu_bind cores train "${train_args[@]}" --threads 1 --balance "$1" \
      --metrics "$2" 2>"$work/$1.err" || { cat "$work/$1.err" >&2; exit 1; }
    return
  fi
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local common=(WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
                MTRAIN_STORE_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))'))
  env "${common[@]}" "${rank1_env[@]}" RANK=1 LOCAL_RANK=1 taskset -c "$rank1_cpus" "$bin_dir/mtrain-train" "${train_args[@]}" \
    --threads 1 --balance "$1" 2>"$work/$1.1.err" &
  other=$!
  env "${common[@]}" RANK=0 LOCAL_RANK=0 taskset -c "$rank0_cpus" "$bin_dir/mtrain-train" "${train_args[@]}" \
    --threads "$rank0_threads" --balance "$1" --metrics "$2" 2>"$work/$1.0.err" || { cat "$work/$1.0.err" >&2; exit 1; }
  wait "$other" || { other=""; cat "$work/$1.1.err" >&2; exit 1; }
  other=""
}

# Global images/s in the median window after the skipped steps, from rank 0's metrics.
figure() {
  python3 - "$1" "$global_batch" "$skip" <<'EOF'
import json, statistics, sys
path, g, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rates = []
previous = None
for line in open(path):
    e = json.loads(line)
    if e.get("event") != "step":
        continue
    steps = e["step"] - (previous if previous is not None else 0)
    previous = e["step"]
    if e["step"] - steps >= skip:
        rates.append(g * steps / e["sec"])
print(f"{statistics.median(rates):.1f}")
EOF
}

echo "bench-balance: $model, global batch $global_batch, $steps steps (median window of $log_every after $skip), rank 0 on CPU(s) $rank0_cpus ($rank0_threads thread(s)), rank 1 on CPU $rank1_cpus$([[ $slowdown == neighbour ]] && echo " beside a busy loop")$([[ $slowdown == isa ]] && echo " with oneDNN up to $slow_isa"), $runs rounds"
results="$work/results"
for ((round = 1; round <= runs; ++round)); do
  taskset -c "$rank0_cpus" "$bin_dir/mtrain-train" "${train_args[@]}" --threads "$rank0_threads" --metrics "$work/solo0.jsonl"
  start_busy
  env "${rank1_env[@]}" taskset -c "$rank1_cpus" "$bin_dir/mtrain-train" "${train_args[@]}" --threads 1 --metrics "$work/solo1.jsonl"
  # The pair: solo 0 runs (a SIGTERM stops it at a step) for as long as solo 1 takes its steps.
  taskset -c "$rank0_cpus" "$bin_dir/mtrain-train" "${untimed_args[@]}" --max-steps 1000000 --threads "$rank0_threads" \
    --metrics "$work/pair0.jsonl" >/dev/null 2>&1 &
  other=$!
  env "${rank1_env[@]}" taskset -c "$rank1_cpus" "$bin_dir/mtrain-train" "${train_args[@]}" --threads 1 --metrics "$work/pair1.jsonl"
  kill -TERM "$other"; wait "$other" || true; other=""
  for balance in even auto; do
    two_ranks "$balance" "$work/$balance.jsonl"
    [[ -z "$compare_dir" ]] || two_ranks "$balance" "$work/$balance.b.jsonl" "$compare_dir"
  done
  stop_busy
  s0=$(figure "$work/solo0.jsonl"); s1=$(figure "$work/solo1.jsonl")
  p0=$(figure "$work/pair0.jsonl"); p1=$(figure "$work/pair1.jsonl")
  even=$(figure "$work/even.jsonl"); auto=$(figure "$work/auto.jsonl")
  shares=$(python3 -c 'import json,sys; print(",".join(map(str, [json.loads(l) for l in open(sys.argv[1]) if "\"step\"" in l][-1]["shares"])))' "$work/auto.jsonl")
  echo "round $round: solo 0 $s0, solo 1 $s1, pair $p0 + $p1, even $even, auto $auto img/s (auto's last shares $shares)"
  if [[ -n "$compare_dir" ]]; then
    even_b=$(figure "$work/even.b.jsonl"); auto_b=$(figure "$work/auto.b.jsonl")
    echo "round $round, --compare-bin-dir: even $even_b, auto $auto_b img/s"
  else
    even_b=0 auto_b=0
  fi
  echo "$s0 $s1 $even $auto $p0 $p1 $even_b $auto_b" >>"$results"
done
python3 - "$results" <<'EOF'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
med = lambda xs: statistics.median(xs)
s0, s1, even, auto, p0, p1 = (med([r[k] for r in rows]) for k in range(6))
print(f"median img/s: solo 0 {s0:.1f}, solo 1 {s1:.1f}, ideal {s0 + s1:.1f}, pair {p0:.1f} + {p1:.1f} = "
      f"{med([r[4] + r[5] for r in rows]):.1f}, even {even:.1f}, auto {auto:.1f}")
print(f"median of the rounds' ratios: even / ideal {med([r[2] / (r[0] + r[1]) for r in rows]):.3f}, "
      f"auto / ideal {med([r[3] / (r[0] + r[1]) for r in rows]):.3f}, "
      f"pair / ideal {med([(r[4] + r[5]) / (r[0] + r[1]) for r in rows]):.3f}, "
      f"auto / pair {med([r[3] / (r[4] + r[5]) for r in rows]):.3f}, "
      f"solo 1 / solo 0 {med([r[1] / r[0] for r in rows]):.3f}")
if rows[0][6] > 0:
    print(f"--compare-bin-dir: median img/s even {med([r[6] for r in rows]):.1f}, auto {med([r[7] for r in rows]):.1f}; "
          f"even / ideal {med([r[6] / (r[0] + r[1]) for r in rows]):.3f}, auto / ideal {med([r[7] / (r[0] + r[1]) for r in rows]):.3f}; "
          f"this build / that: even {med([r[2] / r[6] for r in rows]):.3f}, auto {med([r[3] / r[7] for r in rows]):.3f}")
EOF
