#!/usr/bin/env python3
"""One training step's gradients of mtrain, on each device named, against PyTorch in float64.

  check_gradients_torch.py MTRAIN_TRAIN DATA_DIR WORK_DIR [--model resnet18] [--batch 8]
                           [--run cpu="--device cpu" --run cuda="--device cuda --no-tf32" ...]
                           [--factor 10] [--floor 1e-5] [--margin 1e-4]

Writes the first BATCH images of DATA_DIR's Fashion-MNIST IDX files as a one-batch data
set, lets mtrain-train save its initial weights (--max-steps 0) and then take one SGD step
with lr 1, no momentum and no weight decay for each --run NAME="FLAGS", so that the
gradient is the initial weights minus the final ones. PyTorch builds the same model
(bench_torch_train.py), loads the initial weights and computes the gradient of the same
batch in float64 (on the GPU where one is usable, else on the CPU). The batch is the whole
data set, so its order (mtrain's shuffle) does not change batch norm's statistics or the
mean loss.

Flipped ReLUs (Note [Explaining flipped ReLUs] below) are found and explained first: a
ReLU input within float32 rounding of zero may land on either side, and a batch norm
then spreads that one element's gradient over its channel, so a correct float32
gradient can be percents away from float64's in a few tensors. Each column (PyTorch's own
float32 gradient on the CPU, and on the GPU with TF32 off where one is usable; each mtrain
run) is compared with the float64 gradient whose ReLUs pass or stop the gradient where
that column's did, as far as the column's gradient tells; the flips used are listed,
each with its distance from zero.

Prints, per parameter tensor, max |gradient - float64| over the tensor's largest |float64|
value, flips explained. Parameters whose float64 gradient is zero up to rounding (a
convolution's bias ahead of batch norm) are judged against the model's largest gradient
instead. A run whose flags name cuda is held to PyTorch's GPU column, others to its CPU
column: exit status 1 when an mtrain tensor is off by more than FACTOR times
max(PyTorch float32's error, FLOOR).
"""
import argparse
import contextlib
import gzip
import json
import importlib.util
import os
import struct
import subprocess
import sys

import numpy as np
import torch


def load_file(path):
    """A float32 safetensors file (what mtrain-train writes) as {name: array}."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    kinds = {"F32": np.float32, "F64": np.float64, "I64": np.int64}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[8 + length + begin:8 + length + end]
        out[name] = np.frombuffer(raw, dtype=kinds[entry["dtype"]]).reshape(entry["shape"])
    return out


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data[4 + 4 * ndim:], dtype=np.uint8).reshape(dims)


def write_idx(path, magic, array):
    with open(path, "wb") as f:
        f.write(struct.pack(">" + "I" * (1 + array.ndim), magic, *array.shape))
        f.write(array.tobytes())


def write_slice(source, dest, count):
    os.makedirs(dest, exist_ok=True)
    for split in ("train", "t10k"):
        images = read_idx(os.path.join(source, f"{split}-images-idx3-ubyte.gz"))[:count]
        labels = read_idx(os.path.join(source, f"{split}-labels-idx1-ubyte.gz"))[:count]
        write_idx(os.path.join(dest, f"{split}-images-idx3-ubyte"), 0x803, np.ascontiguousarray(images))
        write_idx(os.path.join(dest, f"{split}-labels-idx1-ubyte"), 0x801, np.ascontiguousarray(labels))


# Note [Explaining flipped ReLUs]: a ReLU passes its input's gradient where the input is
# positive. An input within rounding of zero (after 17 layers float32 carries errors of
# ~1e-6 of a layer's scale; float64's smallest inputs are that close) may be positive in
# one float32 implementation and not in another, and each gets a correct gradient for its
# own forward pass. The forward values hardly differ (the element is ~0 either way), so
# what differs is only which gradient the ReLU lets through. For the batch norm whose
# output feeds the ReLU (directly, or through a residual sum), the bias gradient of the
# element's channel is the sum of the gradients let through, so a flip moves it by
# exactly the gradient arriving at that element: a spike in one channel, which names the
# candidate. explain() peels flips off in backward order: it takes the latest ReLU with a
# candidate (an input within MARGIN of zero, in units of the layer's rms) whose spike
# matches the column's error in its channel, recomputes the float64 gradient with that
# ReLU's decision reversed, keeps the flip if that brings every tensor together closer to
# the column (the change upstream must match too), and repeats. A wrong kernel spreads errors over whole tensors,
# which no handful of near-zero inputs explains; a forward pass less exact than float32
# (TF32, say) flips inputs beyond MARGIN, which are not candidates.

class FlipReLU(torch.autograd.Function):
    """ReLU whose backward reverses the pass/stop decision at the flat indices that
    state.flips[call] lists, and keeps the gradient arriving at its output."""

    @staticmethod
    def forward(ctx, x, call, state):
        ctx.save_for_backward(x)
        ctx.call, ctx.state = call, state
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.state.arriving[ctx.call] = grad.detach()
        passes = x > 0
        flips = ctx.state.flips.get(ctx.call)
        if flips:
            passes = passes.clone()
            index = torch.tensor(sorted(flips), device=x.device)
            passes.view(-1)[index] = ~passes.view(-1)[index]
        return grad * passes, None, None


@contextlib.contextmanager
def relu_replaced(fn):
    """torch.relu and F.relu (nn.ReLU) call fn while the block runs."""
    saved = torch.relu, torch.nn.functional.relu
    torch.relu = fn
    torch.nn.functional.relu = lambda t, inplace=False: fn(t)
    try:
        yield
    finally:
        torch.relu, torch.nn.functional.relu = saved


class Float64Reference:
    """The float64 gradient of one batch, for any set of reversed ReLU decisions: one
    forward pass, kept, and a backward pass per set."""

    def __init__(self, model, x, labels, margin):
        self.flips = {}     # ReLU call -> set of flat indices whose decision is reversed
        self.computed = {}  # the flips as a frozenset of (call, index) -> gradients
        self.arriving = {}  # ReLU call -> gradient at its output, in the pass gradients() returned last
        self.inputs = []    # ReLU call -> its input
        self.bias = []      # ReLU call -> the batch norm bias whose gradient sums its input's
        last_bn = [None]
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.register_forward_hook(lambda m, i, o, name=name: last_bn.__setitem__(0, name))

        def relu(t):
            self.inputs.append(t.detach())
            self.bias.append(f"{last_bn[0]}.bias")
            return FlipReLU.apply(t, len(self.inputs) - 1, self)

        with relu_replaced(relu):
            self.loss = torch.nn.functional.cross_entropy(model(x), labels)
        self.params = dict(model.named_parameters())
        self.candidates = []  # (call, flat index, |input| / the call's rms), nearest zero first
        for call, t in enumerate(self.inputs):
            bias = self.params.get(self.bias[call])
            if bias is None or t.dim() != 4 or t.shape[1] != bias.shape[0]:
                continue  # not a batch norm's channels (none ran, or another shape): not told apart here
            distance = (t.abs() / t.pow(2).mean().sqrt()).view(-1)
            for index in torch.nonzero(distance < margin).view(-1).tolist():
                self.candidates.append((call, index, float(distance[index])))
        self.candidates.sort(key=lambda c: c[2])

    def gradients(self, flips):
        """The gradients with `flips` ({call: set of flat indices}) reversed; afterwards
        spike() speaks of the pass that computed them."""
        key = frozenset((call, index) for call, indices in flips.items() for index in indices)
        self.flips = {call: set(indices) for call, indices in flips.items()}
        if key not in self.computed:
            grads = torch.autograd.grad(self.loss, list(self.params.values()), retain_graph=True)
            self.computed[key] = ({n: g.cpu().numpy() for n, g in zip(self.params, grads)}, dict(self.arriving))
        grads, self.arriving = self.computed[key]
        return grads

    def spike(self, call, index):
        """(channel, change of the bias gradient there) if `index` of `call` flipped now."""
        t = self.inputs[call]
        channel = (index // (t.shape[2] * t.shape[3])) % t.shape[1]
        passes = bool(t.view(-1)[index] > 0) != (index in self.flips.get(call, ()))
        arriving = float(self.arriving[call].reshape(-1)[index])
        return channel, -arriving if passes else arriving


def explain(column, reference, scales, floor, tries=16):
    """(float64 gradients with the flips that explain `column`, [(call, index, distance)]).
    A flip is kept only where it lowers the summed error of all tensors: one that matches
    a spike but not the change it makes upstream is not a flip the column made."""
    flips, used, rejected = {}, [], set()
    current = reference.gradients(flips)  # computed once, for every column
    largest = max(scales.values())
    total = sum(relative_errors(column, current, scales, largest).values())
    for _ in range(tries):
        best = None
        for call, index, distance in reference.candidates:
            if index in flips.get(call, ()) or (call, index) in rejected:
                continue
            bias = reference.bias[call]
            channel, change = reference.spike(call, index)
            if abs(change) < floor * scales[bias]:
                continue  # too small to matter at the test's floor
            error = column[bias][channel] - current[bias][channel]
            fit = abs(error - change) / abs(change)
            if fit <= 0.3 and (best is None or (call, -fit) > (best[0], -best[3])):
                best = (call, index, distance, fit)
        if best is None:
            break
        call, index, distance, _ = best
        trial = {c: set(i) for c, i in flips.items()}
        trial.setdefault(call, set()).add(index)
        gradients = reference.gradients(trial)
        trial_total = sum(relative_errors(column, gradients, scales, largest).values())
        if trial_total < total:
            flips, current, total = trial, gradients, trial_total
            used.append((call, index, distance))
        else:
            rejected.add((call, index))
    reference.gradients(flips)  # spike() speaks of the flips returned
    return current, used


def relative_errors(column, truth, scales, largest):
    """max |column - truth| per tensor over its float64 scale (the model's largest where
    the float64 gradient is zero up to rounding)."""
    return {n: float(np.abs(column[n] - g).max()) / (largest if scales[n] < 1e-9 * largest else scales[n])
            for n, g in truth.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trainer")
    ap.add_argument("data_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--run", action="append", default=None, metavar='NAME="FLAGS"')
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--floor", type=float, default=1e-5)
    ap.add_argument("--margin", type=float, default=1e-4,
                    help="ReLU inputs this close to zero, in units of their layer's rms, may flip")
    args = ap.parse_args()
    runs = dict(r.split("=", 1) for r in (args.run or ["cpu=--device cpu"]))
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bench", os.path.join(here, "bench_torch_train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    slice_dir = os.path.join(args.work_dir, "slice")
    write_slice(args.data_dir, slice_dir, args.batch)
    common = [args.trainer, "--model", args.model, "--data-dir", slice_dir, "--batch-size", str(args.batch),
              "--lr", "1", "--momentum", "0", "--weight-decay", "0", "--seed", "3", "--no-eval",
              "--log-level", "warn"]
    start = os.path.join(args.work_dir, "start.safetensors")
    subprocess.run(common + ["--max-steps", "0", "--save-final", start], check=True)
    finals = {}
    for name, flags in runs.items():
        finals[name] = os.path.join(args.work_dir, f"step-{name}.safetensors")
        subprocess.run(common + flags.split() + ["--max-steps", "1", "--save-final", finals[name]], check=True)

    initial = load_file(start)
    images = read_idx(os.path.join(slice_dir, "train-images-idx3-ubyte"))
    labels = torch.from_numpy(read_idx(os.path.join(slice_dir, "train-labels-idx1-ubyte")).astype(np.int64))
    # mtrain's input: float32 pixels / 255 (widened exactly for float64).
    x = torch.from_numpy((images.astype(np.float32) / np.float32(255))[:, None])
    gpu = torch.cuda.is_available()

    def model_of(dtype, device):
        model = bench.build(args.model).to(dtype).train()
        model.load_state_dict({k: torch.from_numpy(v.copy()).to(dtype if v.dtype != np.int64 else torch.int64)
                               for k, v in initial.items()})
        return model.to(device)

    def torch_gradients(dtype, device="cpu"):
        model = model_of(dtype, device)
        torch.nn.functional.cross_entropy(model(x.to(dtype).to(device)), labels.to(device)).backward()
        return {n: p.grad.double().cpu().numpy() for n, p in model.named_parameters()}

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    # float64 where it is fastest: a GPU rounds float64 like the CPU, to ~1e-16.
    device64 = "cuda" if gpu else "cpu"
    reference = Float64Reference(model_of(torch.float64, device64), x.double().to(device64),
                                 labels.to(device64), args.margin)
    truth = reference.gradients({})
    # PyTorch's own float32 gradients: how close float32 arithmetic gets on this batch.
    columns = {"torch-f32": torch_gradients(torch.float32)}
    references = {}  # mtrain's column -> the PyTorch column it is held to
    gpu_runs = [name for name, flags in runs.items() if "cuda" in flags]
    if gpu_runs and gpu:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        columns["torch-gpu"] = torch_gradients(torch.float32, "cuda")
    for name in runs:
        final = load_file(finals[name])
        columns[name] = {n: initial[n].astype(np.float64) - final[n].astype(np.float64) for n in truth}
        references[name] = "torch-gpu" if name in gpu_runs and "torch-gpu" in columns else "torch-f32"
    scales = {n: float(np.abs(g).max()) for n, g in truth.items()}
    largest = max(scales.values())

    raw, errors = {}, {}
    print(f"# {args.model}, batch {args.batch}, float64 on the {device64}: ReLU inputs within "
          f"{args.margin:g} of zero (in units of their layer's rms): {len(reference.candidates)}")
    for column, grads in columns.items():
        raw[column] = relative_errors(grads, truth, scales, largest)
        explained, flips = explain(grads, reference, scales, args.floor)
        errors[column] = relative_errors(grads, explained, scales, largest)
        listed = ", ".join(f"{reference.bias[c].removesuffix('.bias')} relu[{i}] at {d:.1e}" for c, i, d in flips)
        print(f"# {column}: {len(flips)} flipped ReLU(s) explained" + (f": {listed}" if flips else "")
              + f"; worst raw error {max(raw[column].values()):.2e}, explained {max(errors[column].values()):.2e}")

    print("# max |gradient - float64| / max |float64| per tensor, flips explained")
    print(f"# {'tensor':28s} " + " ".join(f"{c:>10s}" for c in columns))
    for name in truth:
        noise = scales[name] < 1e-9 * largest
        print(f"  {name:28s} " + " ".join(f"{errors[c][name]:10.2e}" for c in columns)
              + ("  (zero gradient; over the largest)" if noise else ""))
    verdicts = []
    for column, held_to in references.items():
        # the worst tensor's error / max(PyTorch float32's error, floor)
        worst = max(errors[column][n] / max(errors[held_to][n], args.floor) for n in truth)
        verdicts.append(f"{column} {'pass' if worst <= args.factor else 'FAIL'} {worst:.2f}")
    print(f"times max(PyTorch float32's error on the same kind of device, {args.floor:g}), limit "
          f"{args.factor:g}: " + ", ".join(verdicts))
    return 1 if any("FAIL" in v for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
