"""--model FILE.onnx against PyTorch: networks exported by torch.onnx.export, trained by mtrain.

  /usr/bin/python3 test_onnx_models.py PROJECT_ROOT BIN_DIR

For a small network built here (residual add, batch norms, a convolution without bias,
max and global average pooling, a linear layer), one of the mobile activations, one of
Inception's joins and paddings, and torchvision's resnet18, a small DenseNet
(concatenations), MobileNetV3 small (squeeze-and-excitation), SqueezeNet, GoogLeNet, MNASNet,
EfficientNet-B0, ShuffleNet V2 (shapes computed with the batch) and a small ConvNeXt
(LayerNorm, GELU, linear layers on channels-last images), with one-channel stems, all
exported in training mode from random weights:
1. mtrain-train starts from the graph's initializers: --max-steps 0 --save-final writes the
   module's state_dict, names and values, and it loads into the module with
   load_state_dict(strict=True).
2. One SGD step (lr 1, no momentum) on the same 8 images: every gradient (initial minus
   final weight) matches PyTorch's float64 gradient as closely as PyTorch's own float32
   gradient does (read the same way, through a float32 update), within FACTOR, each against
   the float64 gradient with the ReLU decisions it took (the float64 check of
   scripts/check_gradients_torch.py, flipped ReLUs explained), and the batch norms' running
   statistics match.
3. 2 ranks x 4 images with --sync-bn train the weights 1 rank x 8 images trains, and
   --save-onnx writes the same graph with those weights, which the module then computes with.
4. Bad files are one clear error, before any training: not ONNX, an operator mtrain has no
   layer for, an eval-mode export (batch norms folded), padding from the input's size
   (auto_pad), a weight whose dimensions its data does not hold, a LayerNorm exported as its
   formula (before opset 17), an input shape the data does not fit.
Exit status 77 (skipped) where this python3 lacks torch, torchvision or onnx.
"""
import collections
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import onnx  # noqa: F401  (torch.onnx.export needs it to check what it writes)
    import torch
    import torchvision
except ImportError as e:
    print(f"skipped: {sys.executable} cannot import {e.name}")
    sys.exit(77)

root, bin_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "scripts"))
import check_gradients_torch as check  # noqa: E402

trainer = os.path.join(bin_dir, "mtrain-train")
launcher = os.path.join(bin_dir, "mtrain-launch")
FACTOR, FLOOR, MARGIN = 10.0, 1e-5, 1e-4
BATCH = 8
failures = []


def expect(condition, what):
    print(("ok: " if condition else "FAILED: ") + what, flush=True)
    if not condition:
        failures.append(what)


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + y)
        y = torch.nn.functional.max_pool2d(y, 2)
        y = torch.nn.functional.adaptive_avg_pool2d(y, 1)
        return self.fc(torch.flatten(y, 1))


class MobileNet(torch.nn.Module):
    """What mobile networks are made of: depthwise and grouped convolutions, ReLU6 (Clip),
    Hardswish, Hardsigmoid, clamp(min=0); and arithmetic with numbers on either side."""
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, groups=4, bias=True)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.nn.functional.relu6(self.bn1(self.conv1(x)))
        y = torch.nn.functional.hardswish(self.bn2(self.conv2(self.depthwise(y))))
        y = (1.5 - torch.nn.functional.hardsigmoid(y)) * 2 + torch.clamp(y, min=0) / 4
        y = torch.nn.functional.adaptive_avg_pool2d(y, 1)
        return self.fc(torch.flatten(y, 1))


class InceptionNet(torch.nn.Module):
    """How Inception and GoogLeNet join branches: 1x1 convolutions, a 1x3 and 3x1 pair and an
    average pooling with padding (exported as a Pad of zeros before it) concatenated, max
    pooling in ceil mode, F.pad before a convolution, a dilated convolution (DeepLab's), one
    with another stride along each axis, and a mean over height and width (ReduceMean)."""
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.b1 = torch.nn.Conv2d(8, 4, 1)
        self.b13 = torch.nn.Conv2d(8, 4, (1, 3), padding=(0, 1))
        self.b31 = torch.nn.Conv2d(4, 4, (3, 1), padding=(1, 0))
        self.bp = torch.nn.Conv2d(8, 4, 1)
        self.padded = torch.nn.Conv2d(12, 8, 3)
        self.atrous = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2)
        self.tall = torch.nn.Conv2d(8, 8, (3, 1), stride=(2, 1))
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.stem(x)))  # 14x14
        y = torch.nn.functional.max_pool2d(y, 3, 2, ceil_mode=True)  # 7x7 (6x6 without ceil mode)
        pooled = torch.nn.functional.avg_pool2d(y, 3, 1, padding=1)
        y = torch.cat([self.b1(y), self.b31(self.b13(y)), self.bp(pooled)], 1)
        y = torch.relu(self.padded(torch.nn.functional.pad(y, (1, 1, 1, 1))))
        return self.fc(self.tall(torch.relu(self.atrous(y))).mean([2, 3]))


def squeezenet():
    """torchvision's SqueezeNet 1.1: fire modules (concatenations), max pooling in ceil mode, a
    convolution as the classifier."""
    m = torchvision.models.squeezenet1_1(num_classes=10, dropout=0.0)
    m.features[0] = torch.nn.Conv2d(1, 64, 3, stride=2)
    return m


def googlenet():
    """torchvision's GoogLeNet: Inception blocks (four branches each), max pooling in ceil mode."""
    m = torchvision.models.googlenet(num_classes=10, aux_logits=False, transform_input=False, init_weights=True,
                                     dropout=0.0)
    basic_conv = sys.modules[torchvision.models.GoogLeNet.__module__].BasicConv2d
    m.conv1 = basic_conv(1, 64, kernel_size=7, stride=2, padding=3)
    return m


def mnasnet():
    """torchvision's MNASNet 0.5: depthwise blocks and a mean over height and width (ReduceMean)."""
    m = torchvision.models.mnasnet0_5(num_classes=10, dropout=0.0)
    m.layers[0] = torch.nn.Conv2d(1, m.layers[0].out_channels, 3, padding=1, stride=2, bias=False)
    return m


def efficientnet():
    """torchvision's EfficientNet-B0: SiLU (Sigmoid and Mul), squeeze-and-excitation; stochastic
    depth 0 (PyTorch 1.13 cannot export its random drop) and dropout 0."""
    m = torchvision.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.0)
    m.classifier[0].p = 0.0
    m.features[0][0] = torch.nn.Conv2d(1, 32, 3, stride=2, padding=1, bias=False)
    return m


def shufflenet():
    """torchvision's ShuffleNet V2 x0.5: channel splits (Slices of computed bounds), channel
    shuffles (Reshape, Transpose, Reshape; the export's batch size written into the shapes)
    and a mean over height and width."""
    m = torchvision.models.shufflenet_v2_x0_5(num_classes=10)
    m.conv1[0] = torch.nn.Conv2d(1, 24, 3, 2, 1, bias=False)
    return m


def convnext():
    """torchvision's ConvNeXt, two small stages: LayerNorm over channels-last images, linear
    layers on them (MatMul of a transposed weight, its bias Add), GELU (Div, Erf, Add, Mul),
    layer scale (a parameter per channel), and the Transposes between the layouts. Exported
    with opset 17, where LayerNorm is one node; layer scale 0.5 (not 1e-6) so that the blocks'
    gradients are not lost below the float32 noise of the shortcut's."""
    blocks = [torchvision.models.convnext.CNBlockConfig(16, 32, 1), torchvision.models.convnext.CNBlockConfig(32, None, 1)]
    m = torchvision.models.convnext.ConvNeXt(blocks, stochastic_depth_prob=0.0, layer_scale=0.5, num_classes=10)
    m.features[0][0] = torch.nn.Conv2d(1, 16, 4, stride=4)
    return m


def torchvision_resnet(depth):
    """torchvision's resnet34 or resnet50 with a one-channel stem: mtrain's built-in model of
    that name has its structure and names."""
    def build():
        m = getattr(torchvision.models, f"resnet{depth}")(num_classes=10)
        m.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        return m
    return build


def densenet():
    """torchvision's DenseNet (concatenations), small enough for 28x28 images and one channel."""
    m = torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2,
                                    num_classes=10)
    m.features.conv0 = torch.nn.Conv2d(1, 16, 7, 2, 3, bias=False)
    return m


def mobilenet_v3():
    """torchvision's MobileNetV3 small: squeeze-and-excitation (Mul), hard activations,
    depthwise convolutions, and the classifier's Dropout at rate 0 (a rate above 0 draws
    other masks than PyTorch)."""
    m = torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)
    m.features[0][0] = torch.nn.Conv2d(1, 16, 3, 2, 1, bias=False)
    return m


def resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)  # Fashion-MNIST is one channel
    return m


def export(model, path, shape=(2, 1, 28, 28), training=True, opset=None):
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    options = {"opset_version": opset} if opset else {}
    torch.onnx.export(model, torch.randn(*shape), path, training=mode, do_constant_folding=not training, **options)


def run(args):
    return subprocess.run(args, capture_output=True, text=True)


def weights(path):
    return {k: torch.from_numpy(v.copy()) for k, v in check.load_file(path).items()}


def load(module, values, strict=True):
    """module.load_state_dict(values) with the module's own state_dict metadata: MNASNet reads
    its version from it, and a file of tensors carries none."""
    values = collections.OrderedDict(values)
    values._metadata = module.state_dict()._metadata
    module.load_state_dict(values, strict=strict)
    return module


def compare_step(name, build, work, slice_dir, opset=None, builtin=None):
    """`build`'s module against mtrain's graph of its export, or against mtrain's `builtin`
    model of the same structure (which draws its own weights; PyTorch starts from them)."""
    torch.manual_seed(11)
    module = build().train()
    graph = os.path.join(work, f"{name}.onnx")
    if not builtin:
        export(module, graph, opset=opset)
    # The export's training-mode forward moved the running statistics, and the graph holds
    # them as they are after it; num_batches_tracked it leaves out (mtrain starts it at 0).
    state = {k: v.clone() for k, v in module.state_dict().items()}
    common = [trainer, "--model", builtin or graph, "--data-dir", slice_dir, "--batch-size", str(BATCH), "--lr", "1",
              "--momentum", "0", "--no-eval", "--no-shuffle", "--threads", "2", "--log-level", "warn"]

    start = os.path.join(work, f"{name}-start.safetensors")
    r = run(common + ["--max-steps", "0", "--save-final", start])
    expect(r.returncode == 0, f"{name}: --max-steps 0 runs ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    initial = weights(start)
    expect(set(initial) == set(state), f"{name}: the saved names are the state_dict's "
           f"(missing {sorted(set(state) - set(initial))[:3]}, extra {sorted(set(initial) - set(state))[:3]})")
    if builtin and set(initial) == set(state):
        state = {k: initial[k].to(state[k].dtype).clone() for k in state}
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    expect(all(torch.equal(initial[k], state[k]) for k in state if k in initial and k not in counters),
           f"{name}: the saved values are the module's own")
    expect(all(int(initial[k]) == 0 for k in counters if k in initial), f"{name}: num_batches_tracked starts at 0")
    for k in counters:
        state[k].zero_()
    if name == "small":
        fresh = os.path.join(work, f"{name}-xavier.safetensors")
        r = run(common + ["--max-steps", "0", "--init", "xavier", "--save-final", fresh])
        redrawn = weights(fresh) if r.returncode == 0 else {}
        expect(r.returncode == 0 and not torch.equal(redrawn["conv1.weight"], state["conv1.weight"]) and
               torch.equal(redrawn["bn1.running_mean"], torch.zeros(8)),
               f"{name}: --init xavier initialises the graph afresh, as a built-in model")
    try:
        load(build(), initial)
        expect(True, f"{name}: the saved file loads into the module with load_state_dict(strict=True)")
    except RuntimeError as e:
        expect(False, f"{name}: load_state_dict: {e}")

    final_path = os.path.join(work, f"{name}-step.safetensors")
    r = run(common + ["--max-steps", "1", "--save-final", final_path])
    expect(r.returncode == 0, f"{name}: one step runs ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    final = weights(final_path)
    images = check.read_idx(os.path.join(slice_dir, "train-images-idx3-ubyte"))
    labels = torch.from_numpy(check.read_idx(os.path.join(slice_dir, "train-labels-idx1-ubyte")).astype(np.int64))
    x = torch.from_numpy((images.astype(np.float32) / np.float32(255))[:, None])

    def module(dtype):
        m = build().to(dtype).train()
        load(m, {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
        return m

    own_module = module(torch.float32)
    torch.nn.functional.cross_entropy(own_module(x), labels).backward()
    own = {n: p.grad for n, p in own_module.named_parameters()}
    reference = module(torch.float64)
    float64 = check.Float64Reference(reference, x.double(), labels, MARGIN)
    truth = float64.gradients({})
    # Each column read as a gradient: mtrain's through its float32 update (lr 1, no momentum);
    # PyTorch's float32 one the same way, which rounds it to the weight's precision (a batch
    # norm's weight near 1 keeps a gradient to 6e-8 only).
    mine = {n: (state[n].double() - final[n].double()).numpy() for n in truth}
    theirs = {n: (state[n].double() - (state[n] - own[n].float()).double()).numpy() for n in truth}
    # A ReLU input within float32 rounding of zero may fall on either side in any float32
    # implementation; each column is held to the float64 gradient with the ReLU decisions it
    # took (Note [Explaining flipped ReLUs] in scripts/check_gradients_torch.py). A gradient
    # that is zero in exact arithmetic (a bias before a batch norm) is judged on the scale of
    # the largest gradient instead of its own rounding noise.
    scales = {n: float(np.abs(g).max()) for n, g in truth.items()}
    largest = max(scales.values())
    truth_mine, flips_mine = check.explain(mine, float64, scales, FLOOR)
    truth_theirs, flips_theirs = check.explain(theirs, float64, scales, FLOOR)
    worst = []
    for n in truth:
        scale = max(scales[n], 1e-3 * largest)
        err = float(np.abs(mine[n] - truth_mine[n]).max()) / scale
        torch_err = float(np.abs(theirs[n] - truth_theirs[n]).max()) / scale
        worst.append((err / max(torch_err, FLOOR), n, err, torch_err))
    if os.environ.get("ONNX_TEST_VERBOSE"):
        for w in sorted(worst)[-8:]:
            print(f"  {w[1]}: {w[2]:.2e} against {w[3]:.2e} ({w[0]:.1f}x)")
    ratio, n, err, torch_err = max(worst)
    flipped = (f"; flipped ReLUs explained: mtrain {len(flips_mine)}, PyTorch {len(flips_theirs)}"
               if flips_mine or flips_theirs else "")
    expect(ratio <= FACTOR, f"{name}: every gradient of {len(worst)} within {FACTOR:g}x PyTorch float32's error "
           f"of the float64 gradient (worst {n}: {err:.2e} against {torch_err:.2e}{flipped})")
    stats = [k for k in state if k.endswith("running_mean") or k.endswith("running_var")]
    if not stats:
        return graph
    ref_state = reference.state_dict()
    stat_err = max(float((final[k].double() - ref_state[k]).abs().max()) for k in stats)
    expect(stat_err < 1e-5, f"{name}: the running statistics of {len(stats)} buffers follow PyTorch's "
           f"(largest difference {stat_err:.1e})")
    return graph


def compare_builtin_with_graph(name, build, builtin, work, slice_dir):
    """mtrain's built-in `builtin` against the graph PyTorch exports of `build`'s module with
    the built-in model's initial weights: one step changes every parameter bit for bit
    alike. (For resnet50 on 28x28 images in batches of 8 the float64 check of compare_step
    cannot judge: its float32 gradients are ill-conditioned, PyTorch's own 1e-2 off its
    float64 ones, and the graph path is checked against PyTorch op by op above.)"""
    common = ["--data-dir", slice_dir, "--batch-size", str(BATCH), "--lr", "1", "--momentum", "0", "--no-eval",
              "--no-shuffle", "--threads", "2", "--log-level", "warn"]
    start = os.path.join(work, f"{builtin}-start.safetensors")
    r = run([trainer, "--model", builtin, "--max-steps", "0", "--save-final", start] + common)
    expect(r.returncode == 0, f"{name}: --max-steps 0 runs ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    initial, module = weights(start), build()
    expect(set(initial) == set(module.state_dict()), f"{name}: the saved names are torchvision's state_dict's")
    try:
        load(module, {k: initial[k].to(v.dtype) for k, v in module.state_dict().items()})
    except (RuntimeError, KeyError) as e:
        expect(False, f"{name}: load_state_dict: {e}")
        return
    graph = os.path.join(work, f"{builtin}.onnx")
    export(module.train(), graph)
    steps = {}
    for model in (builtin, graph):
        final = os.path.join(work, f"{builtin}-{'graph' if model == graph else 'built-in'}.safetensors")
        r = run([trainer, "--model", model, "--max-steps", "1", "--save-final", final] + common)
        expect(r.returncode == 0, f"{name}: one step of {os.path.basename(model)} runs ({r.stderr.strip()[-300:]})")
        steps[model] = weights(final) if r.returncode == 0 else {}
    params = [n for n, _ in module.named_parameters()]
    same = [n for n in params if n in steps[builtin] and n in steps[graph] and
            torch.equal(steps[builtin][n], steps[graph][n])]
    expect(len(same) == len(params), f"{name}: one step moves {len(same)} of {len(params)} parameters bit for bit as "
           f"the graph of torchvision's module does")


def compare_ranks(graph, work, slice_dir):
    common = ["--model", graph, "--data-dir", slice_dir, "--lr", "0.5", "--momentum", "0.9", "--no-eval",
              "--no-shuffle", "--threads", "1", "--log-level", "warn", "--max-steps", "3", "--sync-bn"]
    one = os.path.join(work, "one.safetensors")
    two = os.path.join(work, "two.safetensors")
    r1 = run([trainer] + common + ["--batch-size", str(BATCH), "--save-final", one])
    r2 = run([launcher, "--nproc_per_node=2", trainer] + common + ["--batch-size", str(BATCH // 2), "--save-final", two])
    expect(r1.returncode == 0 and r2.returncode == 0,
           f"small: 1 rank and 2 ranks train ({(r1.stderr + r2.stderr).strip()[-400:]})")
    if r1.returncode or r2.returncode:
        return
    a, b = weights(one), weights(two)
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    expect(diff < 1e-5, f"small: 2 ranks x {BATCH // 2} images with --sync-bn train 1 rank x {BATCH}'s weights "
           f"(largest difference {diff:.1e} after 3 steps)")
    saved_onnx(graph, two, work, slice_dir, common)


def saved_onnx(graph, final, work, slice_dir, common):
    """--save-onnx (on 2 ranks, rank 0 writes): the graph's nodes with --save-final's values."""
    from onnx import numpy_helper
    out = os.path.join(work, "trained.onnx")
    final_again = os.path.join(work, "final-again.safetensors")
    r = run([launcher, "--nproc_per_node=2", trainer] + common +
            ["--batch-size", str(BATCH // 2), "--save-final", final_again, "--save-onnx", out])
    expect(r.returncode == 0, f"--save-onnx runs ({r.stderr.strip()[-300:]})")
    if r.returncode:
        return
    before, after = onnx.load(graph), onnx.load(out)
    onnx.checker.check_model(after)
    same_nodes = [(n.op_type, list(n.input), list(n.output)) for n in before.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in after.graph.node]
    expect(same_nodes, f"--save-onnx keeps the graph's {len(before.graph.node)} nodes as they were")
    trained = weights(final_again)
    values = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in after.graph.initializer}
    expect(set(values) <= set(trained) and all(torch.equal(values[k], trained[k]) for k in values),
           f"--save-onnx's {len(values)} initializers are the trained weights, bit for bit")
    expect(not all(torch.equal(values[k], v) for k, v in
                   ((i.name, torch.from_numpy(numpy_helper.to_array(i).copy())) for i in before.graph.initializer)),
           "--save-onnx's initializers differ from the exported ones (training moved them)")
    x = torch.rand(4, 1, 28, 28)
    from_graph, from_file = SmallNet().eval(), SmallNet().eval()
    from_graph.load_state_dict(values, strict=False)
    from_file.load_state_dict(trained, strict=True)
    expect(torch.equal(from_graph(x), from_file(x)), "the module computes the same with --save-onnx's weights")


def bad_files(work, slice_dir):
    def refused(graph, fragments, what):
        r = run([trainer, "--model", graph, "--data-dir", slice_dir, "--max-steps", "1", "--log-level", "warn"])
        ok = r.returncode != 0 and all(f in r.stderr for f in fragments) and "epoch" not in r.stderr + r.stdout
        expect(ok, f"{what}: exit {r.returncode}, one clear error ({r.stderr.strip()[-300:]})")

    text = os.path.join(work, "notes.onnx")
    with open(text, "w") as f:
        f.write("these are not the weights you are looking for\n")
    refused(text, ["notes.onnx", "not an ONNX model"], "a text file")

    class Softplus(SmallNet):
        def forward(self, x):
            return torch.nn.functional.softplus(super().forward(x))
    unsupported = os.path.join(work, "softplus.onnx")
    export(Softplus(), unsupported)
    refused(unsupported, ["operator Softplus is not supported", "Conv", "BatchNormalization"], "an unknown operator")

    folded = os.path.join(work, "eval.onnx")
    export(SmallNet().eval(), folded, training=False)
    refused(folded, ["eval-mode export", "TrainingMode.TRAINING"], "an eval-mode export")

    # Files changed after the export: a convolution that asks for padding from the input's
    # size, and a weight whose dimensions claim far more than the file holds.
    base = os.path.join(work, "base.onnx")
    export(SmallNet(), base)
    model = onnx.load(base)
    conv = model.graph.node[0]
    del conv.attribute[:]
    conv.attribute.extend([onnx.helper.make_attribute("auto_pad", "SAME_UPPER"),
                           onnx.helper.make_attribute("kernel_shape", [3, 3])])
    same = os.path.join(work, "same.onnx")
    onnx.save(model, same)
    refused(same, ["auto_pad SAME_UPPER"], "padding from the input's size")
    model = onnx.load(base)
    weight = next(t for t in model.graph.initializer if t.name == "conv1.weight")
    del weight.dims[:]
    weight.dims.extend([1 << 20, 1 << 20, 3, 3])
    huge = os.path.join(work, "huge.onnx")
    onnx.save(model, huge)
    refused(huge, ["conv1.weight", "which no file of this size holds"], "dimensions the data does not hold")

    decomposed = os.path.join(work, "convnext14.onnx")
    export(convnext(), decomposed)  # opset 14 writes each LayerNorm as means, powers and roots
    refused(decomposed, ["ReduceMean", "opset_version=17"], "a LayerNorm exported before opset 17")

    rgb = os.path.join(work, "rgb.onnx")
    net = SmallNet()
    net.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
    export(net, rgb, shape=(2, 3, 32, 32))
    refused(rgb, ["takes images 3x32x32", "1x28x28"], "an input of another shape")


def main():
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        slice_dir = os.path.join(work, "slice")
        check.write_slice(os.path.join(root, "data/fashion-mnist-mini"), slice_dir, BATCH)
        small = compare_step("small", SmallNet, work, slice_dir)
        compare_step("resnet18", resnet18, work, slice_dir)
        compare_step("mobile", MobileNet, work, slice_dir)
        compare_step("densenet", densenet, work, slice_dir)
        compare_step("mobilenet_v3", mobilenet_v3, work, slice_dir)
        compare_step("inception", InceptionNet, work, slice_dir)
        compare_step("squeezenet", squeezenet, work, slice_dir)
        compare_step("googlenet", googlenet, work, slice_dir)
        compare_step("mnasnet", mnasnet, work, slice_dir)
        compare_step("efficientnet", efficientnet, work, slice_dir)
        compare_step("shufflenet", shufflenet, work, slice_dir)
        compare_step("convnext", convnext, work, slice_dir, opset=17)
        compare_step("built-in resnet34", torchvision_resnet(34), work, slice_dir, builtin="resnet34")
        compare_builtin_with_graph("built-in resnet50", torchvision_resnet(50), "resnet50", work, slice_dir)
        if small:
            compare_ranks(small, work, slice_dir)
        bad_files(work, slice_dir)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)


main()
