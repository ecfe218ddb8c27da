#!/usr/bin/env bash
# Data-parallel training throughput: mtrain (mtrain-launch + mtrain-train) side by side
# with PyTorch DDP under torchrun (scripts/bench_torch_ddp.py), same models, data,
# per-rank batch, plain SGD (lr 0.1, no momentum, file order) and 1 thread per rank.
#
#   scripts/bench-ddp.sh [--runs N] [--models "lenet resnet18"] [--nprocs "1 2"]
#                        [--bin-dir DIR] [--data-dir DIR] [--no-torch] [--no-sync-bn]
#                        [--amp bf16] [--cpu-bind]
#
# Per model: lenet batch 256 per rank, 5 warm-up + 25 timed steps; resnet18 batch 64
# per rank, 2 warm-up + 4 timed steps. mtrain's figure is read from rank 0's metrics:
# its step events carry the window's per-rank "images" and "sec", so global images/s is
# WORLD_SIZE x images / sec over the windows after the warm-up ones. Peak RSS per rank is
# GNU time's %M (VmHWM at exit) around each worker. Prints the median over --runs runs
# of images/s, scaling efficiency (N ranks / (N x 1 rank)), the largest peak RSS of any
# rank, and mtrain / PyTorch; then, for resnet18 at the largest N, the step time with
# --sync-bn against without, from --runs interleaved pairs of runs, and the share of its
# step rank 0 spent blocked in SyncBatchNorm's collectives (the metrics' syncbn_wait_sec).
# --amp bf16 runs both sides in mixed precision: mtrain-train --amp bf16, PyTorch under
# torch.autocast("cpu", dtype=torch.bfloat16). --cpu-bind starts mtrain's workers with
# mtrain-launch --cpu_bind=cores (each rank on its own core); torchrun has no such option.
# Results and the command go in docs/benchmarks.md.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
need_value() { [[ $# -ge 2 ]] || { echo "bench-ddp.sh: $1 expects a value, found the end of the command line" >&2; exit 2; }; }

root=$(cd "$(dirname "$0")/.." && pwd)
bin_dir="$root/build/bin"
runs=3
models="lenet resnet18"
nprocs="1 2"
data_dir=""
torch=1
sync_bn=1
amp=off
launch_args=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) need_value "$@"; runs=$2; shift 2 ;;
    --models) need_value "$@"; models=$2; shift 2 ;;
    --nprocs) need_value "$@"; nprocs=$2; shift 2 ;;
    --bin-dir) need_value "$@"; bin_dir=$2; shift 2 ;;
    --data-dir) need_value "$@"; data_dir=$2; shift 2 ;;
    --no-torch) torch=0; shift ;;
    --no-sync-bn) sync_bn=0; shift ;;
    --amp) need_value "$@"; amp=$2; shift 2 ;;
    --cpu-bind) launch_args+=(--cpu_bind=cores); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench-ddp.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-ddp.sh: --runs expects a positive integer, got '$runs'" >&2; exit 2
fi
case "$amp" in off|bf16) ;; *) echo "bench-ddp.sh: --amp expects off or bf16, got '$amp'" >&2; exit 2 ;; esac
for n in $nprocs; do
  if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-ddp.sh: --nprocs expects positive integers, got '$n'" >&2; exit 2
  fi
done
for m in $models; do
  case "$m" in lenet|resnet18) ;; *)
    echo "bench-ddp.sh: --models expects lenet and/or resnet18, got '$m'" >&2; exit 2 ;;
  esac
done
for b in mtrain-launch mtrain-train; do
  if [[ ! -x $bin_dir/$b ]]; then
    echo "bench-ddp.sh: $bin_dir/$b not found or not executable; build first or pass --bin-dir" >&2
    exit 2
  fi
done
if [[ ! -x /usr/bin/time ]]; then
  echo "bench-ddp.sh: /usr/bin/time (GNU time, for peak RSS) is missing; apt-get install time" >&2
  exit 2
fi
if ((torch)) && ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "(PyTorch not importable by /usr/bin/python3: no reference rows; apt-get install python3-torch)"
  torch=0
fi

batch_of() { case "$1" in resnet18) echo 64 ;; *) echo 256 ;; esac; }
warmup_of() { case "$1" in resnet18) echo 2 ;; *) echo 5 ;; esac; }
timed_of() { case "$1" in resnet18) echo 4 ;; *) echo 25 ;; esac; }
# mtrain logs one step event per window; warm-up and timed step counts are multiples of it.
window_of() { case "$1" in resnet18) echo 1 ;; *) echo 5 ;; esac; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-ddp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Runs "$@" with GNU time writing the worker's peak RSS (KiB) to <prefix>.<RANK>; both
# launchers export RANK before exec'ing the worker.
# shellcheck disable=SC2016  # $0, $RANK and $@ belong to the inner shell
rss_wrap_cmd=(/bin/sh -c 'exec /usr/bin/time -f %M -o "$0.$RANK" "$@"')

# Global images/s from rank 0's metrics: skip the warm-up windows, then world x per-rank
# images / seconds over the rest, the share of that time rank 0 waited for gradients, and
# the share it spent blocked in SyncBatchNorm's collectives.
mtrain_rate() {
  awk -v skip="$2" -v world="$3" '
    function field(name,    m) {
      if (!match($0, "\"" name "\":[-0-9.eE+]+")) return 0
      m = substr($0, RSTART, RLENGTH); sub(/^[^:]*:/, "", m); return m + 0
    }
    # comm_wait_sec is the reducer'"'"'s running total since the start, so the timed windows'"'"'
    # share is the difference from its value at the end of the warm-up.
    # syncbn_wait_sec (only with --sync-bn) is a running total the same way.
    /"event":"step"/ {
      wait = field("comm_wait_sec"); bn_wait = field("syncbn_wait_sec")
      if (++n <= skip) { wait_before = wait; bn_wait_before = bn_wait; next }
      images += field("images"); seconds += field("sec")
    }
    END {
      if (seconds > 0) printf "%.1f %.4f %.4f\n", world * images / seconds, (wait - wait_before) / seconds,
                              (bn_wait - bn_wait_before) / seconds
      else print "nan nan nan"
    }' "$1"
}

max_rss_mib() { cat "$1".* | sort -g | tail -1 | awk '{printf "%.0f\n", $1 / 1024}'; }

median_of() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

# One mtrain run; prints "<global img/s> <comm wait fraction> <SyncBN wait fraction> <max rss MiB>".
run_mtrain() {
  local model=$1 n=$2 tag=$3; shift 3
  local w; w=$(window_of "$model")
  local steps=$(( $(warmup_of "$model") + $(timed_of "$model") ))
  local args=(--model "$model" --batch-size "$(batch_of "$model")" --threads 1 --no-eval
              --max-steps "$steps" --epochs 1000000 --log-every "$w" --momentum 0 --no-shuffle
              --metrics "$tmp/$tag.jsonl" --log-level warn --amp "$amp" "$@")
  [[ -n $data_dir ]] && args+=(--data-dir "$data_dir")
  if ! OMP_NUM_THREADS=1 "$bin_dir/mtrain-launch" --nproc_per_node="$n" "${launch_args[@]}" \
      "${rss_wrap_cmd[@]}" "$tmp/$tag.rss" "$bin_dir/mtrain-train" "${args[@]}" > "$tmp/$tag.log" 2>&1; then
    echo "bench-ddp.sh: mtrain $tag failed:" >&2; cat "$tmp/$tag.log" >&2; exit 1
  fi
  echo "$(mtrain_rate "$tmp/$tag.jsonl" $(( $(warmup_of "$model") / w )) "$n") $(max_rss_mib "$tmp/$tag.rss")"
}

# One torchrun run; prints "<global img/s> <max rss MiB>".
run_torch() {
  local model=$1 n=$2 tag=$3
  local args=(--model "$model" --batch-size "$(batch_of "$model")" --threads 1
              --warmup "$(warmup_of "$model")" --steps "$(timed_of "$model")" --amp "$amp")
  [[ -n $data_dir ]] && args+=(--data-dir "$data_dir")
  local port=$(( 20000 + RANDOM % 20000 ))
  if ! OMP_NUM_THREADS=1 /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 \
      --log_dir "$tmp/$tag.torchlogs" --nproc_per_node "$n" --master_port "$port" --no_python \
      "${rss_wrap_cmd[@]}" "$tmp/$tag.rss" /usr/bin/python3 "$root/scripts/bench_torch_ddp.py" "${args[@]}" \
      > "$tmp/$tag.log" 2>&1; then
    echo "bench-ddp.sh: torchrun $tag failed:" >&2; cat "$tmp/$tag.log" >&2; exit 1
  fi
  local rate; rate=$(sed -n 's/.*"img_per_s": \([0-9.]*\).*/\1/p' "$tmp/$tag.log")
  echo "${rate:-nan} $(max_rss_mib "$tmp/$tag.rss")"
}

cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //' || echo unknown)
echo "data-parallel throughput, 1 thread per rank, median of $runs run(s), --amp $amp${launch_args[*]:+, mtrain-launch ${launch_args[*]}}"
echo "machine: $(nproc) cores ($cpu); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A rate rss wait
for model in $models; do
  for n in $nprocs; do
    mr=(); mw=(); mm=(); tr=(); tm=()
    for ((r = 1; r <= runs; r++)); do
      read -r a b _ c < <(run_mtrain "$model" "$n" "mtrain.$model.$n.$r")
      mr+=("$a"); mw+=("$b"); mm+=("$c")
      if ((torch)); then
        read -r a b < <(run_torch "$model" "$n" "torch.$model.$n.$r")
        tr+=("$a"); tm+=("$b")
      fi
    done
    rate[mtrain.$model.$n]=$(median_of "${mr[@]}"); wait[$model.$n]=$(median_of "${mw[@]}")
    rss[mtrain.$model.$n]=$(printf '%s\n' "${mm[@]}" | sort -g | tail -1)
    if ((torch)); then
      rate[torch.$model.$n]=$(median_of "${tr[@]}")
      rss[torch.$model.$n]=$(printf '%s\n' "${tm[@]}" | sort -g | tail -1)
    fi
  done
done

first_n=${nprocs%% *}
printf '\n%-9s %6s %5s %-8s %10s %8s %12s %9s %10s\n' model batch/r ranks engine "img/s" scaling \
  "peak RSS/r" "vs torch" "comm wait"
for model in $models; do
  for n in $nprocs; do
    for engine in mtrain torch; do
      [[ $engine == torch ]] && ! ((torch)) && continue
      v=${rate[$engine.$model.$n]}
      scaling=$(awk -v v="$v" -v b="${rate[$engine.$model.$first_n]}" -v n="$n" -v n1="$first_n" \
        'BEGIN { printf "%.2f", (v / n) / (b / n1) }')
      ratio="-"; cw="-"
      if [[ $engine == mtrain ]]; then
        ((torch)) && ratio=$(awk -v a="$v" -v b="${rate[torch.$model.$n]}" 'BEGIN { printf "%.2fx", a / b }')
        cw=$(awk -v f="${wait[$model.$n]}" 'BEGIN { printf "%.1f%%", 100 * f }')
      fi
      printf '%-9s %6s %5s %-8s %10s %8s %8s MiB %9s %10s\n' "$model" "$(batch_of "$model")" "$n" \
        "$engine" "$v" "$scaling" "${rss[$engine.$model.$n]}" "$ratio" "$cw"
    done
  done
done
echo "(scaling: per-rank img/s over the $first_n-rank run's; comm wait: share of mtrain's step time"
echo " rank 0 spent waiting for gradient all-reduces; PyTorch runs plain DDP, no SyncBN on CPU)"

last_n=${nprocs##* }
if ((sync_bn)) && [[ " $models " == *" resnet18 "* ]] && ((last_n > 1)); then
  # Interleaved pairs, so that both runs of a pair see the same machine: the plain runs
  # of the table above were taken minutes earlier.
  sr=(); pr=(); ratios=(); waits=()
  for ((r = 1; r <= runs; r++)); do
    read -r a _ _ _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn-off.$r")
    read -r b _ w _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn.$r" --sync-bn)
    pr+=("$a"); sr+=("$b"); waits+=("$w")
    ratios+=("$(awk -v p="$a" -v s="$b" 'BEGIN { printf "%.4f", 100 * (p / s - 1) }')")
  done
  awk -v plain="$(median_of "${pr[@]}")" -v sync="$(median_of "${sr[@]}")" -v n="$last_n" \
      -v r="$(median_of "${ratios[@]}")" -v all="${ratios[*]}" -v w="$(median_of "${waits[@]}")" 'BEGIN {
    printf "\nresnet18, %d ranks, mtrain, %s interleaved pairs: %.1f img/s with --sync-bn vs %.1f without;\n",
      n, split(all, a, " "), sync, plain
    printf "step time with --sync-bn %+.1f%% (median of the pairs; each pair:", r
    for (i = 1; i <= length(a); i++) printf " %+.1f%%", a[i]
    printf ")\n"
    printf "rank 0 blocked in SyncBatchNorm'"'"'s collectives: %.1f%% of its step (median of the --sync-bn runs)\n",
      100 * w }'
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
