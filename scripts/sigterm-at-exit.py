#!/usr/bin/env python3
"""Counts how mtrain-train ends when a SIGTERM reaches it on its way out of an error, as a
launcher's teardown does when two ranks fail together (Note [An acknowledgement never
outlives the run] in trainer/stopping/stop_signals.cpp).

A world of one resumes from a checkpoint directory whose two files are damaged, so it
fails in set-up; the moment its error record appears, this sends SIGTERM. Every run should
end with exit status 1; any other signal is printed with the end of its stderr.

    python3 scripts/sigterm-at-exit.py build/bin/mtrain-train 150
"""
import collections
import os
import signal
import subprocess
import sys
import tempfile


def damaged_checkpoint_dir(train, work):
    ckpt = os.path.join(work, "checkpoints")
    flags = ["--model", "lenet", "--dataset", "synthetic", "--batch-size", "4", "--no-eval", "--threads", "1",
             "--checkpoint-dir", ckpt]
    subprocess.run([train, *flags, "--max-steps", "2", "--checkpoint-every", "1"], check=True, capture_output=True)
    for name in ("checkpoint.safetensors", "checkpoint.previous.safetensors"):
        path = os.path.join(ckpt, name)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(data)
    return flags


def one_try(train, flags, error_file):
    if os.path.exists(error_file):
        os.remove(error_file)
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=error_file)
    p = subprocess.Popen([train, *flags, "--max-steps", "4"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    while p.poll() is None and not os.path.exists(error_file):
        pass  # spin: the window between the record and the exit is short
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, err = p.communicate()
    return p.returncode, err.decode(errors="replace")


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} MTRAIN_TRAIN TRIES")
    train, tries = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as work:
        flags = damaged_checkpoint_dir(train, work)
        ends = collections.Counter()
        for i in range(tries):
            code, err = one_try(train, flags, os.path.join(work, "error.json"))
            ends[f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"] += 1
            if code < 0 and code != -signal.SIGTERM:
                print(f"try {i}: died of {signal.Signals(-code).name}; stderr ends:\n{err[-300:]}")
    print(", ".join(f"{n} x {end}" for end, n in sorted(ends.items())))
    sys.exit(0 if set(ends) == {"exit 1"} else 1)


if __name__ == "__main__":
    main()
