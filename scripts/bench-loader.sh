#!/usr/bin/env bash
# The input pipeline per core against torchvision's: ImageNet-sized JPEGs (generated; sizes
# drawn around ImageNet's: mostly 500x375 and 375x500, some 500x333, a tenth anything from
# 200 to 1200 pixels wide) through RandomResizedCrop(224), RandomHorizontalFlip and
# ToTensor + Normalize, batches of 64, one core each:
#   torchvision  ImageFolder + DataLoader(num_workers=0), torch.set_num_threads(1)
#   full         mtrain-bench-loader --dataset imagefolder --full-decode (the same bytes)
#   folder       mtrain-bench-loader --dataset imagefolder (JPEGs decoded at a reduced scale)
#   shards       mtrain-bench-loader --dataset webdataset on the same images packed by mtrain-pack
# mtrain's loaders run one worker thread. Per run: images/s after the first batch. Prints
# medians over --runs rounds, each against torchvision, the cores that would feed 3,000
# images/s (an H200 training resnet50), and last "per core vs torchvision: X.XX" (folder).
#
#   scripts/bench-loader.sh [--quick] [--runs 3] [--images 1600] [--bin-dir DIR]
#
# --quick: 400 images, one round (a few minutes). Results go in docs/benchmarks.md.
set -euo pipefail

runs=3 images=1600
bin_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin
while (($#)); do
  case $1 in
    --quick) runs=1 images=400; shift ;;
    --runs) runs=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-loader.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for tool in mtrain-bench-loader mtrain-pack; do
  [[ -x $bin_dir/$tool ]] || { echo "bench-loader.sh: no $tool in $bin_dir (--bin-dir)" >&2; exit 2; }
done
/usr/bin/python3 -c 'import torchvision, PIL, numpy' 2>/dev/null ||
  { echo "bench-loader.sh: /usr/bin/python3 needs torchvision, PIL and numpy (Debian's python3-torchvision)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/make_jpegs.py" "$work/photos" "$images" 10 imagenet
"$bin_dir/mtrain-pack" --from "$work/photos" --to "$work/shards" --shard-size 200 > /dev/null
echo "bench-loader: $images JPEGs, $(du -sh "$work/photos/train" | cut -f1) ($(nproc) cores; each run on one)"

flags=(--random-resized-crop 224 --random-flip --normalize 0.485,0.456,0.406:0.229,0.224,0.225 --batch-size 64
       --loader-workers 1 --threads 1 --model resnet18)
mtrain() {  # images/s of one mtrain-bench-loader run
  OMP_NUM_THREADS=1 "$bin_dir/mtrain-bench-loader" "${flags[@]}" "$@" | awk '/images\/s with/ { print $(NF-7) }'
}
torchvision() {
  OMP_NUM_THREADS=1 /usr/bin/python3 - "$work/photos/train" <<'PY'
import sys, time, torch
from torchvision import datasets, transforms as T
torch.set_num_threads(1)
torch.manual_seed(0)
tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
loader = torch.utils.data.DataLoader(datasets.ImageFolder(sys.argv[1], tf), batch_size=64, shuffle=True, num_workers=0)
images, start = 0, None
for b, (x, y) in enumerate(loader):
    if b == 0:
        start = time.perf_counter()
        continue
    images += x.shape[0]
print(f"{images / (time.perf_counter() - start):.1f}")
PY
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

declare -A rate
for ((r = 1; r <= runs; r++)); do
  rate[torchvision]+="$(torchvision) "
  rate[full]+="$(mtrain --dataset imagefolder --data-dir "$work/photos" --full-decode) "
  rate[folder]+="$(mtrain --dataset imagefolder --data-dir "$work/photos") "
  rate[shards]+="$(mtrain --dataset webdataset --data-dir "$work/shards") "
  echo "round $r of $runs done" >&2
done
tv=$(tr ' ' '\n' <<< "${rate[torchvision]}" | grep . | median)
printf '%-12s %8s img/s per core\n' torchvision "$tv"
for k in full folder shards; do
  m=$(tr ' ' '\n' <<< "${rate[$k]}" | grep . | median)
  printf '%-12s %8s img/s per core  %5.2fx torchvision  %4.1f cores for 3,000 img/s  (runs: %s)\n' "$k" "$m" \
    "$(awk -v a="$m" -v b="$tv" 'BEGIN { print a / b }')" "$(awk -v a="$m" 'BEGIN { print 3000 / a }')" "${rate[$k]% }"
done
folder=$(tr ' ' '\n' <<< "${rate[folder]}" | grep . | median)
printf 'per core vs torchvision: %.2f\n' "$(awk -v a="$folder" -v b="$tv" 'BEGIN { print a / b }')"
