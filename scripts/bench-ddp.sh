#!/usr/bin/env bash
# Data-parallel training throughput: mtrain (mtrain-launch + mtrain-train) side by side
# with PyTorch DDP under torchrun (scripts/bench_torch_ddp.py), same models, data,
# per-rank batch, plain SGD (lr 0.1, no momentum, file order) and 1 thread per rank.
#
#   scripts/bench-ddp.sh [--runs N] [--models "lenet resnet18"] [--nprocs "1 2"]
#                        [--bin-dir DIR] [--data-dir DIR] [--no-torch] [--no-sync-bn]
#                        [--amp bf16] [--cpu-bind]
#
# Per model: lenet batch 256 per rank, 5 warm-up + 25 timed steps in windows of 5;
# resnet18 batch 64 per rank, 2 warm-up + 8 timed steps in windows of 1. mtrain's figure
# is read from rank 0's metrics: its step events carry the window's per-rank "images" and
# "sec"; PyTorch's from rank 0's step times, summed into windows of the same size. Two
# global images/s figures per run: "median", WORLD_SIZE x images / sec of the median
# window, and "all", WORLD_SIZE x images / sec over all the timed windows. The median is
# the robust one on a shared VM, where a neighbour's burst can slow a few steps of one
# run by tens of percent; "all" is kept to show when that happened. Peak RSS per rank is
# GNU time's %M (VmHWM at exit) around each worker. --runs rounds, each running every
# rank count back to back. Prints the median over the rounds of both figures, the
# scaling efficiency of each (N ranks / (N x 1 rank) within a round, median over the
# rounds), the largest peak RSS of any rank, mtrain / PyTorch (median figures), and
# for mtrain's N-rank runs the ranks' mean wait after backward split into
# communication no rank hid and waiting for the slowest rank (rank_waits in the
# metrics), as shares of the step;
# then, for resnet18 at the largest N, the step time with --sync-bn against without,
# from --runs pairs of back-to-back runs, alternately plain and --sync-bn first (median
# windows), and the share of its step rank 0 spent blocked in SyncBatchNorm's
# collectives (the metrics' syncbn_wait_sec).
# Beside every run of N > 1 ranks, mtrain's and PyTorch's, the script also runs N
# independent 1-rank trainings of the same engine at once ("side by side", with three
# times the timed steps so that their median window falls where all N train): no
# communication, the same machine load. Their summed images/s over N x the round's
# 1-rank figure is how much the machine itself lets N processes of that engine scale
# (on a shared VM often well below 1, even for pure arithmetic; faster kernels lean
# harder on what the cores share), and the N-rank figure over the side-by-side sum of
# the same round is what data parallelism itself costs (medians of those per-round
# ratios). Per round,
# scaling is the product of the two; medians over the rounds need not multiply to the
# median scaling. Not with --cpu-bind (the 1-rank runs would be unbound) or without a
# 1-rank column.
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
timed_of() { case "$1" in resnet18) echo 8 ;; *) echo 25 ;; esac; }
# mtrain logs one step event per window; warm-up and timed step counts are multiples of it.
window_of() { case "$1" in resnet18) echo 1 ;; *) echo 5 ;; esac; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-ddp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Runs "$@" with GNU time writing the worker's peak RSS (KiB) to <prefix>.<RANK>; both
# launchers export RANK before exec'ing the worker.
# shellcheck disable=SC2016  # $0, $RANK and $@ belong to the inner shell
rss_wrap_cmd=(/bin/sh -c 'exec /usr/bin/time -f %M -o "$0.$RANK" "$@"')

# The median of an awk array v[1..n] (sorted in place; n is small).
awk_median='
    function median(v, n,    i, j, x) {
      for (i = 2; i <= n; i++) { x = v[i]; for (j = i - 1; j >= 1 && v[j] > x; j--) v[j + 1] = v[j]; v[j + 1] = x }
      return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    }'

# From rank 0's metrics, skipping the warm-up windows: global images/s over all the
# timed windows (world x per-rank images / seconds), the share of that time rank 0
# waited for gradients, the share it spent blocked in SyncBatchNorm's collectives, the
# global images/s of the median window, and what the ranks' mean wait after backward
# was made of, as shares of the mean step time: communication no rank hid, and waiting
# for the slowest rank (the metrics' rank_waits, Note [Every rank's wait] in
# trainer/ddp/reducer.cpp; 0 0 in a world of one).
mtrain_rate() {
  awk -v skip="$2" -v world="$3" -v w="$4" "$awk_median"'
    function field(name,    m) {
      if (!match($0, "\"" name "\":[-0-9.eE+]+")) return 0
      m = substr($0, RSTART, RLENGTH); sub(/^[^:]*:/, "", m); return m + 0
    }
    # rank_waits.wait_sec summed over the ranks, over their count.
    function mean_rank_wait(    m, k, v, i, s) {
      if (!match($0, /"wait_sec":\[[^]]*\]/)) return 0
      m = substr($0, RSTART + 12, RLENGTH - 13); k = split(m, v, ",")
      for (i = 1; i <= k; i++) s += v[i]
      return k ? s / k : 0
    }
    # comm_wait_sec is the reducer'"'"'s running total since the start, so the timed windows'"'"'
    # share is the difference from its value at the end of the warm-up.
    # syncbn_wait_sec (only with --sync-bn) is a running total the same way.
    # rank_waits runs one step behind and covers its own count of steps ("steps"): its
    # timed share spans the last warm-up step to the last timed step but one.
    /"event":"step"/ {
      wait = field("comm_wait_sec"); bn_wait = field("syncbn_wait_sec")
      rw = mean_rank_wait(); exposed = field("exposed_sec"); rw_steps = field("steps")
      if (++n <= skip) {
        wait_before = wait; bn_wait_before = bn_wait
        rw_before = rw; exposed_before = exposed; rw_steps_before = rw_steps; next
      }
      images += field("images"); seconds += field("sec")
      if (field("sec") > 0) window_rate[++windows] = world * field("images") / field("sec")
    }
    END {
      if (seconds <= 0) { print "nan nan nan nan nan nan"; exit }
      split("0 0", share)
      if (rw_steps > rw_steps_before) {
        step_sec = seconds / (windows * w); covered = rw_steps - rw_steps_before
        share[1] = (exposed - exposed_before) / covered / step_sec
        share[2] = ((rw - rw_before) - (exposed - exposed_before)) / covered / step_sec
      }
      printf "%.1f %.4f %.4f %.1f %.4f %.4f\n", world * images / seconds, (wait - wait_before) / seconds,
             (bn_wait - bn_wait_before) / seconds, median(window_rate, windows), share[1], share[2]
    }' "$1"
}

# Global images/s of the median window from step times (one per line): windows of $3
# consecutive steps, each worth world x batch x $3 images.
steps_median_rate() {
  awk -v world="$1" -v batch="$2" -v w="$3" "$awk_median"'
    { sum += $1 } NR % w == 0 { window_rate[++windows] = world * batch * w / sum; sum = 0 }
    END { if (windows) printf "%.1f\n", median(window_rate, windows); else print "nan" }'
}

max_rss_mib() { cat "$1".* | sort -g | tail -1 | awk '{printf "%.0f\n", $1 / 1024}'; }

# Ends the whole script from any subshell (a failed run inside $(...) or <(...) would
# otherwise only end that subshell and leave an empty figure behind), and the runs
# going in the background (side by side) with it: each is listed in
# $tmp/background.pids, and its launcher is sent SIGTERM, which stops its workers.
die() {
  echo "bench-ddp.sh: $*" >&2
  local pid
  if [[ -f $tmp/background.pids ]]; then
    while read -r pid; do
      [[ $pid == "$BASHPID" ]] && continue
      pkill -TERM -P "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    done < "$tmp/background.pids"
  fi
  kill -TERM $$ 2>/dev/null; exit 1
}

# The median of the arguments (the mean of the two middle ones for an even count); a
# value that is not a number (a run that measured nothing prints nan) ends the script.
median_of() {
  local v
  (($# > 0)) || die "no values to take the median of"
  for v in "$@"; do [[ $v =~ ^-?[0-9]+(\.[0-9]+)?$ ]] || die "expected a measured figure, found '$v'"; done
  printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# One mtrain run; prints "<global img/s, all windows> <comm wait fraction> <SyncBN wait
# fraction> <global img/s, median window> <exposed communication fraction> <waiting for
# the slowest rank fraction> <max rss MiB>".
run_mtrain() {
  local model=$1 n=$2 tag=$3; shift 3
  local w; w=$(window_of "$model")
  # extra_timed: more timed steps for the side-by-side runs (see run_side_by_side).
  local steps=$(( $(warmup_of "$model") + $(timed_of "$model") + ${extra_timed:-0} ))
  local args=(--model "$model" --batch-size "$(batch_of "$model")" --threads 1 --no-eval
              --max-steps "$steps" --epochs 1000000 --log-every "$w" --momentum 0 --no-shuffle
              --metrics "$tmp/$tag.jsonl" --log-level warn --amp "$amp" "$@")
  [[ -n $data_dir ]] && args+=(--data-dir "$data_dir")
  if ! OMP_NUM_THREADS=1 "$bin_dir/mtrain-launch" --nproc_per_node="$n" "${launch_args[@]}" \
      "${rss_wrap_cmd[@]}" "$tmp/$tag.rss" "$bin_dir/mtrain-train" "${args[@]}" > "$tmp/$tag.log" 2>&1; then
    cat "$tmp/$tag.log" >&2; die "mtrain $tag failed (its output is above)"
  fi
  echo "$(mtrain_rate "$tmp/$tag.jsonl" $(( $(warmup_of "$model") / w )) "$n" "$w") $(max_rss_mib "$tmp/$tag.rss")"
}

# N independent 1-rank runs of engine $1 (mtrain or torch) at once; prints the sum of
# their median-window img/s. Their starts differ by up to a second or so (LeNet times
# only about one second of steps), so each runs three times the timed steps: the median
# window then falls where all N are training.
run_side_by_side() {
  local engine=$1 model=$2 n=$3 tag=$4 i pids=() field
  for ((i = 1; i <= n; i++)); do
    extra_timed=$(( 2 * $(timed_of "$model") )) "run_$engine" "$model" 1 "$tag.$i" > "$tmp/$tag.$i.out" &
    pids+=($!)
    echo $! >> "$tmp/background.pids"
  done
  for i in "${pids[@]}"; do wait "$i" || die "side-by-side run $tag failed"; done
  : > "$tmp/background.pids"  # all ended: none of their numbers may be signalled later
  # Where each engine's line has its median-window rate (run_mtrain, run_torch).
  if [[ $engine == mtrain ]]; then field=4; else field=3; fi
  local rates=()
  for ((i = 1; i <= n; i++)); do rates+=("$(awk -v f="$field" '{ print $f }' "$tmp/$tag.$i.out")"); done
  printf '%s\n' "${rates[@]}" | awk -v n="$n" '
    $1 ~ /^[0-9.]+$/ { s += $1; k++ }
    END { if (k == n) printf "%.1f\n", s; else print "nan" }'
}

# One torchrun run; prints "<global img/s, all steps> <max rss MiB> <global img/s, median window>".
run_torch() {
  local model=$1 n=$2 tag=$3
  local args=(--model "$model" --batch-size "$(batch_of "$model")" --threads 1 --warmup "$(warmup_of "$model")"
              --steps "$(( $(timed_of "$model") + ${extra_timed:-0} ))" --amp "$amp")
  [[ -n $data_dir ]] && args+=(--data-dir "$data_dir")
  local port=$(( 20000 + RANDOM % 20000 ))
  if ! OMP_NUM_THREADS=1 /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 \
      --log_dir "$tmp/$tag.torchlogs" --nproc_per_node "$n" --master_port "$port" --no_python \
      "${rss_wrap_cmd[@]}" "$tmp/$tag.rss" /usr/bin/python3 "$root/scripts/bench_torch_ddp.py" "${args[@]}" \
      > "$tmp/$tag.log" 2>&1; then
    cat "$tmp/$tag.log" >&2; die "torchrun $tag failed (its output is above)"
  fi
  local rate; rate=$(sed -n 's/.*"img_per_s": \([0-9.]*\).*/\1/p' "$tmp/$tag.log")
  local median; median=$(sed -n 's/.*"step_s": \[\([^]]*\)\].*/\1/p' "$tmp/$tag.log" | tr ',' '\n' |
    steps_median_rate "$n" "$(batch_of "$model")" "$(window_of "$model")")
  echo "${rate:-nan} $(max_rss_mib "$tmp/$tag.rss") ${median:-nan}"
}

# The side-by-side reference compares with 1-rank runs that mtrain-launch starts
# unbound, so it needs a 1-rank column and no --cpu-bind.
side_by_side=1; side_by_side_why=""
if [[ ${nprocs%% *} != 1 ]]; then side_by_side=0; side_by_side_why="--nprocs does not start with 1"; fi
if ((${#launch_args[@]})); then side_by_side=0; side_by_side_why="--cpu-bind pins the N-rank runs only"; fi

cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //' || echo unknown)
echo "data-parallel throughput, 1 thread per rank, median of $runs run(s), --amp $amp${launch_args[*]:+, mtrain-launch ${launch_args[*]}}"
echo "machine: $(nproc) cores ($cpu); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
# Every round r runs each rank count back to back, mtrain then PyTorch, so that a
# round's N-rank and 1-rank runs see the same machine: a shared VM's speed drifts over
# minutes. Figures are medians over the rounds; scaling is the median of the per-round
# ratios. Keys: engine.model.n.r (med: median window, all: all the timed windows).
declare -A med all rss_r wait_r exposed_r slowest_r side_r
for model in $models; do
  for ((r = 1; r <= runs; r++)); do
    for n in $nprocs; do
      read -r a b _ d e s c < <(run_mtrain "$model" "$n" "mtrain.$model.$n.$r")
      all[mtrain.$model.$n.$r]=$a; wait_r[mtrain.$model.$n.$r]=$b; med[mtrain.$model.$n.$r]=$d
      exposed_r[mtrain.$model.$n.$r]=$e; slowest_r[mtrain.$model.$n.$r]=$s; rss_r[mtrain.$model.$n.$r]=$c
      if ((n > 1 && side_by_side)); then
        side_r[mtrain.$model.$n.$r]=$(run_side_by_side mtrain "$model" "$n" "side.$model.$n.$r")
      fi
      if ((torch)); then
        read -r a b d < <(run_torch "$model" "$n" "torch.$model.$n.$r")
        all[torch.$model.$n.$r]=$a; rss_r[torch.$model.$n.$r]=$b; med[torch.$model.$n.$r]=$d
        if ((n > 1 && side_by_side)); then
          side_r[torch.$model.$n.$r]=$(run_side_by_side torch "$model" "$n" "torch-side.$model.$n.$r")
        fi
      fi
    done
  done
done

# The values of array $1 for key $2 over the rounds, one per line.
per_round() {
  local -n values=$1
  local r
  for ((r = 1; r <= runs; r++)); do echo "${values[$2.$r]}"; done
}
# The median over the rounds of f(round's value of $1 at key $2, of $3 at key $4) for
# the awk expression f in terms of a and b.
median_ratio() {
  local -n left=$1 right=$3
  local r out=()
  for ((r = 1; r <= runs; r++)); do
    out+=("$(awk -v a="${left[$2.$r]}" -v b="${right[$4.$r]}" "BEGIN { printf \"%.4f\", $5 }")")
  done
  median_of "${out[@]}"
}

first_n=${nprocs%% *}
printf '\n%-9s %6s %5s %-8s %10s %8s %10s %8s %12s %9s %10s %16s\n' model batch/r ranks engine "img/s med" \
  scaling "img/s all" scaling "peak RSS/r" "vs torch" "comm wait" "exposed+slowest"
for model in $models; do
  for n in $nprocs; do
    for engine in mtrain torch; do
      [[ $engine == torch ]] && ! ((torch)) && continue
      key=$engine.$model.$n; base=$engine.$model.$first_n
      v=$(median_of $(per_round med "$key")); x=$(median_of $(per_round all "$key"))
      scaling=$(median_ratio med "$key" med "$base" "(a / $n) / (b / $first_n)")
      scaling_all=$(median_ratio all "$key" all "$base" "(a / $n) / (b / $first_n)")
      rss=$(per_round rss_r "$key" | sort -g | tail -1)
      ratio="-"; cw="-"; wait_split="-"
      if [[ $engine == mtrain ]]; then
        ((torch)) && ratio=$(awk -v a="$v" -v b="$(median_of $(per_round med "torch.$model.$n"))" \
          'BEGIN { printf "%.2fx", a / b }')
        cw=$(awk -v f="$(median_of $(per_round wait_r "$key"))" 'BEGIN { printf "%.1f%%", 100 * f }')
        if ((n > 1)); then
          wait_split=$(awk -v e="$(median_of $(per_round exposed_r "$key"))" \
            -v s="$(median_of $(per_round slowest_r "$key"))" 'BEGIN { printf "%.1f%% + %.1f%%", 100 * e, 100 * s }')
        fi
      fi
      printf '%-9s %6s %5s %-8s %10s %8.2f %10s %8.2f %8s MiB %9s %10s %16s\n' "$model" "$(batch_of "$model")" "$n" \
        "$engine" "$v" "$scaling" "$x" "$scaling_all" "$rss" "$ratio" "$cw" "$wait_split"
    done
  done
done
echo "(img/s med: the median window's; img/s all: over all the timed windows; scaling: per-rank img/s"
echo " over the same round's $first_n-rank run's; vs torch: of the median figures; comm wait: share of"
echo " mtrain's step time rank 0 spent waiting for gradient all-reduces; exposed+slowest: every rank's mean"
echo " wait split into communication no rank hid and waiting for the slowest rank's backward, shares of the"
echo " step, each the median over the rounds (so they need not add up to rank 0's comm wait); PyTorch runs"
echo " plain DDP, no SyncBN on CPU)"
((side_by_side)) || echo "(no side-by-side runs: $side_by_side_why)"
for model in $models; do
  for n in $nprocs; do
    ((n > 1 && side_by_side)) || continue
    for engine in mtrain torch; do
      [[ $engine == torch ]] && ! ((torch)) && continue
      key=$engine.$model.$n
      awk -v m="$model" -v n="$n" -v s="$(median_of $(per_round side_r "$key"))" -v n1="$first_n" -v engine="$engine" \
          -v e="$(median_ratio side_r "$key" med "$engine.$model.$first_n" "(a / $n) / (b / $first_n)")" \
          -v q="$(median_ratio med "$key" side_r "$key" "a / b")" 'BEGIN {
        printf "%s, %s: %d independent 1-rank runs side by side: %.1f img/s together, %.2f of %d x the %d-rank run'"'"'s;\n",
          m, engine, n, s, e, n, n1
        printf "  %d ranks reach %.2f of the side-by-side sum (medians of the per-round ratios)\n", n, q }'
    done
  done
done

last_n=${nprocs##* }
if ((sync_bn)) && [[ " $models " == *" resnet18 "* ]] && ((last_n > 1)); then
  # Pairs of runs back to back, so that both runs of a pair see the same machine: the
  # plain runs of the table above were taken minutes earlier.
  sr=(); pr=(); ratios=(); waits=()
  for ((r = 1; r <= runs; r++)); do
    # Which of the pair runs first alternates, so that a drifting machine favours neither.
    if ((r % 2)); then
      read -r _ _ _ a _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn-off.$r")
      read -r _ _ w b _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn.$r" --sync-bn)
    else
      read -r _ _ w b _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn.$r" --sync-bn)
      read -r _ _ _ a _ < <(run_mtrain resnet18 "$last_n" "mtrain.syncbn-off.$r")
    fi
    pr+=("$a"); sr+=("$b"); waits+=("$w")
    ratios+=("$(awk -v p="$a" -v s="$b" 'BEGIN { printf "%.4f", 100 * (p / s - 1) }')")
  done
  awk -v plain="$(median_of "${pr[@]}")" -v sync="$(median_of "${sr[@]}")" -v n="$last_n" \
      -v r="$(median_of "${ratios[@]}")" -v all="${ratios[*]}" -v w="$(median_of "${waits[@]}")" 'BEGIN {
    printf "\nresnet18, %d ranks, mtrain, %s back-to-back pairs: %.1f img/s with --sync-bn vs %.1f without (median windows);\n",
      n, split(all, a, " "), sync, plain
    printf "median step time with --sync-bn %+.1f%% (median of the pairs; each pair:", r
    for (i = 1; i <= length(a); i++) printf " %+.1f%%", a[i]
    printf ")\n"
    printf "rank 0 blocked in SyncBatchNorm'"'"'s collectives: %.1f%% of its step (median of the --sync-bn runs)\n",
      100 * w }'
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
