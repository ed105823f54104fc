"""pretrain_gpt.py as a Megatron user drives it: data flags, schedules, resumes with changed flags.
Each case either trains as Megatron-LM would or stops with one line naming the flag and the fix."""
import json

import pytest

from test_cli import TINY, run_cli

BASE = TINY + ["--fp32", "--num-workers", "0", "--global-batch-size", "8"]
_MOCK = TINY.index("--mock-data")
assert TINY[_MOCK + 1:_MOCK + 3] == ["--vocab-size", "301"]
REAL = TINY[:_MOCK] + TINY[_MOCK + 3:] + ["--fp32", "--num-workers", "0", "--global-batch-size", "8",
                                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _records(path):
    return [json.loads(x) for x in open(path) if "lm_loss" in x]


@pytest.mark.slow
def test_resume_with_a_smaller_global_batch_reads_on_to_its_last_step(tmp_path):
    """The train split is sized --train-iters x --global-batch-size; resumed at 32 consumed samples with
    half the batch, the run needs 32 + 6 x 4 = 56 (it stopped with a StopIteration traceback at 40)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    first = run_cli(BASE + ["--train-iters", "4", "--save", str(ckpt)])
    assert first.returncode == 0, first.stderr[-2000:]
    r = run_cli(BASE + ["--train-iters", "10", "--global-batch-size", "4", "--load", str(ckpt),
                        "--override-opt_param-scheduler", "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["consumed_samples"] for x in _records(log)] == [32 + 4 * k for k in range(1, 7)]


# ------------------------------------------------------------------------------------------------ data flags
def _data_cfg(tmp_path, *flags):
    from megacoat.config import parse_args, validate_config

    cfg = parse_args(["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
                      "--num-workers", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *flags])
    validate_config(cfg, 1)
    return cfg


def _build(cfg):
    from megacoat.data import build_datasets, build_tokenizer

    return build_datasets(cfg, build_tokenizer(cfg.data))


@pytest.mark.parametrize("under", ["file", "under_file"])
def test_data_cache_path_that_cannot_be_a_directory_is_named(tmp_path, under):
    """--data-cache-path naming a file, or a path under one, ended in a NotADirectoryError traceback."""
    from megacoat.data import DataConfigError
    from test_data_iterators import null_data

    (tmp_path / "notes.txt").write_text("x")
    cache = tmp_path / "notes.txt" if under == "file" else tmp_path / "notes.txt" / "cache"
    cfg = _data_cfg(tmp_path, "--data-path", null_data(tmp_path, "a"), "--data-cache-path", str(cache))
    with pytest.raises(DataConfigError, match=r"--data-cache-path .*notes.txt.*give --data-cache-path a writable"):
        _build(cfg)


def test_read_only_data_cache_without_the_indices_is_named(tmp_path, monkeypatch):
    """A cache directory that exists but cannot be written (a shared read-only cache) is fine while it holds the
    indices; lacking them, the PermissionError of the index build is reported naming --data-cache-path."""
    import megacoat.data.gpt_dataset as gpt_dataset
    from megacoat.data import DataConfigError
    from test_data_iterators import null_data

    cfg = _data_cfg(tmp_path, "--data-path", null_data(tmp_path, "a"), "--data-cache-path", str(tmp_path / "c"))
    _build(cfg)  # the indices are cached: read back below without writing

    def read_only(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(gpt_dataset, "exclusive_lock", read_only)
    _build(cfg)
    cfg.train.seed += 1  # other indices: they would have to be written
    with pytest.raises(DataConfigError, match=r"--data-cache-path .*c: cannot write .*Permission denied"):
        _build(cfg)


@pytest.mark.slow
def test_cli_unwritable_data_cache_is_one_line(tmp_path):
    from test_data_iterators import null_data

    (tmp_path / "f").write_text("x")
    r = run_cli(REAL + ["--train-iters", "2", "--data-path", null_data(tmp_path, "a"), "--data-cache-path", str(tmp_path / "f" / "c")])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("pretrain_gpt.py: error: --data-cache-path") == 1


def test_blend_weight_zero_leaves_the_prefix_out(tmp_path):
    """Megatron's blend never draws from a prefix weighted 0; it was refused as 'no train documents ... give this
    split a larger share of --split', a fix that does not apply."""
    from test_data_iterators import null_data

    a, b = null_data(tmp_path, "a", seed=1), null_data(tmp_path, "b", seed=2)
    cache = str(tmp_path / "cache")
    zero = _build(_data_cfg(tmp_path, "--data-path", "0", a, "1", b, "--data-cache-path", cache))
    only_b = _build(_data_cfg(tmp_path, "--data-path", "1", b, "--data-cache-path", cache))
    assert len(zero.train) == len(only_b.train)
    assert all((zero.train[i] == only_b.train[i]).all() for i in range(len(zero.train)))


@pytest.mark.parametrize("words,message", [
    (["nan", "A", "1", "B"], "finite and non-negative"),
    (["inf", "A", "1", "B"], "finite and non-negative"),
    (["-1", "A", "2", "B"], "finite and non-negative"),
    (["0.3", "A", "0.7", "A"], r"A is named twice; give it once with the weights summed \(1 A\)"),
    (["0.2", "A", "0.5", "B", "0.3", "./A"], r"./A is named twice; give it once with the weights summed \(0.5 ./A\)"),
    (["A", "B", "A"], "A is named twice; name it once"),
])
def test_bad_blends_are_refused_naming_the_fix(words, message, tmp_path, monkeypatch):
    """A NaN/inf weight ended in 'cannot convert float NaN to integer' (traceback); a prefix named twice blended two
    identically shuffled copies of one dataset (each sample drawn twice)."""
    from megacoat.data import DataConfigError
    from megacoat.data.dataset_builder import parse_blend

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataConfigError, match=message):
        parse_blend(words)


# ------------------------------------------------------------------------------------------------ schedule flags
def _refusal(flags, base=BASE) -> str:
    from megacoat.config import ConfigError, parse_args, validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(parse_args(base + list(flags)), 1)
    return str(e.value)


@pytest.mark.parametrize("flags,message", [
    # Megatron: 'expected sample-based learning rate decay' / '... warmup' / 'expected sample-based training'.
    # Each was accepted and ignored: the decay ran over --train-samples, warmup was 0, --train-iters was replaced.
    (["--train-samples", "64", "--lr-decay-iters", "4"], "--lr-decay-iters counts iterations, but --train-samples"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"], "--lr-warmup-iters counts iterations, but --train-samples"),
    (["--train-samples", "64", "--train-iters", "4"], "--train-iters 4 and --train-samples 64 (8 steps of "
                                                      "--global-batch-size 8) disagree: give only one"),
    # Megatron: 'can only specify one of lr-warmup-fraction and lr-warmup-iters'; the fraction silently won.
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters "
                                                                "conflict"),
    # Megatron: 'split and blend_per_split are incompatible'; --split was silently ignored.
    (["--train-data-path", "A", "--valid-data-path", "B", "--split", "50,50,0"], "--split 50,50,0 divides the "
                                                                                "documents of --data-path"),
])
def test_flags_of_another_unit_or_source_are_refused(flags, message):
    text = _refusal(flags, REAL if "--train-data-path" in flags else BASE)
    assert message in text and "\n" not in text


def test_consistent_unit_flags_and_defaults_resolve():
    """What stays accepted: a --train-iters equal to what --train-samples gives, --lr-warmup-iters 0 with either
    unit; the defaults resolve by unit; validating twice (tests, tools) keeps the resolved values."""
    from megacoat.config import parse_args, validate_config

    cfg = parse_args(BASE + ["--train-samples", "64", "--train-iters", "8", "--lr-warmup-iters", "0"])
    validate_config(cfg, 1)
    validate_config(cfg, 1)
    assert cfg.train.train_iters == 8 and cfg.optim.lr_warmup_iters == 0 and cfg.optim.lr_decay_iters is None
    cfg = parse_args(BASE)
    validate_config(cfg, 1)
    validate_config(cfg, 1)
    assert (cfg.train.train_iters, cfg.optim.lr_warmup_iters, cfg.optim.lr_decay_iters) == (200, 20, 200)
    assert cfg.data.split == "969,30,1"
    cfg = parse_args(BASE + ["--lr-warmup-fraction", "0.25", "--train-iters", "8"])
    validate_config(cfg, 1)
    validate_config(cfg, 1)
    assert cfg.optim.lr_warmup_iters == 0


# ------------------------------------------------------------------------------------------------ resume
def _scheduler(*flags, samples=False):
    from megacoat.config import parse_args, validate_config
    from megacoat.training.lr_schedule import build_lr_scheduler

    cfg = parse_args(BASE + list(flags))
    validate_config(cfg, 1)
    return build_lr_scheduler(cfg)


def _saved_after(steps, *flags):
    s = _scheduler(*flags)
    for _ in range(steps):
        s.step(8) if s.unit == "samples" else s.step()
    return s.state_dict()


@pytest.mark.parametrize("changed,named", [
    (["--lr", "5e-4"], "--lr 0.001 in the checkpoint, 0.0005 now"),
    (["--min-lr", "0"], "--min-lr 0.0001 in the checkpoint, 0.0 now"),
    (["--lr-warmup-iters", "1"], "--lr-warmup-iters (or --lr-warmup-fraction) 2 in the checkpoint, 1 now"),
    (["--train-iters", "8"], "--lr-decay-iters (default: --train-iters) 4 in the checkpoint, 8 now"),
    (["--lr-decay-style", "linear"], "--lr-decay-style cosine in the checkpoint, linear now"),
])
def test_resume_with_other_schedule_flags_follows_megatrons_rule(changed, named):
    """Megatron refuses a resume whose schedule flags differ from the checkpoint's (an assertion) unless
    --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler picks a side; the new flags were
    silently taken (extending --train-iters re-decayed: the lr jumped back up from --min-lr)."""
    from megacoat.config import ConfigError

    base = ["--train-iters", "4", "--lr-warmup-iters", "2"]
    saved = _saved_after(4, *base)
    resumed = _scheduler(*base, *changed)
    with pytest.raises(ConfigError) as e:
        resumed.load_state_dict(saved)
    assert named in str(e.value) and "--override-opt_param-scheduler" in str(e.value) and \
        "--use-checkpoint-opt_param-scheduler" in str(e.value)

    follow = _scheduler(*base, *changed, "--override-opt_param-scheduler")
    follow.load_state_dict(saved)
    fresh = _scheduler(*base, *changed)
    assert follow.num_steps == 4 and follow.lr_at(5) == fresh.lr_at(5)
    keep = _scheduler(*base, *changed, "--use-checkpoint-opt_param-scheduler")
    keep.load_state_dict(saved)
    same = _scheduler(*base)
    assert keep.state_dict() == same.state_dict() | {"num_steps": 4} and keep.lr_at(5) == same.lr_at(5)


def test_resume_in_the_other_unit_is_refused_and_old_checkpoints_load():
    from megacoat.config import ConfigError

    saved = _saved_after(4, "--train-iters", "4")
    with pytest.raises(ConfigError, match="counts iterations but this run's counts samples .* --no-load-optim"):
        _scheduler("--train-samples", "64").load_state_dict(saved)
    s = _scheduler("--train-iters", "8", "--lr", "5e-4")
    s.load_state_dict({"num_steps": 4})  # a checkpoint that saved the position only
    assert s.num_steps == 4 and s.max_lr == 5e-4


def test_both_scheduler_override_flags_conflict():
    assert "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict" in _refusal(
        ["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"])


@pytest.mark.slow
def test_cli_resume_with_another_lr(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--train-iters", "4", "--lr-warmup-iters", "1"]
    assert run_cli(flags + ["--save", str(ckpt)]).returncode == 0
    r = run_cli(flags + ["--load", str(ckpt), "--lr", "5e-4", "--train-iters", "6"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("pretrain_gpt.py: error: the checkpoint's learning-rate schedule differs") == 1
    log = tmp_path / "log.jsonl"
    r = run_cli(flags + ["--load", str(ckpt), "--train-iters", "6", "--use-checkpoint-opt_param-scheduler",
                         "--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["lr"] for x in _records(log)] == [1e-4, 1e-4]  # the checkpoint's decay ended at iteration 4


# ------------------------------------------------------------------------------------------------ Megatron flags
def test_nccl_backend_on_the_cpu_is_refused():
    """--distributed-backend nccl (Megatron scripts pass it) on the CPU: every rank died in init_process_group with
    'device_id parameter must be an accelerator with an index' (a traceback per rank)."""
    import torch

    from megacoat.config import ConfigError, parse_args
    from megacoat.training.trainer import Trainer

    from megacoat.config import validate_config

    # --use-cpu asks for the CPU whatever the machine has: refused with the other flags (so --dry-run says it too)
    with pytest.raises(ConfigError, match="--distributed-backend nccl needs GPUs and --use-cpu runs on the CPU"):
        validate_config(parse_args(BASE + ["--use-cpu", "--distributed-backend", "nccl"]), 1)
    r = run_cli(BASE + ["--use-cpu", "--distributed-backend", "nccl", "--dry-run"])
    assert r.returncode == 2 and "--use-cpu runs on the CPU" in r.stderr and "Traceback" not in r.stderr
    if torch.cuda.is_available():
        pytest.skip("the no-GPU case")
    with pytest.raises(ConfigError, match="--distributed-backend nccl needs GPUs, but this run is on the CPU .*gloo"):
        Trainer(parse_args(BASE + ["--train-iters", "1", "--distributed-backend", "nccl"]))


@pytest.mark.parametrize("flags", [["--use-flash-attn"], ["--no-masked-softmax-fusion"], ["--use-mcore-models"],
                                   ["--transformer-impl", "local"], ["--transformer-impl", "transformer_engine"],
                                   ["--attention-softmax-in-fp32"], ["--log-throughput"], ["--attention-backend", "auto"],
                                   ["--no-bias-gelu-fusion"], ["--no-bias-dropout-fusion"],
                                   ["--apply-query-key-layer-scaling"]])
def test_megatron_flags_without_effect_are_accepted_with_a_note(flags):
    """Flags Megatron scripts pass: they stopped the run as 'unrecognized arguments' with no fix; they change
    nothing here, so they are accepted, the configuration is the one without them, and a note says why."""
    from megacoat.config import parse_args, parse_args_with_notes

    cfg, notes = parse_args_with_notes(BASE + flags)
    assert cfg.to_dict() == parse_args(BASE).to_dict()
    assert len(notes) == 1 and notes[0].startswith(f"{flags[0]} changes nothing here: ")


@pytest.mark.parametrize("flags,fix", [
    (["--ckpt-format", "torch_dist"], "tools/checkpoint/convert.py --load-format megatron"),
    (["--use-legacy-models"], "megatron-core GPT only: drop the flag"),
    (["--data-args-path", "blend.txt"], "--data-path $(cat FILE)"),
])
def test_megatron_flags_refused_name_the_fix(flags, fix, capsys):
    from megacoat.config import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(BASE + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {flags[0]} is not supported: " in err and fix in err


def test_megatron_aliases():
    from megacoat.config import parse_args

    assert parse_args(BASE + ["--recompute-activations"]).train.recompute_granularity == "selective"
    cfg = parse_args(BASE + ["--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings"])
    assert cfg.model.position_embedding_type == "rope"


@pytest.mark.slow
def test_cli_prints_the_note_once_and_trains(tmp_path):
    r = run_cli(BASE + ["--train-iters", "1", "--use-flash-attn", "--transformer-impl", "local"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("pretrain_gpt.py: note: --use-flash-attn changes nothing here") == 1
    assert r.stderr.count("pretrain_gpt.py: note: --transformer-impl changes nothing here") == 1


# ------------------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("split,tested", [("90,5,5", True), ("95,5,0", False)])
def test_the_test_split_is_evaluated_at_the_end(tmp_path, split, tested):
    """Megatron evaluates a non-empty test split once training ends ('validation loss at iteration N on test
    set'); its documents were set aside by --split and never used."""
    import io

    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    from test_data_iterators import null_data

    out, log = io.StringIO(), tmp_path / "log.jsonl"
    cfg = parse_args(REAL + ["--train-iters", "2", "--eval-iters", "1", "--data-path", null_data(tmp_path, "a"),
                             "--split", split, "--data-cache-path", str(tmp_path / "c"), "--log-json", str(log)])
    t = Trainer(cfg, log_stream=out)
    t.train()
    t.close()
    records = [json.loads(x) for x in open(log)]
    assert ("validation loss at iteration 2 on test set" in out.getvalue()) == tested
    assert [r["iteration"] for r in records if "test_loss" in r] == ([2] if tested else [])
    assert [r["iteration"] for r in records if "valid_loss" in r] == [2]


def test_a_run_stopped_by_exit_interval_leaves_the_test_split_for_its_end(tmp_path):
    import io

    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    from test_data_iterators import null_data

    out = io.StringIO()
    cfg = parse_args(REAL + ["--train-iters", "3", "--exit-interval", "1", "--eval-iters", "1", "--data-path",
                             null_data(tmp_path, "a"), "--split", "90,5,5", "--data-cache-path", str(tmp_path / "c")])
    t = Trainer(cfg, log_stream=out)
    t.train()
    t.close()
    assert "on test set" not in out.getvalue() and "validation loss at iteration 1" in out.getvalue()


def test_a_run_out_of_time_saves_and_leaves_without_the_final_validation(tmp_path):
    """--exit-duration-in-mins: the job's remaining time is for the save; a validation after it could outlast
    the allocation (Megatron-LM exits there too)."""
    import io

    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    from test_data_iterators import null_data

    out = io.StringIO()
    save = tmp_path / "ckpt"
    cfg = parse_args(REAL + ["--train-iters", "3", "--log-interval", "1", "--exit-duration-in-mins", "1",
                             "--eval-iters", "1", "--data-path", null_data(tmp_path, "a"), "--split", "90,5,5",
                             "--data-cache-path", str(tmp_path / "c"), "--save", str(save)])
    t = Trainer(cfg, log_stream=out)
    t.checkpointer.start_time -= 3600  # the hour since the process started is over the limit
    t.train()
    t.close()
    assert "exiting at iteration 1: --exit-duration-in-mins 1.0 reached" in out.getvalue()
    assert "validation loss" not in out.getvalue() and "on test set" not in out.getvalue()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.parametrize("flags,fix", [
    (["--seq-length", "64", "--max-position-embeddings", "32"], "raise it to at least 64, or leave it out"),
    (["--exit-interval", "0"], "leave it out to run all --train-iters"),  # Megatron takes 0 as 'never'
])
def test_refusals_say_the_fix(flags, fix):
    assert fix in _refusal(flags)


def test_a_validation_split_without_tokens_says_the_fix(tmp_path):
    """Documents of length 0 at the end of the data: the validation split has documents but no token. The refusal
    named the split only; it now says what to change."""
    import numpy as np

    from megacoat.data import DataConfigError
    from megacoat.data.indexed_dataset import IndexedDatasetBuilder

    rng, prefix = np.random.default_rng(0), str(tmp_path / "z")
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for n in [int(rng.integers(5, 80)) for _ in range(60)] + [0] * 4:
            b.add_document(rng.integers(0, 1000, size=n))
    cfg = _data_cfg(tmp_path, "--data-path", prefix, "--split", "94,6,0", "--data-cache-path", str(tmp_path / "c"))
    with pytest.raises(DataConfigError, match=r"the valid split has 0 tokens; a sample needs at least 2; give the "
                                              r"valid split more documents \(--split\), or skip evaluation with "
                                              r"--eval-iters 0"):
        _build(cfg)


def test_a_token_id_beyond_the_vocabulary_further_in_the_data_is_named(tmp_path):
    """The datasets' first samples are checked when built; an id of another tokenizer in a later document stopped
    training with 'IndexError: index out of range in self' (a traceback, mid-run)."""
    import numpy as np

    from megacoat.data import DataConfigError, build_data_iterators, build_tokenizer
    from megacoat.data.indexed_dataset import IndexedDatasetBuilder

    rng, prefix = np.random.default_rng(0), str(tmp_path / "rare")
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        for i in range(200):
            doc = rng.integers(0, 900, size=int(rng.integers(5, 80)))
            doc[-1] = 1500 if i == 150 else doc[-1]
            b.add_document(doc)
    cfg = _data_cfg(tmp_path, "--data-path", prefix, "--split", "100,0,0", "--data-cache-path", str(tmp_path / "c"),
                    "--train-iters", "40")
    tok = build_tokenizer(cfg.data)
    it = build_data_iterators(cfg, tok, 0, 1)
    ids = np.stack([it.train_dataset[i] for i in range(4)])
    assert ids.max() < tok.vocab_size  # the build-time probe passes
    with pytest.raises(DataConfigError, match="a micro-batch holds token id 1500 but the tokenizer has 1001 ids"):
        for _ in it.train:
            pass


# ------------------------------------------------------------------------------------------------ output paths
@pytest.mark.parametrize("flag,where,message", [
    ("--log-json", "dir", "is a directory: name a file in it"),
    ("--log-json", "under_file/x.jsonl", "is a file, not a directory"),
    ("--tensorboard-dir", "under_file/tb", "cannot create the directory"),
    ("--tensorboard-dir", "under_file", "is a file, not a directory"),
])
def test_output_paths_that_cannot_be_written_are_named(tmp_path, flag, where, message):
    """--log-json / --tensorboard-dir naming a directory, a file or a path under a file ended in
    IsADirectoryError / NotADirectoryError tracebacks (--log-json only once training had started)."""
    from megacoat.config import ConfigError, parse_args
    from megacoat.training.trainer import Trainer

    if flag == "--tensorboard-dir":
        pytest.importorskip("torch.utils.tensorboard")
    (tmp_path / "dir").mkdir()
    (tmp_path / "under_file").write_text("x")
    path = str(tmp_path / where)
    with pytest.raises(ConfigError, match=f"{flag} {path}.*{message}"):
        Trainer(parse_args(BASE + ["--train-iters", "1", flag, path]))


def test_log_json_in_a_missing_directory_is_created(tmp_path):
    import io

    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer

    log = tmp_path / "runs" / "a" / "log.jsonl"
    t = Trainer(parse_args(BASE + ["--train-iters", "1", "--log-json", str(log)]), log_stream=io.StringIO())
    t.train()
    t.close()
    assert [json.loads(x)["iteration"] for x in open(log)] == [1]
