"""Shared bits of the data benchmarks: the markdown report header (date, commit, command, machine)."""
import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def git_commit() -> str:
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "megacoat/data", "csrc", "benchmarks"],
                               cwd=ROOT).returncode
        return sha + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(title: str) -> str:
    import numpy

    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"# {title}\n\n"
            f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
            f"- git commit: {git_commit()}\n"
            f"- command: `{command}`\n"
            f"- machine: {platform.processor() or platform.machine()}, {cpus} CPU core(s) available, "
            f"Python {platform.python_version()}, numpy {numpy.__version__}; load average at start "
            f"{os.getloadavg()[0]:.2f} (the machine is shared, so numbers vary by ~2x from run to run)\n\n")


def write(path: str, text: str) -> None:
    path = os.path.join(ROOT, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"(written to {os.path.relpath(path, ROOT)})")
