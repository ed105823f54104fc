"""The JSON-lines log after a resume: records of iterations the checkpoint did not reach are removed."""
import json
import os

from megacoat.training.log import drop_json_records_after


def test_records_after_the_resumed_iteration_are_dropped_and_other_lines_kept(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"iteration": i, "lm loss": 5.0 - i / 7}) for i in range(1, 6)]
    lines.insert(2, json.dumps({"event": "evaluation"}))  # a record without an iteration stays
    lines.append("{not json")  # a line cut by a crash stays: it names no iteration
    path.write_text("\n".join(lines))  # the last line without its newline
    drop_json_records_after(str(path), 3)
    kept = path.read_text().splitlines()
    assert kept == lines[:4] + ["{not json"]
    assert os.listdir(tmp_path) == ["log.jsonl"]  # no temporary file left beside it


def test_nothing_to_drop_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"iteration": 1}) + "\n")
    before = os.stat(path).st_mtime_ns
    drop_json_records_after(str(path), 4)
    assert os.stat(path).st_mtime_ns == before
    drop_json_records_after(str(tmp_path / "absent.jsonl"), 0)  # no log yet: nothing happens
