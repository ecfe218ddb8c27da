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
# prints the versions, then runs the stages (all, or those named), each under its own
# time limit; a failed stage never stops the next. Logs, JSON lines and summary.md go to
# $OUT (default runs/gpu-kit). EPOCHS (default 4): mtrain float32's epochs (its test
# accuracy is a goal); SPEED_EPOCHS (default 2): every other training run's.
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
profile     80 every kernel of PROFILE_STEPS (3) d2l steps under ncu, mtrain and PyTorch eager: GPU ms per step, top kernels
EOF
}
stage_limit() { stage_table | awk -v s="$1" '$1 == s { print $2 }'; }

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
  cp "$build"/bin/mtrain-{train,launch,bench} "$stage/bin/"
  for b in "${test_bins[@]}" nccl_test_worker; do cp "$build/tests/$b" "$stage/tests/"; done
  printf '%s\n' "$manifest" >"$stage/tests/gpu-tests.tsv"
  cp -r "$root/data/fashion-mnist-mini" "$stage/data/"
  mkdir -p "$stage/data/fashion-mnist"
  cp "$data"/*-ubyte.gz "$stage/data/fashion-mnist/"
  cp "$root"/scripts/bench_torch_gpu.py "$root"/scripts/bench_torch_train.py \
    "$root"/scripts/check_gradients_torch.py "$root"/scripts/kernel_table.py "$stage/scripts/"

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

# One training run of the d2l recipe; its epoch JSON lines go to $out/<tag>.jsonl.
mtrain_run() {  # tag, limit, epochs, extra flags...
  local tag=$1 limit=$2 n=$3; shift 3
  run_limited "$limit" "$out/$tag.log" "$kit_dir/bin/mtrain-launch" --nproc_per_node=1 train \
    --device cuda --backend nccl --model resnet18 --data-dir "$kit_dir/data/fashion-mnist" \
    --batch-size 256 --lr 0.1 --momentum 0 --epochs "$n" --log-every 50 \
    --metrics "$out/$tag.jsonl" "$@"
}

torch_run() {  # tag, limit, epochs, extra flags...
  local tag=$1 limit=$2 n=$3 rc; shift 3
  run_limited "$limit" "$out/$tag.log" python3 -m torch.distributed.run --nproc_per_node 1 \
    --master_port $((20000 + RANDOM % 20000)) "$kit_dir/scripts/bench_torch_gpu.py" \
    --data-dir "$kit_dir/data/fashion-mnist" --epochs "$n" "$@"
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

# Every kernel of a few d2l steps, timed by Nsight Compute (ncu, which these machines
# have; Nsight Systems they lack), for mtrain and for PyTorch eager in the same set-up:
# the GPU's busy time per step against the step's wall time tells waiting from working,
# and the kernel table says where the work goes. --clock-control none leaves the clocks
# as training runs them, --cache-control none the caches as the previous kernel left them;
# gpu__time_duration needs one pass, so nothing is replayed. ncu runs the kernels one at a
# time, so kernels that overlap in training (NCCL's beside backward) add up here.
stage_profile() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [[ -n $ncu ]] || { echo "SKIP|no ncu on PATH, in /usr/local/cuda/bin or /opt/nvidia/nsight-compute"; return; }
  local half=$(($1 / 2)) notes=() tag
  local profile=("$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum
                 --target-processes all --force-overwrite)
  run_limited "$half" "$out/profile-mtrain.log" "${profile[@]}" --export "$work/profile-mtrain" \
    "$kit_dir/bin/mtrain-launch" --nproc_per_node=1 train --device cuda --backend nccl --model resnet18 \
    --data-dir "$kit_dir/data/fashion-mnist" --batch-size 256 --lr 0.1 --momentum 0 --max-steps "$PROFILE_STEPS" \
    --no-eval || notes+=("mtrain: exit $?")
  run_limited "$half" "$out/profile-torch.log" "${profile[@]}" --export "$work/profile-torch" \
    python3 -m torch.distributed.run --nproc_per_node 1 --master_port $((20000 + RANDOM % 20000)) \
    "$kit_dir/scripts/bench_torch_gpu.py" --data-dir "$kit_dir/data/fashion-mnist" --epochs 1 \
    --max-steps "$PROFILE_STEPS" --no-eval || notes+=("torch: exit $?")
  for tag in mtrain torch; do
    [[ -f $work/profile-$tag.ncu-rep ]] &&
      "$ncu" --import "$work/profile-$tag.ncu-rep" --csv --page raw --print-kernel-base function \
        --print-units base >"$out/profile-$tag.csv" 2>>"$out/profile-$tag.log"
  done
  local table
  table=$(python3 "$kit_dir/scripts/kernel_table.py" --steps "$PROFILE_STEPS" \
    mtrain="$out/profile-mtrain.csv" pytorch="$out/profile-torch.csv" 2>&1 | tee "$out/profile.md" | tail -1)
  cat "$out/profile.md" >&2
  if ((${#notes[@]})); then echo "FAIL|${notes[*]}; $table"; else echo "PASS|$table"; fi
}

stage_grads() {
  [[ -n $no_gpu ]] && { echo "SKIP|no GPU: $no_gpu"; return; }
  mkdir -p "$work/grads"
  run_limited "$1" "$out/grads.log" python3 "$kit_dir/scripts/check_gradients_torch.py" "$kit_dir/bin/mtrain-train" \
    "$kit_dir/data/fashion-mnist-mini" "$work/grads" --run cpu="--device cpu" --run cuda="--device cuda --no-tf32" \
    --run cuda-det="--device cuda --no-tf32 --deterministic"
  local rc=$? last
  cat "$out/grads.log" >&2
  last=$(tail -1 "$out/grads.log")
  if ((rc == 0)); then echo "PASS|$last"; else echo "FAIL|exit $rc: $last"; fi
}

# xz, or Python's lzma where xz is not installed.
unxz_to_stdout() {
  if command -v xz >/dev/null; then
    xz -dc "$1"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"
  fi
}

run_kit() {
  local archive=${1:-$root/.gpu-kit}/$kit_name
  shift || true
  [[ -f $archive ]] || die "no kit at $archive (make it with 'scripts/gpu-kit.sh pack' where the toolchain is)"
  local stages=("$@")
  ((${#stages[@]})) || mapfile -t stages < <(stage_table | awk '{ print $1 }')
  local s
  for s in "${stages[@]}"; do [[ -n $(stage_limit "$s") ]] || die "unknown stage '$s' (see 'scripts/gpu-kit.sh stages')"; done

  out=${OUT:-$root/runs/gpu-kit}
  epochs=${EPOCHS:-4}
  speed_epochs=${SPEED_EPOCHS:-2}
  PROFILE_STEPS=${PROFILE_STEPS:-3}
  kit_dir=${KIT_WORK:-/tmp/mtrain-gpu-kit}
  mkdir -p "$out" || die "cannot write $out"
  out=$(cd "$out" && pwd)
  rm -rf "$kit_dir"
  mkdir -p "$kit_dir" || die "cannot write $kit_dir"
  unxz_to_stdout "$archive" | tar -C "$kit_dir" -xf - || die "could not unpack $archive"
  work=$(mktemp -d)
  mapfile -t cuda_dirs < <(cuda_lib_dirs)
  local path_list
  path_list=$(printf '%s:' "$kit_dir/lib" "${cuda_dirs[@]}")
  export LD_LIBRARY_PATH=${path_list%:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONUNBUFFERED=1

  write_versions
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
  local start result
  for s in "${stages[@]}"; do
    start=$SECONDS
    if [[ $s == sanitizer && -n $beside ]]; then
      echo "== sanitizer (beside the tests, limit $(stage_limit sanitizer) s)"
      wait "$beside_pid"
      result=$(cat "$beside")
      start=$s_start
    else
      echo "== $s (limit $(stage_limit "$s") s)"
      # The stage's own lines (tables, per-run notes) go to its log and are shown after it.
      result=$("stage_$s" "$(stage_limit "$s")" 2>"$out/$s.stage.log" | tail -1)
      cat "$out/$s.stage.log"
    fi
    [[ $result == *"|"* ]] || result="FAIL|the stage printed no result"
    record "$s" "${result%%|*}" $((SECONDS - start)) "${result#*|}"
    echo "   ${result%%|*}: ${result#*|}"
  done
  {
    echo
    echo "## Stages"
    cat "$out/stages.md"
    [[ -f $out/d2l.md ]] && { echo; echo "## d2l recipe ($epochs epochs)"; cat "$out/d2l.md"; }
  } >"$out/summary.md"
  cat "$out/versions.txt" "$out/summary.md" >"$out/summary.tmp" && mv "$out/summary.tmp" "$out/summary.md"
  echo
  cat "$out/summary.md"
  rm -rf "$work"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run_kit "$@" ;;
  stages) stage_table ;;
  -h | --help | "") usage ;;
  *) die "unknown command '$1' (pack, run or stages; see --help)" ;;
esac
