"""Reading and writing the run folders, and checking what a run wrote."""

import csv
import json
import os
import subprocess
import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_text(path, default=""):
    """The file's text (undecodable bytes replaced), or default when it cannot
    be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def read_float(path):
    """The one number a file holds, or None."""
    try:
        with open(path) as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return None


def read_csv(path, row):
    """[row(r) for each record r of the CSV at path (a dict by its header)],
    leaving out the records row() rejects with KeyError or ValueError or
    returns None for; [] when the file is missing."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            try:
                v = row(r)
            except (KeyError, ValueError):
                continue
            if v is not None:
                out.append(v)
    return out


def load_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    """obj as indented JSON, with a final newline."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def png_problems(folder, names, min_size=0, bad="not a plausible PNG", missing=None):
    """Problems with the PNGs `names` in folder: each must begin with the PNG
    signature and be at least min_size bytes. A failed one is reported as
    "<name>: <bad>", a missing one as "<name>: <missing>" (default: the
    error)."""
    problems = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
            if head != PNG_MAGIC or os.path.getsize(path) < min_size:
                problems.append(f"{name}: {bad}")
        except OSError as e:
            problems.append(f"{name}: {missing or e}")
    return problems


def report_problems(problems, label):
    """Prints the problems the outputs' check found, then "ok" or how many;
    the exit status: 0 when none, 1 otherwise."""
    for p in problems:
        print(f"{label}: {p}")
    print(f"{label}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


def git_commit(root, default=None):
    """The short commit of the checkout at root, or default."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return default
    return out or default


def die(prog, msg):
    """prog's message on stderr, then exit status 2 (bad input)."""
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def read_meta(run_dir, die):
    """The run's parameters (run_dir/run.json, as the driver wrote them)."""
    try:
        return load_json(os.path.join(run_dir, "run.json"))
    except (OSError, ValueError) as e:
        die(f"run.json: {e}")


def parts(run_dir, sub, names, die):
    """(name, run_dir/sub/name) of each name: a run's phases or runs, each
    folder required."""
    for name in names:
        d = os.path.join(run_dir, sub, name)
        if not os.path.isdir(d):
            die(f"{d}: missing")
        yield name, d


def locust_aggregated(folder):
    """The "Aggregated" row (a dict) of Locust's folder/locust_stats.csv, or
    None."""
    path = os.path.join(folder, "locust_stats.csv")
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("Name") == "Aggregated":
                return r
    return None
