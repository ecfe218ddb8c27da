#!/usr/bin/env python3
"""A fault sweep of mtrain-launch and mtrain-train on this machine: each fault is made TRIES
times on real processes and the outcomes counted, for the table in docs/launcher.md
("Faults, measured").

    python3 scripts/fault-sweep.py build/bin 10

- kill: 2 workers; one of them, chosen in turn, is SIGKILLed mid-run. Right: the report's
  root cause names that rank and signal 9, and the launcher exits 137.
- stop: 2 workers, --timeout 10; one is SIGSTOPped mid-run. Right: the job ends naming that
  rank; the seconds from the stop to the launcher's exit are reported (median, max).
- damaged: a run checkpoints twice; one byte of the latest file, at a random offset, is
  flipped; the run is continued. Right: it resumes from the previous file, exits 0, sets
  the damaged one aside, and leaves two checkpoints that load.
- exit-signal: scripts/sigterm-at-exit.py (SIGTERM on the way out of an error). Right: exit 1.
The store flood and the partitions are CTest cases (test_store_robustness,
test_multihost_partition); docs/launcher.md gives their commands.
"""
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TRAIN_FLAGS = ["--model", "lenet", "--dataset", "synthetic", "--batch-size", "8", "--no-eval", "--threads", "1"]


def worker_pid(rank, launcher_pid, limit=30.0):
    """The pid of the mtrain-train child of `launcher_pid` whose RANK is `rank`."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != launcher_pid:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            except (OSError, IndexError, ValueError):
                continue
            if env.get(b"RANK") == str(rank).encode():
                return int(pid)
        time.sleep(0.05)
    raise RuntimeError(f"no worker with RANK={rank} under launcher {launcher_pid}")


def start_gang(bindir, extra):
    return subprocess.Popen(
        [f"{bindir}/mtrain-launch", "--nproc_per_node", "2", "train", *TRAIN_FLAGS, "--epochs", "100000", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def root_cause_rank(report):
    m = re.search(r"Root cause[^\n]*:\n\s*rank\s*: (\d+)", report)
    return int(m.group(1)) if m else None


def sweep_kill(bindir, tries):
    right = 0
    for i in range(tries):
        rank = i % 2
        p = start_gang(bindir, [])
        pid = worker_pid(rank, p.pid)
        time.sleep(1.0)  # mid-run
        os.kill(pid, signal.SIGKILL)
        _, err = p.communicate(timeout=120)
        ok = p.returncode == 137 and root_cause_rank(err) == rank and "signal 9 (SIGKILL)" in err
        right += ok
        if not ok:
            print(f"kill try {i}: exit {p.returncode}\n{err[-1500:]}")
    return f"{right}/{tries} named the killed rank, exit 137"


def sweep_stop(bindir, tries):
    right, seconds = 0, []
    for i in range(tries):
        rank = i % 2
        p = start_gang(bindir, ["--timeout", "10"])
        pid = worker_pid(rank, p.pid)
        time.sleep(1.0)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = p.communicate(timeout=120)
        seconds.append(time.monotonic() - stopped)
        ok = p.returncode != 0 and root_cause_rank(err) == rank
        right += ok
        if not ok:
            print(f"stop try {i}: exit {p.returncode}\n{err[-1500:]}")
    return (f"{right}/{tries} named the stopped rank; ended {statistics.median(seconds):.2f} s "
            f"(median; max {max(seconds):.2f}) after the stop")


def sweep_damaged(bindir, tries):
    right = 0
    for i in range(tries):
        with tempfile.TemporaryDirectory() as work:
            ckpt = os.path.join(work, "ckpt")
            run = [f"{bindir}/mtrain-train", *TRAIN_FLAGS, "--checkpoint-dir", ckpt, "--checkpoint-every", "5"]
            subprocess.run([*run, "--max-steps", "10"], check=True, capture_output=True)
            latest = os.path.join(ckpt, "checkpoint.safetensors")
            data = bytearray(open(latest, "rb").read())
            at = random.randrange(len(data))
            data[at] ^= 0xFF
            open(latest, "wb").write(data)
            r = subprocess.run([*run, "--max-steps", "15"], capture_output=True, text=True)
            log = r.stdout + r.stderr
            resumed_previous = "checkpoint.previous.safetensors" in log.split("resuming from", 1)[-1][:200]
            set_aside = os.path.exists(os.path.join(ckpt, "checkpoint.damaged.safetensors"))
            # Both slots load: a world-of-one resume from each succeeds.
            both_load = all(
                subprocess.run([f"{bindir}/mtrain-train", *TRAIN_FLAGS, "--checkpoint-dir", d, "--max-steps", "15"],
                               capture_output=True).returncode == 0
                for d in _slots(ckpt, work))
            ok = r.returncode == 0 and resumed_previous and set_aside and both_load
            right += ok
            if not ok:
                print(f"damaged try {i} (byte {at} of {len(data)}): exit {r.returncode}, resumed from previous "
                      f"{resumed_previous}, set aside {set_aside}, both load {both_load}\n{log[-1500:]}")
    return f"{right}/{tries} resumed from the previous file, set the damaged one aside, kept two good ones"


def _slots(ckpt, work):
    """Each rotation slot alone in a directory of its own, as the latest checkpoint."""
    for name in ("checkpoint.safetensors", "checkpoint.previous.safetensors"):
        d = os.path.join(work, "slot-" + name)
        os.makedirs(d)
        os.link(os.path.join(ckpt, name), os.path.join(d, "checkpoint.safetensors"))
        yield d


def sweep_exit_signal(bindir, tries):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sigterm-at-exit.py")
    r = subprocess.run([sys.executable, script, f"{bindir}/mtrain-train", str(tries)], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1]


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} BINDIR TRIES")
    bindir, tries = sys.argv[1], int(sys.argv[2])
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = [("kill a worker (SIGKILL)", sweep_kill), ("stop a worker (SIGSTOP, --timeout 10)", sweep_stop),
            ("flip a byte of the latest checkpoint", sweep_damaged),
            ("SIGTERM on the way out of an error", sweep_exit_signal)]
    print("| fault | outcome |\n| --- | --- |")
    for name, sweep in rows:
        print(f"| {name} | {sweep(bindir, tries)} |", flush=True)


if __name__ == "__main__":
    main()
