"""Every flag with a valid range is checked by validate_config: one line naming the flag, never a traceback."""
import dataclasses
import os
import subprocess
import sys

import pytest

from megacoat.config import ConfigError, MegacoatConfig, _flag, parse_args, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--log-interval", "1"]


def refusal(flags, world=1) -> str:
    with pytest.raises(ConfigError) as e:
        validate_config(parse_args(TINY + flags), world)
    return str(e.value)


BAD = [  # (flags, the flag the message must name)
    (["--seed=-5"], "--seed"),
    (["--seed", str(2 ** 32)], "--seed"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "1e38"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--min-lr", "nan"], "--min-lr"),
    (["--min-lr=-1e-5"], "--min-lr"),
    (["--min-lr", "1e-2"], "--min-lr"),  # above --lr
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size"),
    (["--seq-length", "0"], "--seq-length"),
    (["--hidden-size", "0"], "--hidden-size"),
    (["--num-layers", "0"], "--num-layers"),
    (["--num-attention-heads", "0"], "--num-attention-heads"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups"),
    (["--kv-channels", "0"], "--kv-channels"),
    (["--max-position-embeddings", "32"], "--max-position-embeddings"),
    (["--norm-epsilon", "0"], "--norm-epsilon"),
    (["--rotary-base", "nan"], "--rotary-base"),
    (["--init-method-std", "0"], "--init-method-std"),
    (["--attention-dropout", "1"], "--attention-dropout"),
    (["--hidden-dropout=-0.1"], "--hidden-dropout"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by"),
    (["--eval-iters=-1"], "--eval-iters"),
    (["--eval-interval=-1"], "--eval-interval"),
    (["--exit-duration-in-mins=-1"], "--exit-duration-in-mins"),
    (["--exit-duration-in-mins", "nan"], "--exit-duration-in-mins"),
    (["--exit-interval", "0"], "--exit-interval"),
    (["--clip-grad=-1"], "--clip-grad"),
    (["--weight-decay=-1"], "--weight-decay"),
    (["--adam-beta1", "1"], "--adam-beta1"),
    (["--adam-beta2=-0.5"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--adam-eps", "inf"], "--adam-eps"),
    (["--lr-warmup-iters", "100", "--lr-decay-iters", "10"], "--lr-warmup-iters"),
    (["--lr-warmup-iters", "10", "--lr-decay-iters", "10"], "--lr-decay-iters"),
    (["--lr-warmup-iters=-1"], "--lr-warmup-iters"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters"),
    (["--train-samples", "800", "--lr-warmup-samples", "400", "--lr-decay-samples", "80"], "--lr-warmup-samples"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction"),
    (["--save-retain", "2"], "--save-retain"),  # without --save
    (["--save", "ckpt", "--save-retain", "0"], "--save-retain"),
    (["--save-interval", "5"], "--save-interval"),  # without --save
    (["--save", "ckpt", "--save-interval", "0"], "--save-interval"),
    (["--log-interval", "0"], "--log-interval"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--global-batch-size", "7"], "--global-batch-size"),
    (["--train-iters", "0"], "--train-iters"),
    (["--train-samples", "0"], "--train-samples"),
    (["--num-workers=-1"], "--num-workers"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--split", "0,1,0"], "--split"),
    (["--split", "a,b"], "--split"),
    (["--split=-1,2,1"], "--split"),
    (["--split", "1,1,1,1"], "--split"),
    (["--valid-data-path", "some/prefix"], "--train-data-path"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size"),
    (["--ranks-per-node", "0"], "--ranks-per-node"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    (["--world-size", "0"], "--world-size"),
    (["--peak-tflops", "0"], "--peak-tflops"),
    (["--max-skipped-iterations", "0"], "--max-skipped-iterations"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"], "--recompute-num-layers"),
    (["--gradient-alltoall-pipeline", "0"], "--gradient-alltoall-pipeline"),
    (["--fp8-gemm-candidates", "0"], "--fp8-gemm-candidates"),
]


@pytest.mark.parametrize("flags,flag", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_flag_is_refused_in_one_line_naming_it(flags, flag):
    message = refusal(flags)
    assert flag in message, message
    assert "\n" not in message, message


GOOD = [  # edge values that are valid (and used by runs and tests)
    ["--seed", "0"], ["--seed", str(2 ** 32 - 1)],
    ["--eval-interval", "0"], ["--eval-iters", "0"], ["--clip-grad", "0"], ["--weight-decay", "0"],
    ["--num-workers", "0"], ["--min-lr", "0"], ["--lr-warmup-iters", "0"],
    ["--save", "ckpt", "--exit-duration-in-mins", "0"],  # save and exit at the first check
    ["--lr", "1e30", "--min-lr", "1e30"],  # diverges on purpose (the skip-and-stop test): large but computable
    ["--train-iters", "4"],  # shorter than the default warmup (20): never finishes warming up
    ["--lr-warmup-iters", "9", "--lr-decay-iters", "10"],
    ["--lr-decay-style", "constant", "--lr-warmup-iters", "100", "--lr-decay-iters", "10"],  # no decay span
    ["--lr-warmup-fraction", "1.0", "--lr-decay-iters", "10"],
    ["--split", "100,0,0"], ["--split", "949/50/1"], ["--split", "98,2"],
    ["--mock-data", "--split", "0,1,0"],  # --split does not apply to mock data
]


@pytest.mark.parametrize("flags", GOOD, ids=[" ".join(f) for f in GOOD])
def test_edge_values_that_are_valid_pass(flags):
    validate_config(parse_args(TINY + flags), 1)


def _numeric_fields():
    """(flag, type) of every int/float flag without a fixed list of choices."""
    out = []
    for section in dataclasses.fields(MegacoatConfig):
        for f in dataclasses.fields(section.default_factory()):
            kind = str(f.type)
            if "choices" in f.metadata or "bool" in kind or not ("int" in kind or "float" in kind):
                continue
            out.append((_flag(f.name), "float" if "float" in kind else "int"))
    return out


NUMERIC = _numeric_fields()


def test_the_survey_finds_the_numeric_flags():
    flags = dict(NUMERIC)
    assert len(flags) > 50 and flags["--lr"] == "float" and flags["--seed"] == "int"
    assert "--weight-quantization-bits" not in flags  # argparse checks choices


@pytest.mark.parametrize("flag,kind", NUMERIC, ids=[f for f, _ in NUMERIC])
def test_every_numeric_flag_has_a_range(flag, kind):
    """A new numeric flag fails here until validate_config checks its range: -1 (ints) and NaN (floats)
    are outside every range."""
    message = refusal([f"{flag}={'-1' if kind == 'int' else 'nan'}"])
    assert flag in message, message


def test_several_problems_are_listed_together():
    message = refusal(["--seed=-1", "--lr", "nan", "--eval-iters=-2"])
    assert message.count("\n  - ") == 3
    assert "--seed -1" in message and "--lr nan" in message and "--eval-iters -2" in message


def test_out_of_range_values_are_refused_before_they_divide_anything():
    # --num-attention-heads 0 used to end in a ZeroDivisionError (hidden size % heads) before any message.
    assert "--num-attention-heads 0 must be >= 1" in refusal(["--num-attention-heads", "0"])


@pytest.mark.parametrize("flags,expect", [
    (["--seed=-5"], "--seed -5 must be >= 0 and < 2**32"),
    (["--lr", "nan"], "--lr nan must be > 0 and finite"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0 must be >= 1"),
    (["--lr-warmup-iters", "100", "--lr-decay-iters", "10"], "--lr-warmup-iters 100 must be below --lr-decay-iters 10"),
])
def test_cli_prints_the_message_and_exits_nonzero_without_a_traceback(flags, expect):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--mock-data", *flags],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]  # one line, the last one
    assert last.startswith("pretrain_gpt.py: error: invalid configuration: ") and expect in last, r.stderr[-2000:]
    assert r.stderr.count("pretrain_gpt.py: error:") == 1


def test_validating_twice_is_harmless():
    """Callers validate a config the trainer validates again (resolved defaults are not taken as user flags)."""
    cfg = parse_args(TINY + ["--train-iters", "4"])  # warmup (default 20) longer than the run
    validate_config(cfg, 1)
    validate_config(cfg, 1)
