#!/usr/bin/env bash
# `cmake --install` into an empty prefix, then the README's and the design card's command
# by name, from a directory with no data/ in it: the binaries find each other and the
# shipped data from where they were installed (Note [Installing mtrain]).
#
#   bash test_install.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

cmake --install "$build" --prefix "$prefix" >/dev/null
for b in mtrain-launch mtrain-train mtrain-bench mtrain-plot mtrain-trace mtrain-pack mtrain-bench-loader; do
  [[ -x $prefix/bin/$b ]] || { echo "FAILED: $prefix/bin/$b is not installed" >&2; exit 1; }
done
[[ -f $prefix/share/mtrain/data/fashion-mnist-mini/train-images-idx3-ubyte.gz ]] ||
  { echo "FAILED: the shipped data is not installed" >&2; exit 1; }

mkdir "$work/elsewhere"
cd "$work/elsewhere"
out=$(env -u MTRAIN_STORE_TOKEN PATH="$prefix/bin:$PATH" \
  mtrain-launch --nproc_per_node=2 train --model mlp --max-steps 2 --no-eval 2>&1) ||
  { echo "$out"; echo "FAILED: the installed mtrain-launch ... train did not run" >&2; exit 1; }
echo "$out" | tail -5
grep -q "fashion-mnist-mini from $prefix/share/mtrain/data/fashion-mnist-mini" <<<"$out" ||
  { echo "FAILED: the installed mtrain-train did not read the installed data" >&2; exit 1; }
echo "ok: installed under $prefix, ran by name from $work/elsewhere"
