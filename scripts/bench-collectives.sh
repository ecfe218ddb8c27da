#!/bin/bash
# All-reduce bus bandwidth on 2 ranks (loopback, 1 thread each), 4 KiB .. 64 MiB float32:
# mtrain-bench over Gloo (via mtrain-launch) and over Open MPI (via mpirun), next to
# the same collective called straight through each library (raw_allreduce_bench) and
# PyTorch's dist.all_reduce on Gloo. Every variant runs REPEATS times, interleaved (in
# an order that rotates from repeat to repeat) so that machine noise hits all of them
# alike; the table shows the median busbw (GB/s), each ratio of medians, and the median
# of each repeat's own mtrain/raw ratio ("paired").
#
# usage: scripts/bench-collectives.sh [build dir]     (default: build)
#   env: REPEATS (3), WARMUP (5), ITERS (20), MIN_BYTES (4096), MAX_BYTES (67108864),
#        BACKENDS ("gloo mpi"; e.g. "mpi" measures only mtrain and raw Open MPI),
#        STAT (mean; median reports each run's median iteration instead of its mean),
#        PYTHON (/usr/bin/python3, needs torch), REALTIME (0; 1 runs every variant under
#        `chrt -f 10`, needs root: on a machine shared with other jobs this keeps their
#        scheduling delays, up to a 4 ms tick per wake-up, out of the latencies)
# Needs a build with MPI and the tests (build/tests/raw_allreduce_bench).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
repeats=${REPEATS:-3}
warmup=${WARMUP:-5}
iters=${ITERS:-20}
min_bytes=${MIN_BYTES:-4096}
max_bytes=${MAX_BYTES:-67108864}
python=${PYTHON:-/usr/bin/python3}
backends=" ${BACKENDS:-gloo mpi} "
stat_flag=()
case ${STAT:-mean} in
  mean) ;;
  median) stat_flag=(--median) ;;
  *) echo "bench-collectives.sh: STAT must be mean or median, found '${STAT}'" >&2; exit 2 ;;
esac
bench=$build/bin/mtrain-bench
launch=$build/bin/mtrain-launch
raw=$build/tests/raw_allreduce_bench
for f in "$bench" "$launch" "$raw"; do
  [[ -x $f ]] || { echo "bench-collectives.sh: $f is missing; build the project (with tests) first" >&2; exit 2; }
done

export OMP_NUM_THREADS=1
rt=()
[[ ${REALTIME:-0} == 1 ]] && rt=(chrt -f 10)
mpirun=("${rt[@]}" mpirun --allow-run-as-root -np 2)
out=$(mktemp -d "${TMPDIR:-/tmp}/bench-collectives.XXXXXX")
trap 'rm -rf "$out"' EXIT

free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Runs two ranks of a RANK/WORLD_SIZE program; rank 0's stdout goes to $1.
two_ranks() {
  local log=$1; shift
  local pids=() rank
  for rank in 0 1; do
    if [[ $rank == 0 ]]; then
      RANK=$rank WORLD_SIZE=2 "${rt[@]}" "$@" >"$log" &
    else
      RANK=$rank WORLD_SIZE=2 "${rt[@]}" "$@" >/dev/null &
    fi
    pids+=($!)
  done
  local rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}

sizes=("$min_bytes" "$max_bytes" "$warmup" "$iters" "${stat_flag[@]}")
have_torch=0
if "$python" -c 'import torch' 2>/dev/null; then
  have_torch=1
else
  echo "bench-collectives.sh: $python cannot import torch; the torch columns show '-'" >&2
fi
for ((r = 0; r < repeats; r++)); do
  echo "repeat $((r + 1))/$repeats" >&2
  if [[ $backends == *" gloo "* ]]; then
    mtrain_gloo() {
      "${rt[@]}" "$launch" --nproc_per_node=2 bench --backend gloo --op allreduce \
        -b "$min_bytes" -e "$max_bytes" -w "$warmup" -n "$iters" "${stat_flag[@]}" >"$out/mtrain_gloo.$r" 2>/dev/null
    }
    raw_gloo() {
      local store
      store=$(mktemp -d "$out/gloo-store.XXXXXX")
      RAW_GLOO_STORE_DIR=$store two_ranks "$out/raw_gloo.$r" "$raw" gloo "${sizes[@]}"
    }
    torch_gloo() {
      [[ $have_torch == 1 ]] || return 0
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) \
        two_ranks "$out/torch_gloo.$r" "$python" "$root/scripts/bench-collectives-torch.py" "${sizes[@]}"
    }
    # Rotate the order from repeat to repeat, so that a drift of the machine favours none.
    case $((r % 3)) in
      0) mtrain_gloo; raw_gloo; torch_gloo ;;
      1) raw_gloo; torch_gloo; mtrain_gloo ;;
      2) torch_gloo; mtrain_gloo; raw_gloo ;;
    esac
  fi
  if [[ $backends == *" mpi "* ]]; then
    mtrain_mpi() {
      "${mpirun[@]}" "$bench" --backend mpi --op allreduce \
        -b "$min_bytes" -e "$max_bytes" -w "$warmup" -n "$iters" "${stat_flag[@]}" >"$out/mtrain_mpi.$r"
    }
    raw_mpi() { "${mpirun[@]}" "$raw" mpi "${sizes[@]}" >"$out/raw_mpi.$r"; }
    # Alternate which goes first, so that a drift of the machine favours neither.
    if ((r % 2 == 0)); then mtrain_mpi; raw_mpi; else raw_mpi; mtrain_mpi; fi
  fi
done

"$python" - "$out" "$repeats" "$have_torch" "$backends" <<'PY'
import statistics, sys
out, repeats, have_torch, backends = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4].split()
variants = ["mtrain_gloo", "raw_gloo", "torch_gloo", "mtrain_mpi", "raw_mpi"]
measured = [v for v in variants
            if v.split("_")[1] in backends and (have_torch or v != "torch_gloo")]
busbw = {}  # (variant, bytes) -> [GB/s per repeat]
for v in measured:
    for r in range(repeats):
        for line in open(f"{out}/{v}.{r}"):
            f = line.split()
            if line.startswith("#") or len(f) < 6:
                continue
            if f[5] != "OK":
                sys.exit(f"bench-collectives.sh: {v} repeat {r} failed its check at {f[0]} bytes")
            busbw.setdefault((v, int(f[0])), []).append(float(f[4]))
sizes = sorted({b for (_, b) in busbw})
med = lambda v, b: statistics.median(busbw[(v, b)]) if (v, b) in busbw else None
def human(b):
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            return f"{b // scale} {unit}iB"
    return f"{b} B"
# The machine's speed shifts between runs by up to 3x (the same raw loop has measured
# 100 and 340 us per 1 MiB all-reduce minutes apart), and a shift usually lasts across
# the two runs of a repeat. So the "paired" columns take each repeat's own ratio and
# report the median of those, next to the ratio of the two medians.
def paired(a, c, b):
    xs, ys = busbw.get((a, b)), busbw.get((c, b))
    if not xs or not ys or len(xs) != len(ys):
        return "-"
    return f"{100 * statistics.median(x / y for x, y in zip(xs, ys)):.0f} %"
print(f"all-reduce float32, 2 ranks, busbw GB/s, median of {repeats} runs")
print("| size | mtrain gloo | raw gloo | torch gloo | mtrain/raw gloo | paired | mtrain/torch gloo | mtrain mpi | raw mpi | mtrain/raw mpi | paired |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for b in sizes:
    mg, rg, tg, mm, rm = (med(v, b) for v in variants)
    pct = lambda a, c: f"{100 * a / c:.0f} %" if a is not None and c else "-"
    num = lambda x: f"{x:.3f}" if x is not None else "-"
    print(f"| {human(b)} | {num(mg)} | {num(rg)} | {num(tg)} | {pct(mg, rg)} | {paired('mtrain_gloo', 'raw_gloo', b)} "
          f"| {pct(mg, tg)} | {num(mm)} | {num(rm)} | {pct(mm, rm)} | {paired('mtrain_mpi', 'raw_mpi', b)} |")
PY
