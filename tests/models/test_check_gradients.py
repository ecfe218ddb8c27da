"""scripts/check_gradients_torch.py, the float64 gradient check of a whole resnet18 step.

  /usr/bin/python3 test_check_gradients.py PROJECT_ROOT MTRAIN_TRAIN

1. explain() on planted columns (PyTorch float64 only, batch 4): a gradient computed with
   two near-zero ReLU inputs flipped, plus float32-sized noise, is explained by exactly
   those two flips; a gradient with the same spike in a batch norm's bias but no change
   upstream (what no flip produces) is not explained by a flip.
2. The script end to end on mtrain-train's CPU step (batch 8 of the shipped set): the CPU
   column passes, and a column whose gradient carries a weight-decay term of 1e-6 (about
   1e-4 of the batch norms' weight gradients) fails, with exit status 1.
Exit status 77 (skipped) where this python3 has no torch or numpy.
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"skipped: {sys.executable} cannot import {e.name}")
    sys.exit(77)

root, trainer = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "scripts"))
import bench_torch_train  # noqa: E402
import check_gradients_torch as check  # noqa: E402

failures = []


def expect(condition, what):
    print(("ok: " if condition else "FAILED: ") + what)
    if not condition:
        failures.append(what)


def planted_flips():
    torch.manual_seed(7)
    images = check.read_idx(os.path.join(root, "data/fashion-mnist-mini/train-images-idx3-ubyte.gz"))[:4]
    labels = check.read_idx(os.path.join(root, "data/fashion-mnist-mini/train-labels-idx1-ubyte.gz"))[:4]
    x = torch.from_numpy(images.astype(np.float64) / 255)[:, None]
    model = bench_torch_train.build("resnet18").double().train()
    reference = check.Float64Reference(model, x, torch.from_numpy(labels.astype(np.int64)), 1e-4)
    truth = reference.gradients({})
    scales = {n: float(np.abs(g).max()) for n, g in truth.items()}
    largest = max(scales.values())

    # The two candidates nearest zero whose flip moves their batch norm's bias gradient
    # well beyond the floor, in different ReLU calls.
    planted = []
    for call, index, _ in reference.candidates:
        channel, change = reference.spike(call, index)
        if abs(change) > 1e-3 * scales[reference.bias[call]] and all(call != c for c, _ in planted):
            planted.append((call, index))
        if len(planted) == 2:
            break
    expect(len(planted) == 2, f"two candidates with a visible flip among {len(reference.candidates)}")
    flips = {}
    for call, index in planted:
        flips.setdefault(call, set()).add(index)
    rng = np.random.default_rng(0)
    flipped = {n: g + 1e-7 * scales[n] * rng.standard_normal(g.shape) for n, g in reference.gradients(flips).items()}
    raw = max(check.relative_errors(flipped, truth, scales, largest).values())

    explained, found = check.explain(flipped, reference, scales, 1e-5)
    error = max(check.relative_errors(flipped, explained, scales, largest).values())
    expect(sorted((c, i) for c, i, _ in found) == sorted(planted),
           f"the planted flips {sorted(planted)} are the ones found: {[(c, i) for c, i, _ in found]}")
    expect(raw > 1e-3 and error < 1e-6, f"flips explained: error {raw:.1e} before, {error:.1e} after")

    # The first flip's spike alone, in the bias gradient and nowhere upstream.
    call, index = planted[0]
    bias = reference.bias[call]
    reference.gradients({})  # spike() now speaks of the pass without flips
    channel, change = reference.spike(call, index)
    spiked = {n: g.copy() for n, g in truth.items()}
    spiked[bias][channel] += change
    explained, found = check.explain(spiked, reference, scales, 1e-5)
    error = max(check.relative_errors(spiked, explained, scales, largest).values())
    expect(not found and error > 1e-3, f"a spike without its upstream change is no flip: {len(found)} "
                                       f"flip(s) kept, error {error:.1e}")


def end_to_end():
    with tempfile.TemporaryDirectory() as work:
        result = subprocess.run(
            [sys.executable, os.path.join(root, "scripts/check_gradients_torch.py"), trainer,
             os.path.join(root, "data/fashion-mnist-mini"), work, "--run", "cpu=--device cpu",
             "--run", "decay=--device cpu --weight-decay 1e-6"], capture_output=True, text=True)
    print(result.stdout + result.stderr)
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    expect(result.returncode == 1, f"exit status 1 (a column failed), got {result.returncode}")
    expect("cpu pass" in last, "mtrain's CPU gradient passes")
    expect("decay FAIL" in last, "the gradient with a weight-decay term of 1e-6 fails")


planted_flips()
end_to_end()
sys.exit(1 if failures else 0)
