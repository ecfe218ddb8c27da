#!/usr/bin/env python3
"""The kernels of a profile, per run: GPU milliseconds per step and where they go.

  kernel_table.py --steps N [--wall NAME=MS ...] [--top K] NAME=CSV [NAME=CSV ...]

Each CSV is what `ncu --import REP --csv --page raw --print-kernel-base demangled
--print-units base` writes: a header row (with "Kernel Name" and gpu__time_duration.sum),
a units row, then one row per kernel launch with its time in nanoseconds. Names printed
with `--print-kernel-base function` (the bare function name) work too.

Prints, per run: the GPU's busy milliseconds per step (the kernels' time; with --wall
NAME=MS, the step's wall time, also as a share of it: the rest is the GPU waiting), the
top kernels by total time and the time by kind, as markdown tables; then one line with
every run's figures. The first step's extra kernels (initialisation, the first
broadcast, cuDNN's planning) count too, so a few steps slightly overstate a step.

Kinds (Note [Kernel kinds]): convolution, matmul, batch norm, elementwise, reduction,
pooling, loss, optimizer, copies, collective, other.
"""
import argparse
import collections
import csv
import re
import sys

METRIC = "gpu__time_duration.sum"

KIND_ORDER = ["convolution", "matmul", "batch norm", "elementwise", "reduction", "pooling", "loss", "optimizer",
              "copies", "collective", "other"]

# Note [Kernel kinds]
# A demangled name is `void NAMESPACES::FUNCTION<TEMPLATE ARGUMENTS>(PARAMETERS)`. The
# function's own qualified name (before the first '<' or '(') says what a kernel does; its
# template arguments may name other kinds' words (mtrain's batch-norm kernels are
# templated on functors such as SumX, PyTorch's elementwise kernels on lambdas inside
# add_kernel or direct_copy_kernel_cuda), so they are read only when the name alone is a
# generic wrapper or says nothing:
#  1. mtrain's own kernels (tensor/cuda/*.cu) by their exact function name;
#  2. the qualified name against RULES, first match wins;
#  3. a generic wrapper (PyTorch's elementwise and reduce kernels) is refined by its
#     template arguments: a copy, fill or conversion is "copies", a batch-norm, loss or
#     pooling lambda is that kind;
#  4. a name that matched nothing: the whole name against RULES (cutlass::Kernel2<...gemm...>);
#  5. vendor kernels still unmatched (xmma, cutlass, sm80_/sm90_, cuDNN): convolution;
#     else "other".
# cuBLAS's products (gemm without any convolution word) are "matmul"; cuDNN's
# convolution kernels and its layout transposes (nchwToNhwc) are "convolution"; cuDNN's
# op_generic_tensor_kernel (cudnnAddTensor: mtrain's convolution bias) is "elementwise".
# PyTorch computes a convolution's bias gradient and the global average pool as
# reductions (reduce_kernel: sum, mean), hence the kind "reduction".
MTRAIN_KERNELS = {
    # tensor/cuda/batchnorm.cu, batchnorm_channels.cu as first built (the fused batch
    # norm's kernels are all named bn_*, which RULES take as batch norm)
    "channel_partials_kernel": "batch norm", "channel_finish_kernel": "batch norm", "apply_kernel": "batch norm",
    "backward_coefficients_kernel": "batch norm", "backward_apply_kernel": "batch norm",
    "invstd_kernel": "batch norm", "update_running_kernel": "batch norm", "param_grads_kernel": "batch norm",
    "merge_stats_kernel": "batch norm",
    # elementwise.cu: map_kernel<inputs, Op>, the functor Op names the operation;
    # map16_kernel the same on 16-bit activations, channel_bias_kernel a convolution's
    # bias on them (MTRAIN_SPEEDUPS=amp-activations; that bias's gradient runs batch
    # norm's reduction kernels, bn_*<..., StoreChannelSum>, and is counted as batch norm)
    "map_kernel": "elementwise", "map16_kernel": "elementwise", "channel_bias_kernel": "elementwise",
    # kernels.cu, mixed_precision.cu
    "fill_kernel": "copies", "narrow_kernel": "copies", "widen_kernel": "copies",
    "unscale_kernel": "optimizer",
    # loss.cu
    "cross_entropy_rows_kernel": "loss", "sum_rows_kernel": "loss", "count_correct_kernel": "loss",
    # sgd.cu
    "sgd_kernel": "optimizer", "sgd_multi_tensor_kernel": "optimizer",
}

RULES = [
    ("collective", r"nccl"),
    # "bn" as a word of its own (cuDNN's bn_fw_tr_1C11_kernel_NCHW, mtrain's fused bn_
    # kernels), not inside another (BnGeometry, ...nn_n_tilesize).
    ("batch norm", r"batch_?norm|welford|(?:^|[^a-z0-9])bn(?:[^a-z0-9]|$)"),
    ("loss", r"nll_loss|softmax|cross_entropy|loss"),
    ("pooling", r"pool"),
    ("optimizer", r"multi_tensor_apply|sgd|unscale|non_finite|update_scale|foreach|optimizer"),
    ("copies", r"memcpy|memset|copy|convert(?!olution)|fill"),
    ("convolution", r"conv|fprop|dgrad|wgrad|implicit|winograd|fft|nchwtonhwc|nhwctonchw|nchw2nhwc|nhwc2nchw|cudnn"),
    ("matmul", r"gemm|gemv|matmul|cublas|splitkreduce"),
    ("reduction", r"reduce|reduction"),
    ("elementwise", r"elementwise|op_generic_tensor|add_tensor|map_kernel|activation|relu|sigmoid"),
]
_RULES = [(kind, re.compile(pattern)) for kind, pattern in RULES]
VENDOR = re.compile(r"xmma|cutlass|sm\d\d_|cudnn")
# What a generic wrapper's template arguments can make of it.
REFINE = [
    ("batch norm", re.compile(r"batch_?norm|welford")),
    ("loss", re.compile(r"nll_loss|softmax|cross_entropy")),
    ("pooling", re.compile(r"pool")),
    ("copies", re.compile(r"copy|fill|convert(?!olution)")),
]
GENERIC = {"elementwise", "reduction"}


def split_name(name):
    """(qualified function name, its last component, the rest) of a kernel's name."""
    s = name.strip().replace("(anonymous namespace)", "anonymous_namespace")
    if s.startswith("void "):
        s = s[5:]
    head = re.match(r"[^<(]*", s).group(0).strip()
    return head, head.split("::")[-1], s[len(head):]


def _first_rule(text):
    for kind, pattern in _RULES:
        if pattern.search(text):
            return kind
    return None


def kind_of(name):
    """The kind of a kernel, by its (demangled or bare) name: Note [Kernel kinds]."""
    head, base, rest = split_name(name)
    if base in MTRAIN_KERNELS and (head == base or head.startswith("mtrain::")):
        return MTRAIN_KERNELS[base]
    kind = _first_rule(head.lower())
    if kind in GENERIC:
        args = rest.lower()
        for refined, pattern in REFINE:
            if pattern.search(args):
                return refined
        return kind
    if kind:
        return kind
    kind = _first_rule(name.lower())
    if kind:
        return kind
    return "convolution" if VENDOR.search(name.lower()) else "other"


def short_name(name, width=90):
    """The kernel's name without namespaces and parameters, for a table cell."""
    head, base, rest = split_name(name)
    depth, args = 0, ""
    for ch in rest:  # the template arguments only: stop at the parameter list
        if ch == "(" and depth == 0:
            break
        depth += ch == "<"
        depth -= ch == ">"
        args += ch
    args = re.sub(r"\b(?:[A-Za-z_][A-Za-z0-9_]*::)+", "", args.replace("anonymous_namespace::", ""))
    s = base + args
    return s if len(s) <= width else s[:width - 3] + "..."


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


def summarise(launches, steps):
    """Per step: total ms, launches, and by kernel and by kind [launches, ms], largest first."""
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for kernel, ns in launches:
        for table, key in ((by_kernel, kernel), (by_kind, kind_of(kernel))):
            table[key][0] += 1
            table[key][1] += ns
    per_step = lambda table: sorted(((k, c / steps, ns / 1e6 / steps) for k, (c, ns) in table.items()),
                                    key=lambda row: -row[2])
    return {"ms": sum(ns for _, ns in launches) / 1e6 / steps, "launches": len(launches) / steps,
            "kernels": per_step(by_kernel), "kinds": per_step(by_kind)}


def render(name, s, steps, wall, top):
    busy = f"GPU busy {s['ms']:.2f} ms per step" + (
        f", {s['ms'] / wall:.0%} of the step's {wall:.2f} ms wall time" if wall
        else " (no wall time given: --wall NAME=MS)")
    lines = [f"\n### {name}: {s['launches'] * steps:.0f} launches over {steps} steps", "", busy, "",
             "| kernel | kind | launches per step | ms per step | share |", "|---|---|---|---|---|"]
    total = s["ms"] or 1.0
    for kernel, count, ms in s["kernels"][:top]:
        lines.append(f"| `{short_name(kernel)}` | {kind_of(kernel)} | {count:.1f} | {ms:.3f} | {ms / total:.1%} |")
    lines += ["", "| kind | launches per step | ms per step | share |", "|---|---|---|---|"]
    for kind, count, ms in s["kinds"]:
        lines.append(f"| {kind} | {count:.1f} | {ms:.3f} | {ms / total:.1%} |")
    return "\n".join(lines)


def parse_pairs(items, what, convert=str):
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"kernel_table.py: {what} expects NAME=VALUE, found '{item}'")
        try:
            pairs.append((name, convert(value)))
        except ValueError:
            raise SystemExit(f"kernel_table.py: {what} {name}: not a number: '{value}'")
    return pairs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, required=True, help="training steps the profile covers")
    ap.add_argument("--top", type=int, default=15, help="kernels in each run's table")
    ap.add_argument("--wall", action="append", default=[], metavar="NAME=MS",
                    help="a run's wall milliseconds per step (repeatable)")
    ap.add_argument("runs", nargs="+", metavar="NAME=CSV")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps expects a positive integer")
    walls = dict(parse_pairs(args.wall, "--wall", float))
    summary = []
    for name, path in parse_pairs(args.runs, "a run"):
        try:
            launches = read_launches(path)
        except (OSError, ValueError) as e:
            summary.append(f"{name}: {e}")
            continue
        s = summarise(launches, args.steps)
        wall = walls.get(name)
        print(render(name, s, args.steps, wall, args.top))
        busy = f"{s['ms']:.2f} ms/step" + (f" ({s['ms'] / wall:.0%} of {wall:.2f} ms wall)" if wall else "")
        kinds = ", ".join(f"{kind} {ms:.2f}" for kind, _, ms in s["kinds"])
        summary.append(f"{name} {busy} in {s['launches']:.0f} launches ({kinds})")
    print()
    print("; ".join(summary))
    return 0 if summary and all(" ms/step" in s for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
