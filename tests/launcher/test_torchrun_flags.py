"""Every row of docs/launcher.md's "torchrun's flags" table, run for real.

  python3 test_torchrun_flags.py MTRAIN_LAUNCH DOCS_LAUNCHER_MD

Each row's command runs as `mtrain-launch COMMAND` in an empty directory that holds an
executable hello.py (leading VAR=VALUE words go to the environment). "supported" and
"accepted" rows must exit 0; "refused" rows must exit 2 with one error line naming the
flag. When /usr/bin/python3 can import torch, the table must also name every option of
that torchrun's argument parser.
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile

STATES = {"supported", "accepted", "refused"}


def table_rows(markdown):
    section = markdown.split("## torchrun's flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in STATES:
            flags = re.findall(r"`(-[^`]+)`", cells[0])
            command = cells[2].strip("`")
            rows.append((cells[0], flags, cells[1], command))
    return rows


def run_row(launcher, state, command, workdir):
    words = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MTRAIN_STORE_TOKEN"))}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    env["MTRAIN_PYTHON"] = sys.executable
    result = subprocess.run([launcher] + words, cwd=workdir, env=env, capture_output=True, text=True, timeout=60)
    problems = []
    if state == "refused":
        errors = [l for l in result.stderr.splitlines() if l.startswith("mtrain-launch: error: ")]
        flag = words[0].split("=")[0]
        if result.returncode != 2 or len(errors) != 1 or flag not in errors[0]:
            problems.append(f"expected exit 2 and one error line naming {flag}")
    elif result.returncode != 0:
        problems.append("expected exit 0")
    if problems:
        return f"{command!r}: {problems[0]}, found exit {result.returncode}\n{result.stderr}"
    return None


def torchrun_options():
    """The long options of the installed torchrun, underscore spelling; None without torch."""
    probe = ("import json, torch.distributed.run as r\n"
             "print(json.dumps([s for a in r.get_args_parser()._actions for s in a.option_strings]))")
    result = subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    import json
    return {s.replace("-", "_").lstrip("_") for s in json.loads(result.stdout) if s.startswith("--")} - {"help"}


def main():
    launcher, docs = sys.argv[1], sys.argv[2]
    with open(docs) as f:
        rows = table_rows(f.read())
    failures = []
    if len(rows) < 20:
        failures.append(f"found only {len(rows)} rows in the table of {docs}")
    with tempfile.TemporaryDirectory() as workdir:
        hello = os.path.join(workdir, "hello.py")
        with open(hello, "w") as f:
            f.write("#!/usr/bin/env python3\nprint('hello')\n")
        os.chmod(hello, 0o755)
        for name, _, state, command in rows:
            problem = run_row(launcher, state, command, workdir)
            print(f"{'FAIL' if problem else 'ok  '} {state:9} {name}: {command}")
            if problem:
                failures.append(problem)
    documented = {f.lstrip("-").replace("-", "_") for _, flags, _, _ in rows for f in flags}
    options = torchrun_options()
    if options is None:
        print("(torch not importable by /usr/bin/python3: the table's coverage of torchrun is not checked)")
    else:
        missing = sorted(options - documented)
        print(f"torchrun's parser has {len(options)} long options; missing from the table: {missing or 'none'}")
        if missing:
            failures.append(f"torchrun options missing from the table: {missing}")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
