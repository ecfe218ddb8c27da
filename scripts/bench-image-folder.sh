#!/usr/bin/env bash
# The loader on your own images: the same random 3x32x32 images read as CIFAR-10 binary
# batches (bytes straight into memory) and as a folder of PNGs (decoded at load), and the
# binary batches again with --random-crop 4 --random-flip (the work the loader's worker
# does per image). One process of mtrain-train each, same model, batch and steps:
#   binary    --dataset cifar10
#   folder    --dataset imagefolder (the same images as PNGs in a folder per class)
#   augment   --dataset cifar10 --random-crop 4 --random-flip --normalize auto
# Per run: images/s over the steps after the first --skip (from the metrics' step events),
# and the seconds outside the steps (start-up, loading and decoding, exit). Prints
# medians over --runs rounds and folder/binary, augment/binary.
#
#   scripts/bench-image-folder.sh [--runs 3] [--model simplecnn] [--images 4000]
#                                 [--batch-size 64] [--steps 40] [--skip 10] [--bin-dir DIR]
#
# Results and the command go in docs/benchmarks.md.
set -euo pipefail

runs=3 model=simplecnn images=4000 batch=64 steps=40 skip=10
bin_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/bin
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --images) images=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --skip) skip=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench-image-folder.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -x $bin_dir/mtrain-train ]] || { echo "bench-image-folder.sh: no mtrain-train in $bin_dir (--bin-dir)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The images, twice: CIFAR-10 binary batches and PNGs (8-bit RGB, written with zlib).
python3 - "$work" "$images" <<'EOF'
import os, random, struct, sys, zlib
work, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
def png(path, rgb):  # rgb: 32 rows of 96 bytes
    raw = b"".join(b"\x00" + rgb[r * 96:(r + 1) * 96] for r in range(32))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 32, 32, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
binary = os.path.join(work, "cifar")
os.makedirs(binary)
files = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
counts = [n // 5] * 5 + [max(n // 10, 10)]
for name, count in zip(files, counts):
    split = "val" if name == "test_batch.bin" else "train"
    with open(os.path.join(binary, name), "wb") as out:
        for k in range(count):
            label = rng.randrange(10)
            # Smooth images (a few gradients), so PNG compresses as it does real photos.
            a, b, c = rng.random(), rng.random(), rng.random()
            chw = bytes(int(255 * ((a * x + b * y) / 62 + c * ch) % 256) for ch in range(3) for y in range(32) for x in range(32))
            out.write(bytes([label]) + chw)
            hwc = bytes(chw[ch * 1024 + p] for p in range(1024) for ch in range(3))
            d = os.path.join(work, "folder", split, f"class{label}")
            os.makedirs(d, exist_ok=True)
            png(os.path.join(d, f"{name[:-4]}_{k:05}.png"), hwc)
EOF

one_run() {  # name, flags...
  local name=$1; shift
  local metrics=$work/$name.jsonl
  local start end
  start=$(date +%s.%N)
  "$bin_dir/mtrain-train" --model "$model" --batch-size "$batch" --max-steps "$steps" --no-eval --log-every 1 \
    --metrics "$metrics" --log-level warn "$@"
  end=$(date +%s.%N)
  python3 - "$metrics" "$skip" "$batch" "$start" "$end" <<'EOF'
import json, sys
path, skip, batch, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
steps = [json.loads(l) for l in open(path) if '"event":"step"' in l]
later = steps[skip:]
rate = sum(s["images"] for s in later) / sum(s["sec"] for s in later)
# Everything but the steps: start-up, loading and decoding, and the exit.
print(f"{rate:.1f} {end - start - sum(s['sec'] for s in steps):.2f}")
EOF
}

declare -A rate first
for ((r = 1; r <= runs; r++)); do
  for name in binary folder augment; do
    case $name in
      binary) out=$(one_run binary --dataset cifar10 --data-dir "$work/cifar") ;;
      folder) out=$(one_run folder --dataset imagefolder --data-dir "$work/folder") ;;
      augment) out=$(one_run augment --dataset cifar10 --data-dir "$work/cifar" --random-crop 4 --random-flip --normalize auto) ;;
    esac
    rate[$name]+="${out% *} "
    first[$name]+="${out#* } "
  done
done
python3 - "${rate[binary]}" "${rate[folder]}" "${rate[augment]}" "${first[binary]}" "${first[folder]}" "${first[augment]}" <<EOF
import statistics, sys
b, f, a, fb, ff, fa = ([float(x) for x in s.split()] for s in sys.argv[1:])
m = statistics.median
print(f"# model $model, $images images 3x32x32, batch $batch, steps $steps (skip $skip), $runs runs; medians")
print(f"binary  {m(b):8.1f} img/s, {m(fb):.2f} s outside the steps")
print(f"folder  {m(f):8.1f} img/s, {m(ff):.2f} s outside the steps   folder/binary {m([x / y for x, y in zip(f, b)]):.3f}")
print(f"augment {m(a):8.1f} img/s, {m(fa):.2f} s outside the steps   augment/binary {m([x / y for x, y in zip(a, b)]):.3f}")
EOF
