#!/usr/bin/env bash
# A GPU session in a few commands: build mtrain on a GPU host that has CUDA and PyTorch
# but neither mtrain's Debian packages nor a network, run the gpu-labelled tests, and
# run the training benchmark against PyTorch (docs/gpu.md, docs/benchmarks.md).
#
#   scripts/gpu-session.sh prepare          # where apt works: .deps and .gpu-data
#   scripts/gpu-session.sh test             # on the GPU host: build, ctest -L gpu
#   scripts/gpu-session.sh bench mtrain     # on the GPU host: build, mtrain's runs
#   scripts/gpu-session.sh bench torch      # on the GPU host: PyTorch's runs
#   scripts/gpu-session.sh summary          # anywhere: the table from the JSON lines
#
# prepare downloads the packages (scripts/offline-deps.sh .deps) and copies the full
# Fashion-MNIST (from ../shared/datasets, or DATA=DIR) into .gpu-data/fashion-mnist;
# both directories are git-ignored, so carry them to the GPU host with the tree. The
# other steps write logs and JSON lines under $OUT (default runs/gpu-session); test
# and bench mtrain build first (scripts/build-offline.sh, CUDA_ARCHS default 90, into
# build-offline; bench only the two binaries it runs; incremental when already built).
#
# The benchmark is d2l's recipe: resnet18 (3x3 stem), Fashion-MNIST, batch 256, plain
# SGD lr 0.1, EPOCHS epochs (default 4), one process under the launcher with the DDP
# machinery on (mtrain: --backend nccl, a one-rank NCCL group driving the reducer;
# PyTorch: torchrun + DistributedDataParallel). mtrain runs float32 and --amp bf16;
# PyTorch runs eager float32, AMP bf16 with channels_last, and that under torch.compile.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
self=$root/scripts/gpu-session.sh
cd "$root"
out=${OUT:-$root/runs/gpu-session}
build=$root/build-offline
data=$root/.gpu-data/fashion-mnist
epochs=${EPOCHS:-4}
mkdir -p "$out"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"; }

# The build directory's source tree, as CMake recorded it (empty when there is none).
built_from() { sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null || true; }

# Builds `$@` (every target when none is named): configures first on a fresh machine, or
# when the build directory was carried from another root; else only what changed.
ensure_build() {
  local targets="$*"
  if [[ ! -f $build/env.sh || $(built_from) != "$root" ]]; then
    [[ -d $root/.deps ]] || { echo "gpu-session.sh: no .deps here; run 'scripts/gpu-session.sh prepare' where apt works" >&2; exit 2; }
    TARGETS=$targets CUDA_ARCHS=${CUDA_ARCHS:-90} scripts/build-offline.sh "$root/.deps" "$build" > "$out/build.log" 2>&1 ||
      { tail -40 "$out/build.log"; echo "gpu-session.sh: build failed (log: $out/build.log)" >&2; exit 1; }
  else
    # shellcheck disable=SC2086  # a list of target names
    cmake --build "$build" -j "$(nproc)" ${targets:+--target $targets} >> "$out/build.log" 2>&1 ||
      { tail -40 "$out/build.log"; echo "gpu-session.sh: build failed (log: $out/build.log)" >&2; exit 1; }
  fi
  # shellcheck disable=SC1091
  source "$build/env.sh"
}

versions() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    nvcc --version 2>&1 | tail -1 || true
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1 || true
  } > "$out/versions.txt"
  cat "$out/versions.txt"
}

need_data() {
  [[ -f $data/train-images-idx3-ubyte.gz ]] ||
    { echo "gpu-session.sh: no Fashion-MNIST in $data; run 'scripts/gpu-session.sh prepare' and carry .gpu-data" >&2; exit 2; }
}

run_mtrain() {  # tag, extra flags...
  local tag=$1; shift
  "$build/bin/mtrain-launch" --nproc_per_node=1 train --device cuda --backend nccl --model resnet18 \
    --data-dir "$data" --batch-size 256 --lr 0.1 --momentum 0 --epochs "$epochs" --log-every 50 \
    --metrics "$out/mtrain-$tag.jsonl" "$@" > "$out/mtrain-$tag.log" 2>&1 ||
    { tail -30 "$out/mtrain-$tag.log"; echo "gpu-session.sh: mtrain $tag failed" >&2; return 1; }
  grep '"event":"epoch"' "$out/mtrain-$tag.jsonl"
}

run_torch() {  # tag, extra flags...
  local tag=$1; shift
  python3 -m torch.distributed.run --nproc_per_node 1 --master_port $((20000 + RANDOM % 20000)) \
    scripts/bench_torch_gpu.py --data-dir "$data" --epochs "$epochs" "$@" > "$out/torch-$tag.log" 2>&1 ||
    { tail -30 "$out/torch-$tag.log"; echo "gpu-session.sh: torch $tag failed" >&2; return 1; }
  grep '"framework"' "$out/torch-$tag.log" | sed 's/^\[[^]]*\]://' > "$out/torch-$tag.jsonl" ||
    { tail -30 "$out/torch-$tag.log"; echo "gpu-session.sh: torch $tag printed no result" >&2; return 1; }
  cat "$out/torch-$tag.jsonl"
}

summary() {
  python3 - "$out" "$epochs" <<'EOF'
import json, pathlib, statistics, sys
out, epochs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = []
for f in sorted(out.glob("*.jsonl")):
    events = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    events = [e for e in events if e.get("event", "epoch") == "epoch"]
    if not events:
        continue
    steady = events[1:] or events  # the first epoch carries start-up (JIT, autotuning, compile)
    sec = statistics.median(e["sec"] for e in steady)
    rate = statistics.median(e["img_per_s"] for e in steady)
    rows.append((f.stem, len(events), events[0]["sec"], sec, rate, events[-1].get("test_acc")))
print(f"| run | epochs | first epoch s | median later epoch s | median img/s | test acc after last |")
print("|---|---|---|---|---|---|")
for name, n, first, sec, rate, acc in rows:
    print(f"| {name} | {n} | {first:.2f} | {sec:.2f} | {rate:,.0f} | {acc} |")
EOF
}

case "${1:-}" in
  prepare)
    scripts/offline-deps.sh "$root/.deps"
    src=${DATA:-$root/../shared/datasets/fashion-mnist}
    mkdir -p "$data"
    cp "$src"/*-ubyte.gz "$data"/
    echo "carry: .deps .gpu-data ($(du -sh "$root/.deps" "$root/.gpu-data" | awk '{print $1}' | paste -sd' '))"
    ;;
  test)
    versions
    ensure_build
    set -o pipefail
    ctest --test-dir "$build" -L gpu --output-on-failure 2>&1 | tee "$out/gpu-tests.log"
    ;;
  bench)
    need_data
    versions
    case "${2:-all}" in
      mtrain)
        ensure_build mtrain-train mtrain-launch  # the tests' binaries are not needed here
        run_mtrain fp32
        run_mtrain bf16 --amp bf16 ;;
      torch)
        run_torch fp32
        run_torch bf16-cl --amp bf16 --channels-last
        run_torch bf16-cl-compile --amp bf16 --channels-last --compile ;;
      all)
        NO_SUMMARY=1 "$self" bench mtrain || exit 1
        NO_SUMMARY=1 "$self" bench torch || exit 1 ;;
      *) echo "gpu-session.sh: bench expects mtrain, torch or all" >&2; exit 2 ;;
    esac
    [[ -n ${NO_SUMMARY:-} ]] || summary | tee "$out/summary.md"
    ;;
  summary) summary ;;
  -h|--help|"") usage ;;
  *) echo "gpu-session.sh: unknown step '$1' (see --help)" >&2; exit 2 ;;
esac
