#!/usr/bin/env python3
"""The kernels of a profile, per run: GPU milliseconds per step and where they go.

  kernel_table.py --steps N NAME=CSV [NAME=CSV ...]

Each CSV is what `ncu --import REP --csv --page raw --print-kernel-base function
--print-units base` writes: one row per kernel launch, with its gpu__time_duration.sum
(nanoseconds). Prints, per run, the kernels by total time (markdown), then one line with
each run's kernels, their time per step and its share by kind. The first step's extra
kernels (initialisation, the first broadcast) count too, so a few steps slightly
overstate a step.
"""
import argparse
import collections
import csv
import sys

METRIC = "gpu__time_duration.sum"
# Kinds, by what the kernel's name contains (first match wins).
KINDS = [
    ("convolution", ("conv", "xmma", "cutlass", "gemm", "sm90_", "sm80_", "implicit", "winograd", "fft", "wgrad",
                     "dgrad", "cudnn", "nchwtonhwc", "nhwctonchw")),
    ("batch norm", ("batch_norm", "batchnorm", "bn_", "welford")),
    ("collective", ("nccl",)),
]


def kind_of(name):
    lower = name.lower()
    for kind, words in KINDS:
        if any(w in lower for w in words):
            return kind
    return "other"


def read_launches(path):
    """[(kernel name, nanoseconds)] from an ncu raw-page CSV."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r and METRIC in r), None)
    if header is None:
        raise ValueError(f"{path}: no header with 'Kernel Name' and {METRIC}")
    name_col, time_col = rows[header].index("Kernel Name"), rows[header].index(METRIC)
    launches = []
    for r in rows[header + 1:]:
        value = r[time_col].replace(",", "") if len(r) > time_col else ""
        try:
            launches.append((r[name_col], float(value)))
        except ValueError:
            continue  # the units row ("nsecond")
    return launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, required=True, help="training steps the profile covers")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("runs", nargs="+", metavar="NAME=CSV")
    args = ap.parse_args()
    summary = []
    for run in args.runs:
        name, path = run.split("=", 1)
        try:
            launches = read_launches(path)
        except (OSError, ValueError) as e:
            summary.append(f"{name}: {e}")
            continue
        total = sum(t for _, t in launches)
        by_kernel = collections.defaultdict(lambda: [0, 0.0])
        by_kind = collections.defaultdict(float)
        for kernel, t in launches:
            by_kernel[kernel][0] += 1
            by_kernel[kernel][1] += t
            by_kind[kind_of(kernel)] += t
        print(f"\n### {name}: {len(launches)} launches, {total / 1e6 / args.steps:.2f} ms of kernels per step "
              f"({args.steps} steps)\n")
        print("| kernel | kind | launches per step | ms per step | share |")
        print("|---|---|---|---|---|")
        for kernel, (count, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"| `{kernel[:70]}` | {kind_of(kernel)} | {count / args.steps:.1f} | {t / 1e6 / args.steps:.3f} "
                  f"| {t / total:.1%} |")
        kinds = ", ".join(f"{k} {t / 1e6 / args.steps:.2f}" for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]))
        summary.append(f"{name} {total / 1e6 / args.steps:.2f} ms/step in {len(launches) / args.steps:.0f} "
                       f"launches ({kinds})")
    print()
    print("; ".join(summary))
    return 0 if summary and all(" ms/step " in s for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
