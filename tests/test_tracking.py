"""Experiment tracking: W&B (offline: the run directory holds every figure of the log line, the
validation loss and the resolved config, from one rank) and TensorBoard; clear errors when absent."""
import glob
import json
import os
import struct
import sys

import pytest

from megacoat.config import ConfigError, MegacoatConfig, parse_args, validate_config
from megacoat.training.tracking import Trackers, flatten_metrics
from test_cli import TINY, _env, _free_port, ROOT

import subprocess

ARGS = TINY + ["--global-batch-size", "4", "--fp32", "--num-workers", "0", "--train-iters", "4",
               "--eval-interval", "2", "--eval-iters", "1"]
FIGURES = ["lm_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "peak_mem_gib", "skipped", "nan",
           "time_per_iter_s", "consumed_samples"]


def wandb_records(path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framing (32 KiB blocks of
    [crc32 u32, length u16, type u8, data]; types 1 full, 2 first, 3 middle, 4 last), protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    out, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(pending)
            out.append(r)
            pending = b""
    return out


def _run(args, nproc, extra_env):
    env = dict(_env(), **extra_env)
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics(tmp_path):
    pytest.importorskip("wandb")
    log = tmp_path / "log.jsonl"
    save_dir = tmp_path / "wb"
    r = _run(ARGS + ["--wandb-project", "megacoat-test", "--wandb-entity", "team-x", "--wandb-exp-name", "tiny",
                     "--wandb-save-dir", str(save_dir), "--log-json", str(log)], 2,
             {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"})
    assert r.returncode == 0, r.stderr[-3000:]
    runs = glob.glob(str(save_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs  # one rank logs, not every rank
    (wfile,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    recs = wandb_records(wfile)
    history, config, run = {}, {}, None
    for rec in recs:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            run = rec.run
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
    assert run.entity == "team-x" and run.project == "megacoat-test" and run.display_name == "tiny"
    # The resolved config: derived values filled in by validation, not the raw flags.
    assert config["model"]["ffn_hidden_size"] == 192 and config["train"]["global_batch_size"] == 4
    assert config["optim"]["lr_decay_iters"] == 4
    lines = [json.loads(x) for x in open(log)]
    train = [x for x in lines if "lm_loss" in x]
    assert [x["iteration"] for x in train] == [1, 2, 3, 4]
    for x in train:
        got = history[x["iteration"]]
        for k in FIGURES:
            assert got[k] == pytest.approx(x[k], rel=1e-12), k
        assert got["comm_bytes_per_iter/grad"] == x["comm_bytes_per_iter"]["grad"] > 0  # bytes on the wire
    valid = [x for x in lines if "valid_loss" in x]
    assert [x["iteration"] for x in valid] == [2, 4]
    for x in valid:
        assert history[x["iteration"]]["valid_loss"] == pytest.approx(x["valid_loss"], rel=1e-12)


def test_tensorboard_scalars_equal_the_log(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    r = _run(ARGS + ["--tensorboard-dir", str(tb), "--log-json", str(log)], 1, {})
    assert r.returncode == 0, r.stderr[-3000:]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    train = [x for x in map(json.loads, open(log)) if "lm_loss" in x]
    for k in ("lm_loss", "lr", "grad_norm", "tokens_per_s", "skipped"):
        events = acc.Scalars(k)
        assert [e.step for e in events] == [1, 2, 3, 4]
        assert [e.value for e in events] == pytest.approx([x[k] for x in train], rel=1e-6)
    assert [e.step for e in acc.Scalars("valid_loss")] == [2, 4]


def _cfg(*flags):
    cfg = parse_args(list(flags))
    validate_config(cfg, 1)
    return cfg


def test_missing_packages_are_clear_errors(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="needs the tensorboard package: pip install tensorboard"):
        Trackers(_cfg("--tensorboard-dir", str(tmp_path)))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="needs the wandb package: pip install wandb"):
        Trackers(_cfg("--wandb-project", "p"))


def test_wandb_options_need_a_project():
    with pytest.raises(ConfigError, match="need --wandb-project"):
        _cfg("--wandb-entity", "team")


def test_flatten_metrics():
    assert flatten_metrics({"iteration": 3, "a": 1.5, "mfu": None, "c": {"grad": 10, "param": 0}, "ok": True}) == \
        {"a": 1.5, "c/grad": 10, "c/param": 0, "ok": 1.0}


@pytest.mark.slow
def test_wandb_run_id_survives_a_restart(tmp_path):
    """With --save, a resumed job (preemption, requeue) logs into the same W&B run."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    flags = TINY + ["--global-batch-size", "2", "--fp32", "--num-workers", "0", "--wandb-project", "p",
                    "--wandb-save-dir", str(tmp_path / "wb"), "--save", str(tmp_path / "ck")]
    for iters in ("2", "3"):
        r = _run(flags + ["--train-iters", iters, "--load", str(tmp_path / "ck"), "--override-opt_param-scheduler"], 1,
                 env)
        assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and len({r.rsplit("-", 1)[1] for r in runs}) == 1, runs


def test_wandb_without_a_login_is_one_line(tmp_path):
    """--wandb-project with W&B online and no API key: wandb.init's UsageError was a traceback from the trainer's
    constructor; now one line with the ways out (login, offline mode, no tracker), before any step."""
    pytest.importorskip("wandb")
    env = {k: v for k, v in _env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_MODE="online", WANDB_SILENT="true", WANDB_DISABLE_GIT="true",
               WANDB_CONFIG_DIR=str(tmp_path / "cfg"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py")] + ARGS
                       + ["--wandb-project", "megacoat-test", "--wandb-save-dir", str(tmp_path / "wb")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "--wandb-project megacoat-test: W&B could not start a run" in r.stderr
    assert "WANDB_MODE=offline" in r.stderr and " iteration " not in r.stdout
