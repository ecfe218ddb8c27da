"""A graph from ONNX against the same network built in: mtrain-train's speed on each.

  python3 scripts/bench-onnx.py BIN_DIR [--runs N] [--model resnet18] [--steps S] [--batch B]
      [--device cpu|cuda] [--data-dir DIR]

Exports the built-in model's PyTorch twin (scripts/bench_torch_train.py builds it with the
same layers and state_dict names) to ONNX in training mode, then runs mtrain-train on the
built-in model and on the graph with the same flags, alternating, N times each. Each run's
speed is the median img/s of its logged windows after the first (warm-up); the result is
the median over runs of each, and their ratio (the graph's over the built-in's):

  per run: built-in 161.2 graph 160.8 ...
  median img/s: built-in 161.0, graph 160.4; graph / built-in: 0.996 (median of the runs' pairs: 0.998)
"""
import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)


def speed(trainer, model, args, work, tag):
    metrics = os.path.join(work, f"{tag}.jsonl")
    cmd = [trainer, "--model", model, "--batch-size", str(args.batch), "--max-steps", str(args.steps),
           "--log-every", str(args.every), "--no-eval", "--threads", str(args.threads), "--seed", "1",
           "--metrics", metrics, "--log-level", "warn", "--device", args.device]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    subprocess.run(cmd, check=True)
    with open(metrics) as f:
        windows = [e["img_per_s"] for e in map(json.loads, f) if e.get("event") == "step"]
    return statistics.median(windows[1:] if len(windows) > 1 else windows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="mtrain-train's --device")
    ap.add_argument("--data-dir", help="mtrain-train's --data-dir (default: its own)")
    args = ap.parse_args()
    import torch
    import bench_torch_train
    trainer = os.path.join(args.bin_dir, "mtrain-train")
    with tempfile.TemporaryDirectory() as work:
        graph = os.path.join(work, f"{args.model}.onnx")
        torch.manual_seed(0)
        # The TorchScript exporter, which torch >= 2.9 runs only when asked (dynamo=False).
        legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
        torch.onnx.export(bench_torch_train.build(args.model).train(), torch.randn(2, 1, 28, 28), graph,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, **legacy)
        built, read = [], []
        for i in range(args.runs):
            built.append(speed(trainer, args.model, args, work, f"built{i}"))
            read.append(speed(trainer, graph, args, work, f"graph{i}"))
            print(f"run {i + 1}: built-in {built[-1]:.1f} graph {read[-1]:.1f} img/s", flush=True)
    b, g = statistics.median(built), statistics.median(read)
    pairs = statistics.median(r / b_ for r, b_ in zip(read, built))
    print(f"median img/s: built-in {b:.1f}, graph {g:.1f}; graph / built-in: {g / b:.3f} "
          f"(median of the runs' pairs: {pairs:.3f})")


main()
