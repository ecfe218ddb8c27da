#!/usr/bin/env bash
# test_gpu_kit.sh SOURCE_DIR: the packed GPU kit (MTRAIN_GPU_KIT, default
# SOURCE_DIR/.gpu-kit) unpacked into an empty folder and run there, on this machine.
set -uo pipefail
src=$1
kit_dir=${MTRAIN_GPU_KIT:-$src/.gpu-kit}
archive=$kit_dir/mtrain-gpu-kit.tar.xz
[[ -f $archive ]] || { echo "SKIPPED: no kit at $archive (scripts/gpu-kit.sh pack makes one)"; exit 77; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

mkdir "$tmp/kit"
xz -dc "$archive" | tar -C "$tmp/kit" -xf - || { echo "FAIL: cannot unpack $archive"; exit 1; }

# 1. Every library a binary loads comes from the kit, unless the GPU machine brings it
#    (the list gpu-kit.sh leaves out): a library missing from the kit resolves to this
#    machine's copy here and is named.
provided='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libnccl)\.so'
cuda_path=/usr/local/cuda/lib64
for f in "$tmp"/kit/bin/* "$tmp"/kit/tests/*; do
  [[ $f == *.tsv ]] && continue
  while read -r name arrow path _; do
    [[ $arrow == "=>" ]] || continue
    [[ $path == "$tmp/kit/lib/"* ]] && continue
    [[ $name =~ $provided ]] && continue
    fail "$(basename "$f") loads $name from $path, not from the kit"
  done < <(LD_LIBRARY_PATH=$tmp/kit/lib:$cuda_path ldd "$f")
  LD_LIBRARY_PATH=$tmp/kit/lib:$cuda_path ldd "$f" | grep -q 'not found' && fail "$(basename "$f"): a library is not found"
done

# 2. The binaries start from the unpacked folder.
for b in mtrain-train mtrain-launch mtrain-bench mtrain-bench-loader mtrain-pack; do
  LD_LIBRARY_PATH=$tmp/kit/lib:$cuda_path "$tmp/kit/bin/$b" --help >"$tmp/help.txt" 2>&1 ||
    fail "$b --help exited $? from the kit: $(head -3 "$tmp/help.txt")"
done

# 3. `run` on this machine: every stage ends with a status and a note; without a GPU
#    every gpu test binary starts and skips (77), which also proves it loads.
OUT=$tmp/out KIT_WORK=$tmp/work bash "$src/scripts/gpu-kit.sh" run "$kit_dir" >"$tmp/run.txt" 2>&1
rc=$?
cat "$tmp/run.txt"
((rc == 0)) || fail "gpu-kit.sh run exited $rc"
[[ -f $tmp/out/summary.md ]] || fail "no summary.md"
for stage in tests sanitizer d2l ddp flags grads onnx imagenet; do
  grep -Eq "^\| $stage \| (PASS|FAIL|SKIP|TIMEOUT) \| [0-9]+ \| .+ \|$" "$tmp/out/stages.md" ||
    fail "stage $stage has no row with a status and a note"
done
if ! nvidia-smi -L >/dev/null 2>&1; then
  tests=$(grep -c . "$tmp/work/tests/gpu-tests.tsv")
  skipped=$(awk -F'\t' '$2 == "SKIP"' "$tmp/out/tests.tsv" | wc -l)
  ((skipped == tests - 1)) || fail "without a GPU, $skipped of the $((tests - 1)) gpu test binaries skipped (tests.tsv: $(tr '\n' ';' <"$tmp/out/tests.tsv"))"
  for stage in sanitizer d2l ddp flags grads onnx imagenet; do
    grep -Eq "^\| $stage \| SKIP \| [0-9]+ \| .*(no GPU|SKIPPED).* \|$" "$tmp/out/stages.md" ||
      fail "without a GPU, stage $stage does not say it skipped for want of a GPU"
  done
fi
grep -Eiq 'segmentation fault|core dumped|terminate called' "$tmp/run.txt" "$tmp"/out/*.log && fail "a crash in the run's output"

((failures == 0)) || { echo "$failures failure(s)"; exit 1; }
echo "gpu kit: OK"
