#!/usr/bin/env bash
# ResNet-50 at 224x224 on a GPU (the GPU kit's `imagenet` stage; any device with --device):
# does mtrain train it as fast as PyTorch, and does the streamed JPEG pipeline keep up?
#   1. generated ImageNet-sized JPEGs (scripts/make_jpegs.py makes a quarter of --images,
#      each copied three times: generating is slow), packed by mtrain-pack;
#   2. the loader alone (mtrain-bench-loader: RandomResizedCrop(224), flip, normalise) with
#      each count of --loader-workers in --workers: images/s;
#   3. mtrain-train --model resnet50 --max-steps STEPS on --dataset synthetic 3x224x224 in
#      float32 and --amp bf16, and on the shards with --amp bf16 and --train-workers loader
#      workers; img/s of the last logged window (the first steps plan every convolution);
#   4. PyTorch (scripts/bench_torch_train.py --device DEVICE): the same model from random
#      images on the device, float32, and AMP bf16 with channels_last: median step img/s.
# Prints a table and three last lines (exit status 1 when a training run gave no figure):
#   resnet50 vs PyTorch: float32 X.XX, bf16 Y.YY (PyTorch bf16 channels_last)
#   streamed vs synthetic (bf16): Z.ZZ (the loader keeps up at 0.95 or more)
#   loader: N img/s with W workers, ...
#
#   scripts/bench-imagenet.sh [--bin-dir DIR] [--device cuda] [--model resnet50]
#       [--batch-size 128] [--steps 40] [--images 3200] [--workers "1 4 8 16"]
#       [--train-workers 12] [--work DIR]
#
# On the CPU, for a dry run: --device cpu --model resnet18 --batch-size 2 --steps 4 --images 40.
# PYTHON (default python3) needs PyTorch, torchvision, PIL and numpy (here: /usr/bin/python3).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin_dir=$here/../build/bin device=cuda model=resnet50 batch=128 steps=40 images=3200
workers="1 4 8 16" train_workers=12 work="" python=${PYTHON:-python3}
while (($#)); do
  case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --train-workers) train_workers=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-imagenet.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for tool in mtrain-train mtrain-bench-loader mtrain-pack; do
  [[ -x $bin_dir/$tool ]] || { echo "bench-imagenet.sh: no $tool in $bin_dir (--bin-dir)" >&2; exit 2; }
done
((steps >= 20)) || [[ $device == cpu ]] || { echo "bench-imagenet.sh: --steps below 20 measures planning" >&2; exit 2; }
if [[ -z $work ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
log_every=$((steps / 4 > 0 ? steps / 4 : 1))
norm=0.485,0.456,0.406:0.229,0.224,0.225

# 1. Data.
"$python" "$here/make_jpegs.py" "$work/photos" $(((images + 3) / 4)) 8 imagenet
for f in "$work"/photos/train/*/*.jpg; do
  for k in 1 2 3; do cp "$f" "${f%.jpg}-$k.jpg"; done
done
"$bin_dir/mtrain-pack" --from "$work/photos" --to "$work/shards" --shard-size 100 >/dev/null
echo "bench-imagenet: $(find "$work/photos/train" -name '*.jpg' | wc -l) JPEGs ($(du -sh "$work/photos/train" | cut -f1)), $(nproc) cores, $model on $device"

# 2. The loader alone.
loader_rates=()
for w in $workers; do
  rate=$(OMP_NUM_THREADS=1 "$bin_dir/mtrain-bench-loader" --dataset webdataset --data-dir "$work/shards" \
           --random-resized-crop 224 --random-flip --normalize "$norm" --batch-size 64 --loader-workers "$w" \
           --threads 1 --model "$model" 2>"$work/loader.err" | awk '/images\/s with/ { print $(NF-7) }') ||
    echo "loader, $w workers: $(tail -1 "$work/loader.err")" >&2
  loader_rates+=("${rate:-?} img/s with $w workers")
  echo "loader, $w workers: ${rate:-?} img/s"
done

# 3. mtrain: the img/s of the last logged window.
mtrain_run() {  # tag, flags...
  local tag=$1; shift
  "$bin_dir/mtrain-train" --device "$device" --model "$model" --batch-size "$batch" --max-steps "$steps" \
    --epochs 1000 --log-every "$log_every" --no-eval --metrics "$work/$tag.jsonl" --log-level warn "$@" \
    >"$work/$tag.log" 2>&1 || { echo "mtrain $tag: exit $? ($(grep -m1 -i error "$work/$tag.log" || true))" >&2; echo "?"; return; }
  "$python" -c 'import json, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "step"]
print("%.1f" % steps[-1]["img_per_s"] if steps else "?")' "$work/$tag.jsonl"
}
synthetic=(--dataset synthetic --synthetic-shape 3x224x224)
streamed=(--dataset webdataset --data-dir "$work/shards" --random-resized-crop 224 --random-flip --normalize "$norm"
          --loader-workers "$train_workers")
m_fp32=$(mtrain_run synthetic-fp32 "${synthetic[@]}")
m_bf16=$(mtrain_run synthetic-bf16 "${synthetic[@]}" --amp bf16)
m_stream=$(mtrain_run streamed-bf16 "${streamed[@]}" --amp bf16)

# 4. PyTorch.
torch_run() {  # flags...
  "$python" "$here/bench_torch_train.py" --device "$device" --model "$model" --shape 3x224x224 --batch-size "$batch" \
    --steps $((steps / 2 > 0 ? steps / 2 : 1)) --warmup $((steps / 2 > 0 ? steps / 2 : 1)) --threads "$(nproc)" "$@" \
    2>"$work/torch.err" | "$python" -c 'import json, sys; print(json.loads(sys.stdin.readlines()[-1])["img_per_s"])' ||
    { echo "torch $*: $(tail -1 "$work/torch.err")" >&2; echo "?"; }
}
t_fp32=$(torch_run)
t_bf16=$(torch_run --amp bf16 --channels-last)

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "?" }'; }
printf '| run | img/s |\n|---|---|\n'
printf '| mtrain, synthetic, float32 | %s |\n| mtrain, synthetic, --amp bf16 | %s |\n' "$m_fp32" "$m_bf16"
printf '| mtrain, JPEG shards, --amp bf16, %s loader workers | %s |\n' "$train_workers" "$m_stream"
printf '| PyTorch, float32 | %s |\n| PyTorch, AMP bf16, channels_last | %s |\n' "$t_fp32" "$t_bf16"
echo "resnet50 vs PyTorch: float32 $(ratio "$m_fp32" "$t_fp32"), bf16 $(ratio "$m_bf16" "$t_bf16") (PyTorch bf16 channels_last)"
echo "streamed vs synthetic (bf16): $(ratio "$m_stream" "$m_bf16") (the loader keeps up at 0.95 or more)"
echo "loader: $(IFS=,; echo "${loader_rates[*]}" | sed 's/,/, /g')"
# A run without a figure (its reason is above) fails the benchmark.
for v in "$m_fp32" "$m_bf16" "$m_stream" "$t_fp32" "$t_bf16"; do [[ $v != "?" ]] || exit 1; done
