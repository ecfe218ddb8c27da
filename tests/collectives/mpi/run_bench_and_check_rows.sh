#!/bin/bash
# usage: run_bench_and_check_rows.sh <expected rows> <command...>
# Runs an mtrain-bench command and passes only when it exits 0 and prints exactly the
# expected number of result rows, every one of them checked OK.
set -u
expected=$1
shift
output=$("$@")
rc=$?
printf '%s\n' "$output"
rows=$(printf '%s\n' "$output" | grep -cE '^ +[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +OK$')
failed=$(printf '%s\n' "$output" | grep -c 'FAIL')
if [[ $rc -ne 0 ]]; then
  echo "run_bench_and_check_rows: command exited with $rc" >&2
  exit 1
fi
if [[ $rows -ne $expected || $failed -ne 0 ]]; then
  echo "run_bench_and_check_rows: expected $expected OK rows, found $rows OK and $failed FAIL" >&2
  exit 1
fi
