#!/usr/bin/env bash
# Single-process training throughput of mtrain-train (images per second), per model.
#
#   scripts/bench-train.sh [--batch-size N] [--threads N] [--runs N] [--models "lenet resnet18"]
#                          [--steps N] [--window N] [--bin PATH] [--data-dir DIR] [--no-torch]
#                          [--shape CxHxW]
#
# --shape trains on synthetic images of that shape instead of Fashion-MNIST (both sides;
# e.g. --models resnet50 --shape 3x224x224 --batch-size 16, torchvision's ResNet-50 in PyTorch).
#
# Each run trains --steps optimizer steps with --no-eval and a metrics file, logging a
# step event every --window steps. The first window (oneDNN primitive creation, cold
# caches) is discarded; the run's figure is images / seconds over the other windows.
# The script prints the median over --runs runs, with the min and max. Results and the
# command that produced them go in docs/benchmarks.md.
# When /usr/bin/python3 can import torch, each model is also trained by PyTorch
# (scripts/bench_torch_train.py: same model, data, batch and threads) in the same
# invocation, and the last column is mtrain / PyTorch.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
need_value() { [[ $# -ge 2 ]] || { echo "bench-train.sh: $1 expects a value, found the end of the command line" >&2; exit 2; }; }

root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/build/bin/mtrain-train"
batch=256
threads=$(nproc)
runs=3
models="lenet resnet18"
steps=""
window=""
data_dir=""
shape=""
torch=1

while [[ $# -gt 0 ]]; do
  case "$1" in
    --batch-size) need_value "$@"; batch=$2; shift 2 ;;
    --threads) need_value "$@"; threads=$2; shift 2 ;;
    --runs) need_value "$@"; runs=$2; shift 2 ;;
    --models) need_value "$@"; models=$2; shift 2 ;;
    --steps) need_value "$@"; steps=$2; shift 2 ;;
    --window) need_value "$@"; window=$2; shift 2 ;;
    --bin) need_value "$@"; bin=$2; shift 2 ;;
    --data-dir) need_value "$@"; data_dir=$2; shift 2 ;;
    --no-torch) torch=0; shift ;;
    --shape) need_value "$@"; shape=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench-train.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

for v in batch threads runs; do
  if ! [[ ${!v} =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-train.sh: --${v/batch/batch-size} expects a positive integer, got '${!v}'" >&2; exit 2
  fi
done
if [[ ! -x $bin ]]; then
  echo "bench-train.sh: $bin not found or not executable; build first (scripts/setup.sh) or pass --bin" >&2
  exit 2
fi

# Steps and window per model when not given: enough windows after the warm-up one for
# a stable figure, few enough that resnet18 (seconds per step on 2 cores) stays short.
default_window() { case "$1" in resnet*) echo 1 ;; *) echo 5 ;; esac; }
default_steps() { case "$1" in resnet*) echo 4 ;; *) echo 30 ;; esac; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-train.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# images/s of one run from its metrics file: total images / total seconds over every
# step window but the first (each step event carries its window's "images" and "sec").
run_rate() {
  awk '
    function field(name,    m) {
      if (!match($0, "\"" name "\":[-0-9.eE+]+")) return 0
      m = substr($0, RSTART, RLENGTH); sub(/^[^:]*:/, "", m); return m + 0
    }
    /"event":"step"/ {
      if (++n == 1) next
      images += field("images"); seconds += field("sec")
    }
    END { if (seconds > 0) printf "%.1f\n", images / seconds; else print "nan" }' "$1"
}

median_of() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print v[int(NR / 2) + 1]}'; }

if ((torch)) && ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "(PyTorch not importable by /usr/bin/python3: no reference column; apt-get install python3-torch)"
  torch=0
fi

cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //' || echo unknown)
echo "mtrain-train single-process throughput: batch $batch, $threads thread(s), median of $runs run(s)"
echo "machine: $(nproc) cores ($cpu)"
printf '%-10s %-8s %6s %8s %6s %12s %12s %12s %9s\n' model engine batch threads steps "img/s median" min max "vs torch"

for model in $models; do
  w=${window:-$(default_window "$model")}
  s=${steps:-$(default_steps "$model")}
  if (( s < 2 * w )); then
    echo "bench-train.sh: --steps $s must cover at least two windows of $w (the first is warm-up)" >&2; exit 2
  fi
  rates=()
  for ((r = 1; r <= runs; r++)); do
    args=(--model "$model" --batch-size "$batch" --threads "$threads" --max-steps "$s" --epochs 1000000
          --log-every "$w" --no-eval --metrics "$tmp/$model.$r.jsonl" --log-level warn)
    [[ -n $data_dir ]] && args+=(--data-dir "$data_dir")
    [[ -n $shape ]] && args+=(--dataset synthetic --synthetic-shape "$shape")
    if ! "$bin" "${args[@]}" > "$tmp/$model.$r.log" 2>&1; then
      echo "bench-train.sh: $model run $r failed:" >&2; cat "$tmp/$model.$r.log" >&2; exit 1
    fi
    rates+=("$(run_rate "$tmp/$model.$r.jsonl")")
  done
  mapfile -t sorted < <(printf '%s\n' "${rates[@]}" | sort -g)
  median=$(median_of "${rates[@]}")
  ratio="-"
  if ((torch)); then
    trates=()
    for ((r = 1; r <= runs; r++)); do
      targs=(--model "$model" --batch-size "$batch" --threads "$threads" --warmup "$w" --steps $((s - w)))
      [[ -n $data_dir ]] && targs+=(--data-dir "$data_dir")
      [[ -n $shape ]] && targs+=(--shape "$shape")
      line=$(/usr/bin/python3 "$root/scripts/bench_torch_train.py" "${targs[@]}")
      trates+=("$(sed -n 's/.*"img_per_s": \([0-9.]*\).*/\1/p' <<<"$line")")
    done
    mapfile -t tsorted < <(printf '%s\n' "${trates[@]}" | sort -g)
    tmedian=$(median_of "${trates[@]}")
    ratio=$(awk -v a="$median" -v b="$tmedian" 'BEGIN { printf "%.2fx", a / b }')
  fi
  printf '%-10s %-8s %6s %8s %6s %12s %12s %12s %9s\n' "$model" mtrain "$batch" "$threads" "$s" \
    "$median" "${sorted[0]}" "${sorted[-1]}" "$ratio"
  if ((torch)); then
    printf '%-10s %-8s %6s %8s %6s %12s %12s %12s %9s\n' "$model" pytorch "$batch" "$threads" "$s" \
      "$tmedian" "${tsorted[0]}" "${tsorted[-1]}" "1.00x"
  fi
done
