#!/usr/bin/env python3
"""One training step's gradients of mtrain, on each device named, against PyTorch in float64.

  check_gradients_torch.py MTRAIN_TRAIN DATA_DIR WORK_DIR [--model resnet18] [--batch 8]
                           [--run cpu="--device cpu" --run cuda="--device cuda --no-tf32" ...]
                           [--factor 10] [--floor 1e-4]

Writes the first BATCH images of DATA_DIR's Fashion-MNIST IDX files as a one-batch data
set, lets mtrain-train save its initial weights (--max-steps 0) and then take one SGD step
with lr 1, no momentum and no weight decay for each --run NAME="FLAGS", so that the
gradient is the initial weights minus the final ones. PyTorch builds the same model
(bench_torch_train.py), loads the initial weights and computes the gradient of the same
batch in float64. The batch is the whole data set, so its order (mtrain's shuffle) does not
change batch norm's statistics or the mean loss.

Prints, per parameter tensor, max |gradient - float64| over the tensor's largest |float64|
value for PyTorch's own float32 gradient (on the CPU, and on the GPU with TF32 off where
one is usable) and for mtrain's runs. Parameters whose
float64 gradient is zero up to rounding (a convolution's bias ahead of batch norm) are
judged against the model's largest gradient instead. Float32 arithmetic cannot do better
than PyTorch's float32 column of the same kind of device (a run whose flags name cuda is
held to PyTorch's GPU), which is far from zero where a ReLU input within rounding of zero
flips; so the test is relative to it: exit status 1 when an mtrain tensor is off by more
than FACTOR times max(PyTorch float32's error, FLOOR).
"""
import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trainer")
    ap.add_argument("data_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--run", action="append", default=None, metavar='NAME="FLAGS"')
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--floor", type=float, default=1e-4)
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

    def torch_gradients(dtype, device="cpu"):
        model = bench.build(args.model).to(dtype).train()
        model.load_state_dict({k: torch.from_numpy(v.copy()).to(dtype if v.dtype != np.int64 else torch.int64)
                               for k, v in initial.items()})
        model = model.to(device)
        torch.nn.functional.cross_entropy(model(x.to(dtype).to(device)), labels.to(device)).backward()
        return {n: p.grad.double().cpu().numpy() for n, p in model.named_parameters()}

    truth = torch_gradients(torch.float64)
    # PyTorch's own float32 gradients: how close float32 arithmetic gets on this batch.
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    columns = {"torch-f32": torch_gradients(torch.float32)}
    references = {}  # mtrain's column -> the PyTorch column it is held to
    gpu_runs = [name for name, flags in runs.items() if "cuda" in flags]
    if gpu_runs and torch.cuda.is_available():
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        columns["torch-gpu"] = torch_gradients(torch.float32, "cuda")
    for name in runs:
        final = load_file(finals[name])
        columns[name] = {n: initial[n].astype(np.float64) - final[n].astype(np.float64) for n in truth}
        references[name] = "torch-gpu" if name in gpu_runs and "torch-gpu" in columns else "torch-f32"
    largest = max(float(np.abs(g).max()) for g in truth.values())

    worst = 0.0  # of error / max(torch float32's error, floor) over mtrain's columns
    print(f"# {args.model}, batch {args.batch}: max |gradient - float64| / max |float64| per tensor")
    print(f"# {'tensor':28s} " + " ".join(f"{c:>10s}" for c in columns))
    for name, g in truth.items():
        scale = float(np.abs(g).max())
        # A gradient that is zero up to float64 rounding is compared to the model's largest.
        noise = scale < 1e-9 * largest
        errors = {c: float(np.abs(grads[name] - g).max()) / (largest if noise else scale)
                  for c, grads in columns.items()}
        for column, reference in references.items():
            worst = max(worst, errors[column] / max(errors[reference], args.floor))
        print(f"  {name:28s} " + " ".join(f"{e:10.2e}" for e in errors.values())
              + ("  (zero gradient; over the largest)" if noise else ""))
    print(f"worst: {worst:.2f} times max(PyTorch float32's error on the same kind of device, {args.floor:g})"
          f" (limit {args.factor:g})")
    return 0 if worst <= args.factor else 1


if __name__ == "__main__":
    sys.exit(main())
