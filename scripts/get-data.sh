#!/usr/bin/env bash
# Downloads the four official IDX files of a dataset and checks their MD5s.
#
#   scripts/get-data.sh fashion-mnist|mnist [DEST_DIR]
#
# DEST_DIR defaults to data/<name>/ in the project root, where mtrain-train looks
# first. Files already present with the right MD5 are kept (the script is idempotent);
# each download goes to a temporary file that is renamed only once its MD5 matches, so
# a failed or interrupted run never leaves a partial or corrupt file under a real name.
set -euo pipefail

die() {
  echo "get-data: error: $*" >&2
  exit 1
}

usage() {
  echo "usage: $0 fashion-mnist|mnist [DEST_DIR]" >&2
  exit 2
}

[[ $# -ge 1 && $# -le 2 ]] || usage
dataset="$1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${2:-${repo_root}/data/${dataset}}"

# MD5s of the official .gz files (the checksums each project publishes).
declare -A md5
case "${dataset}" in
  fashion-mnist)
    base_url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"
    md5=(
      [train-images-idx3-ubyte.gz]=8d4fb7e6c68d591d4c3dfef9ec88bf0d
      [train-labels-idx1-ubyte.gz]=25c81989df183df01b3e8a0aad5dffbe
      [t10k-images-idx3-ubyte.gz]=bef4ecab320f06d8554ea6380940ec79
      [t10k-labels-idx1-ubyte.gz]=bb300cfdad3c16e7a12a480ee83cd310
    )
    ;;
  mnist)
    base_url="https://ossci-datasets.s3.amazonaws.com/mnist"
    md5=(
      [train-images-idx3-ubyte.gz]=f68b3c2dcbeaaa9fbdd348bbdeb94873
      [train-labels-idx1-ubyte.gz]=d53e105ee54ea40749a09fcbcd1e9432
      [t10k-images-idx3-ubyte.gz]=9fb629c4189551a2d022fa330f9573f3
      [t10k-labels-idx1-ubyte.gz]=ec29112dd5afa0611ce80d1b7f02629c
    )
    ;;
  *)
    echo "get-data: error: unknown dataset '${dataset}' (expected fashion-mnist or mnist)" >&2
    usage
    ;;
esac
readonly files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz
                t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

if command -v curl >/dev/null 2>&1; then
  fetch() { curl --fail --location --silent --show-error --retry 2 --connect-timeout 20 -o "$2" "$1"; }
elif command -v wget >/dev/null 2>&1; then
  fetch() { wget --quiet --tries=3 --timeout=20 -O "$2" "$1"; }
else
  die "neither curl nor wget is installed; install one of them (e.g. apt-get install curl)"
fi

md5_of() { md5sum "$1" | cut -d' ' -f1; }

partial=""
cleanup() {
  if [[ -n "${partial}" ]]; then rm -f "${partial}"; fi
}
trap cleanup EXIT

mkdir -p "${dest_dir}"
for name in "${files[@]}"; do
  target="${dest_dir}/${name}"
  expected="${md5[${name}]}"
  if [[ -f "${target}" ]]; then
    if [[ "$(md5_of "${target}")" == "${expected}" ]]; then
      echo "get-data: ${target} already present (md5 ok)"
      continue
    fi
    # A wrong file under the real name (an interrupted manual copy, say) would be
    # loaded by mtrain-train; it goes before anything else can fail.
    echo "get-data: ${target} has the wrong md5; removing it and downloading it again"
    rm -f "${target}"
  fi
  url="${base_url}/${name}"
  partial="${target}.part"
  echo "get-data: downloading ${url}"
  if ! fetch "${url}" "${partial}"; then
    die "could not download ${url} (network unreachable, or the server refused). Nothing was kept for ${name}. Check your connection or proxy, or download the file by hand into ${dest_dir}/ and rerun this script to verify it."
  fi
  actual="$(md5_of "${partial}")"
  if [[ "${actual}" != "${expected}" ]]; then
    die "${url}: expected md5 ${expected}, found ${actual}; the download was discarded (corrupt transfer or changed upstream file)"
  fi
  mv "${partial}" "${target}"
  partial=""
  echo "get-data: ${target} ok"
done
echo "get-data: ${dataset} ready in ${dest_dir}"
