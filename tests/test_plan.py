"""tools/plan.py and the layout search (training/layout_search.py): every candidate fits the dry run's memory
planner on every rank, every printed command line parses and passes --dry-run, flags given stay fixed, more link
bandwidth never makes the best pick slower, and impossible requests get a clear error."""
import copy
import dataclasses
import io
import json
import os
import re
import shlex
import sys

import torch

from megacoat.config import parse_args
from megacoat.training.hardware import load_hardware, parse_hardware
from megacoat.training.layout_search import command_line, distinct, inexactness, layout_of, preferred, search
from megacoat.training.planner import peak_estimate, plan_run
from megacoat.training.step_time import methods_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan as plan_tool  # noqa: E402
import pretrain_gpt  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--mock-data", "--vocab-size", "1000", "--bf16", "--untie-embeddings-and-output-weights",
         "--global-batch-size", "32"]


def _small_machine(gib: float):
    """The h200 file with `gib` of memory per GPU: small enough that memory decides what fits."""
    raw = copy.deepcopy(load_hardware("h200").raw)
    raw["memory_gib"], raw["reserved_gib"] = gib, 0.0
    return parse_hardware(raw)


def test_every_candidate_fits_the_memory_planner_on_every_rank():
    hw = _small_machine(0.03)
    res = search(MODEL + ["--ranks-per-node", "4"], 8, hw, 1000, max_micro_batch=8)
    assert res.candidates and res.too_large > 0  # memory decided something
    picked = res.candidates[:: max(1, len(res.candidates) // 12)][:12] + res.candidates[-2:]
    for c in picked:
        argv = command_line(MODEL + ["--ranks-per-node", "4"], c)
        cfg = parse_args(argv)
        plans = plan_run(cfg, 8, 1000, torch.device("cuda"))  # every rank, the dry run's planner
        m = methods_of(cfg, 8 // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size))
        recipe = "bf16" if m.recipe == "fp32" else m.recipe
        peaks = [peak_estimate(pl if c.fp8_copies else dataclasses.replace(pl, fp8_weight_copies=0),
                               m.memory_format, recipe) for pl in plans]
        assert max(peaks) <= hw.usable_bytes, (c.summary, max(peaks), hw.usable_bytes)
        assert max(peaks) == c.peak_bytes


def _printed_commands(text: str):
    return [shlex.split(line.split("python pretrain_gpt.py ", 1)[1]) for line in text.splitlines()
            if "python pretrain_gpt.py " in line]


def test_printed_command_lines_parse_and_pass_the_dry_run(capsys):
    out = io.StringIO()
    argv = MODEL + ["--world-size", "8", "--ranks-per-node", "4", "--hardware", "h200", "--inter-node-gbps", "100",
                    "--top", "4"]
    assert plan_tool.plan(argv, out) == 0
    text = out.getvalue()
    commands = _printed_commands(text)
    assert len(commands) == 4 and "configurations fit on 8 GPUs of h200" in text
    for cmd in commands:
        assert "--world-size" not in cmd and "--hardware" not in cmd and "--top" not in cmd
        assert pretrain_gpt.main(cmd + ["--dry-run", "--world-size", "8"]) == 0
        printed = capsys.readouterr().out
        assert "dry run: world 8" in printed and "predicted step on h200" in printed
    # the first pick's predicted tokens/s equals the dry run's for the same command at the same link
    first = commands[0]
    shown = float(re.search(r"1\. ([\d,]+) tokens/s per GPU", text).group(1).replace(",", ""))
    assert pretrain_gpt.main(first + ["--dry-run", "--world-size", "8", "--inter-node-gbps", "100"]) == 0
    again = re.search(r"\| ([\d,]+) tokens/s per GPU", capsys.readouterr().out).group(1)
    assert float(again.replace(",", "")) == shown


def test_flags_given_stay_fixed():
    argv = MODEL + ["--ranks-per-node", "4", "--tensor-model-parallel-size", "2", "--fp8-format", "hybrid",
                    "--fp8-recipe", "coat", "--micro-batch-size", "2"]
    res = search(argv, 8, load_hardware("h200"), 1000)
    assert res.candidates
    for c in res.candidates:
        assert c.summary.startswith("TP 2 ") and re.search(r"micro-batch 2[,;]", c.summary) and "; coat" in c.summary
        cmd = command_line(argv, c)
        assert cmd.count("--tensor-model-parallel-size") == 1 and cmd.count("--micro-batch-size") == 1
        assert "--fp8-recipe" in cmd and cmd.count("--fp8-format") == 1
    narrowed = search(MODEL + ["--ranks-per-node", "4"], 8, load_hardware("h200"), 1000, recipes=["bf16"],
                      states=["fp32"], comms=["plain"])
    assert narrowed.candidates and all("; bf16, fp32 states" in c.summary and ("ZeRO plain" in c.summary or
                                                                              "non-sharded" in c.summary)
                                       for c in narrowed.candidates)


def test_megatrons_recompute_alias_stays_fixed_too():
    """--recompute-activations (Megatron's spelling of --recompute-granularity selective) is a recomputation
    choice: every candidate is predicted with it, and the command line does not add another."""
    argv = MODEL + ["--ranks-per-node", "4", "--recompute-activations"]
    res = search(argv, 8, load_hardware("h200"), 1000, recipes=["bf16"], states=["fp32"], max_micro_batch=2)
    assert res.candidates
    for c in res.candidates:
        assert "selective recompute" in c.summary, c.summary
        assert "--recompute-granularity" not in command_line(argv, c)


def test_a_faster_link_never_makes_the_best_pick_slower():
    h200 = load_hardware("h200")
    best = []
    for gbps in (10, 100, 800):
        res = search(MODEL + ["--ranks-per-node", "2"], 8, h200.with_inter_node_gbps(gbps), 1000,
                     recipes=["bf16", "coat"], states=["fp32"], max_micro_batch=2)
        best.append(res.candidates[0].tokens_per_s_per_gpu)
    assert best == sorted(best) and best[-1] > best[0]


def test_each_layout_is_shown_once_with_exact_formats_unless_lossy_ones_buy_half_a_percent():
    res = search(MODEL + ["--ranks-per-node", "2"], 8, load_hardware("h200", 25), 1000, max_micro_batch=4)
    top = distinct(res.candidates, 6)
    assert len({layout_of(c) for c in top}) == len(top)
    for c in top:
        group = [d for d in res.candidates if layout_of(d) == layout_of(c)]
        fastest = max(d.tokens_per_s_per_gpu for d in group)
        assert c.tokens_per_s_per_gpu >= 0.995 * fastest
        # nothing as fast makes fewer lossy choices
        assert not [d for d in group if d.tokens_per_s_per_gpu >= 0.995 * fastest and inexactness(d) < inexactness(c)]
    exact = [c for c in res.candidates if inexactness(c) == 0]
    assert preferred(exact) is exact[0] and "ZeRO plain" in exact[0].summary or "non-sharded" in exact[0].summary


def test_impossible_requests_get_a_clear_error(capsys, tmp_path):
    tiny = _small_machine(0.001).raw
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(dict(tiny, name="tiny")))
    assert plan_tool.main(MODEL + ["--world-size", "2", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tools/plan.py: error: nothing fits:" in err and "over 0.0 GiB per GPU on 2 GPUs of tiny" in err
    assert "Give more GPUs, a smaller --global-batch-size or model" in err and "Traceback" not in err
    assert plan_tool.main(MODEL) == 2
    assert "needs --world-size N" in capsys.readouterr().err
    assert plan_tool.main(MODEL + ["--world-size", "8", "--recipes", "bf16,fp4"]) == 2
    assert "--recipes bf16,fp4: choose from bf16, tensorwise, coat" in capsys.readouterr().err
    assert plan_tool.main(MODEL + ["--world-size", "8", "--hardware", "missing.json"]) == 2
    assert "no such machine file" in capsys.readouterr().err
    no_batch = [a for a in MODEL if a not in ("--global-batch-size", "32")]
    assert plan_tool.main(no_batch + ["--world-size", "8"]) == 2
    assert "needs --global-batch-size" in capsys.readouterr().err
    # a fixed layout that cannot be: the refusal says which
    assert plan_tool.main(MODEL + ["--world-size", "8", "--tensor-model-parallel-size", "3"]) == 2
    assert "no layout can run on 8 GPUs of h200: --tensor-model-parallel-size 3" in capsys.readouterr().err


def test_one_reason_for_every_layout_is_given_alone(capsys):
    """A flag every layout refuses (a conflict, a value out of range, a fixed size that cannot be) is the
    configuration's fault: it is said once, without the advice about GPUs and memory, and without repeats."""
    for flags, message in [(["--lr", "-1"], "invalid configuration: --lr -1.0 must be > 0"),
                           (["--fp32"], "invalid configuration: --bf16 and --fp32 conflict: pick one."),
                           (["--overlap-grad-reduce"], "invalid configuration: --overlap-grad-reduce / "
                            "--overlap-param-gather need --use-distributed-optimizer"),
                           (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3 does not "
                            "divide --world-size 8")]:
        assert plan_tool.main(MODEL + ["--world-size", "8"] + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tools/plan.py: error: no layout can run on 8 GPUs of h200: {message}"), err
        assert err.count(message) == 1 and "Give more GPUs" not in err
    # reasons that differ per layout keep the list, each once
    assert plan_tool.main(MODEL + ["--world-size", "8", "--num-layers-per-virtual-pipeline-stage", "3"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits: no valid layout" in err and err.count("TP 1 PP 1 vp layers 3:") == 1
    assert "Change or drop the fixed flags the refusals name." in err and "Give more GPUs" not in err


def test_a_fixed_size_that_cannot_divide_the_world_is_named(capsys):
    """--tensor-model-parallel-size 3 (or 16) or --pipeline-model-parallel-size 3 on 8 GPUs: the refusal names the
    flag, not just "no valid layout"."""
    for flags, message in [(["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide "
                             "--world-size 8"),
                           (["--tensor-model-parallel-size", "16"], "--tensor-model-parallel-size 16 does not "
                            "divide --world-size 8"),
                           (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3 does not "
                            "divide --world-size 8")]:
        assert plan_tool.main(MODEL + ["--world-size", "8"] + flags) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # sizes the search chose itself are left out without a word: 12 GPUs of one node, TP 8 does not divide them
    res = search(MODEL + ["--ranks-per-node", "16", "--global-batch-size", "48"], 12, load_hardware("h200"), 1000,
                 max_micro_batch=1)
    assert res.candidates and not [r for r in res.invalid if "does not divide" in r]


def test_a_machine_or_batch_no_layout_can_mend_is_refused_up_front(capsys):
    for flags, message in [(["--world-size", "0"], "--world-size 0 must be >= 1"),
                           (["--world-size", "-8"], "--world-size -8 must be >= 1"),
                           (["--world-size", "8", "--ranks-per-node", "0"], "--ranks-per-node 0 must be >= 1"),
                           (["--world-size", "12", "--ranks-per-node", "8"], "--world-size 12 is not a multiple of "
                            "--ranks-per-node 8: plan for whole nodes (--world-size 8 or 16)"),
                           (["--world-size", "8", "--global-batch-size", "0"], "--global-batch-size 0 must be >= 1"),
                           # a micro-batch given that no data-parallel size can take (larger than, or not dividing,
                           # the global batch): named, not "nothing fits ... give more GPUs"
                           (["--world-size", "8", "--micro-batch-size", "64"], "--global-batch-size 32 is not a "
                            "multiple of --micro-batch-size 64"),
                           (["--world-size", "8", "--micro-batch-size", "3"], "--global-batch-size 32 is not a "
                            "multiple of --micro-batch-size 3")]:
        assert plan_tool.main(MODEL + flags) == 2
        err = capsys.readouterr().err
        assert f"tools/plan.py: error: {message}" in err and "nothing fits" not in err, err
    # one node partly used is a machine that exists
    assert plan_tool.main(MODEL + ["--world-size", "4", "--ranks-per-node", "8", "--top", "1"]) == 0


def test_top_and_max_micro_batch_below_one_are_refused(capsys):
    for flag, value in [("--top", "0"), ("--top", "-1"), ("--max-micro-batch", "0")]:
        try:
            rc = plan_tool.main(MODEL + ["--world-size", "8", flag, value])
        except SystemExit as e:  # argparse
            rc = e.code
        captured = capsys.readouterr()
        assert rc == 2 and f"argument {flag}: must be >= 1, got {value}" in captured.err
        assert "pretrain_gpt.py" not in captured.out


def test_the_scaling_tables_page_and_plot_are_checked_before_the_study(tmp_path, capsys, monkeypatch):
    def study(*a, **k):
        raise AssertionError("the study ran before its outputs were checked")
    monkeypatch.setattr(plan_tool, "scaling_rows", study)
    page = tmp_path / "planner.md"
    assert plan_tool.main(["--scaling-table", "--out", str(page), "--plot", str(tmp_path / "p.png")]) == 2
    assert f"--out {page}: no such page" in capsys.readouterr().err
    page.write_text("no markers\n")
    assert plan_tool.main(["--scaling-table", "--out", str(page), "--plot", str(tmp_path / "p.png")]) == 2
    assert "has no <!-- scaling-table --> ... <!-- /scaling-table --> block" in capsys.readouterr().err
    page.write_text(f"{plan_tool.BEGIN}\n{plan_tool.END}\n")
    assert plan_tool.main(["--scaling-table", "--out", str(page), "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert f"--plot {tmp_path / 'no' / 'p.png'}: its directory does not exist" in capsys.readouterr().err


def test_the_scaling_table_replaces_only_its_block(tmp_path, monkeypatch):
    from types import SimpleNamespace as Pick

    def row(gpus, gbps, tps):  # a study's row: the best picks per method, plain and with SDP4Bit
        return {"model": "7B", "gpus": gpus, "gbps": gbps,
                **{m: {"plain": Pick(tokens_per_s_per_gpu=tps, summary="TP 1"),
                       "sdp4bit": Pick(tokens_per_s_per_gpu=tps * 1.1, summary="TP 1, qWD")} for m in ("bf16", "COAT")}}

    rows = [row(8, 100, 4000.0), row(64, 100, 3500.0)]
    monkeypatch.setattr(plan_tool, "scaling_rows", lambda: rows)  # the study itself takes minutes
    page = tmp_path / "planner.md"
    page.write_text(f"before\n{plan_tool.BEGIN}\nold table\n{plan_tool.END}\nafter\n")
    assert plan_tool.main(["--scaling-table", "--out", str(page), "--plot", str(tmp_path / "p.png")]) == 0
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith(f"{plan_tool.END}\nafter\n") and "old table" not in text
    assert plan_tool.scaling_markdown(rows) in text and "3,850 (1.10x)" in text
    assert "7B, COAT: 8 GPUs at 100 Gb/s 1.10x, 64 GPUs at 100 Gb/s 1.10x." in text
    assert sorted(os.listdir(tmp_path)) in (["p.png", "planner.md"], ["planner.md"])  # no temporary file left


def test_sdp4bit_only_where_nodes_split_each_dp_group_evenly():
    """12 GPUs as 3 nodes of 4 with PP 2: DP 6 groups lie 4 + 2 over nodes, DP 3 groups 2 + 1. Plain ZeRO runs
    there (and is proposed); SDP4Bit's two-level groups cannot, so no such candidate is offered, and asking for it
    is refused naming --ranks-per-node."""
    argv = MODEL + ["--ranks-per-node", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "12"]
    res = search(argv, 12, load_hardware("h200"), 1000, recipes=["bf16"], states=["fp32"], max_micro_batch=2,
                 recompute=False)
    uneven = [c for c in res.candidates if re.search(r"PP 2 (vp \d+ )?DP [36],", c.summary)]
    assert uneven and all(c.summary.endswith("ZeRO plain") for c in uneven), [c.summary for c in uneven]
    res = search(argv + ["--use-distributed-optimizer", "--quantized-gradients"], 12, load_hardware("h200"), 1000,
                 recipes=["bf16"], states=["fp32"], max_micro_batch=2, recompute=False)
    assert not res.candidates and any("spread unevenly" in r and "--ranks-per-node" in r for r in res.invalid)
