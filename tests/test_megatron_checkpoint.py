"""Megatron-LM checkpoints <-> megacoat, against megatron-core's own GPTModel.

A megatron-core GPTModel is built at TP=1 on the CPU; its state dict is written in Megatron's
`torch` layout at TP=2/PP=2 by the split below (Megatron's rules, written out here independently
of megacoat's converter), or saved by megatron-core's `dist_checkpointing.save` (torch_dist).
megacoat converts it; every tensor must match and the converted model's logits must equal
megatron-core's forward (run on the CPU with its two CUDA-only calls patched out).
"""
import argparse
import contextlib
import io
import os
import pickle
import socket
import zipfile

import pytest
import torch

mcore = pytest.importorskip("megatron.core", reason="needs megatron-core (pip install --no-deps megatron-core)")

import megacoat  # noqa: E402
from megacoat.checkpoint import CheckpointError, CheckpointReader, resolve_checkpoint_dir  # noqa: E402
from megacoat.checkpoint.model_io import read_model_tensors  # noqa: E402
from megacoat.convert.megatron import TokenizerFlags, megacoat_to_megatron, megatron_to_megacoat  # noqa: E402
from megacoat.convert.megatron_pickle import load_torch_file  # noqa: E402

VOCAB = 100  # padded to 128 by Megatron's rule (make_vocab_size_divisible_by 64 x TP 2)
SEQ = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore_env():
    """One-process torch.distributed + megatron-core model-parallel state (TP=1, PP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


LLAMA = dict(normalization="RMSNorm", swiglu=True, bias=False, gqa=2, pos="rope", rotary_base=500000, tied=False)
GPT2 = dict(normalization="LayerNorm", swiglu=False, bias=True, gqa=None, pos="learned_absolute", rotary_base=10000,
            tied=True)


def build_mcore(kind: dict, num_layers=4, hidden=64, heads=4, ffn=96, seed=0):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(seed)
    act = torch.nn.functional.silu if kind["swiglu"] else torch.nn.functional.gelu
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                            num_query_groups=kind["gqa"], ffn_hidden_size=ffn, normalization=kind["normalization"],
                            gated_linear_unit=kind["swiglu"], activation_func=act, add_bias_linear=kind["bias"],
                            bias_activation_fusion=not kind["swiglu"], use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                            layernorm_epsilon=1e-5)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=kind["normalization"]), vocab_size=128,
                     max_sequence_length=SEQ, position_embedding_type=kind["pos"],
                     share_embeddings_and_output_weights=kind["tied"], rotary_base=kind["rotary_base"])
    with torch.no_grad():  # norms start at 1 / 0 and biases at 0: randomise so that every tensor is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def megatron_args(kind: dict, model, tp: int, pp: int, **extra) -> argparse.Namespace:
    c = model.config
    a = argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, group_query_attention=kind["gqa"] is not None,
        num_query_groups=kind["gqa"], kv_channels=c.kv_channels, seq_length=SEQ, max_position_embeddings=SEQ,
        position_embedding_type=kind["pos"], rotary_base=kind["rotary_base"], rotary_percent=1.0,
        normalization=kind["normalization"], norm_epsilon=1e-5, swiglu=kind["swiglu"], add_bias_linear=kind["bias"],
        bias_gelu_fusion=kind["bias"], untie_embeddings_and_output_weights=not kind["tied"],
        make_vocab_size_divisible_by=64, padded_vocab_size=128, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1,
        consumed_train_samples=4096, params_dtype=torch.float32, transformer_impl="local")
    for k, v in extra.items():
        setattr(a, k, v)
    return a


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def megatron_split(sd: dict, tp: int, pp: int, num_layers: int, gated: bool, tied: bool, te_names: bool = False):
    """{(tp rank, pp rank): state dict} the way Megatron shards a GPTModel (written out independently)."""
    per_stage = num_layers // pp
    out = {}
    for p in range(pp):
        for t in range(tp):
            local = {}
            for k, v in sd.items():
                parts = k.split(".")
                if k.startswith("decoder.layers."):
                    layer = int(parts[2])
                    if not p * per_stage <= layer < (p + 1) * per_stage:
                        continue
                    k = ".".join(parts[:2] + [str(layer - p * per_stage)] + parts[3:])
                elif k.startswith("embedding.") and p != 0:
                    continue
                elif (k.startswith("decoder.final_layernorm") or k.startswith("output_layer")) and p != pp - 1:
                    continue
                if k.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
                    v = v.chunk(tp, dim=0)[t]
                elif k.endswith(("linear_fc1.weight", "linear_fc1.bias")):
                    if gated:  # rank t holds [gate_t; up_t]
                        gate, up = v.chunk(2, dim=0)
                        v = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
                    else:
                        v = v.chunk(tp, dim=0)[t]
                elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    v = v.chunk(tp, dim=1)[t]
                if te_names:
                    k = k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                    k = k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
                local[k] = v.clone()
            if tied and pp > 1 and p == pp - 1:
                local["output_layer.weight"] = sd["embedding.word_embeddings.weight"].chunk(tp)[t].clone()
            out[(t, p)] = local
    return out


def save_torch_format(root: str, shards: dict, args, iteration: int = 250, vp_chunks: int = 0) -> str:
    pp = max(p for _, p in shards) + 1
    for (t, p), sd in shards.items():
        d = os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
        os.makedirs(d)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "rng_state": [{"random_rng_state": (3, tuple(range(5)), None)}], "optimizer": {"step": 1}}
        if vp_chunks:
            state.update({f"model{v}": sd[v] for v in range(vp_chunks)})
        else:
            state["model"] = sd
        torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


@contextlib.contextmanager
def cpu_forward():
    """megatron-core's forward asks for torch.cuda.current_device() (RoPE cache) and forks the CUDA RNG
    tracker around attention dropout (0 here); both are device plumbing, not math."""
    from megatron.core import tensor_parallel
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, tracker.fork = saved


def mcore_logits(model, tokens):
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    pos = torch.arange(SEQ).expand_as(tokens)
    with torch.no_grad(), cpu_forward():
        return model(tokens, pos, mask)


def assert_matches(ckpt: str, sd: dict, kind: dict, num_layers: int = 4):
    m, vocab, t, _ = read_model_tensors(ckpt)
    assert vocab == VOCAB
    expect = {"embedding.word_embeddings.weight": sd["embedding.word_embeddings.weight"][:VOCAB],
              "final_norm.weight": sd["decoder.final_layernorm.weight"]}
    if not kind["tied"]:
        expect["output_layer.weight"] = sd["output_layer.weight"][:VOCAB]
    if kind["pos"] == "learned_absolute":
        expect["embedding.position_embeddings.weight"] = sd["embedding.position_embeddings.weight"]
    if kind["normalization"] == "LayerNorm":
        expect["final_norm.bias"] = sd["decoder.final_layernorm.bias"]
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"decoder.layers.{i}."
        pairs = [("input_norm", "input_layernorm"), ("attention.qkv", "self_attention.linear_qkv"),
                 ("attention.proj", "self_attention.linear_proj"), ("post_attention_norm", "pre_mlp_layernorm"),
                 ("mlp.fc1", "mlp.linear_fc1"), ("mlp.fc2", "mlp.linear_fc2")]
        for a, b in pairs:
            for suffix in ("weight", "bias"):
                if theirs + f"{b}.{suffix}" in sd:
                    expect[ours + f"{a}.{suffix}"] = sd[theirs + f"{b}.{suffix}"]
    assert set(t) == set(expect)
    for k, v in expect.items():
        assert torch.equal(t[k], v), k
    return m


@pytest.mark.parametrize("kind,te_names", [(LLAMA, False), (LLAMA, True), (GPT2, False)],
                         ids=["llama-local", "llama-te-names", "gpt2-local"])
def test_torch_format_tp2_pp2_converts_exactly(mcore_env, tmp_path, kind, te_names):
    model = build_mcore(kind)
    sd = weights(model)
    shards = megatron_split(sd, 2, 2, 4, kind["swiglu"], kind["tied"], te_names)
    args = megatron_args(kind, model, 2, 2, transformer_impl="transformer_engine" if te_names else "local")
    src = save_torch_format(str(tmp_path / "mlm"), shards, args)
    out = megatron_to_megacoat(src, str(tmp_path / "mc"), log=lambda s: None)
    m = assert_matches(out, sd, kind)
    assert m.rotary_base == kind["rotary_base"] and m.num_query_groups == (kind["gqa"] or 4)
    assert m.untie_embeddings_and_output_weights == (not kind["tied"])
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours = megacoat.load_model(out)(tokens)
    theirs = mcore_logits(model, tokens)[..., :VOCAB]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # Independent check that the logits are not trivially equal (random weights, non-constant output).
    assert theirs.std() > 1e-3


def test_virtual_pipeline_and_carried_iteration(mcore_env, tmp_path):
    kind = LLAMA
    model = build_mcore(kind, num_layers=8)
    sd = weights(model)
    # PP=2 with 2 virtual stages of 2 layers: rank p chunk v holds global layers of virtual stage v*pp + p.
    stages = {}
    for v in range(2):
        for p in range(2):
            first = (v * 2 + p) * 2
            sub = {k: x for k, x in sd.items() if not k.startswith("decoder.layers.")}
            for i in range(2):
                for k, x in sd.items():
                    if k.startswith(f"decoder.layers.{first + i}."):
                        sub[k.replace(f"decoder.layers.{first + i}.", f"decoder.layers.{i}.", 1)] = x
            if not (v == 0 and p == 0):
                sub = {k: x for k, x in sub.items() if not k.startswith("embedding.")}
            if not (v == 1 and p == 1):
                sub = {k: x for k, x in sub.items() if not k.startswith(("decoder.final", "output_layer"))}
            stages.setdefault((0, p), {})[v] = sub
    args = megatron_args(kind, model, 1, 2, virtual_pipeline_model_parallel_size=2)
    src = save_torch_format(str(tmp_path / "mlm"), stages, args, iteration=1234, vp_chunks=2)
    out = megatron_to_megacoat(src, str(tmp_path / "mc"), carry_iteration=True, log=lambda s: None)
    assert out.endswith("iter_0001234")
    assert_matches(out, sd, kind, num_layers=8)
    from megacoat.checkpoint.reader import CheckpointReader
    st = CheckpointReader(out).common()["train_state"]
    assert st["iteration"] == 1234 and st["consumed_samples"] == 4096


def test_round_trip_megacoat_megatron_megacoat(mcore_env, tmp_path):
    model = build_mcore(LLAMA)
    sd = weights(model)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(sd, 1, 1, 4, True, False),
                            megatron_args(LLAMA, model, 1, 1))
    a = megatron_to_megacoat(src, str(tmp_path / "a"), tp=2, log=lambda s: None)
    for spec in ("transformer_engine", "local"):
        mlm = megacoat_to_megatron(a, str(tmp_path / f"mlm-{spec}"), tp=2, pp=2, spec=spec, log=lambda s: None)
        assert os.path.basename(mlm) == "release"
        files = sorted(os.listdir(mlm))
        assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
        b = megatron_to_megacoat(str(tmp_path / f"mlm-{spec}"), str(tmp_path / f"b-{spec}"), log=lambda s: None)
        ta, tb = read_model_tensors(a)[2], read_model_tensors(b)[2]
        assert set(ta) == set(tb)
        for k in ta:
            assert torch.equal(ta[k], tb[k]), k
        # The TP=2 shards are Megatron's: compare rank files with the independent split of the original.
        want = megatron_split(sd, 2, 2, 4, True, False, te_names=spec == "transformer_engine")
        for (t, p), ref in want.items():
            got = load_torch_file(os.path.join(mlm, f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt"))["model"]
            tensors = {k: v for k, v in got.items() if not k.endswith("_extra_state")}
            assert set(tensors) == set(ref)
            for k, v in ref.items():
                if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    rows = v.shape[0]  # padding rows: zeros in megacoat's output, Megatron's values in the source
                    keep = min(rows, max(0, VOCAB - t * rows))
                    assert torch.equal(tensors[k][:keep], v[:keep]), k
                    assert torch.count_nonzero(tensors[k][keep:]) == 0
                else:
                    assert torch.equal(tensors[k], v), (spec, t, p, k)


def test_megatron_output_loads_into_megatron_core(mcore_env, tmp_path):
    """The local-spec TP=1 output loads strictly into megatron-core's GPTModel and gives the same logits."""
    model = build_mcore(LLAMA)
    sd = weights(model)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(sd, 1, 1, 4, True, False),
                            megatron_args(LLAMA, model, 1, 1))
    mc = megatron_to_megacoat(src, str(tmp_path / "mc"), true_vocab_size=VOCAB, carry_iteration=True,
                              log=lambda s: None)
    out = megacoat_to_megatron(mc, str(tmp_path / "back"), spec="local", carry_iteration=True, log=lambda s: None)
    state = load_torch_file(os.path.join(out, "mp_rank_00", "model_optim_rng.pt"))
    assert state["iteration"] == 250 and state["args"].consumed_train_samples == 4096
    assert state["args"].padded_vocab_size == 128 and state["args"].true_vocab_size == VOCAB
    fresh = build_mcore(LLAMA, seed=7)
    fresh.load_state_dict(state["model"], strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(mcore_logits(fresh, tokens)[..., :VOCAB], mcore_logits(model, tokens)[..., :VOCAB],
                               rtol=0, atol=0)


def test_torch_dist_written_by_megatron_core(mcore_env, tmp_path):
    pytest.importorskip("psutil", reason="megatron-core's dist_checkpointing.save needs psutil")
    from megatron.core import dist_checkpointing
    model = build_mcore(LLAMA)
    sd = weights(model)
    it_dir = tmp_path / "mlm" / "iter_0000040"
    it_dir.mkdir(parents=True)
    state = {"args": megatron_args(LLAMA, model, 1, 1, ckpt_format="torch_dist"), "checkpoint_version": 3.0,
             "iteration": 40, "model": model.sharded_state_dict()}
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # CPU-only torch: the saver's device syncs are no-ops
    try:
        with cpu_forward():  # its failure all-reduce asks for torch.cuda.current_device() too
            dist_checkpointing.save(state, str(it_dir))
    finally:
        torch.cuda.synchronize = saved
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("40")
    out = megatron_to_megacoat(str(tmp_path / "mlm"), str(tmp_path / "mc"), log=lambda s: None)
    assert_matches(out, sd, LLAMA)
    from megacoat.checkpoint.reader import CheckpointReader  # torch_dist keys use TE names: the spec is the args'
    assert CheckpointReader(out).meta["extra"]["source"] == {"megatron_format": "torch_dist",
                                                             "megatron_transformer_impl": "local"}
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(megacoat.load_model(out)(tokens), mcore_logits(model, tokens)[..., :VOCAB],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra,needle", [
    (dict(num_experts=8), "mixture of experts"), (dict(multi_latent_attention=True), "multi-latent attention"),
    (dict(qk_layernorm=True), "QK layernorm"), (dict(rotary_interleaved=True), "interleaved RoPE"),
    (dict(rotary_percent=0.5), "partial RoPE"), (dict(squared_relu=True), "squared-ReLU"),
    (dict(position_embedding_type="yarn"), "position embedding 'yarn'")])
def test_unsupported_variants_are_refused(mcore_env, tmp_path, extra, needle):
    model = build_mcore(LLAMA, num_layers=2)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(weights(model), 1, 1, 2, True, False),
                            megatron_args(LLAMA, model, 1, 1, **extra))
    with pytest.raises(CheckpointError, match=needle):
        megatron_to_megacoat(src, str(tmp_path / "mc"), log=lambda s: None)


def test_unknown_tensor_and_exact_gelu_refused(mcore_env, tmp_path):
    model = build_mcore(LLAMA, num_layers=2)
    sd = weights(model)
    sd["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(16)
    src = save_torch_format(str(tmp_path / "a"), megatron_split(sd, 1, 1, 2, True, False),
                            megatron_args(LLAMA, model, 1, 1))
    with pytest.raises(CheckpointError, match="q_layernorm"):
        megatron_to_megacoat(src, str(tmp_path / "mc"), log=lambda s: None)
    g = build_mcore(GPT2, num_layers=2)
    src = save_torch_format(str(tmp_path / "b"), megatron_split(weights(g), 1, 1, 2, False, True),
                            megatron_args(GPT2, g, 1, 1, bias_gelu_fusion=False))
    with pytest.raises(CheckpointError, match="exact \\(erf\\) GELU"):
        megatron_to_megacoat(src, str(tmp_path / "mc2"), log=lambda s: None)


def _zip_with_pickle(path: str, payload: bytes) -> None:
    """A torch.save-shaped zip whose data.pkl is `payload`."""
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = payload if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)


def test_untrusted_pickles_never_run_code(tmp_path):
    import shutil
    victim = tmp_path / "victim"
    victim.mkdir()

    class Deleter:  # a callable torch does not block: it must become an inert record
        def __reduce__(self):
            return (shutil.rmtree, (str(victim),))

    class Shell:  # os.system: torch's weights-only unpickler blocks the module
        def __reduce__(self):
            return (os.system, (f"rmdir {victim}",))

    class Evaluator:  # a builtin that is not allow-listed
        def __reduce__(self):
            return (eval, (f"__import__('shutil').rmtree({str(victim)!r})",))

    path = str(tmp_path / "a.pt")
    _zip_with_pickle(path, pickle.dumps({"args": Deleter()}, protocol=2))
    out = load_torch_file(path)
    assert victim.is_dir() and type(out["args"]).__name__ == "rmtree"
    # An enum of a module that is not installed (as megatron-core's AttnBackend inside the args, when
    # megatron-core is absent) loads as a record holding its value: {"backend": AttnKind(3)}.
    enum_pickle = b"\x80\x02}X\x07\x00\x00\x00backendcmegatron.not_installed\nAttnKind\nK\x03\x85Rs."
    _zip_with_pickle(path, enum_pickle)
    out = load_torch_file(path)
    assert type(out["backend"]).__name__ == "AttnKind" and out["backend"].args == (3,)
    for evil in (Shell(), Evaluator()):
        _zip_with_pickle(path, pickle.dumps({"args": evil}, protocol=2))
        with pytest.raises(CheckpointError, match="refused to unpickle"):
            load_torch_file(path)
    assert victim.is_dir()
    from megacoat.convert.megatron_pickle import load_dcp_metadata
    for evil in (Deleter(), Evaluator()):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(evil))
        with pytest.raises(CheckpointError, match="not a checkpoint metadata type"):
            load_dcp_metadata(str(tmp_path / ".metadata"))
    assert victim.is_dir()


def convert_tool():
    """tools/checkpoint/convert.py as a module (its `main(argv)` returns the exit code)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("convert", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                          "checkpoint", "convert.py"))
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    return convert


def test_convert_cli_and_tokenizer_copy(mcore_env, tmp_path):
    """convert.py both ways with a HuggingFace tokenizer directory named on the command line."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([f"alpha beta gamma {i} delta epsilon zeta eta theta" for i in range(200)], trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    n = tok.get_vocab_size()
    model = build_mcore(LLAMA, num_layers=2)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(weights(model), 1, 1, 2, True, False),
                            megatron_args(LLAMA, model, 1, 1, tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model="/nonexistent/tokenizer"))
    convert = convert_tool()
    assert convert.main(["--load-format", "megatron", "--load-dir", src, "--save-format", "megacoat", "--save-dir",
                         str(tmp_path / "mc"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                         str(tok_dir)]) == 0
    from megacoat.checkpoint.model_io import load_tokenizer
    from megacoat.checkpoint.reader import CheckpointReader
    loaded = load_tokenizer(str(tmp_path / "mc"))
    assert loaded.vocab_size == n and loaded.tokenize("alpha beta") == tok.encode("alpha beta").ids
    cfg = CheckpointReader(str(tmp_path / "mc" / "iter_0000000")).config
    assert cfg["data"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert os.path.isfile(os.path.join(cfg["data"]["tokenizer_model"], "tokenizer.json"))
    assert read_model_tensors(str(tmp_path / "mc"))[1] == n  # Megatron's padding rows dropped
    assert convert.main(["--load-format", "megacoat", "--load-dir", str(tmp_path / "mc"), "--save-format",
                         "megatron", "--save-dir", str(tmp_path / "back"), "--megatron-transformer-impl", "local"]) == 0
    back = load_torch_file(str(tmp_path / "back" / "release" / "mp_rank_00" / "model_optim_rng.pt"))
    assert back["args"].tokenizer_type == "HuggingFaceTokenizer"
    assert os.path.isfile(os.path.join(back["args"].tokenizer_model, "tokenizer.json"))
    # Bad target layouts and format pairs are errors with a message, not tracebacks.
    assert convert.main(["--load-format", "megatron", "--load-dir", src, "--save-format", "hf", "--save-dir",
                         str(tmp_path / "x")]) == 2
    assert convert.main(["--load-format", "megacoat", "--load-dir", str(tmp_path / "mc"), "--save-format", "megatron",
                         "--save-dir", str(tmp_path / "y"), "--target-tensor-parallel-size", "3"]) == 2


def test_resume_training_from_converted_checkpoint(mcore_env, tmp_path):
    """The worked example of docs/migrating-from-megatron.md: convert with --carry-iteration, then
    `pretrain --load ckpt --use-checkpoint-args` continues at Megatron's iteration with its weights,
    and its saves keep the layer spec recorded at conversion (for the way back to Megatron)."""
    from megacoat.config import parse_args
    from megacoat.training.trainer import Trainer
    model = build_mcore(LLAMA, num_layers=2)
    sd = weights(model)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(sd, 2, 1, 2, True, False),
                            megatron_args(LLAMA, model, 2, 1, consumed_train_samples=120), iteration=30)
    ckpt = str(tmp_path / "mc")
    megatron_to_megacoat(src, ckpt, carry_iteration=True, log=lambda s: None)
    flags = ["--load", ckpt, "--use-checkpoint-args", "--mock-data", "--micro-batch-size", "2", "--global-batch-size",
             "4", "--train-iters", "32", "--fp32", "--num-workers", "0", "--eval-interval", "0", "--eval-iters", "0",
             "--log-interval", "1", "--lr-warmup-iters", "0", "--save", str(tmp_path / "trained")]
    trainer = Trainer(parse_args(flags), log_stream=open(os.devnull, "w"))
    assert trainer.cfg.model.num_query_groups == 2 and trainer.cfg.model.rotary_base == 500000
    assert trainer.model.vocab_size == VOCAB
    steps = []
    trainer.train(on_step=lambda t, rec: steps.append(t.state.iteration))
    assert steps == [31, 32]
    assert trainer.state.consumed_samples == 120 + 2 * 4
    source = CheckpointReader(resolve_checkpoint_dir(ckpt)).meta["extra"]["source"]
    assert source["megatron_transformer_impl"] in ("local", "transformer_engine")
    assert CheckpointReader(resolve_checkpoint_dir(str(tmp_path / "trained"))).meta["extra"]["source"] == source


def _layer_names(path: str) -> set:
    state = load_torch_file(os.path.join(path, "mp_rank_00", "model_optim_rng.pt"))
    return {k for k in state["model"] if not k.endswith("_extra_state")}, state["args"].transformer_impl


@pytest.mark.parametrize("te_names", [False, True], ids=["local", "transformer_engine"])
def test_megatron_round_trip_keeps_the_layer_spec(mcore_env, tmp_path, capsys, te_names):
    """Megatron -> megacoat -> Megatron writes the parameter names of the spec it came with (no flag
    needed), says which spec it wrote, and --megatron-transformer-impl still overrides it."""
    spec, other = ("transformer_engine", "local") if te_names else ("local", "transformer_engine")
    model = build_mcore(LLAMA, num_layers=2)
    sd = weights(model)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(sd, 1, 1, 2, True, False, te_names),
                            megatron_args(LLAMA, model, 1, 1, transformer_impl=spec))
    convert, mc = convert_tool(), str(tmp_path / "mc")
    assert convert.main(["--load-format", "megatron", "--load-dir", src, "--save-format", "megacoat",
                         "--save-dir", mc]) == 0
    assert convert.main(["--load-format", "megacoat", "--load-dir", mc, "--save-format", "megatron",
                         "--save-dir", str(tmp_path / "back")]) == 0
    assert f"{spec} layer spec (recorded when the checkpoint was imported)" in capsys.readouterr().out
    names, impl = _layer_names(str(tmp_path / "back" / "release"))
    assert names == set(megatron_split(sd, 1, 1, 2, True, False, te_names)[(0, 0)]) and impl == spec
    assert convert.main(["--load-format", "megacoat", "--load-dir", mc, "--save-format", "megatron",
                         "--save-dir", str(tmp_path / "other"), "--megatron-transformer-impl", other]) == 0
    assert f"{other} layer spec (asked for)" in capsys.readouterr().out
    names, impl = _layer_names(str(tmp_path / "other" / "release"))
    assert names == set(megatron_split(sd, 1, 1, 2, True, False, not te_names)[(0, 0)]) and impl == other
    # A resharded copy keeps the record; a checkpoint of unknown origin gets Megatron's default, and says so.
    assert convert.main(["--load-format", "megacoat", "--load-dir", mc, "--save-format", "megacoat",
                         "--save-dir", str(tmp_path / "mc2"), "--target-tensor-parallel-size", "2"]) == 0
    assert convert.main(["--load-format", "megacoat", "--load-dir", str(tmp_path / "mc2"), "--save-format",
                         "megatron", "--save-dir", str(tmp_path / "back2")]) == 0
    assert _layer_names(str(tmp_path / "back2" / "release"))[1] == spec
    from megacoat.checkpoint.reader import CheckpointReader
    from megacoat.checkpoint.format import METADATA_FILE, write_json_atomic
    it = os.path.join(mc, "iter_0000000")
    meta = CheckpointReader(it).meta
    del meta["extra"]["source"]
    write_json_atomic(os.path.join(it, METADATA_FILE), meta)
    capsys.readouterr()
    assert convert.main(["--load-format", "megacoat", "--load-dir", mc, "--save-format", "megatron",
                         "--save-dir", str(tmp_path / "unknown")]) == 0
    assert "transformer_engine layer spec (Megatron's default" in capsys.readouterr().out
    assert _layer_names(str(tmp_path / "unknown" / "release"))[1] == "transformer_engine"


def _tracker(path) -> str:
    return open(os.path.join(path, "latest_checkpointed_iteration.txt")).read().strip()


def test_convert_refuses_a_live_save_dir_and_never_rewinds_it(mcore_env, tmp_path, capsys):
    """A --save-dir holding a run at iteration 4 is refused without --force (one line naming the
    directory and the flag); with --force an older iteration is still refused (the tracker would move
    back and the next --load rewind the run), a newer one is written."""
    model = build_mcore(LLAMA, num_layers=2)
    shards = megatron_split(weights(model), 1, 1, 2, True, False)
    args = megatron_args(LLAMA, model, 1, 1)
    src = {it: save_torch_format(str(tmp_path / f"mlm{it}"), shards, args, iteration=it) for it in (4, 250)}
    convert, live = convert_tool(), str(tmp_path / "live")
    assert convert.main(["--load-format", "megatron", "--load-dir", src[4], "--save-format", "megacoat",
                         "--save-dir", live, "--carry-iteration"]) == 0
    assert _tracker(live) == "4"
    capsys.readouterr()
    into_live = ["--load-format", "megatron", "--load-dir", src[4], "--save-format", "megacoat", "--save-dir", live]
    assert convert.main(into_live) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and live in err and "--force" in err
    assert convert.main(into_live + ["--force"]) == 2
    err = capsys.readouterr().err
    assert "iteration 4" in err and "iteration 0" in err and live in err
    assert convert.main(["--load-format", "megacoat", "--load-dir", live, "--save-format", "megacoat",
                         "--save-dir", live, "--force"]) == 2  # in place at iteration 0
    assert _tracker(live) == "4" and sorted(os.listdir(live)) == [".megacoat-save.lock", "iter_0000004",
                                                                   "latest_checkpointed_iteration.txt"]
    # Forced into a directory whose run is older: written, the tracker moves forward, the old run stays.
    assert convert.main(["--load-format", "megatron", "--load-dir", src[250], "--save-format", "megacoat",
                         "--save-dir", live, "--carry-iteration", "--force"]) == 0
    assert _tracker(live) == "250" and os.path.isdir(os.path.join(live, "iter_0000004"))
    assert megacoat.load_model(live) is not None
    # Without its tracker the directory still holds iteration 250: writing 4 would rewind it.
    os.remove(os.path.join(live, "latest_checkpointed_iteration.txt"))
    assert convert.main(["--load-format", "megatron", "--load-dir", src[4], "--save-format", "megacoat",
                         "--save-dir", live, "--carry-iteration", "--force"]) == 2
    assert "iteration 250" in capsys.readouterr().err
    assert sorted(os.listdir(live)) == [".megacoat-save.lock", "iter_0000004", "iter_0000250"]
    # Megatron output: the same rules (a `release` checkpoint counts as iteration 0).
    out = str(tmp_path / "mlm_out")
    to_megatron = ["--load-format", "megacoat", "--load-dir", os.path.join(live, "iter_0000250"), "--save-format",
                   "megatron", "--save-dir", out]
    assert convert.main(to_megatron + ["--carry-iteration"]) == 0 and _tracker(out) == "250"
    assert convert.main(to_megatron) == 2 and "--force" in capsys.readouterr().err
    assert convert.main(to_megatron + ["--force"]) == 2 and "iteration 250" in capsys.readouterr().err
    assert _tracker(out) == "250" and not os.path.exists(os.path.join(out, "release"))
    assert convert.main(to_megatron + ["--carry-iteration", "--force", "--target-tensor-parallel-size", "2"]) == 0
    assert sorted(os.listdir(os.path.join(out, "iter_0000250"))) == ["mp_rank_00", "mp_rank_01"]
