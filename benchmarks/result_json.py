"""JSON result files written whole or not at all: a run cut off while writing leaves the previous file (or none),
never a truncated one that a resumable benchmark would take for done."""
import json
import os


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
