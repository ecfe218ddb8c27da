#!/usr/bin/env bash
# Installs mtrain's Debian dependencies (only those missing), configures and builds into
# build/, then installs the binaries under PREFIX (default /usr/local: mtrain-launch,
# mtrain-train, mtrain-bench, mtrain-plot, mtrain-trace, mtrain-pack and mtrain-bench-loader on PATH, the shipped data beside
# them). Idempotent: a second run installs no package and rebuilds only what changed.
# Without --tests it installs and builds what training needs, nothing more; --tests adds the
# test suite and the packages only the tests use (Catch2, PyTorch, Pillow, SLURM, munge,
# iproute2).
#
#   bash scripts/setup.sh            # Release build in build/, installed in /usr/local
#   bash scripts/setup.sh --tests    # the same, with the test suite (ctest --test-dir build)
#   BUILD_DIR=out CMAKE_ARGS="-DMTRAIN_CUDA=OFF" bash scripts/setup.sh
#   PREFIX=$HOME/.local bash scripts/setup.sh    # install without root
#   PREFIX= bash scripts/setup.sh                # build only, install nothing
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}
jobs=${JOBS:-$(nproc)}

with_tests=OFF
for arg in "$@"; do
  case $arg in
    --tests) with_tests=ON ;;
    *) echo "setup: unknown argument '$arg' (expected nothing, or --tests)" >&2; exit 2 ;;
  esac
done

# Verified package names: docs/building.md. ocl-icd-opencl-dev is only a Recommends of
# libdnnl-dev, but oneDNN's CMake config needs it.
packages=(
  build-essential cmake ninja-build pkg-config
  libdnnl-dev ocl-icd-opencl-dev
  libgloo-dev libopenmpi-dev openmpi-bin
  libcxxopts-dev libspdlog-dev nlohmann-json3-dev zlib1g-dev libcairo2-dev
  libpng-dev libturbojpeg0-dev libjpeg62-turbo-dev
  # --model FILE.onnx: ONNX's protobuf classes and checker (models/onnx/onnx_graph.cpp).
  libonnx-dev libprotobuf-dev
)
test_packages=(
  catch2 python3
  # The `slurm` tests (tests/slurm) run their own munged, slurmctld and slurmd under a
  # temporary directory and use neither the packaged services nor /etc/slurm. Nothing in
  # mtrain links to them; without them those tests are skipped.
  slurm-wlm munge
  # The `multihost` tests (tests/multihost): `ip` builds two network namespaces joined by a
  # veth pair, so two launchers talk over a real interface.
  iproute2
  # The tests that run real PyTorch programs under mtrain-launch and torchrun
  # (tests/launcher/test_launch_torch.cpp) and compare with PyTorch; PyTorch's columns in
  # the benchmarks.
  python3-torch
  # The test that compares image folders with Pillow's decoding and resizing
  # (tests/data/test_image_folder_pil.cpp).
  python3-pil
  # The tests that export PyTorch and torchvision networks to ONNX and train them
  # (tests/models/onnx), and that compare the streamed images' crops with torchvision's
  # (tests/data/test_image_transforms_torch.cpp).
  python3-onnx python3-torchvision
)
[[ $with_tests == ON ]] && packages+=("${test_packages[@]}")

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) || true
  [[ $status == *"install ok installed"* ]] || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  "${sudo_cmd[@]}" apt-get update
  # Through env: sudo's env_reset would drop a variable set in front of it.
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags on purpose
cmake -S "$root" -B "$build_dir" -G Ninja -DMTRAIN_BUILD_TESTS=$with_tests ${CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$jobs"
echo "setup: built into $build_dir/bin$([[ $with_tests == ON ]] && echo ', with the tests' || true)"

prefix=${PREFIX-/usr/local}
if [[ -n $prefix ]]; then
  install_cmd=(cmake --install "$build_dir" --prefix "$prefix")
  # sudo only where the user cannot write: the prefix, or its nearest existing parent
  # (so that PREFIX=$HOME/.local is not created owned by root).
  existing=$prefix
  while [[ ! -e $existing ]]; do existing=$(dirname "$existing"); done
  if [[ $(id -u) -ne 0 && ! -w $existing ]] && command -v sudo >/dev/null; then install_cmd=(sudo "${install_cmd[@]}"); fi
  "${install_cmd[@]}" >/dev/null
  echo "setup: installed mtrain-launch, mtrain-train, mtrain-bench, mtrain-plot, mtrain-trace, mtrain-pack and mtrain-bench-loader in $prefix/bin"
  case ":$PATH:" in *":$prefix/bin:"*) ;; *) echo "setup: add $prefix/bin to PATH to run them by name" ;; esac
fi
