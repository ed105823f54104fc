"""Which code a benchmark ran: the commit of the checkout it runs from.

An exported snapshot (`git archive` of a commit, as scripts/gpu_evidence.sh's callers make it) has a
COMMIT file at its root whose first word is that commit, and no .git of its own: asking git there
answers for whatever repository encloses the snapshot (on a GPU host, for example, a copy of the working
tree with another HEAD), so the COMMIT file is read first."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_commit(root: str = ROOT) -> str:
    """The exported snapshot's commit (COMMIT file), else git's HEAD of `root`, else ''."""
    try:
        with open(os.path.join(root, "COMMIT")) as f:
            first = f.readline().split()
        if first:
            return first[0]
    except OSError:
        pass
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    except OSError:
        return ""
