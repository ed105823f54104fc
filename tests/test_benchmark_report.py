"""benchmarks/report.py: docs/benchmarks.md is what the report generates from the committed results; the blocks
come from the newest result folder of each table, link to it and show its plots; a page without a table's
markers is refused with what to add."""
import json
import random
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402
import tables_spec as spec  # noqa: E402


def test_committed_page_is_what_the_report_generates():
    page = ROOT / "docs" / "benchmarks.md"
    assert page.read_text() == report.generate(str(page), str(ROOT / "benchmarks" / "results")), \
        "docs/benchmarks.md differs from its generated tables: run `python benchmarks/report.py`"


def _merged(table, date, rng):
    """A table's merged JSON as benchmarks/tables.py writes it, from synthetic parts."""
    runs = [{"name": m, "label": spec.METHODS[m].label, "kind": "megacoat", "outcome": "ok", "info": {"method": m},
             "metrics": {"tokens_per_s": rng.uniform(1e4, 9e4), "tflops": 300.0, "mfu": 0.3,
                         "peak_gib": rng.uniform(20, 40)}} for m in spec.METHODS]
    analysis = spec.TABLES[table].analyse({"1p36b-gbs4": {"runs": runs, "searches": []}})
    parts = {"1p36b-gbs4": {"date": f"{date}T01:02:03Z", "commit": "abcdef0123456789", "device_name": "NVIDIA H200",
                            "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "seconds": 200.0,
                            "status": "complete", "command": "python benchmarks/tables.py table-a"}}
    return {"table": table, "title": spec.TABLES[table].title, "folder": f"{date}_{table}_h200", "date": date,
            "hardware": "h200", "steps": None, "parts": parts,
            "missing_parts": [p.name for p in spec.TABLES[table].parts if p.name != "1p36b-gbs4"], **analysis}, runs


def _write(results, merged, png=True):
    folder = results / merged["folder"]
    folder.mkdir(parents=True)
    (folder / f"{merged['table']}.json").write_text(json.dumps(merged))
    if png:
        (folder / "tokens_per_s.png").write_bytes(b"\x89PNG")
    return folder


@pytest.fixture
def page(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(ROOT / "docs" / "benchmarks.md", docs / "benchmarks.md")
    return docs / "benchmarks.md"


def _outside_blocks(text):
    """The page without the contents of its generated blocks."""
    return re.sub(r"(<!-- table:([\w-]+) -->).*?(<!-- /table:\2 -->)", r"\1\3", text, flags=re.S)


def test_blocks_come_from_the_newest_folder(page, tmp_path):
    rng = random.Random(5)
    results = tmp_path / "results"
    old, _ = _merged("table-a", "2030-01-01", rng)
    new, runs = _merged("table-a", "2030-02-01", rng)
    _write(results, old, png=False)
    _write(results, new)
    (results / "2030-03-01_table-a_h200").mkdir()        # no merged JSON yet: not a result
    before = page.read_text()
    assert report.main(["--check", "--page", str(page), "--results", str(results)]) == 1
    assert page.read_text() == before                      # --check changes nothing
    assert report.main(["--page", str(page), "--results", str(results)]) == 0
    text = page.read_text()
    block = text[text.index("<!-- table:table-a -->"):text.index("<!-- /table:table-a -->")]
    assert "[2030-02-01_table-a_h200](../results/2030-02-01_table-a_h200/README.md)" in block
    assert "![tokens per s](../results/2030-02-01_table-a_h200/tokens_per_s.png)" in block
    assert "2030-01-01" not in block and "`abcdef0`" in block
    bf16 = runs[0]["metrics"]["tokens_per_s"]
    coat = runs[3]["metrics"]["tokens_per_s"]
    assert f"| {spec.METHODS['coat-fp8states'].label} | {coat:,.0f} | {coat / bf16:.3f}x |" in block
    assert "Parts not measured yet: `1p36b-gbs32`" in block
    # a table without a folder here gets its placeholder; everything outside the blocks is unchanged
    assert "Not measured with `benchmarks/tables.py` yet: `python benchmarks/tables.py table-d`" in text
    assert _outside_blocks(text) == _outside_blocks(before)
    assert report.main(["--check", "--page", str(page), "--results", str(results)]) == 0


def test_a_page_without_a_tables_markers_is_refused(page, tmp_path, capsys):
    page.write_text(page.read_text().replace("<!-- /table:table-c2 -->\n", ""))
    assert report.main(["--check", "--page", str(page), "--results", str(tmp_path)]) == 2
    assert "`<!-- /table:table-c2 -->`" in capsys.readouterr().err


def test_result_folders_ignore_other_tables_and_names(tmp_path):
    for name in ("2030-01-01_table-a_h200", "2030-05-01_table-d_h200", "2030-04-01_table-a_cpu", "notes",
                 "2030-06-01_coat-1p36b_h200", "2030-02-01_table-a_h200", "2030-03-01_table-a_h100"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name.split('_')[1] if '_' in name else name}.json").write_text("{}")
    # the newest of each hardware; the table's own (h200) first, then the others newest first
    assert [Path(f).name for f in report.result_folders(str(tmp_path), "table-a")] == [
        "2030-02-01_table-a_h200", "2030-04-01_table-a_cpu", "2030-03-01_table-a_h100"]
    assert report.result_folders(str(tmp_path), "table-c1") == []


def test_parts_measured_on_other_hardware_are_shown_once(page, tmp_path):
    """A table measured in parts on two machines: each folder's block shows what it measured, and neither calls
    a part, section or target not measured where the other folder has it."""
    rng = random.Random(7)
    results = tmp_path / "results"
    h200, _ = _merged("table-a", "2030-02-01", rng)
    h100, _ = _merged("table-a", "2030-01-01", rng)
    h100["folder"], h100["hardware"] = "2030-01-01_table-a_h100", "h100"
    # the H100 folder measured 1p36b-gbs32 only, the H200 folder 1p36b-gbs4 only
    h100["parts"] = {"1p36b-gbs32": dict(h200["parts"]["1p36b-gbs4"], date="2030-01-01T01:02:03Z",
                                         device_name="NVIDIA H100 80GB HBM3")}
    h100["missing_parts"] = [p for p in h200["missing_parts"] if p != "1p36b-gbs32"] + ["1p36b-gbs4"]
    for s in h100["sections"]:
        s["rows"] = [] if s["key"] == "1p36b-gbs4" else s["rows"]
    for s in h200["sections"]:
        s["rows"] = [] if s["key"] == "1p36b-gbs32" else s["rows"]
    h100["sections"][1]["rows"] = h200["sections"][0]["rows"]
    h100["targets"] = [dict(t, value=None, met=None) for t in h100["targets"]]
    _write(results, h200)
    _write(results, h100)
    assert report.main(["--page", str(page), "--results", str(results)]) == 0
    text = page.read_text()
    block = text[text.index("<!-- table:table-a -->"):text.index("<!-- /table:table-a -->")]
    h200_block, h100_block = block.split("2030-01-01, commit")
    assert "2030-02-01_table-a_h200" in h200_block and "2030-01-01_table-a_h100" in h100_block
    assert "`1p36b-gbs32`" not in h200_block.split("Reproduce")[0] and "global batch 32" not in h200_block
    assert "`1p36b-gbs4`" not in h100_block.split("Reproduce")[0] and "global batch 4\n" not in h100_block
    assert "| 1p36b-gbs4 |" in h200_block and "| 1p36b-gbs4 |" not in h100_block
    assert "Parts not measured yet: `7b-mbs2`" in h200_block and "Parts not measured yet: `7b-mbs2`" in h100_block
    assert block.count("Reproduce:") == 1 and "Reproduce:" in h100_block
