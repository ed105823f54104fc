"""tools/checkpoint/convert.py given what users get wrong: damaged or unusual Hugging Face directories,
bad targets. Each is converted correctly or refused with one line naming the problem and the fix."""
import json
import os
import shutil

import pytest
import torch

import megacoat

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_checkpoint_hf import _assert_logits_close, _hf_logits, _tokens, convert, gpt2, llama  # noqa: E402


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Llama saved in one file and sharded (index + 4 shards), and its logits."""
    root = tmp_path_factory.mktemp("hf")
    model = llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 1
    return root, _hf_logits(model, _tokens())


def _to_megacoat(src, dst, *extra):
    return convert("--load-format", "hf", "--load-dir", str(src), "--save-format", "megacoat", "--save-dir", str(dst),
                   *extra)


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _no_config(d):
    (d / "config.json").unlink()


def _config_not_json(d):
    (d / "config.json").write_text("{\"model_type\": \"llama\",")


def _config_a_list(d):
    (d / "config.json").write_text("[1, 2]")


def _missing_shard(d):
    sorted(d.glob("model-*.safetensors"))[1].unlink()


def _index_without_weight_map(d):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _shard_from_another_download(d):
    shard = sorted(d.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, shard, metadata={"format": "pt"})


def _truncated_safetensors(d):
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])


def _config_without_key(d):
    _edit_config(d, intermediate_size=None)


def _config_with_more_layers(d):
    _edit_config(d, num_hidden_layers=3)


def _pickle_with_code(d):
    (d / "model.safetensors").unlink()
    torch.save({"w": _RunsCode()}, d / "pytorch_model.bin")


def _damaged_pickle(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(bytes(range(256)) * 4)


class _RunsCode:
    """Unpickled, it would create a file named by the test."""

    def __reduce__(self):
        return (open, (os.environ["CONVERT_PICKLE_MARKER"], "w"))


@pytest.mark.parametrize("layout, damage, words", [
    ("single", _no_config, ["no config.json", "--load-dir"]),
    ("single", _config_not_json, ["config.json", "not readable JSON"]),
    ("single", _config_a_list, ["config.json", "JSON list"]),
    ("sharded", _missing_shard, ["lacks 1 of the", "model-00002-of-", "download"]),
    ("sharded", _index_without_weight_map, ["model.safetensors.index.json", "weight_map"]),
    ("sharded", _shard_from_another_download, ["names tensors its shards do not hold", "download"]),
    ("single", _truncated_safetensors, ["model.safetensors", "truncated or damaged"]),
    ("single", _config_without_key, ["config.json", "'intermediate_size'"]),
    ("single", _config_with_more_layers, ["model.layers.2.", "do not match config.json"]),
    ("single", _pickle_with_code, ["pytorch_model.bin", "could run code", "safetensors"]),
    ("single", _damaged_pickle, ["pytorch_model.bin", "damaged, or not a weights file"]),
], ids=lambda x: x.__name__.strip("_") if callable(x) else None)
def test_damaged_hf_directories_are_named(tmp_path, capsys, monkeypatch, hf_llama, layout, damage, words):
    root, _ = hf_llama
    src = _copy(root / layout, tmp_path / "hf")
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("CONVERT_PICKLE_MARKER", str(marker))
    damage(src)
    assert _to_megacoat(src, tmp_path / "out") == 2
    _one_line_error(capsys, *words)
    assert not marker.exists()  # nothing in a pickle ran
    assert not (tmp_path / "out").exists() or not any(p.name.startswith("iter_") for p in (tmp_path / "out").iterdir())


def test_pickled_and_sharded_weights_convert(tmp_path, hf_llama):
    """pytorch_model.bin (one file or sharded with its index), read weights-only, gives the same model."""
    root, want = hf_llama
    one = _copy(root / "single", tmp_path / "bin")
    torch.save(load_file(one / "model.safetensors"), one / "pytorch_model.bin")
    (one / "model.safetensors").unlink()
    sharded = _copy(root / "sharded", tmp_path / "bin_sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    renamed = {}
    for shard in sorted(sharded.glob("model-*.safetensors")):
        renamed[shard.name] = shard.name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(load_file(shard), sharded / renamed[shard.name])
        shard.unlink()
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (sharded / "model.safetensors.index.json").unlink()
    for src in (one, sharded, root / "sharded"):
        out = tmp_path / f"mc_{src.name}"
        assert _to_megacoat(src, out) == 0
        with torch.no_grad():
            _assert_logits_close(megacoat.load_model(str(out), dtype=torch.float32)(_tokens()), want)


def _rewrite_weights(d, edit):
    tensors = edit(load_file(d / "model.safetensors"))
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("make, prefix", [(gpt2, "transformer."), (llama, "model.")], ids=["gpt2", "llama"])
def test_base_model_layout_converts(tmp_path, make, prefix):
    """Weights named as the base model names them (no 'transformer.' / 'model.' prefix, the layout of
    the original gpt2 upload): transformers loads them into the LM-head model, and so does convert.py."""
    model = make()
    model.save_pretrained(tmp_path / "hf")
    _rewrite_weights(tmp_path / "hf", lambda t: {k.removeprefix(prefix): v for k, v in t.items()})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    want = _hf_logits(hf, _tokens())
    _assert_logits_close(want, _hf_logits(model, _tokens()))
    assert _to_megacoat(tmp_path / "hf", tmp_path / "mc") == 0
    with torch.no_grad():
        _assert_logits_close(megacoat.load_model(str(tmp_path / "mc"), dtype=torch.float32)(_tokens()), want)


def test_output_layer_must_match_tie_word_embeddings(tmp_path, capsys, hf_llama):
    """Untied without lm_head.weight (transformers: a random output layer) and tied with an lm_head.weight
    other than the embedding (transformers: ignored) are refused; a tied copy equal to the embedding is not."""
    root, _ = hf_llama
    untied = _copy(root / "single", tmp_path / "untied_no_head")
    _rewrite_weights(untied, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    assert _to_megacoat(untied, tmp_path / "o1") == 2
    _one_line_error(capsys, "no lm_head.weight", "random", '"tie_word_embeddings": true')

    tied = _copy(root / "single", tmp_path / "tied_other_head")
    _edit_config(tied, tie_word_embeddings=True)
    assert _to_megacoat(tied, tmp_path / "o2") == 2
    _one_line_error(capsys, "different lm_head.weight", '"tie_word_embeddings": false')

    copy = _copy(tied, tmp_path / "tied_copy")
    _rewrite_weights(copy, lambda t: dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(copy).eval()
    assert _to_megacoat(copy, tmp_path / "o3") == 0
    with torch.no_grad():
        _assert_logits_close(megacoat.load_model(str(tmp_path / "o3"), dtype=torch.float32)(_tokens()),
                             _hf_logits(hf, _tokens()))


def test_target_tp_must_split_heads_groups_and_ffn(tmp_path, capsys, hf_llama):
    """A target TP is the TP the saved flags name: the heads (4), query groups (2) and FFN size (96) of
    the model must split evenly over it, as a run at that TP needs."""
    root, _ = hf_llama
    for tp in ("3", "4"):
        assert _to_megacoat(root / "single", tmp_path / f"tp{tp}", "--target-tensor-parallel-size", tp) == 2
        _one_line_error(capsys, f"--target-tensor-parallel-size {tp} does not divide", "query groups 2", "[1, 2]")
    assert _to_megacoat(root / "single", tmp_path / "mc") == 0
    capsys.readouterr()
    for fmt in ("megacoat", "megatron"):
        assert convert("--load-format", "megacoat", "--load-dir", str(tmp_path / "mc"), "--save-format", fmt,
                       "--save-dir", str(tmp_path / f"to_{fmt}"), "--target-tensor-parallel-size", "4") == 2
        _one_line_error(capsys, "--target-tensor-parallel-size 4 does not divide", "choose one of [1, 2]")


def _to_hf(src, dst, *extra):
    return convert("--load-format", "megacoat", "--load-dir", str(src), "--save-format", "hf", "--save-dir", str(dst),
                   *extra)


@pytest.fixture()
def old_and_new(tmp_path, hf_llama):
    """A megacoat checkpoint of the tiny Llama, and a directory holding another model (GPT-2, sharded,
    with its generation settings and slow-tokenizer files) with that model's logits."""
    root, _ = hf_llama
    assert _to_megacoat(root / "single", tmp_path / "mc") == 0
    old = gpt2()
    out = tmp_path / "out"
    old.save_pretrained(out, max_shard_size="100KB")
    (out / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (out / "merges.txt").write_text("#version: 0.2\n")
    assert (out / "generation_config.json").exists()
    return tmp_path / "mc", out, _hf_logits(old, _tokens())


def test_forced_export_leaves_nothing_of_the_old_model(capsys, old_and_new):
    """--force over another model: its generation_config.json (eos/bos of another vocabulary) and tokenizer
    files would otherwise be read with the new weights."""
    mc, out, _ = old_and_new
    capsys.readouterr()
    assert _to_hf(mc, out) == 2
    _one_line_error(capsys, "already holds a Hugging Face model", "--force")
    assert _to_hf(mc, out, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.generation_config.eos_token_id == json.loads((out / "config.json").read_text())["eos_token_id"]


def test_interrupted_export_keeps_the_old_model_or_is_clearly_incomplete(tmp_path, capsys, monkeypatch, old_and_new):
    """A kill while the weights are written leaves the old model whole; one while files move in leaves no
    config.json (transformers refuses the directory); converting again completes it."""
    import safetensors.torch
    mc, out, old_logits = old_and_new
    before = sorted(p.name for p in out.iterdir())
    real_save = safetensors.torch.save_file

    def killed_while_writing(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        _to_hf(mc, out, "--force")
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == before
    _assert_logits_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), _tokens()),
                         old_logits)

    real_replace, moved = os.replace, []

    def killed_while_moving(src, dst):
        if moved:
            raise KeyboardInterrupt
        moved.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_while_moving)
    with pytest.raises(KeyboardInterrupt):
        _to_hf(mc, out, "--force")
    monkeypatch.undo()
    assert not (out / "config.json").exists()
    with pytest.raises((OSError, ValueError), match="config.json"):  # not a model
        transformers.AutoModelForCausalLM.from_pretrained(out)
    assert _to_hf(mc, out, "--force") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        _assert_logits_close(_hf_logits(hf, _tokens()), megacoat.load_model(str(mc), dtype=torch.float32)(_tokens()))


def test_save_dir_that_is_a_file_is_named(tmp_path, capsys, old_and_new):
    mc, _, _ = old_and_new
    capsys.readouterr()
    (tmp_path / "a_file").write_text("x")
    for fmt in ("hf", "megacoat"):
        assert convert("--load-format", "megacoat", "--load-dir", str(mc), "--save-format", fmt,
                       "--save-dir", str(tmp_path / "a_file")) == 2
        _one_line_error(capsys, "a_file is a file, not a directory")
    assert (tmp_path / "a_file").read_text() == "x"


def test_foreign_directories_given_as_megacoat_checkpoints_are_named(tmp_path, capsys, old_and_new):
    """A Hugging Face model or a Megatron-LM checkpoint (its save directory, or one iteration's) given where
    a megacoat checkpoint belongs: named, with the conversion that reads it (was 'the save was interrupted',
    or a tracker naming a missing iteration)."""
    from megacoat.checkpoint import CheckpointError
    mc, hf_dir, _ = old_and_new
    for carry in ([], ["--carry-iteration"]):
        out = tmp_path / f"megatron{len(carry)}"
        assert convert("--load-format", "megacoat", "--load-dir", str(mc), "--save-format", "megatron",
                       "--save-dir", str(out), *carry) == 0
    capsys.readouterr()
    for path, fmt in ((hf_dir, "hf"), (tmp_path / "megatron0", "megatron"), (tmp_path / "megatron1", "megatron"),
                      (tmp_path / "megatron0" / "release", "megatron")):
        assert _to_hf(path, tmp_path / "x") == 2
        _one_line_error(capsys, f"--load-format {fmt} --load-dir {path}")
        with pytest.raises(CheckpointError, match=f"--load-format {fmt}"):
            megacoat.load_model(str(path))
        # pretrain_gpt.py --load: refused too, not "no checkpoint yet: starting from scratch"
        from test_save_ownership import train
        with pytest.raises(CheckpointError, match=f"{path}.* is .*--load-format {fmt}"):
            train(["--train-iters", "1", "--load", str(path)])


def _snapshot(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_save_dir_equal_to_load_dir_or_inside_a_checkpoint_is_refused(tmp_path, capsys, old_and_new):
    """Writing into the input (same path spelled another way too; --force and --dtype would replace a
    checkpoint by a cast copy of itself) or an HF export inside a checkpoint's iteration directory
    (deleted with it) is refused, and the input is left as it was."""
    mc, hf_dir, _ = old_and_new
    capsys.readouterr()
    before_mc, before_hf = _snapshot(mc), _snapshot(hf_dir)
    cases = [("hf", hf_dir, "megacoat", str(hf_dir) + "/", [], "is the --load-dir"),
             ("megacoat", mc, "megacoat", str(mc / "."), ["--force", "--dtype", "bf16"], "is the --load-dir"),
             ("megacoat", mc, "hf", str(mc), [], "is the --load-dir"),
             ("megacoat", mc, "hf", str(mc / "iter_0000000"), [], "iteration directory")]
    for load_fmt, load, save_fmt, save, extra, words in cases:
        assert convert("--load-format", load_fmt, "--load-dir", str(load), "--save-format", save_fmt,
                       "--save-dir", save, *extra) == 2
        _one_line_error(capsys, words)
    assert _snapshot(mc) == before_mc and _snapshot(hf_dir) == before_hf


def test_other_heads_of_a_supported_model_type_are_refused(tmp_path, capsys):
    """model_type llama, but a sequence classifier: its score head is not an output layer over the vocabulary."""
    cfg = transformers.LlamaConfig(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "cls")
    capsys.readouterr()
    assert _to_megacoat(tmp_path / "cls", tmp_path / "out") == 2
    _one_line_error(capsys, "['LlamaForSequenceClassification']", "LlamaForCausalLM")


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_export_names_no_special_token_the_model_does_not_have(tmp_path, make):
    """The export's config.json says bos_token_id null where the tokenizer has no BOS: left out,
    transformers fills in its own (Llama 1, a plain token here; GPT-2 50256, outside this vocabulary)."""
    from megacoat.checkpoint.model_io import load_tokenizer
    make().save_pretrained(tmp_path / "hf")
    assert _to_megacoat(tmp_path / "hf", tmp_path / "mc") == 0
    assert _to_hf(tmp_path / "mc", tmp_path / "out") == 0
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert cfg.bos_token_id is None
    assert cfg.eos_token_id == load_tokenizer(str(tmp_path / "mc")).eod


@pytest.mark.parametrize("fail_at", range(3))
def test_interrupted_megatron_rewrite_keeps_a_whole_checkpoint(tmp_path, monkeypatch, old_and_new, fail_at):
    """--force over a Megatron checkpoint of the same iteration, killed at each step of putting the new
    directory in place: `release` holds the old layout (TP 1) or the new one (TP 2), complete (the old
    directory was deleted before the new one was renamed in)."""
    import shutil

    import megacoat.checkpoint.format as fmt
    from megacoat.convert.megatron_pickle import load_torch_file
    mc, _, _ = old_and_new
    out = tmp_path / "megatron"
    to_megatron = ["--load-format", "megacoat", "--load-dir", str(mc), "--save-format", "megatron",
                   "--save-dir", str(out)]
    assert convert(*to_megatron) == 0
    steps = []
    real_rename, real_rmtree, real_exchange = os.rename, shutil.rmtree, fmt.exchange_paths

    def step(fn, *args):
        if any(str(a).endswith(("release", "release.partial", "release.replaced")) for a in args):
            if len(steps) == fail_at:
                raise KeyboardInterrupt
            steps.append(args)
        return fn(*args)

    monkeypatch.setattr(os, "rename", lambda a, b: step(real_rename, a, b))
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: step(lambda p: real_rmtree(p, *a, **k), p))
    monkeypatch.setattr(fmt, "exchange_paths", lambda a, b: step(real_exchange, a, b))
    try:
        convert(*to_megatron, "--force", "--target-tensor-parallel-size", "2")
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    ranks = sorted(p.name for p in (out / "release").iterdir())
    assert ranks in (["mp_rank_00"], ["mp_rank_00", "mp_rank_01"]), ranks
    for r in ranks:
        assert "model" in load_torch_file(str(out / "release" / r / "model_optim_rng.pt"))
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"


def test_target_pp_is_checked_for_every_output(tmp_path, capsys, old_and_new):
    """PP 0 (a ZeroDivisionError traceback for Megatron output) and a PP that does not divide the 2 layers
    (accepted unchecked from Megatron input) are refused, whatever the formats."""
    mc, _, _ = old_and_new
    assert convert("--load-format", "megacoat", "--load-dir", str(mc), "--save-format", "megatron",
                   "--save-dir", str(tmp_path / "megatron")) == 0
    capsys.readouterr()
    for load_fmt, load, save_fmt in (("megacoat", mc, "megatron"), ("megacoat", mc, "megacoat"),
                                     ("megatron", tmp_path / "megatron", "megacoat")):
        for pp, words in (("0", "must be >= 1"), ("3", "does not divide")):
            assert convert("--load-format", load_fmt, "--load-dir", str(load), "--save-format", save_fmt,
                           "--save-dir", str(tmp_path / f"out_{save_fmt}"), "--target-pipeline-parallel-size", pp) == 2
            _one_line_error(capsys, f"--target-pipeline-parallel-size {pp}" if pp == "3" else words, words)


@pytest.mark.parametrize("metadata, words", [
    ('{"format": "megacoat-checkpoint", "version": 1}', "lacks iteration, layouts"),
    ("[]", "JSON list, not an object"),
], ids=["keys-missing", "a-list"])
def test_edited_metadata_is_named(tmp_path, capsys, old_and_new, metadata, words):
    mc, _, _ = old_and_new
    broken = _copy(mc, tmp_path / "broken")
    (broken / "iter_0000000" / "metadata.json").write_text(metadata)
    capsys.readouterr()
    assert _to_hf(broken, tmp_path / "x") == 2
    _one_line_error(capsys, "metadata.json", words)


def _word_tokenizer(d, n, eos="<eos>"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(n - 1)}
    vocab[eos] = n - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


@pytest.mark.parametrize("ids, eos, words", [(301, "<eos>", "has 301 ids but the model's embedding only 203 rows"),
                                             (150, "<end>", "cannot find an end-of-document token")],
                         ids=["larger-than-the-embedding", "no-eos"])
def test_tokenizer_the_checkpoint_could_not_use_is_refused(tmp_path, capsys, hf_llama, ids, eos, words):
    """tokenizer.json is copied into the checkpoint: one with more ids than the embedding has rows, or
    without an end-of-document token, made a checkpoint that generate.py and training then refused."""
    pytest.importorskip("tokenizers")
    root, _ = hf_llama
    src = _copy(root / "single", tmp_path / "hf")
    _word_tokenizer(src, ids, eos)
    assert _to_megacoat(src, tmp_path / "out") == 2
    _one_line_error(capsys, words)
    _word_tokenizer(src, 150)
    assert _to_megacoat(src, tmp_path / "ok") == 0


def test_quantized_weights_are_refused(tmp_path, capsys, hf_llama):
    """float8 projection weights, with a quantization_config or without (no scales to undo): converting
    them as weights would be another model."""
    root, _ = hf_llama
    src = _copy(root / "single", tmp_path / "hf")
    _rewrite_weights(src, lambda t: {k: v.to(torch.float8_e4m3fn) if k.endswith("proj.weight") else v
                                     for k, v in t.items()})
    assert _to_megacoat(src, tmp_path / "out") == 2
    _one_line_error(capsys, "float8_e4m3fn tensors", "fp32, bf16 and fp16")
    _edit_config(src, quantization_config={"quant_method": "fp8"})
    assert _to_megacoat(src, tmp_path / "out") == 2
    _one_line_error(capsys, "quantized model", "'fp8'")


@pytest.mark.parametrize("fmt, writer", [("megacoat", "megacoat.checkpoint.model_io.write_pieces"),
                                         ("megatron", "torch.save")])
def test_disk_full_while_writing_is_one_line_and_publishes_nothing(tmp_path, capsys, monkeypatch, hf_llama, fmt,
                                                                   writer):
    """A full disk while the weights are written: one line (was an OSError traceback), and the target
    holds no checkpoint, only the hidden directory a new conversion clears."""
    import errno

    root, _ = hf_llama
    assert _to_megacoat(root / "single", tmp_path / "mc") == 0
    capsys.readouterr()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "file"))

    monkeypatch.setattr(writer, full_disk)
    to_fmt = ["--load-format", "megacoat", "--load-dir", str(tmp_path / "mc"), "--save-format", fmt,
              "--save-dir", str(tmp_path / "out")]
    assert convert(*to_fmt) == 2
    monkeypatch.undo()
    _one_line_error(capsys, "No space left on device", "no incomplete output was published")
    assert not [p for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")]
    assert convert(*to_fmt) == 0


def test_cast_beyond_the_dtype_range_is_refused(tmp_path, capsys, hf_llama):
    """--dtype fp16 of a weight past 65504 made it inf (a different model, written without a word)."""
    root, _ = hf_llama
    src = _copy(root / "single", tmp_path / "hf")
    _rewrite_weights(src, lambda t: dict(t, **{"model.norm.weight": t["model.norm.weight"] * 0 + 1e5}))
    assert _to_megacoat(src, tmp_path / "mc") == 0
    capsys.readouterr()
    runs = [lambda out, *a: _to_megacoat(src, out, *a), lambda out, *a: _to_hf(tmp_path / "mc", out, *a)]
    runs += [lambda out, *a, fmt=fmt: convert("--load-format", "megacoat", "--load-dir", str(tmp_path / "mc"),
                                              "--save-format", fmt, "--save-dir", str(out), *a)
             for fmt in ("megacoat", "megatron")]
    for i, run in enumerate(runs):
        assert run(tmp_path / f"fp16_{i}", "--dtype", "fp16") == 2
        _one_line_error(capsys, "final_norm.weight holds values up to 1e+05", "float16's range (max 65504)")
        assert run(tmp_path / f"bf16_{i}", "--dtype", "bf16") == 0
        capsys.readouterr()


def test_megatron_input_flags_are_refused_elsewhere(tmp_path, capsys, old_and_new):
    """The tokenizer and vocabulary flags describe a Megatron checkpoint being read; given to another
    conversion they were silently ignored."""
    mc, _, _ = old_and_new
    capsys.readouterr()
    for save_fmt in ("megatron", "hf", "megacoat"):
        assert convert("--load-format", "megacoat", "--load-dir", str(mc), "--save-format", save_fmt, "--save-dir",
                       str(tmp_path / save_fmt), "--true-vocab-size", "100", "--vocab-size", "100") == 2
        _one_line_error(capsys, "--true-vocab-size, --vocab-size apply to --load-format megatron only")


def test_damaged_megatron_checkpoints_are_named(tmp_path, capsys, old_and_new):
    """A truncated rank file is called that (was 'the pre-1.6 torch format; re-save it'); a tracker naming
    a missing iteration names both (was 'no tracker here')."""
    mc, _, _ = old_and_new
    out = tmp_path / "megatron"
    assert convert("--load-format", "megacoat", "--load-dir", str(mc), "--save-format", "megatron",
                   "--save-dir", str(out), "--carry-iteration") == 0
    capsys.readouterr()
    from_megatron = ["--load-format", "megatron", "--load-dir", str(out), "--save-format", "megacoat"]
    rank_file = out / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2])
    assert convert(*from_megatron, "--save-dir", str(tmp_path / "a")) == 2
    _one_line_error(capsys, "model_optim_rng.pt", "truncated or damaged")
    rank_file.write_bytes(data)
    (out / "latest_checkpointed_iteration.txt").write_text("7")
    assert convert(*from_megatron, "--save-dir", str(tmp_path / "b")) == 2
    _one_line_error(capsys, "names '7'", "iter_0000007 does not exist")


def test_a_megacoat_checkpoint_given_as_megatron_or_an_empty_directory_flag_is_named(tmp_path, capsys, old_and_new):
    """A megacoat checkpoint read as Megatron (same tracker name, a metadata.json as torch_dist has) was told
    of a "sharded backend None"; an empty --save-dir or --load-dir was told of a lock file or of a directory ''.
    A failed conversion leaves no --save-dir it created (it held the lock file)."""
    mc, _, _ = old_and_new
    capsys.readouterr()
    for path in (mc, mc / "iter_0000000"):
        assert convert("--load-format", "megatron", "--load-dir", str(path), "--save-format", "megacoat",
                       "--save-dir", str(tmp_path / "new")) == 2
        _one_line_error(capsys, f"{path} is a megacoat checkpoint, not a Megatron-LM one", "--load-format megacoat")
    for flag, load, save in (("--save-dir", str(mc), ""), ("--load-dir", "", str(tmp_path / "new"))):
        assert convert("--load-format", "megacoat", "--load-dir", load, "--save-format", "megacoat",
                       "--save-dir", save) == 2
        _one_line_error(capsys, f"{flag} is empty: name a directory")
    assert not (tmp_path / "new").exists()
