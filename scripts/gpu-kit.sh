#!/usr/bin/env bash
# The GPU kit: everything a short GPU window needs, built here, run there (docs/gpu.md).
#
#   scripts/gpu-kit.sh pack [KIT_DIR]        # here: build for sm_90, gather, compress
#   scripts/gpu-kit.sh run [KIT_DIR] [STAGE...]  # on the GPU machine: unpack, run, summarise
#   scripts/gpu-kit.sh stages                # the stages and their time limits
#
# pack builds (in $BUILD, default build-gpukit; CUDA_ARCHS, default 90 for the H100 and
# H200) the three binaries and every gpu-labelled test binary, then gathers into one
# archive, KIT_DIR/mtrain-gpu-kit.tar.xz (KIT_DIR default .gpu-kit, git-ignored; at most
# 60 MiB): those binaries; every shared library they load that is neither glibc's,
# libstdc++/libgcc_s (any newer distribution has them) nor CUDA's (the GPU machine has
# cudart, cuBLAS, cuDNN and NCCL: its CUDA toolkit and its PyTorch's nvidia-* wheels);
# the shipped mini set and the full Fashion-MNIST (DATA, default
# ../shared/datasets/fashion-mnist); the PyTorch benchmark scripts; the list of gpu tests
# with their arguments and time limits as CTest has them.
#
# run unpacks into $KIT_WORK (default /tmp/mtrain-gpu-kit), finds CUDA's libraries,
# prints the versions, then runs the stages (all, or those named, in the order named),
# each under its own time limit; a failed stage never stops the next. Into $OUT (default
# runs/gpu-kit) it writes, after every stage, summary.md (versions, stages, the d2l and
# speed tables, the two ratio lines, the profile) and logs.tar.xz (every log, JSON line
# and table), plus stages.md and tests.tsv: few files, so a GPU window's all come back.
# EPOCHS (default 4): mtrain float32's epochs in d2l (its test accuracy is a goal);
# SPEED_EPOCHS (default 2): every other training run's. speed and speed-ref:
# SPEED_BATCHES (default "256 1024"), SPEED_CONFIGS (default every configuration: a
# comma-separated list of tags of speed_configs and torch_refs below), SPEED_LARGE (the
# tags that run at the batches after the first; default the baseline, speedups, fp32-all,
# best and PyTorch's eager float32 and bf16 channels_last). profile:
# PROFILE_STEPS (3), PROFILE_MTRAIN (default "baseline speedups": tags of speed_configs).
# KIT_STATE (default /tmp/mtrain-gpu-kit-state) keeps the speed results between calls on
# one machine, so a later call's speed-ref completes the ratios. KIT_SCRIPTS (default the
# kit's scripts folder): where the Python scripts come from (KIT_SCRIPTS=scripts takes
# the tree's, fixed after the kit was packed).
# On a machine without a GPU every stage ends with a line saying why.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
self=$root/scripts/gpu-kit.sh
kit_name=mtrain-gpu-kit.tar.xz
max_kit_mib=60

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"; }
die() { echo "gpu-kit.sh: $*" >&2; exit 2; }

# ---- stages ------------------------------------------------------------------------------
# name, time limit in seconds, what it runs. Note [Kit time budget] in docs/gpu.md says
# why each limit is what it is; together they fit a 10-minute call on a cold machine.
stage_table() {
  cat <<'EOF'
tests      100 every gpu-labelled test binary but the sanitizer's, four at a time
sanitizer  100 compute-sanitizer memcheck over two resnet18 steps, beside the tests
d2l        240 the d2l recipe: mtrain and PyTorch eager float32 (accuracy); mtrain --cudnn-benchmark, --amp bf16; PyTorch bf16+channels_last, compiled
ddp         40 two ranks on one GPU over Gloo against one rank with the doubled batch, one step; mtrain-bench over NCCL
flags       60 30 resnet18 steps at batch 256 plain, --cudnn-benchmark, --no-tf32 and --trace: img/s, memory, host ms per phase
grads       40 one resnet18 step's gradients on the CPU and the GPU (--no-tf32) against PyTorch float64 and float32
speed      320 the d2l recipe, SPEED_EPOCHS (2) epochs at batch 256 and 1024: mtrain with each speed switch alone and together, PyTorch eager float32
speed-ref  170 PyTorch's other references at batch 256 and 1024: float32 channels_last+cudnn.benchmark, AMP bf16 channels_last, that compiled
profile     80 every kernel of PROFILE_STEPS (3) d2l steps under ncu, mtrain (PROFILE_MTRAIN) and PyTorch eager: GPU ms per step, kinds
onnx        80 d2l's resnet18 exported to ONNX by the machine's PyTorch against the built-in one, 30 steps each, alternated 3 times
imagenet   180 resnet50 at 224: synthetic float32 and bf16 against PyTorch, from JPEG shards with 12 loader workers, the loader alone
EOF
}
stage_limit() { stage_table | awk -v s="$1" '$1 == s { print $2 }'; }

# mtrain's speed configurations, one a line (a configuration is added or removed in one
# line): tag, MTRAIN_SPEEDUPS (a comma-separated list of switches, "all" every one; "-":
# unset), trainer flags ("-": none). A binary that lacks a switch or flag exits 2 naming
# it, and the configuration reads "not built". In the order run: the baseline and the
# combinations first, so a stage cut short loses single switches, not the ratios.
speed_configs() {
  cat <<'EOF'
baseline            -                -
speedups            all              -
speedups-bf16       all              --amp bf16
fp32-all            all              --channels-last --cuda-graphs
fp32-all-benchmark  all              --channels-last --cuda-graphs --cudnn-benchmark
best                all              --channels-last --cuda-graphs --cudnn-benchmark --amp bf16
best-f32-acts       fused-bn,skip-conv-bias,fresh-grads,cudnn-graph --channels-last --cuda-graphs --cudnn-benchmark --amp bf16
fused-bn            fused-bn         -
skip-conv-bias      skip-conv-bias   -
fresh-grads         fresh-grads      -
cudnn-graph         cudnn-graph      -
cudnn-benchmark     -                --cudnn-benchmark
channels-last       -                --channels-last
cuda-graphs         -                --cuda-graphs
bf16                -                --amp bf16
bf16-activations    amp-activations  --amp bf16
EOF
}

# PyTorch's references (scripts/bench_torch_gpu.py), one a line: tag, the stage that runs
# it, its flags ("-": none). Eager float32 runs in speed, beside mtrain, so the float32
# ratio comes from one stage.
torch_refs() {
  cat <<'EOF'
torch-fp32               speed      -
torch-fp32-cl-benchmark  speed-ref  --channels-last --cudnn-benchmark
torch-bf16-cl            speed-ref  --amp bf16 --channels-last
torch-bf16-cl-compile    speed-ref  --amp bf16 --channels-last --compile
EOF
}

# ---- pack --------------------------------------------------------------------------------

# Libraries the GPU machine brings itself: glibc's, the compiler runtime, the driver and
# CUDA's (found there by `run`).
is_provided_lib() {
  case $1 in
    linux-vdso.so.* | ld-linux-x86-64.so.* | libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | \
      librt.so.* | libresolv.so.* | libutil.so.* | libstdc++.so.* | libgcc_s.so.* | \
      libcuda.so.* | libcudart.so.* | libcublas.so.* | libcublasLt.so.* | libcudnn*.so.* | libnccl.so.*)
      return 0 ;;
  esac
  return 1
}

pack() {
  local kit=${1:-$root/.gpu-kit}
  local build=${BUILD:-$root/build-gpukit}
  local data=${DATA:-$root/../shared/datasets/fashion-mnist}
  [[ -f $data/train-images-idx3-ubyte.gz ]] || die "no Fashion-MNIST in $data (set DATA=DIR)"
  command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || die "pack needs the CUDA toolkit (nvcc)"

  echo "gpu-kit.sh pack: configuring $build for sm_${CUDA_ARCHS:-90}"
  mkdir -p "$build" || die "cannot write $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >"$build/gpu-kit-configure.log" 2>&1 ||
    { tail -30 "$build/gpu-kit-configure.log"; die "configure failed (log: $build/gpu-kit-configure.log)"; }
  grep -q '^MTRAIN_HAVE_CUDA:INTERNAL=ON' "$build/CMakeCache.txt" 2>/dev/null ||
    grep -q 'mtrain: CUDA path ON' "$build/gpu-kit-configure.log" || die "the build has no CUDA path (see $build/gpu-kit-configure.log)"

  # Everything (CTest knows a test's binary only once it is built), then the gpu tests as
  # CTest runs them: name, binary, time limit, arguments.
  echo "gpu-kit.sh pack: building (log: $build/gpu-kit-build.log)"
  cmake --build "$build" -j "${JOBS:-$(nproc)}" >"$build/gpu-kit-build.log" 2>&1 ||
    { tail -40 "$build/gpu-kit-build.log"; die "build failed (log: $build/gpu-kit-build.log)"; }
  local manifest
  manifest=$(ctest --test-dir "$build" -L gpu --show-only=json-v1 | python3 -c '
import json, os, sys
for t in json.load(sys.stdin)["tests"]:
    if "command" not in t:
        sys.exit(f"gpu test {t['name']} has no binary")
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    cmd = t["command"]
    print("\t".join([t["name"], os.path.basename(cmd[0]), str(int(float(props.get("TIMEOUT", 120))))] + cmd[1:]))
') || die "could not list the gpu tests"
  mapfile -t test_bins < <(cut -f2 <<<"$manifest" | sort -u)

  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  mkdir -p "$stage"/{bin,tests,lib,data,scripts}
  cp "$build"/bin/mtrain-{train,launch,bench,bench-loader,pack} "$stage/bin/"
  for b in "${test_bins[@]}" nccl_test_worker; do cp "$build/tests/$b" "$stage/tests/"; done
  printf '%s\n' "$manifest" >"$stage/tests/gpu-tests.tsv"
  cp -r "$root/data/fashion-mnist-mini" "$stage/data/"
  mkdir -p "$stage/data/fashion-mnist"
  cp "$data"/*-ubyte.gz "$stage/data/fashion-mnist/"
  cp "$root"/scripts/bench_torch_gpu.py "$root"/scripts/bench_torch_train.py \
    "$root"/scripts/check_gradients_torch.py "$root"/scripts/kernel_table.py "$root"/scripts/bench-onnx.py \
    "$root"/scripts/bench-imagenet.sh "$root"/scripts/make_jpegs.py "$stage/scripts/"

  # Every library the binaries load (ldd gives the whole closure), but those provided.
  local lib name
  while read -r lib; do
    name=$(basename "$lib")
    is_provided_lib "$name" && continue
    cp -L "$lib" "$stage/lib/$name"
  done < <(for f in "$stage"/bin/* "$stage"/tests/*; do
             [[ $f == *.tsv ]] || ldd "$f"
           done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
  git -C "$root" rev-parse --short HEAD >"$stage/commit" 2>/dev/null || echo unknown >"$stage/commit"
  git -C "$root" status --porcelain | grep -q . && echo "(with uncommitted changes)" >>"$stage/commit"

  mkdir -p "$kit"
  tar -C "$stage" -cf - . | xz -T0 -6 >"$kit/$kit_name" || die "could not write $kit/$kit_name"
  local mib
  mib=$(( ($(stat -c %s "$kit/$kit_name") + 1048575) / 1048576 ))
  echo "gpu-kit.sh pack: $kit/$kit_name, $mib MiB ($(ls "$stage/lib" | wc -l) libraries, $(wc -l <<<"$manifest") gpu tests)"
  ((mib <= max_kit_mib)) || die "the kit is $mib MiB, over the $max_kit_mib MiB a GPU window carries"
}

# ---- run ---------------------------------------------------------------------------------

# Directories holding CUDA's libraries on this machine: the toolkit's, then the nvidia-*
# wheels of python3's PyTorch (cuDNN and NCCL come only from there on the GPU machines).
cuda_lib_dirs() {
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d $d ]] && echo "$d"
  done
  python3 - 2>/dev/null <<'EOF' || true
import glob, os, importlib.util
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    for d in sorted(set(os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "lib", "lib*.so*")))):
        print(d)
EOF
}

# The first directory of `dirs` that holds `lib` (a glob).
find_lib() {
  local pattern=$1 d; shift
  for d in "$@"; do
    compgen -G "$d/$pattern" >/dev/null && { compgen -G "$d/$pattern" | head -n1; return; }
  done
}

write_versions() {
  {
    echo "kit: commit $(tr '\n' ' ' <"$kit_dir/commit")"
    echo "host: $(uname -srm), $(nproc) cores"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    else
      echo "gpu: none (nvidia-smi is not installed)"
    fi
    command -v nvcc >/dev/null && nvcc --version | tail -1 | sed 's/^/nvcc: /'
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "(no cuda)")' 2>&1 | sed 's/^/python3: /'
    local l
    for l in 'libcudart.so.13*' 'libcublas.so.13*' 'libcudnn.so.9*' 'libnccl.so.2*'; do
      echo "lib: ${l%%\**} -> $(find_lib "$l" "${cuda_dirs[@]}" | xargs -r readlink -f || true)"
    done
  } >"$out/versions.txt" 2>&1
  cat "$out/versions.txt"
}

# Binaries whose libraries do not all resolve, with the missing names.
check_libraries() {
  local f missing bad=0
  for f in "$kit_dir"/bin/* "$kit_dir"/tests/*; do
    [[ $f == *.tsv ]] && continue
    missing=$(ldd "$f" 2>&1 | awk '/not found/ { print $1 }' | paste -sd' ')
    [[ -n $missing ]] && { echo "libraries: $(basename "$f") cannot find $missing"; bad=1; }
  done
  ((bad == 0)) && echo "libraries: every binary resolves all of its libraries"
  return $bad
}

# Records a stage's row: name, status, seconds, note.
record() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >>"$out/stages.md"; }

# `timeout` with the stage's remaining time; 124/137 become TIMEOUT.
run_limited() {  # seconds, log, command...
  local limit=$1 log=$2; shift 2
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
}

stage_tests() {
  local limit=$1 deadline=$((SECONDS + $1)) passed=0 failed=0 skipped=0 timed=0
  local results=$out/tests.tsv
  : >"$results"
  # One line per test: name, binary, time limit, arguments; the sanitizer has its own stage.
  run_one() {
    local name=$1 bin=$2 t=$3; shift 3
    local left=$((deadline - SECONDS))
    ((left < t)) && t=$left
    ((t < 1)) && { printf '%s\tTIMEOUT\t0\tno time left in the stage\n' "$name" >>"$results"; return; }
    local start=$SECONDS rc
    (cd "$work" && MTRAIN_TEST_BIN_DIR=$kit_dir/bin MTRAIN_TEST_SOURCE_DIR=$kit_dir \
      timeout -k 5 "$t" "$kit_dir/tests/$bin" "$@" >"$out/test-$name.log" 2>&1)
    rc=$?
    local status=FAIL note
    case $rc in
      0) status=PASS ;;
      77) status=SKIP ;;
      124 | 137) status=TIMEOUT ;;
    esac
    note=$(grep -m1 -E '^SKIPPED|FAILED|failed|error' "$out/test-$name.log" | cut -c1-160)
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - start)) "$note" >>"$results"
  }
  local fields running=0
  while IFS=$'\t' read -r -a fields; do
    [[ ${fields[0]} == test_train_cuda_sanitizer ]] && continue
    if ((running >= 4)); then wait -n; running=$((running - 1)); fi
    run_one "${fields[@]}" &
    running=$((running + 1))
  done <"$kit_dir/tests/gpu-tests.tsv"
  wait
  # (no `column`: GPU images may lack util-linux's extras)
  awk -F'\t' '{ printf "  %-28s %-8s %5s  %s\n", $1, $2, $3, $4 }' "$results" >&2
  passed=$(awk -F'\t' '$2 == "PASS"' "$results" | wc -l)
  failed=$(awk -F'\t' '$2 == "FAIL"' "$results" | wc -l)
  skipped=$(awk -F'\t' '$2 == "SKIP"' "$results" | wc -l)
  timed=$(awk -F'\t' '$2 == "TIMEOUT"' "$results" | wc -l)
  local note="$passed passed, $failed failed, $skipped skipped, $timed timed out"
  if ((failed + timed > 0)); then
    echo "FAIL|$note: $(awk -F'\t' '$2 == "FAIL" || $2 == "TIMEOUT" { printf "%s ", $1 }' "$results")"
  elif ((passed == 0)); then
    echo "SKIP|$note ($(awk -F'\t' 'NR == 1 { print $4 }' "$results"))"
  else
    echo "PASS|$note"
  fi
}

stage_sanitizer() {
  local log=$out/sanitizer.log rc
  (cd "$work" && MTRAIN_TEST_BIN_DIR=$kit_dir/bin MTRAIN_TEST_SOURCE_DIR=$kit_dir \
    run_limited "$1" "$log" "$kit_dir/tests/test_train_cuda_sanitizer")
  rc=$?
  case $rc in
    0) echo "PASS|$(grep -ho 'ERROR SUMMARY: [0-9]* errors' "$log" | tail -1)" ;;
    77) echo "SKIP|$(grep -m1 '^SKIPPED' "$log")" ;;
    124 | 137) echo "TIMEOUT|after $1 s (log: sanitizer.log)" ;;
    *) echo "FAIL|exit $rc: $(grep -m1 -E 'ERROR SUMMARY|Invalid|error' "$log" | cut -c1-160)" ;;
  esac
}

# One training run of the d2l recipe; its step and epoch JSON lines go to $out/<tag>.jsonl.
# MTRAIN_SPEEDUPS: "-" leaves the environment's as it is, "" unsets it.
mtrain_recipe() {  # tag, limit, epochs, batch, log-every, MTRAIN_SPEEDUPS, extra flags...
  local tag=$1 limit=$2 n=$3 batch=$4 every=$5 speedups=$6; shift 6
  local envs=(env)
  [[ $speedups == - ]] || envs+=(-u MTRAIN_SPEEDUPS)
  [[ $speedups == - || -z $speedups ]] || envs+=("MTRAIN_SPEEDUPS=$speedups")
  rm -f "$out/$tag.jsonl"
  run_limited "$limit" "$out/$tag.log" "${envs[@]}" "$kit_dir/bin/mtrain-launch" --nproc_per_node=1 train \
    --device cuda --backend nccl --model resnet18 --data-dir "$kit_dir/data/fashion-mnist" \
    --batch-size "$batch" --lr 0.1 --momentum 0 --epochs "$n" --log-every "$every" \
    --metrics "$out/$tag.jsonl" "$@" </dev/null
}

mtrain_run() {  # tag, limit, epochs, extra flags...
  local tag=$1 limit=$2 n=$3; shift 3
  mtrain_recipe "$tag" "$limit" "$n" 256 50 - "$@"
}

# PyTorch's run also prints the rate of steps 21-30 (--log-steps), as mtrain's step events.
torch_run() {  # tag, limit, epochs, extra flags...
  local tag=$1 limit=$2 n=$3 rc; shift 3
  run_limited "$limit" "$out/$tag.log" python3 -m torch.distributed.run --nproc_per_node 1 \
    --master_port $((20000 + RANDOM % 20000)) "$scripts/bench_torch_gpu.py" \
    --data-dir "$kit_dir/data/fashion-mnist" --epochs "$n" --log-steps "$@" </dev/null
  rc=$?
  grep '"framework"' "$out/$tag.log" | sed 's/^\[[^]]*\]://' >"$out/$tag.jsonl"
  return $rc
}

# mtrain float32 runs EPOCHS epochs (the accuracy goal); the others SPEED_EPOCHS, enough
# for one epoch after the first, which carries start-up (autotuning, compilation).
stage_d2l() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local deadline=$((SECONDS + $1)) failed=() tag rc
  local runs=("mtrain-fp32 55" "mtrain-fp32-cudnn-benchmark 30" "mtrain-bf16 35" "torch-fp32 35" "torch-bf16-cl 25"
              "torch-bf16-cl-compile 60")
  local spec limit left
  for spec in "${runs[@]}"; do
    tag=${spec% *} limit=${spec#* }
    left=$((deadline - SECONDS))
    ((left < limit)) && limit=$left
    ((limit < 5)) && { failed+=("$tag(no time left)"); continue; }
    case $tag in
      mtrain-fp32) mtrain_run "$tag" "$limit" "$epochs" ;;
      mtrain-fp32-cudnn-benchmark) mtrain_run "$tag" "$limit" "$speed_epochs" --cudnn-benchmark ;;
      mtrain-bf16) mtrain_run "$tag" "$limit" "$speed_epochs" --amp bf16 ;;
      torch-fp32) torch_run "$tag" "$limit" "$epochs" ;;
      torch-bf16-cl) torch_run "$tag" "$limit" "$speed_epochs" --amp bf16 --channels-last ;;
      torch-bf16-cl-compile) torch_run "$tag" "$limit" "$speed_epochs" --amp bf16 --channels-last --compile ;;
    esac
    rc=$?
    if ((rc == 124 || rc == 137)); then
      failed+=("$tag(timed out after $limit s)")
    elif ((rc != 0)); then
      failed+=("$tag(exit $rc: $(grep -m1 -iE 'error|failed' "$out/$tag.log" | cut -c1-120))")
    fi
  done
  summary_table >"$out/d2l.md"
  cat "$out/d2l.md" >&2
  if ((${#failed[@]} == 0)); then echo "PASS|$(accuracy_note)"; else echo "FAIL|${failed[*]}; $(accuracy_note)"; fi
}

# The recipe's accuracy in mtrain and in PyTorch eager, both float32 (summary_table wrote
# it): whether the goal is the recipe's or the trainer's.
accuracy_note() { cat "$out/d2l-accuracy.txt" 2>/dev/null || echo "no accuracy"; }

summary_table() {
  python3 - "$out" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
accuracy = {"mtrain-fp32": "finished no epoch", "torch-fp32": "finished no epoch"}
print("| run | epochs | first epoch s | median later epoch s | median img/s | test acc after last |")
print("|---|---|---|---|---|---|")
for tag in ["mtrain-fp32", "mtrain-fp32-cudnn-benchmark", "mtrain-bf16", "torch-fp32", "torch-bf16-cl",
            "torch-bf16-cl-compile"]:
    f = out / f"{tag}.jsonl"
    events = []
    if f.exists():
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event", "epoch") == "epoch" and "sec" in e:
                events.append(e)
    if not events:
        print(f"| {tag} | 0 | - | - | - | - |")
        continue
    steady = events[1:] or events  # the first epoch carries start-up (autotuning, compile)
    print(f"| {tag} | {len(events)} | {events[0]['sec']:.2f} | {statistics.median(e['sec'] for e in steady):.2f} "
          f"| {statistics.median(e['img_per_s'] for e in steady):,.0f} | {events[-1].get('test_acc')} |")
    if tag in accuracy:
        accuracy[tag] = f"test accuracy {events[-1].get('test_acc')} after {len(events)} epochs"
(out / "d2l-accuracy.txt").write_text("; ".join(f"{tag} {note}" for tag, note in accuracy.items()) + "\n")
EOF
}

stage_ddp() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local deadline=$((SECONDS + $1)) common rc notes=()
  # One step: resnet18 runs are chaotic, float32 rounding differences (flipped ReLUs)
  # grow about tenfold a step (H200: 9.3e-6 after one step, 1.8e-3 after three, 0.087
  # after ten), so later steps compare rounding, not the data-parallel arithmetic.
  common=(train --device cuda --model resnet18 --sync-bn --no-tf32 --data-dir "$kit_dir/data/fashion-mnist-mini"
          --max-steps 1 --lr 0.01 --momentum 0 --seed 5 --threads 1)
  run_limited $((deadline - SECONDS)) "$out/ddp-two.log" env CUDA_VISIBLE_DEVICES=0 "$kit_dir/bin/mtrain-launch" \
    --nproc_per_node=2 "${common[@]}" --backend gloo --batch-size 32 --save-final "$out/ddp-two.safetensors" ||
    notes+=("two ranks: exit $?")
  run_limited $((deadline - SECONDS)) "$out/ddp-one.log" env CUDA_VISIBLE_DEVICES=0 "$kit_dir/bin/mtrain-launch" \
    --nproc_per_node=1 "${common[@]}" --batch-size 64 --save-final "$out/ddp-one.safetensors" ||
    notes+=("one rank: exit $?")
  local diff=""
  if ((${#notes[@]} == 0)); then
    diff=$(python3 - "$out/ddp-two.safetensors" "$out/ddp-one.safetensors" <<'EOF' 2>&1
import sys
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert a.keys() == b.keys(), "different tensors"
worst = max((float(abs(a[k].astype("float64") - b[k].astype("float64")).max()), k) for k in a)
print(f"{worst[0]} {worst[1]}")
EOF
    ) || notes+=("compare: $diff")
  fi
  local left=$((deadline - SECONDS))
  # Up to 256 MiB: each row fills and checks its buffers on the host 25 times, and a
  # 1 GiB row alone took longer than the stage (H200, first run).
  ((left > 3)) && run_limited "$left" "$out/bench-nccl.log" "$kit_dir/bin/mtrain-launch" --nproc_per_node=1 bench \
    --backend nccl --op allgather -b 1M -e 256M -f 4 -w 5 -n 20 || notes+=("nccl bench: exit $?")
  if ((${#notes[@]})); then
    echo "FAIL|${notes[*]}"
  elif python3 -c "import sys; sys.exit(0 if float('${diff% *}') <= 1e-4 else 1)"; then
    echo "PASS|max |two ranks - one rank| over the weights = $diff (tolerance 1e-4); nccl allgather: $(tail -1 "$out/bench-nccl.log" | awk '{print $4 " GB/s at " $1 " B"}')"
  else
    echo "FAIL|max |two ranks - one rank| over the weights = $diff, over the 1e-4 tolerance"
  fi
}

# The numerics flags whose cost on a real GPU is unknown (docs/gpu.md, Status): what
# --cudnn-benchmark keeps reserved (the allocator never splits a block, so a trial's
# workspace may stay), and whether --no-tf32 finds float32 algorithms at all.
stage_flags() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local deadline=$((SECONDS + $1)) tag notes=() left
  # "trace" is plain with --trace over the measured steps: the host's time per phase,
  # which shows where it waits for the GPU (a phase as long as its GPU work).
  for tag in plain cudnn-benchmark no-tf32 trace; do
    left=$((deadline - SECONDS))
    ((left < 3)) && { notes+=("$tag: no time left"); continue; }
    local extra=()
    case $tag in
      plain) ;;
      trace) extra=(--trace "$work/flags-trace" --trace-steps 21:30) ;;
      *) extra=("--$tag") ;;
    esac
    run_limited "$left" "$out/flags-$tag.log" "$kit_dir/bin/mtrain-train" --device cuda --model resnet18 \
      --data-dir "$kit_dir/data/fashion-mnist" --batch-size 256 --lr 0.1 --max-steps 30 --log-every 10 --no-eval \
      --metrics "$out/flags-$tag.jsonl" "${extra[@]}" || notes+=("$tag: exit $?")
  done
  local table
  table=$(python3 - "$out" "$work/flags-trace/rank-0.json" <<'EOF'
import collections, json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = []
# Steps 21-30 (the last step event): the first steps plan (and with --cudnn-benchmark
# time) every convolution.
for tag in ["plain", "cudnn-benchmark", "no-tf32"]:
    f = out / f"flags-{tag}.jsonl"
    events = [json.loads(l) for l in f.read_text().splitlines()] if f.exists() else []
    steps = [e for e in events if e.get("event") == "step"]
    epochs = [e for e in events if e.get("event") == "epoch"]
    if steps and epochs:
        parts.append(f"{tag} {steps[-1]['img_per_s']:,.0f} img/s (steps 21-30), "
                     f"{epochs[-1].get('cuda_reserved_mib', 0):,.0f} MiB reserved")
    else:
        parts.append(f"{tag}: no result")
try:
    spans = collections.defaultdict(float)
    trace = json.loads(pathlib.Path(sys.argv[2]).read_text())
    for e in trace.get("traceEvents", trace) if isinstance(trace, dict) else trace:
        if e.get("ph") == "X":
            spans[e["name"]] += e.get("dur", 0) / 1000 / 10  # ms per step, 10 steps
    top = sorted(spans.items(), key=lambda kv: -kv[1])[:8]
    parts.append("host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
except (OSError, ValueError) as e:
    parts.append(f"trace: {e}")
print("; ".join(parts))
EOF
  )
  if ((${#notes[@]})); then echo "FAIL|${notes[*]}; $table"; else echo "PASS|$table"; fi
}

# ---- speed -------------------------------------------------------------------------------

# Whether SPEED_CONFIGS (a comma-separated list of tags; empty: all) selects a tag at a
# batch: the first batch of SPEED_BATCHES runs every configuration, the others only those
# of SPEED_LARGE (the baseline, the combinations and the references: a host-bound step
# gains per image with the batch, a GPU-bound one does not, and these tell which).
speed_selected() {  # tag, batch
  [[ -z $speed_only || ",$speed_only," == *",$1,"* ]] || return 1
  [[ $2 == "${speed_batches%% *}" || -n $speed_only || " $speed_large " == *" $1 "* ]]
}

# A run's share of its stage, in seconds: what its start, two epochs and its planning
# need on an H200 (mtrain ~4 s to start and 3.5 s an epoch at batch 256; PyTorch ~10 s to
# start, torch.compile ~40 s more) with room to spare; the stage's deadline caps it too.
speed_share() {  # mtrain|torch, flags
  local share
  if [[ $1 == mtrain ]]; then share=22; else share=35; fi
  [[ " $2 " == *" --cudnn-benchmark "* ]] && share=$((share + 8))
  [[ " $2 " == *" --amp "* && $1 == mtrain ]] && share=$((share + 8))
  [[ " $2 " == *" --compile "* ]] && share=$((share + 60))
  echo "$share"
}

# What a run's exit status means. A binary without a switch (an unknown flag, or an
# unknown name in MTRAIN_SPEEDUPS) exits 2 with a line naming it: "not built".
run_status() {  # exit status, limit, log, MTRAIN_SPEEDUPS, flags
  local rc=$1 limit=$2 log=$3 speedups=$4 flags=$5 names w
  case $rc in
    0) echo "ok"; return ;;
    124 | 137) echo "timed out after $limit s"; return ;;
  esac
  names="MTRAIN_SPEEDUPS"
  for w in ${speedups//,/ }; do [[ $w == all ]] || names+="|$w"; done
  for w in $flags; do [[ $w == --* ]] && names+="|$w"; done
  if ((rc == 2)) && grep -qiE -- "error.*($names)" "$log" 2>/dev/null; then
    echo "not built: $(grep -m1 -iE -- "error.*($names)" "$log" | sed 's/^\[[^]]*\] *//' | cut -c1-140)"
  else
    echo "exit $rc: $(grep -m1 -iE 'error|failed' "$log" 2>/dev/null | cut -c1-140)"
  fi
}

# One configuration at one batch size: $out/speed/<tag>-b<batch>.{log,jsonl,status}, a
# copy of the JSON lines and the status in $state/speed for a later call.
speed_run() {  # deadline, mtrain|torch, batch, tag, MTRAIN_SPEEDUPS or -, flags or -
  local deadline=$1 who=$2 batch=$3 tag=$4 speedups=$5 flags=$6
  local name=$tag-b$batch share left rc status flag_args
  speed_selected "$tag" "$batch" || return 0
  [[ $speedups == - ]] && speedups=""
  [[ $flags == - ]] && flags=""
  read -r -a flag_args <<<"$flags"
  rm -f "$out/speed/$name".* "$state/speed/$name".* 2>/dev/null
  share=$(speed_share "$who" "$flags")
  left=$((deadline - SECONDS))
  ((left < share)) && share=$left
  if ((share < 8)); then
    status="no time left"
  else
    if [[ $who == mtrain ]]; then
      mtrain_recipe "speed/$name" "$share" "$speed_epochs" "$batch" 10 "$speedups" --no-eval "${flag_args[@]}"
    else
      torch_run "speed/$name" "$share" "$speed_epochs" --batch-size "$batch" --no-eval "${flag_args[@]}"
    fi
    rc=$?
    status=$(run_status "$rc" "$share" "$out/speed/$name.log" "$speedups" "$flags")
  fi
  echo "$status" >"$out/speed/$name.status"
  echo "$kit_commit" >"$out/speed/$name.kit"
  cp "$out/speed/$name".{status,kit} "$state/speed/" 2>/dev/null
  [[ -s $out/speed/$name.jsonl ]] && cp "$out/speed/$name.jsonl" "$state/speed/" 2>/dev/null
  speed_ran+=("$name")
  echo "  $name: $status" >&2
}

# Every configuration, in both tables' order, one a line: who, tag, MTRAIN_SPEEDUPS, flags, stage.
speed_manifest() {
  speed_configs | awk '{ f = ""; for (i = 3; i <= NF; i++) f = f (i > 3 ? " " : "") $i; printf "mtrain\t%s\t%s\t%s\tspeed\n", $1, $2, f }'
  torch_refs | awk '{ f = ""; for (i = 3; i <= NF; i++) f = f (i > 3 ? " " : "") $i; printf "torch\t%s\t-\t%s\t%s\n", $1, f, $2 }'
}

# Runs, at one batch, the manifest's configurations that `pick` (called with who, tag and
# stage) accepts, in the manifest's order.
speed_runs() {  # deadline, batch, pick
  local deadline=$1 batch=$2 pick=$3 line fields
  for line in "${manifest[@]}"; do
    IFS=$'\t' read -r -a fields <<<"$line"
    "$pick" "${fields[0]}" "${fields[1]}" "${fields[4]}" || continue
    if [[ ${fields[0]} == mtrain ]]; then
      speed_run "$deadline" mtrain "$batch" "${fields[1]}" "${fields[2]}" "${fields[3]}"
    else
      speed_run "$deadline" torch "$batch" "${fields[1]}" - "${fields[3]}"
    fi
  done
}
pick_baseline() { [[ $1 == mtrain && $2 == baseline ]]; }
pick_switches() { [[ $1 == mtrain && $2 != baseline ]]; }
pick_eager() { [[ $1 == torch && $3 == speed ]]; }
pick_references() { [[ $1 == torch && $3 == speed-ref ]]; }

stage_speed() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local deadline=$((SECONDS + $1)) batch
  local -a manifest  # read by speed_runs
  mapfile -t manifest < <(speed_manifest)
  speed_ran=()
  for batch in $speed_batches; do
    # The baseline, then PyTorch eager float32, then the switches: the ratios' runs first.
    speed_runs "$deadline" "$batch" pick_baseline
    speed_runs "$deadline" "$batch" pick_eager
    speed_runs "$deadline" "$batch" pick_switches
  done
  speed_result
}

stage_speed_ref() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local deadline=$((SECONDS + $1)) batch
  local -a manifest  # read by speed_runs
  mapfile -t manifest < <(speed_manifest)
  speed_ran=()
  # Batch 256 first (the ratios'), the compiled run last at each batch (the longest).
  for batch in $speed_batches; do speed_runs "$deadline" "$batch" pick_references; done
  speed_result
}

# Whether each run of this stage with --cuda-graphs replayed a captured step, and each with
# MTRAIN_SPEEDUPS=amp-activations passed 16-bit activations on: its log's first
# "--cuda-graphs:" and "speedup amp-activations:" lines (captured or stored, or not used and
# why), so the table's figures for those runs are read as what they are.
switch_lines() {
  local name line pattern lines=()
  for name in "${speed_ran[@]}"; do
    for pattern in '--cuda-graphs: ' 'speedup amp-activations: '; do
      line=$(grep -h -m1 -e "$pattern" "$out/speed/$name.log" 2>/dev/null |
        sed -E 's/^(\[[^]]*\][: ]*)+//' | cut -c1-170)
      [[ -n $line ]] && lines+=("- $name: $line")
    done
  done
  ((${#lines[@]} > 0)) || return 0
  printf '\nGraphs and 16-bit activations (the first --cuda-graphs and amp-activations lines of each run):\n\n'
  printf '%s\n' "${lines[@]}"
}

# The speed table and the two ratio lines into $out/speed.md (shown in the stage's log),
# then the stage's result: PASS unless a run of this stage failed, timed out or found no
# time left ("not built" is no failure).
speed_result() {
  speed_manifest >"$out/speed/manifest.tsv"
  speed_table >"$out/speed.md" 2>>"$out/speed/table.log"
  switch_lines >>"$out/speed.md"
  cat "$out/speed.md" >&2
  local name status failed=() not_built=0 ok=0 again_tags="" again_batches=""
  for name in "${speed_ran[@]}"; do
    status=$(cat "$out/speed/$name.status" 2>/dev/null)
    case $status in
      ok) ok=$((ok + 1)) ;;
      "not built"*) not_built=$((not_built + 1)) ;;
      *)
        failed+=("$name(${status%%:*})")
        [[ ",$again_tags," == *",${name%-b*},"* ]] || again_tags+="${again_tags:+,}${name%-b*}"
        [[ " $again_batches " == *" ${name##*-b} "* ]] || again_batches+="${again_batches:+ }${name##*-b}"
        ;;
    esac
  done
  local note="$ok of ${#speed_ran[@]} runs measured, $not_built not built"
  local ratios
  ratios=$(grep -E '^(fp32 vs eager|best vs best):' "$out/speed.md" | cut -d'(' -f1 | sed 's/ *$//' | paste -sd';' | sed 's/;/; /')
  [[ -n $ratios ]] && note="$ratios; $note"
  if ((${#speed_ran[@]} == 0)); then
    echo "FAIL|no configuration selected (SPEED_CONFIGS=$speed_only)"
  elif ((${#failed[@]})); then
    echo "FAIL|$note; failed: ${failed[*]}; again: SPEED_BATCHES='$again_batches' SPEED_CONFIGS=$again_tags"
  else
    echo "PASS|$note"
  fi
}

# Per configuration and batch: img/s of steps 21-30 (mtrain's step event at step 30,
# PyTorch's --log-steps line), the median img/s of the whole epochs after the first, and
# that against mtrain's baseline and PyTorch eager float32 at the same batch. A result
# this call lacks comes from an earlier call on this machine ($state), marked so.
speed_table() {
  python3 - "$out/speed" "$state/speed" "$kit_commit" "$speed_batches" <<'EOF'
import json, pathlib, statistics, sys
here, earlier, commit, batches = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4].split()
configs = [line.split("\t") for line in (here / "manifest.tsv").read_text().splitlines() if line.strip()]

def load(name):
    """(status, step img/s, epoch img/s, epochs, where) of one run."""
    for d, where in ((here, ""), (earlier, "earlier call")):
        status_file = d / f"{name}.status"
        if not status_file.exists():
            continue
        status = status_file.read_text().strip()
        kit = (d / f"{name}.kit").read_text().strip() if (d / f"{name}.kit").exists() else "?"
        if where and kit != commit:
            where += f", kit {kit}"
        steps, epochs = [], []
        f = d / f"{name}.jsonl"
        for line in (f.read_text().splitlines() if f.exists() else []):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "step" and (e.get("step") == 30 or "steps" in e):
                steps.append(e["img_per_s"])
            elif e.get("event", "epoch") == "epoch" and "img_per_s" in e and not e.get("partial"):
                epochs.append(e["img_per_s"])
        step = steps[-1] if steps else None
        epoch = statistics.median(epochs[1:]) if len(epochs) > 1 else None
        return status, step, epoch, len(epochs), where
    return None

rows, results = [], {}
for batch in batches:
    for who, tag, speedups, flags, stage in configs:
        r = load(f"{tag}-b{batch}")
        if r:
            results[(tag, batch)] = r

def rate(tag, batch):
    r = results.get((tag, batch))
    return r[2] if r else None

def fmt(v):
    return f"{v:,.0f}" if v else "-"

def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"

print("| configuration | batch | MTRAIN_SPEEDUPS | flags | img/s steps 21-30 | img/s epochs 2+ (median) "
      "| / mtrain baseline | / PyTorch eager fp32 | status |")
print("|---|---|---|---|---|---|---|---|---|")
for batch in batches:
    base, eager = rate("baseline", batch), rate("torch-fp32", batch)
    for who, tag, speedups, flags, stage in configs:
        r = results.get((tag, batch))
        if not r:
            continue
        status, step, epoch, n, where = r
        if status == "ok" and epoch is None:
            status = f"ok, {n} whole epoch(s): no epoch after the first"
        name = tag if who == "mtrain" else f"PyTorch {tag}"
        print(f"| {name} | {batch} | {speedups if speedups != '-' else ''} | {flags if flags != '-' else ''} "
              f"| {fmt(step)} | {fmt(epoch)} | {ratio(epoch, base)} | {ratio(epoch, eager)} "
              f"| {status}{f' ({where})' if where else ''} |")

# The two lines a person copies: batch 256 (the recipe's), whole epochs.
batch = "256" if "256" in batches else batches[0]
eager = rate("torch-fp32", batch)
mtrain = [(rate(tag, batch), tag, flags) for who, tag, _, flags, _ in configs if who == "mtrain" and rate(tag, batch)]
fp32 = [m for m in mtrain if "--amp" not in m[2].split()]
torch_all = [(rate(tag, batch), tag) for who, tag, _, _, _ in configs if who == "torch" and rate(tag, batch)]
torch_missing = [tag for who, tag, _, _, _ in configs if who == "torch" and not rate(tag, batch)]
print()
if fp32 and eager:
    best = max(fp32)
    print(f"fp32 vs eager: {best[0] / eager:.2f} (mtrain {best[1]} {best[0]:,.0f} img/s over PyTorch eager float32 "
          f"{eager:,.0f} img/s, batch {batch}, whole epochs; the baseline: {ratio(rate('baseline', batch), eager)})")
else:
    print(f"fp32 vs eager: n/a (batch {batch}: {'no mtrain float32 configuration' if not fp32 else ''}"
          f"{' and ' if not fp32 and not eager else ''}{'no PyTorch eager float32' if not eager else ''} measured)")
print()
if mtrain and torch_all:
    best, ref = max(mtrain), max(torch_all)
    missing = f"; not measured: {', '.join(torch_missing)} (speed-ref)" if torch_missing else ""
    print(f"best vs best: {best[0] / ref[0]:.2f} (mtrain {best[1]} {best[0]:,.0f} img/s over PyTorch {ref[1]} "
          f"{ref[0]:,.0f} img/s, batch {batch}, whole epochs{missing})")
else:
    print(f"best vs best: n/a (batch {batch}: {'no mtrain' if not mtrain else 'no PyTorch'} configuration measured)")
EOF
}

# ---- profile -----------------------------------------------------------------------------

# A run's wall milliseconds per step at batch 256, from the first of the files that has a
# step event (steps 21-30 in speed's runs; d2l's mtrain logs every 50 steps).
step_wall_ms() {  # jsonl...
  python3 - "$@" <<'EOF' 2>/dev/null
import json, sys
for path in sys.argv[1:]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    steps = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step" and e.get("img_per_s"):
            steps.append(e)
    if steps:
        e = next((s for s in steps if s.get("step") == 30), steps[-1])
        print(f"{256 * 1000 / e['img_per_s']:.3f}")
        break
EOF
}

# Every kernel of a few d2l steps, timed by Nsight Compute (ncu, which these machines
# have; Nsight Systems they lack), for mtrain in each configuration of PROFILE_MTRAIN (tags
# of speed_configs) and for PyTorch eager float32 in the same set-up: the GPU's busy time
# per step against the step's wall time (from speed's steps 21-30, else d2l's) tells
# waiting from working, and the kernel table says where the work goes, by kind
# (scripts/kernel_table.py, Note [Kernel kinds]). --clock-control none leaves the clocks
# as training runs them, --cache-control none the caches as the previous kernel left them;
# gpu__time_duration needs one pass, so nothing is replayed. ncu runs the kernels one at a
# time, so kernels that overlap in training (NCCL's beside backward) add up here.
stage_profile() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [[ -n $ncu ]] || { echo "SKIP|no ncu on PATH, in /usr/local/cuda/bin or /opt/nvidia/nsight-compute"; return; }
  local deadline=$((SECONDS + $1)) notes=() unbuilt=() runs=() walls=() tables=() name tag speedups flags share rc wall
  local profile=("$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum
                 --target-processes all --force-overwrite)
  local -a tags flag_args
  read -r -a tags <<<"$profile_mtrain"
  # The first mtrain configuration, PyTorch, then the other mtrain configurations. Each
  # run gets a share of what is left, the first two twice the others' (an ncu run cut
  # short leaves no report), so a slow one cannot starve the rest.
  runs=("mtrain-${tags[0]}" pytorch)
  for tag in "${tags[@]:1}"; do runs+=("mtrain-$tag"); done
  mkdir -p "$out/profile"
  local i j weights
  for ((i = 0; i < ${#runs[@]}; i++)); do
    name=${runs[i]}
    weights=0
    for ((j = i; j < ${#runs[@]}; j++)); do weights=$((weights + (j < 2 ? 2 : 1))); done
    share=$(((deadline - SECONDS) * (i < 2 ? 2 : 1) / weights))
    ((share < 5)) && { notes+=("$name: no time left"); continue; }
    if [[ $name == pytorch ]]; then
      speedups="" flags=""
      run_limited "$share" "$out/profile/$name.log" "${profile[@]}" --export "$out/profile/$name" \
        python3 -m torch.distributed.run --nproc_per_node 1 --master_port $((20000 + RANDOM % 20000)) \
        "$scripts/bench_torch_gpu.py" --data-dir "$kit_dir/data/fashion-mnist" --epochs 1 \
        --max-steps "$PROFILE_STEPS" --no-eval </dev/null
      rc=$?
      wall=$(step_wall_ms "$out/speed/torch-fp32-b256.jsonl" "$state/speed/torch-fp32-b256.jsonl" "$out/torch-fp32.jsonl")
    else
      tag=${name#mtrain-}
      read -r speedups flags < <(speed_configs | awk -v t="$tag" '$1 == t { f = ""; for (i = 3; i <= NF; i++) f = f " " $i; print $2, f }')
      [[ -n $speedups ]] || { notes+=("$name: no configuration '$tag' in speed_configs"); continue; }
      [[ $speedups == - ]] && speedups=""
      [[ $flags == - ]] && flags=""
      read -r -a flag_args <<<"$flags"
      local envs=(env -u MTRAIN_SPEEDUPS)
      [[ -n $speedups ]] && envs+=("MTRAIN_SPEEDUPS=$speedups")
      run_limited "$share" "$out/profile/$name.log" "${envs[@]}" "${profile[@]}" --export "$out/profile/$name" \
        "$kit_dir/bin/mtrain-launch" --nproc_per_node=1 train --device cuda --backend nccl --model resnet18 \
        --data-dir "$kit_dir/data/fashion-mnist" --batch-size 256 --lr 0.1 --momentum 0 --max-steps "$PROFILE_STEPS" \
        --no-eval "${flag_args[@]}" </dev/null
      rc=$?
      local fallback=()
      [[ $tag == baseline ]] && fallback=("$out/mtrain-fp32.jsonl")
      wall=$(step_wall_ms "$out/speed/$tag-b256.jsonl" "$state/speed/$tag-b256.jsonl" "${fallback[@]}")
    fi
    if ((rc != 0)); then
      local why
      why=$(run_status "$rc" "$share" "$out/profile/$name.log" "${speedups:-}" "${flags:-}")
      [[ $why == "not built"* ]] && { unbuilt+=("$name"); continue; }
      notes+=("$name: $why")
    fi
    if [[ -f $out/profile/$name.ncu-rep ]]; then
      "$ncu" --import "$out/profile/$name.ncu-rep" --csv --page raw --print-kernel-base demangled \
        --print-units base >"$out/profile/$name.csv" 2>>"$out/profile/$name.log"
      tables+=("$name=$out/profile/$name.csv")
      [[ -n $wall ]] && walls+=(--wall "$name=$wall")
    else
      notes+=("$name: no report")
    fi
  done
  local table=""
  if ((${#tables[@]})); then
    table=$(python3 "$scripts/kernel_table.py" --steps "$PROFILE_STEPS" "${walls[@]}" "${tables[@]}" 2>&1 |
            tee "$out/profile.md" | tail -1)
    cat "$out/profile.md" >&2
  fi
  ((${#unbuilt[@]})) && table+=" (not built: ${unbuilt[*]})"
  if ((${#notes[@]})); then echo "FAIL|${notes[*]}; $table"; else echo "PASS|$table"; fi
}

stage_grads() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  mkdir -p "$work/grads"
  run_limited "$1" "$out/grads.log" python3 "$scripts/check_gradients_torch.py" "$kit_dir/bin/mtrain-train" \
    "$kit_dir/data/fashion-mnist-mini" "$work/grads" --run cpu="--device cpu" --run cuda="--device cuda --no-tf32" \
    --run cuda-det="--device cuda --no-tf32 --deterministic"
  local rc=$? last
  cat "$out/grads.log" >&2
  last=$(tail -1 "$out/grads.log")
  if ((rc == 0)); then echo "PASS|$last"; else echo "FAIL|exit $rc: $last"; fi
}

# Issue 43's GPU check: a graph read from ONNX trains as fast as the same network built in
# (the goal: within 3 %). scripts/bench-onnx.py exports d2l's resnet18 with the machine's
# PyTorch (the TorchScript exporter) and alternates the two.
stage_onnx() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  run_limited "$1" "$out/onnx.log" python3 "$scripts/bench-onnx.py" "$kit_dir/bin" --device cuda \
    --data-dir "$kit_dir/data/fashion-mnist" --runs 3 --steps 30 --every 10 --batch 256 --threads 4
  local rc=$? line ratio
  cat "$out/onnx.log" >&2
  line=$(grep -m1 'graph / built-in' "$out/onnx.log")
  ratio=$(sed -n 's|.*graph / built-in: \([0-9.]*\).*|\1|p' <<<"$line")
  if ((rc != 0)); then
    echo "FAIL|exit $rc: $(grep -m1 -iE 'error|Traceback' "$out/onnx.log" | cut -c1-160)"
  elif awk -v r="$ratio" 'BEGIN { exit !(r >= 0.97) }'; then
    echo "PASS|$line"
  else
    echo "FAIL|$line (the goal: 0.97 or more)"
  fi
}

# Issue 44's GPU check: resnet50 at 224 against PyTorch, and whether the streamed JPEG
# pipeline keeps up with it (scripts/bench-imagenet.sh: its table goes to imagenet.md).
stage_imagenet() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  run_limited "$1" "$out/imagenet.log" env PYTHON=python3 bash "$scripts/bench-imagenet.sh" --bin-dir "$kit_dir/bin" \
    --device cuda --work "$work/imagenet"
  local rc=$? lines
  cat "$out/imagenet.log" >&2
  grep -E '^\|' "$out/imagenet.log" >"$out/imagenet.md"
  lines=$(grep -E '^(resnet50 vs PyTorch:|streamed vs synthetic|loader:)' "$out/imagenet.log" | paste -sd';' | sed 's/;/; /g')
  if ((rc == 0)); then echo "PASS|$lines"; else echo "FAIL|exit $rc: ${lines:-$(tail -1 "$out/imagenet.log")}"; fi
}

# xz, or Python's lzma where xz is not installed.
unxz_to_stdout() {
  if command -v xz >/dev/null; then
    xz -dc "$1"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"
  fi
}

xz_from_stdin() {
  if command -v xz >/dev/null; then
    xz -T0 -6
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(sys.stdin.buffer, lzma.open(sys.stdout.buffer, "w", preset=6))'
  fi
}

# summary.md: what a person reads first (the rest is in logs.tar.xz).
write_summary() {  # note for the end (empty when the run is over)
  cat "$out/versions.txt"
  if [[ -f $out/speed.md ]] && grep -qE '^(fp32 vs eager|best vs best):' "$out/speed.md"; then
    echo
    echo "## Ratios"
    echo
    grep -E '^(fp32 vs eager|best vs best):' "$out/speed.md" | awk 'NR > 1 { print "" } { print }'
  fi
  echo
  echo "## Stages"
  echo
  cat "$out/stages.md"
  [[ -f $out/d2l.md ]] && { echo; echo "## d2l recipe ($epochs epochs)"; echo; cat "$out/d2l.md"; }
  [[ -f $out/speed.md ]] && { echo; echo "## Speed ($speed_epochs epochs a run, no evaluation)"; echo; cat "$out/speed.md"; }
  [[ -f $out/profile.md ]] && { echo; echo "## Profile ($PROFILE_STEPS steps)"; cat "$out/profile.md"; }
  [[ -s $out/imagenet.md ]] && { echo; echo "## ResNet-50 at 224"; echo; cat "$out/imagenet.md"; }
  [[ -n $1 ]] && { echo; echo "$1"; }
  return 0
}

# Into $dest: summary.md, logs.tar.xz (everything in $out, under logs/; without ncu's
# reports if they make it too large to come back from a window), stages.md and tests.tsv
# (which tests/kit/test_gpu_kit.sh reads). Each file is replaced whole, so a call cut
# short still returns the stages finished before.
publish() {  # note for summary.md
  local note=$1 max=$((15 * 1048576))
  tar -C "$(dirname "$out")" -cf - "$(basename "$out")" 2>/dev/null | xz_from_stdin >"$dest/logs.tar.xz.tmp"
  if (($(stat -c %s "$dest/logs.tar.xz.tmp") > max)); then
    tar -C "$(dirname "$out")" --exclude='*.ncu-rep' -cf - "$(basename "$out")" 2>/dev/null | xz_from_stdin >"$dest/logs.tar.xz.tmp"
    note="${note:+$note }(logs.tar.xz leaves out ncu's reports: over 15 MiB with them)"
  fi
  mv "$dest/logs.tar.xz.tmp" "$dest/logs.tar.xz"
  write_summary "$note" >"$dest/summary.md.tmp" && mv "$dest/summary.md.tmp" "$dest/summary.md"
  cp "$out/stages.md" "$dest/stages.md"
  [[ -f $out/tests.tsv ]] && cp "$out/tests.tsv" "$dest/tests.tsv"
  return 0
}

run_kit() {
  local archive=${1:-$root/.gpu-kit}/$kit_name
  shift || true
  [[ -f $archive ]] || die "no kit at $archive (make it with 'scripts/gpu-kit.sh pack' where the toolchain is)"
  local stages=("$@")
  ((${#stages[@]})) || mapfile -t stages < <(stage_table | awk '{ print $1 }')
  local s
  for s in "${stages[@]}"; do [[ -n $(stage_limit "$s") ]] || die "unknown stage '$s' (see 'scripts/gpu-kit.sh stages')"; done

  dest=${OUT:-$root/runs/gpu-kit}
  epochs=${EPOCHS:-4}
  speed_epochs=${SPEED_EPOCHS:-2}
  speed_batches=${SPEED_BATCHES:-256 1024}
  speed_only=${SPEED_CONFIGS:-}
  speed_large=${SPEED_LARGE:-baseline speedups fp32-all best torch-fp32 torch-bf16-cl}
  PROFILE_STEPS=${PROFILE_STEPS:-3}
  profile_mtrain=${PROFILE_MTRAIN:-baseline speedups}
  kit_dir=${KIT_WORK:-/tmp/mtrain-gpu-kit}
  state=${KIT_STATE:-/tmp/mtrain-gpu-kit-state}
  mkdir -p "$dest" || die "cannot write $dest"
  dest=$(cd "$dest" && pwd)
  rm -f "$dest"/{summary.md,logs.tar.xz,stages.md,tests.tsv}
  rm -rf "$kit_dir"
  mkdir -p "$kit_dir" || die "cannot write $kit_dir"
  unxz_to_stdout "$archive" | tar -C "$kit_dir" -xf - || die "could not unpack $archive"
  scripts=${KIT_SCRIPTS:-$kit_dir/scripts}
  [[ -f $scripts/bench_torch_gpu.py ]] || die "no bench_torch_gpu.py in $scripts (KIT_SCRIPTS)"
  scripts=$(cd "$scripts" && pwd)
  kit_commit=$(head -1 "$kit_dir/commit")
  work=$(mktemp -d)
  # Logs, JSON lines and tables: $out, archived into $dest/logs.tar.xz after each stage.
  out=$work/logs
  mkdir -p "$out/speed" "$state/speed" || die "cannot write $out or $state"
  mapfile -t cuda_dirs < <(cuda_lib_dirs)
  local path_list
  path_list=$(printf '%s:' "$kit_dir/lib" "${cuda_dirs[@]}")
  export LD_LIBRARY_PATH=${path_list%:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONUNBUFFERED=1

  write_versions
  echo "scripts: $scripts" | tee -a "$out/versions.txt"
  check_libraries | tee "$out/libraries.txt"
  no_gpu=""
  if ! command -v nvidia-smi >/dev/null; then
    no_gpu="nvidia-smi is not installed (no NVIDIA driver)"
  elif ! nvidia-smi -L >/dev/null 2>&1; then
    no_gpu="nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -1)"
  fi
  printf '| stage | status | seconds | note |\n|---|---|---|---|\n' >"$out/stages.md"
  # The sanitizer runs beside the tests (Note [Kit time budget] in docs/gpu.md): neither
  # times anything, and the GPU has room for both.
  local beside="" beside_pid="" s_start=$SECONDS
  if [[ " ${stages[*]} " == *" tests "* && " ${stages[*]} " == *" sanitizer "* ]]; then
    beside=$out/sanitizer.result
    stage_sanitizer "$(stage_limit sanitizer)" 2>"$out/sanitizer.stage.log" | tail -1 >"$beside" &
    beside_pid=$!
  fi
  local start result i
  for ((i = 0; i < ${#stages[@]}; i++)); do
    s=${stages[i]}
    start=$SECONDS
    if [[ $s == sanitizer && -n $beside ]]; then
      echo "== sanitizer (beside the tests, limit $(stage_limit sanitizer) s)"
      wait "$beside_pid"
      result=$(cat "$beside")
      start=$s_start
    else
      echo "== $s (limit $(stage_limit "$s") s)"
      # The stage's own lines (tables, per-run notes) go to its log and are shown after it.
      result=$("stage_${s//-/_}" "$(stage_limit "$s")" 2>"$out/$s.stage.log" | tail -1)
      cat "$out/$s.stage.log"
    fi
    [[ $result == *"|"* ]] || result="FAIL|the stage printed no result"
    record "$s" "${result%%|*}" $((SECONDS - start)) "${result#*|}"
    echo "   ${result%%|*}: ${result#*|}"
    if ((i + 1 < ${#stages[@]})); then
      publish "(run in progress after ${SECONDS} s: ${stages[*]:i+1} not yet run)"
    fi
  done
  publish ""
  echo
  cat "$dest/summary.md"
  echo
  echo "gpu-kit.sh run: $dest: $(cd "$dest" && ls | paste -sd' '), after ${SECONDS} s"
  rm -rf "$work"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run_kit "$@" ;;
  stages) stage_table ;;
  -h | --help | "") usage ;;
  *) die "unknown command '$1' (pack, run or stages; see --help)" ;;
esac
