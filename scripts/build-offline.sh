#!/usr/bin/env bash
# Builds mtrain on a host without its Debian packages or a network, from the packages
# scripts/offline-deps.sh downloaded elsewhere: a GPU node with a compiler, CMake,
# Ninja and CUDA, say. The packages are unpacked into a private prefix inside the build
# directory (never into /), and nothing is installed.
#
#   scripts/build-offline.sh [DEPS_DIR] [BUILD_DIR]   (defaults: .deps, build-offline)
#   env: CUDA_ARCHS (e.g. 90 for H100/H200; default: the project's 80;90),
#        CMAKE_ARGS (more flags for the configure step), JOBS (default: nproc),
#        TARGETS (build only these, e.g. "mtrain-train mtrain-launch"; default: all)
#
# cuDNN and NCCL are taken from the CUDA toolkit's directories when they are there,
# else from the Python wheels a PyTorch installation brings (nvidia-cudnn-cu*,
# nvidia-nccl-cu*). It writes BUILD_DIR/env.sh, which puts the unpacked libraries and
# those of cuDNN and NCCL on LD_LIBRARY_PATH:
#   source build-offline/env.sh && ctest --test-dir build-offline -L gpu --output-on-failure
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$(cd "${1:-$root/.deps}" 2>/dev/null && pwd) ||
  { echo "build-offline.sh: no package directory '${1:-$root/.deps}' (make it with scripts/offline-deps.sh)" >&2; exit 2; }
build=${2:-$root/build-offline}
mkdir -p "$build"
build=$(cd "$build" && pwd)
prefix=$build/deps-prefix

shopt -s nullglob
debs=("$deps"/*.deb)
((${#debs[@]})) || { echo "build-offline.sh: no .deb files in $deps" >&2; exit 2; }
rm -rf "$prefix"
mkdir -p "$prefix"
for deb in "${debs[@]}"; do
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$deb" "$prefix"
  else
    # A .deb is an ar archive whose data.tar.* holds the files; tar recognises the
    # compression of a file (not of a pipe), so the member goes through one.
    member=$(ar t "$deb" | grep '^data\.tar') || { echo "build-offline.sh: $deb has no data.tar member" >&2; exit 1; }
    ar p "$deb" "$member" >"$build/$member"
    tar -xf "$build/$member" -C "$prefix"
    rm -f "$build/$member"
  fi
done
echo "build-offline.sh: unpacked ${#debs[@]} packages into $prefix"

lib_dirs=("$prefix/usr/lib/x86_64-linux-gnu" "$prefix/usr/lib")
cmake_args=(-DCMAKE_PREFIX_PATH="$prefix/usr")

# cuDNN and NCCL: the toolkit's, else PyTorch's wheels.
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -n $nvcc ]]; then
  cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
  cmake_args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
  wheel_dir() {  # nvidia.<name>'s directory in python3's site-packages, or nothing
    python3 -c "import importlib, sys
try:
    m = importlib.import_module('nvidia.$1')
    print(list(m.__path__)[0])
except Exception:
    sys.exit(0)" 2>/dev/null || true
  }
  for lib in cudnn nccl; do
    header=$lib.h
    if compgen -G "$cuda_root/include/$header" >/dev/null || compgen -G "$cuda_root/lib*/lib$lib.so*" >/dev/null ||
       compgen -G "/usr/include/$header" >/dev/null; then
      continue  # CMake finds the toolkit's (or the system's) own
    fi
    d=$(wheel_dir "$lib")
    so=$(compgen -G "$d/lib/lib$lib.so*" | head -n1 || true)
    if [[ -n $d && -f $d/include/$header && -n $so ]]; then
      upper=${lib^^}
      cmake_args+=(-D"${upper}_LIBRARY=$so" -D"${upper}_INCLUDE_DIR=$d/include")
      lib_dirs+=("$d/lib")
      echo "build-offline.sh: $lib from the Python wheel in $d"
    else
      echo "build-offline.sh: $lib not found in $cuda_root or python3's nvidia.$lib; the build will be CPU only" >&2
    fi
  done
else
  echo "build-offline.sh: no nvcc; building CPU only" >&2
fi
[[ -n ${CUDA_ARCHS:-} ]] && cmake_args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")

ld_path=$(IFS=:; echo "${lib_dirs[*]}")
export LD_LIBRARY_PATH=$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags on purpose
cmake -S "$root" -B "$build" -G Ninja "${cmake_args[@]}" ${CMAKE_ARGS:-}
# shellcheck disable=SC2086  # TARGETS is a list of target names
cmake --build "$build" -j "${JOBS:-$(nproc)}" ${TARGETS:+--target $TARGETS}
printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$ld_path" >"$build/env.sh"
echo "build-offline.sh: built into $build/bin; first: source $build/env.sh"
