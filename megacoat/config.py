"""Configuration: a tree of dataclasses, and a Megatron-compatible argparse built from it.

Every field becomes one flag: `--` + the field name with `_` -> `-` (Megatron's spelling).
The help text is the field's `help` metadata. Booleans that default to False are
`store_true` flags; booleans that default to True get a `--no-...` flag instead.
Validation lives in `validate_config`, so that bad flags fail before anything is allocated, with
one message naming the flags involved: first the range of every numeric flag (`_RANGES`; a test
fails for a numeric flag left out), then the checks that need several fields at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence


class ConfigError(ValueError):
    """A configuration problem the user can fix by changing flags."""


# Defaults of flags whose absence matters: a schedule counted in samples refuses iteration flags, and
# --split does not apply to per-split data paths, so these default to None and resolve in validate_config.
DEFAULT_SPLIT = "969,30,1"
DEFAULT_TRAIN_ITERS = 200
DEFAULT_WARMUP_ITERS = 20


def _f(default: Any, help: str, **meta: Any) -> Any:
    """Dataclass field with argparse metadata."""
    meta["help"] = help
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    num_layers: int = _f(4, "Number of transformer layers.")
    hidden_size: int = _f(256, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = _f(
        None, "MLP hidden size. Default: 4*hidden (GELU) or the Llama rule 2/3*4*hidden rounded up to 64 (SwiGLU).")
    num_attention_heads: int = _f(4, "Number of attention heads.")
    group_query_attention: bool = _f(False, "Use grouped-query attention (needs --num-query-groups).")
    num_query_groups: Optional[int] = _f(None, "Number of key/value head groups for grouped-query attention.")
    kv_channels: Optional[int] = _f(None, "Per-head dimension. Default: hidden_size / num_attention_heads.")
    seq_length: int = _f(256, "Sequence length of a training sample.")
    max_position_embeddings: Optional[int] = _f(None, "Maximum positions (learned_absolute table size, RoPE cache). Default: --seq-length.")
    normalization: str = _f("RMSNorm", "Normalization layer.", choices=["RMSNorm", "LayerNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the normalization layers.")
    position_embedding_type: str = _f("rope", "Position embedding.", choices=["rope", "learned_absolute"])
    rotary_base: float = _f(10000.0, "RoPE base (theta).")
    activation: str = _f("swiglu", "MLP activation (Llama: swiglu; GPT-2: gelu).", choices=["swiglu", "gelu"])
    add_bias_linear: bool = _f(False, "Add biases to the linear layers (GPT-2 style).")
    untie_embeddings_and_output_weights: bool = _f(False, "Use a separate output layer instead of the input embedding.")
    init_method_std: float = _f(0.02, "Std of the normal init; output projections use std/sqrt(2*num_layers).")
    attention_dropout: float = _f(0.1, "Dropout probability on attention weights.")
    hidden_dropout: float = _f(0.1, "Dropout probability on the outputs of attention and MLP blocks.")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this times the TP size.")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "Tensor model parallel size (TP).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline model parallel size (PP).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(
        None, "Layers per virtual pipeline stage: each PP rank holds num_layers / (PP x this) model chunks and runs the "
              "interleaved 1F1B schedule (needs micro-batches per step divisible by PP).")
    decoder_first_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the first pipeline stage (uneven split; the other stages share the rest evenly).")
    decoder_last_pipeline_num_layers: Optional[int] = _f(
        None, "Layers on the last pipeline stage (uneven split; the other stages share the rest evenly).")
    sequence_parallel: bool = _f(False, "Shard norms, dropout and residuals along the sequence across TP ranks.")
    ranks_per_node: Optional[int] = _f(
        None, "Ranks per node for the two-level data-parallel groups. Default: $LOCAL_WORLD_SIZE (torchrun), else the world size.")
    distributed_backend: str = _f("auto", "torch.distributed backend: auto = nccl on GPU, gloo on CPU.", choices=["auto", "nccl", "gloo"])
    distributed_timeout_minutes: float = _f(10, "Timeout of collective operations, minutes: when a rank dies, the "
                                                  "others stop with an error within this time instead of hanging.")
    high_priority_stream_groups: list = _f(
        [], "Process groups whose NCCL collectives run on high-priority CUDA streams (Megatron's flag): any of "
            "tp, dp, pp, mp, embedding (dp includes the two-level intra/inter-node DP groups). Communication "
            "kernels then get SMs ahead of queued compute kernels, which helps overlap on slow links. NCCL only.",
        nargs="*", choices=["tp", "dp", "pp", "mp", "embedding"])
    world_size: Optional[int] = _f(None, "With --dry-run: the number of ranks to plan for (default: the launched world).")
    use_distributed_optimizer: bool = _f(False, "ZeRO: shard fp32 master weights and optimizer states over DP ranks.")
    overlap_grad_reduce: bool = _f(False, "Reduce-scatter each gradient bucket as soon as its gradients are final "
                                          "(needs --use-distributed-optimizer).")
    overlap_param_gather: bool = _f(False, "Defer each bucket's parameter all-gather to just before its first use in "
                                           "the next forward (needs --use-distributed-optimizer).")
    ddp_bucket_size: Optional[int] = _f(None, "Elements per gradient/parameter bucket. Default: max(40M, 1M x DP).")
    grad_reduce_in_bf16: bool = _f(False, "Accumulate and reduce gradients in bf16 instead of fp32.")
    accumulate_allreduce_grads_in_fp32: bool = _f(False, "Megatron's flag; fp32 accumulation is the default here.")


@dataclass
class OptimizerConfig:
    optimizer: str = _f("adam", "Optimizer (AdamW with decoupled weight decay).", choices=["adam"])
    lr: float = _f(1e-3, "Peak learning rate (> 0).")
    min_lr: float = _f(1e-4, "Minimum learning rate at the end of decay.")
    lr_warmup_iters: Optional[int] = _f(
        None, f"Linear warmup iterations. Default: {DEFAULT_WARMUP_ITERS}; 0 with --lr-warmup-fraction (which replaces "
              "it) or --train-samples (warm up with --lr-warmup-samples then).")
    lr_decay_style: str = _f("cosine", "Decay after warmup.", choices=["cosine", "linear", "constant"])
    lr_decay_iters: Optional[int] = _f(None, "Iterations over which to decay. Default: --train-iters.")
    lr_warmup_samples: Optional[int] = _f(None, "Linear warmup over this many samples (with --train-samples; replaces "
                                                "--lr-warmup-iters).")
    lr_decay_samples: Optional[int] = _f(None, "Decay over this many samples (with --train-samples). Default: "
                                               "--train-samples.")
    lr_warmup_fraction: Optional[float] = _f(None, "Warmup as a fraction of the decay span (iterations or samples); "
                                                   "replaces --lr-warmup-iters / --lr-warmup-samples.")
    override_opt_param_scheduler: bool = _f(
        False, "Resuming: follow this run's schedule flags (--lr, --min-lr, warmup, decay span and style) where they "
               "differ from the checkpoint's (Megatron's --override-opt_param-scheduler).")
    use_checkpoint_opt_param_scheduler: bool = _f(
        False, "Resuming: keep the checkpoint's schedule where this run's flags differ (Megatron's "
               "--use-checkpoint-opt_param-scheduler). Without either flag, a difference is refused.")
    weight_decay: float = _f(0.1, "Decoupled weight decay (not applied to biases and norm weights).")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.95, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    clip_grad: float = _f(1.0, "Clip gradients to this global L2 norm (0 disables).")
    use_precision_aware_optimizer: bool = _f(
        False, "Store the Adam moments in the dtypes of --exp-avg-dtype / --exp-avg-sq-dtype (fp8: COAT's grouped E4M3 "
               "with dynamic range expansion).")
    exp_avg_dtype: str = _f("fp32", "Dtype of Adam's first moment (needs --use-precision-aware-optimizer).",
                            choices=["fp32", "bf16", "fp8"])
    exp_avg_sq_dtype: str = _f("fp32", "Dtype of Adam's second moment (needs --use-precision-aware-optimizer).",
                               choices=["fp32", "bf16", "fp8"])
    optimizer_state_expansion: bool = _f(
        True, "COAT's dynamic range expansion of fp8 optimizer states (--no-optimizer-state-expansion: plain per-group "
              "absmax scaling, the ablation).")


@dataclass
class PrecisionConfig:
    fp8_format: Optional[str] = _f(
        None, "FP8 linear layers: hybrid = E4M3 forward, E5M2 gradients; e4m3 = E4M3 everywhere. Default: off.",
        choices=[None, "hybrid", "e4m3"])
    fp8_recipe: str = _f("coat", "With --fp8-format: tensorwise = FP8 GEMMs with just-in-time per-tensor scaling and bf16 "
                                 "saved activations; coat = the same GEMMs plus COAT's FP8 activation storage.",
                         choices=["tensorwise", "coat"])
    fp8_weight_cache: str = _f(
        "auto", "With --fp8-format: step = keep each linear weight's FP8 copies (W and W^T, 2 bytes per element) for "
                "the whole optimizer step, remade once after it; none = cast the weight at each use (forward, and W^T "
                "again in backward: no extra memory, more launches and traffic per micro-batch); auto = step unless a "
                "step has one micro-batch under --overlap-param-gather (each layer then waits for its weights: the "
                "copies could not be made ahead) or, on a GPU, the step's estimated peak with the copies passes 95% "
                "of the memory the process can use (then none; said in the log).",
        choices=["auto", "step", "none"])
    fp8_gemm_candidates: int = _f(
        16, "With --fp8-format on a GPU: how many of cuBLASLt's FP8 GEMM algorithms to time for each GEMM shape on "
            "its first call (forward, dgrad and wgrad GEMMs; well under a second once per shape); another than the "
            "heuristic's first is kept only when more than 2% faster. 1 = cuBLASLt's heuristic choice, as "
            "torch._scaled_mm: the same algorithms in every run (timing may pick others in another run, whose sums "
            "differ in rounding).")
    gradient_accumulation_fusion: bool = _f(
        True, "The weight-gradient GEMM accumulates straight into the fp32 (or bf16) main gradient buffer "
              "(where supported: CUDA; elsewhere the gradient is added after the GEMM).")
    cross_entropy_loss_fusion: Optional[bool] = _f(
        None, "The language-model loss through fused Triton kernels that read the logits in their own dtype "
              "(no fp32 copy of the [tokens, vocabulary] logits, no saved softmax). Default: on where they run "
              "(CUDA with Triton); --no-cross-entropy-loss-fusion: torch operations on an fp32 copy of the logits, "
              "as before the fusion.", tristate=True)
    rope_fusion: Optional[bool] = _f(
        None, "RoPE over the QKV output as one Triton kernel each way (q and k rotated, v copied; its backward "
              "writes the QKV gradient and, under FP8, hands the QKV linear its amax). Default: on where the "
              "kernels run (CUDA with Triton; elsewhere --rope-fusion runs their torch reference); "
              "--no-rope-fusion: the torch operations (compiled by Inductor where layers are compiled).",
        tristate=True)


@dataclass
class CommConfig:
    quantized_weights: bool = _f(False, "SDP4Bit qWD: all-gather quantized weight differences in the ZeRO optimizer "
                                        "(needs --use-distributed-optimizer).")
    weight_quantization_bits: int = _f(4, "Bits of the quantized weight differences.", choices=[4, 8])
    wq_group_size: int = _f(2048, "Elements per quantization group (one fp32 scale each) of the weight differences.")
    quantize_weights_directly: bool = _f(False, "Ablation of --quantized-weights: quantize the weights themselves, "
                                                "not their differences.")
    quantized_gradients: bool = _f(False, "SDP4Bit TLq: two-level quantized gradient reduce-scatter with all-to-alls "
                                          "(needs --use-distributed-optimizer).")
    gradient_quantization_bits_intra: int = _f(8, "Bits of gradients sent within a node.", choices=[4, 8])
    gq_group_size_intra: int = _f(128, "Elements per quantization group of gradients within a node.")
    gradient_quantization_bits_inter: int = _f(4, "Bits of gradients sent between nodes.", choices=[4, 8])
    gq_group_size_inter: int = _f(128, "Elements per quantization group of gradients between nodes.")
    hadamard_transform: bool = _f(False, "Smooth gradients with a 32-point Hadamard transform before quantizing "
                                         "(SDP4Bit's TLq-HS).")
    gradient_alltoall_pipeline: int = _f(1, "Split each gradient bucket into this many slices so that one slice's "
                                            "inter-node hop overlaps the next one's intra-node hop.")

    @property
    def sdp4bit(self) -> bool:
        """Any SDP4Bit collective is on (it replaces the ZeRO optimizer's plain ones)."""
        return self.quantized_weights or self.quantized_gradients


@dataclass
class DataConfig:
    data_path: list = _f([], "Megatron data prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'. Empty: the built-in default corpus.", nargs="*")
    split: Optional[str] = _f(
        None, "Train,valid,test split of --data-path documents, e.g. 949,50,1 (weights >= 0; train's must be > 0). "
              f"Default: {DEFAULT_SPLIT}. An empty validation split (e.g. 100,0,0) skips evaluation. Not with "
              "--train-data-path / --valid-data-path / --test-data-path, which give each split its own data.")
    train_data_path: list = _f([], "Separate (weighted) prefixes for training.", nargs="*")
    valid_data_path: list = _f([], "Separate (weighted) prefixes for validation.", nargs="*")
    test_data_path: list = _f([], "Separate (weighted) prefixes for test.", nargs="*")
    data_cache_path: Optional[str] = _f(None, "Where index caches (.npy) and the default corpus live. Default: ~/.cache/megacoat.")
    mock_data: bool = _f(False, "Synthetic random tokens (for speed measurements only).")
    tokenizer_type: Optional[str] = _f(
        None, "Tokenizer: SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer. Default: the default corpus' SentencePiece model.",
        choices=[None, "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                 "NullTokenizer"])
    tokenizer_model: Optional[str] = _f(None, "Tokenizer model file (SentencePiece .model or HF tokenizer.json / directory).")
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's vocab.json.")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: GPT-2's merges.txt.")
    vocab_size: Optional[int] = _f(None, "Vocabulary size for NullTokenizer and --mock-data.")
    num_workers: int = _f(2, "DataLoader worker processes.")
    eod_mask_loss: bool = _f(False, "Mask the loss on end-of-document tokens.")
    reset_position_ids: bool = _f(False, "Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = _f(False, "Block attention across end-of-document tokens.")


@dataclass
class TrainingConfig:
    micro_batch_size: int = _f(8, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Samples per optimizer step over all DP ranks. Default: micro_batch_size * DP.")
    train_iters: Optional[int] = _f(None, f"Optimizer steps to train. Default: {DEFAULT_TRAIN_ITERS}, or the whole "
                                          "steps --train-samples holds (give one of the two).")
    seed: int = _f(1234, "Random seed (weights, data order, dropout); 0 <= seed < 2**32.")
    bf16: bool = _f(False, "Train in bf16 with fp32 master weights (the default on GPU).")
    fp32: bool = _f(False, "Train in fp32 (the default on CPU).")
    fp16: bool = _f(False, "Not supported: use --bf16.")
    use_cpu: bool = _f(False, "Run on CPU even when a GPU is present.")
    torch_compile: Optional[bool] = _f(None, "Compile transformer layers with torch.compile (default: on for GPU).", tristate=True)
    eval_interval: int = _f(100, "Evaluate on the validation set every this many iterations (0: only at the end "
                                       "of training; --eval-iters 0 turns validation off).")
    eval_iters: int = _f(10, "Validation iterations per evaluation (0: no validation). When the validation split "
                             "has no documents (e.g. --split 100,0,0), evaluation is skipped with a warning, as "
                             "Megatron skips it.")
    exit_interval: Optional[int] = _f(None, "Stop after the iteration that is a multiple of this.")
    train_samples: Optional[int] = _f(None, "Train on this many samples (instead of --train-iters; the schedule is "
                                            "then counted in samples too).")
    rampup_batch_size: list = _f([], "Batch-size ramp: START INCREMENT SAMPLES grows the global batch from START by "
                                     "INCREMENT over SAMPLES consumed samples up to --global-batch-size "
                                     "(needs --train-samples).", nargs="*")
    exit_signal_handler: bool = _f(False, "On SIGTERM (SLURM preemption, --signal), save a checkpoint at the next "
                                          "iteration boundary and exit 0.")
    max_skipped_iterations: Optional[int] = _f(None, "Stop with an error after this many consecutive skipped "
                                                     "(non-finite) steps; the last checkpoint stays intact.")
    recompute_granularity: Optional[str] = _f(
        None, "Activation recomputation: full = recompute whole transformer layers in backward; selective = only the "
              "attention core.", choices=[None, "full", "selective"])
    recompute_method: Optional[str] = _f(
        None, "With --recompute-granularity full: uniform = checkpoint groups of --recompute-num-layers layers; "
              "block = recompute the first --recompute-num-layers layers of each stage only.",
        choices=[None, "uniform", "block"])
    recompute_num_layers: Optional[int] = _f(None, "Layers per recomputed group (uniform) or recomputed layers per "
                                                   "stage (block). Default: 1 (uniform), all (block).")
    dry_run: bool = _f(False, "Plan the run without training: build the config, layout and buffer/bucket/shard plan "
                              "under a fake process group and print per-rank memory and bytes sent per step, and "
                              "the predicted step time on --hardware.")
    hardware: str = _f("h200", "With --dry-run: the machine the step time is predicted for: a name shipped with "
                               "megacoat (megacoat/training/hardware/NAME.json) or a JSON file written by "
                               "benchmarks/calibrate.py.")
    inter_node_gbps: Optional[float] = _f(None, "With --dry-run: the link between nodes, Gb/s per GPU (e.g. 400 for "
                                                "one NDR InfiniBand NIC per GPU). Default: the --hardware file's.")


@dataclass
class LoggingConfig:
    log_interval: int = _f(10, "Print the iteration line every this many iterations.")
    peak_tflops: Optional[float] = _f(None, "Peak TFLOP/s per device used for MFU. Default on Hopper: the dense peak of the GEMMs' format (989 bf16, 1979 FP8 with --fp8-format), else MFU is not printed.")
    wandb_project: Optional[str] = _f(None, "Log to this Weights & Biases project (needs `pip install wandb`).")
    wandb_exp_name: Optional[str] = _f(None, "W&B run name.")
    wandb_entity: Optional[str] = _f(None, "W&B entity (team or user) that owns the project.")
    wandb_save_dir: Optional[str] = _f(None, "Directory for W&B's local run files (WANDB_MODE=offline keeps the run "
                                             "there; `wandb sync` uploads it later).")
    tensorboard_dir: Optional[str] = _f(None, "Write TensorBoard event files here (needs `pip install tensorboard`).")
    log_json: Optional[str] = _f(None, "Also append one JSON record per logged iteration to this file (rank printing the log).")
    log_pipeline_bubble: bool = _f(False, "Time each stage's forward/backward compute (CUDA events) and log, every "
                                          "--log-interval, the measured pipeline bubble per stage next to the theory "
                                          "(pp-1)/(vp*m+pp-1).")


@dataclass
class CheckpointConfig:
    save: Optional[str] = _f(None, "Directory to save checkpoints to (<save>/iter_0000100/ + latest_checkpointed_iteration.txt).")
    load: Optional[str] = _f(None, "Directory to load the latest checkpoint from (the same as --save resumes a run).")
    save_interval: Optional[int] = _f(None, "Save every this many iterations (and always at the end and at exits).")
    no_load_optim: bool = _f(False, "Load model weights only: no optimizer state, no LR scheduler state.")
    no_load_rng: bool = _f(False, "Do not restore the RNG states.")
    finetune: bool = _f(False, "Load model weights only and start at iteration 0 (fresh optimizer, scheduler, data).")
    exit_duration_in_mins: Optional[float] = _f(None, "Save and exit after this many minutes of wall time (checked at "
                                                      "--log-interval iterations; 0: at the first check).")
    use_checkpoint_args: bool = _f(False, "Take the model architecture (and tokenizer) flags from the checkpoint in --load.")
    save_retain: Optional[int] = _f(None, "Keep only the newest N checkpoints in --save (older iter_* directories "
                                          "are deleted after each save).")
    async_save: bool = _f(False, "Write checkpoints in the background (one in flight; training stalls only for the copy to CPU).")


@dataclass
class MegacoatConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = [f.name for f in dataclasses.fields(MegacoatConfig)]


def int_at_least(minimum: int):
    """An argparse type for the tools' counts: an integer of at least `minimum`, else argparse's one-line error
    (0 workers would run none or silently one; --top 0 would print nothing)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse with a clearer message for unknown flags (suggests the closest ones)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        if message.startswith("unrecognized arguments"):
            bad = [a for a in message.split(":", 1)[1].split() if a.startswith("--")]
            known = [o for a in self._actions for o in a.option_strings]
            hints = []
            for b in bad:
                close = difflib.get_close_matches(b.split("=")[0], known, n=3)
                if close:
                    hints.append(f"{b}: did you mean {', '.join(close)}?")
            if hints:
                message += "\n  " + "\n  ".join(hints)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="megacoat: Megatron-style GPT pretraining (flags follow Megatron-LM).",
        allow_abbrev=False,
    )
    for section in dataclasses.fields(MegacoatConfig):
        group = parser.add_argument_group(section.name)
        for f in dataclasses.fields(section.default_factory()):
            meta = dict(f.metadata)
            help_ = meta.pop("help", "").replace("%", "%%")  # argparse formats help strings with %
            dest = f"{section.name}.{f.name}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if meta.pop("tristate", False):
                group.add_argument(_flag(f.name), dest=dest, action="store_true", default=None, help=help_)
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest, action="store_false",
                                   help=f"Disable {_flag(f.name)}.")
                continue
            if isinstance(default, bool):
                if default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=dest, action="store_false", default=True,
                                       help=f"Disable: {help_}")
                else:
                    group.add_argument(_flag(f.name), dest=dest, action="store_true", default=False, help=help_)
                continue
            typ = _field_type(f, default)
            kwargs = dict(dest=dest, default=default, help=f"{help_} (default: {default})")
            if "choices" in meta:
                kwargs["choices"] = meta.pop("choices")
            if "nargs" in meta:
                kwargs["nargs"] = meta.pop("nargs")
                typ = str
            group.add_argument(_flag(f.name), type=typ, **kwargs)
    # Megatron spellings that map onto our fields.
    parser.add_argument("--swiglu", dest="model.activation", action="store_const", const="swiglu",
                        help="Alias of --activation swiglu.")
    parser.add_argument("--disable-bias-linear", dest="model.add_bias_linear", action="store_false",
                        help="Alias: no biases in linear layers (the default).")
    for name in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):  # Megatron's spelling
        parser.add_argument(_flag(name).replace("opt-param", "opt_param"), dest=f"optim.{name}", action="store_true",
                            help=f"Alias of {_flag(name)}.")
    parser.add_argument("--recompute-activations", dest="train.recompute_granularity", action="store_const",
                        const="selective", help="Megatron's alias of --recompute-granularity selective.")
    parser.add_argument("--use-rotary-position-embeddings", dest="model.position_embedding_type",
                        action="store_const", const="rope", help="Megatron's alias of --position-embedding-type rope.")
    _add_megatron_flags(parser)
    return parser


# Megatron-LM flags that megacoat accepts and that change nothing here, with why (pretrain_gpt.py says so once).
MEGATRON_NO_OPS = {
    "--use-flash-attn": (None, "attention always runs through torch's scaled_dot_product_attention, which uses "
                               "FlashAttention kernels where the GPU and dtype allow"),
    "--attention-backend": (("flash", "fused", "unfused", "local", "auto"),
                            "attention always runs through torch's scaled_dot_product_attention, which picks its "
                            "kernel itself"),
    "--no-masked-softmax-fusion": (None, "megacoat has no separate masked-softmax kernel (the softmax is part of "
                                         "scaled_dot_product_attention)"),
    "--attention-softmax-in-fp32": (None, "attention's softmax runs inside scaled_dot_product_attention, whose fused "
                                          "GPU kernels accumulate it in fp32"),
    "--apply-query-key-layer-scaling": (None, "it changes only fp16 rounding, and megacoat trains in bf16 or fp32"),
    "--no-bias-gelu-fusion": (None, "megacoat has no separate bias-GELU kernel (--torch-compile fuses whole "
                                    "layers; --no-torch-compile turns that off)"),
    "--no-bias-dropout-fusion": (None, "megacoat has no separate bias-dropout-add kernel (--torch-compile fuses "
                                       "whole layers; --no-torch-compile turns that off)"),
    "--use-mcore-models": (None, "megacoat's GPT is laid out as megatron-core's, its only model"),
    "--transformer-impl": (("local", "transformer_engine"),
                           "megacoat has one layer implementation of its own (FP8 through --fp8-format); for "
                           "converted checkpoints the Megatron layer spec is tools/checkpoint/convert.py's "
                           "--megatron-transformer-impl"),
    "--log-throughput": (None, "the iteration line always shows throughput (tokens/s and TFLOP/s per GPU)"),
}

# Megatron-LM flags refused with what to do instead (argparse's "unrecognized arguments" named no fix).
MEGATRON_REFUSED = {
    "--ckpt-format": (("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
                      "megacoat saves and loads its own checkpoint format, at any TP/PP/DP: drop the flag; a Megatron "
                      "checkpoint converts with tools/checkpoint/convert.py --load-format megatron "
                      "(docs/migrating-from-megatron.md)"),
    "--use-legacy-models": (None, "megacoat has the megatron-core GPT only: drop the flag"),
    "--data-args-path": ("FILE", "give the blend on the command line: --data-path $(cat FILE)"),
    "--per-split-data-args-path": ("FILE", "give each split's blend on the command line: --train-data-path ... "
                                           "--valid-data-path ... --test-data-path ..."),
}

NOTES_DEST = "_megatron_notes"  # parse_args_with_notes collects the no-op notes here


class _MegatronFlag(argparse.Action):
    """A Megatron flag without a setting here: a no-op noted in the namespace, or a refusal with the fix."""

    def __init__(self, option_strings, dest, note: str, refused: bool, **kwargs):
        self.note, self.refused = note, refused
        super().__init__(option_strings, NOTES_DEST, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.refused:
            parser.error(f"{option_string} is not supported: {self.note}")
        notes = getattr(namespace, NOTES_DEST, None) or []
        notes.append(f"{option_string} changes nothing here: {self.note}")
        setattr(namespace, NOTES_DEST, notes)


def _add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM flags without a setting here")
    for table, refused in ((MEGATRON_NO_OPS, False), (MEGATRON_REFUSED, True)):
        for flag, (choices, note) in table.items():
            kwargs = dict(nargs=0) if choices is None else dict(metavar=choices) if isinstance(choices, str) \
                else dict(choices=choices)
            group.add_argument(flag, action=_MegatronFlag, note=note, refused=refused, default=None,
                               help=("Refused: " if refused else "Accepted, no effect: ") + note.replace("%", "%%"),
                               **kwargs)


def _field_type(f: dataclasses.Field, default: Any):
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def parse_args(argv: Optional[Sequence[str]] = None) -> MegacoatConfig:
    """Parse Megatron-style flags into a MegacoatConfig (not yet resolved against the world)."""
    return parse_args_with_notes(argv)[0]


def parse_args_with_notes(argv: Optional[Sequence[str]] = None):
    """(config, notes): the notes say which Megatron flags given were accepted without effect, and why."""
    ns = vars(build_parser().parse_args(argv))
    notes = ns.pop(NOTES_DEST, None) or []
    cfg = MegacoatConfig()
    for key, value in ns.items():
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    return cfg, notes


def config_from_dict(d: dict) -> MegacoatConfig:
    cfg = MegacoatConfig()
    for section, values in d.items():
        sec = getattr(cfg, section)
        for k, v in values.items():
            setattr(sec, k, v)
    return cfg


def resolve_model_defaults(m: ModelConfig) -> None:
    """Fill derived model fields (idempotent)."""
    if m.kv_channels is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}; "
                "pick divisible values or set --kv-channels.")
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.num_query_groups is None or not m.group_query_attention:
        # (one group per head is what this resolves to without grouped-query attention: a second call accepts it)
        if m.num_query_groups not in (None, m.num_attention_heads) and not m.group_query_attention:
            raise ConfigError("--num-query-groups needs --group-query-attention.")
        m.num_query_groups = m.num_attention_heads
    if m.ffn_hidden_size is None:
        if m.activation == "swiglu":
            m.ffn_hidden_size = ((int(2 * 4 * m.hidden_size / 3) + 63) // 64) * 64
        else:
            m.ffn_hidden_size = 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length


def round_to_fp32(x: float) -> float:
    """A Python float rounded to the nearest fp32 value (struct: no tensor, so nothing for a tracer to see):
    the number fp32 kernels and their references compute with."""
    return struct.unpack("f", struct.pack("f", x))[0]


_FP32_MAX = 3.4028234663852886e38

# Range rules of single flags: (test, requirement). Optional flags left unset (None) are not checked.
_RULES = {
    ">=1": (lambda v: v >= 1, "must be >= 1"),
    ">=0": (lambda v: v >= 0, "must be >= 0"),
    ">0 finite": (lambda v: math.isfinite(v) and v > 0, "must be > 0 and finite"),
    ">=0 finite": (lambda v: math.isfinite(v) and v >= 0, "must be >= 0 and finite"),
    "[0,1)": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "[0,1]": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "seed": (lambda v: 0 <= v < 2 ** 32, "must be >= 0 and < 2**32 (numpy's seeds are 32-bit)"),
}

# Every numeric flag with a valid range: (section, field, rule, what the value means / how to fix it).
_RANGES = (
    ("model", "num_layers", ">=1", ""),
    ("model", "hidden_size", ">=1", ""),
    ("model", "ffn_hidden_size", ">=1", " (or leave it unset for the default)"),
    ("model", "num_attention_heads", ">=1", ""),
    ("model", "num_query_groups", ">=1", ""),
    ("model", "kv_channels", ">=1", " (or leave it unset: --hidden-size / --num-attention-heads)"),
    ("model", "seq_length", ">=1", ""),
    ("model", "max_position_embeddings", ">=1", ""),
    ("model", "norm_epsilon", ">0 finite", " (e.g. 1e-5)"),
    ("model", "rotary_base", ">0 finite", " (e.g. 10000)"),
    ("model", "init_method_std", ">0 finite", " (e.g. 0.02)"),
    ("model", "attention_dropout", "[0,1)", ""),
    ("model", "hidden_dropout", "[0,1)", ""),
    ("model", "make_vocab_size_divisible_by", ">=1", ""),
    ("parallel", "tensor_model_parallel_size", ">=1", ""),
    ("parallel", "pipeline_model_parallel_size", ">=1", ""),
    ("parallel", "num_layers_per_virtual_pipeline_stage", ">=1", ""),
    ("parallel", "decoder_first_pipeline_num_layers", ">=1", ""),
    ("parallel", "decoder_last_pipeline_num_layers", ">=1", ""),
    ("parallel", "ranks_per_node", ">=1", ""),
    ("parallel", "distributed_timeout_minutes", ">0 finite", ""),
    ("parallel", "world_size", ">=1", ""),
    ("parallel", "ddp_bucket_size", ">=1", ""),
    ("optim", "min_lr", ">=0 finite", ""),
    ("optim", "lr_warmup_iters", ">=0", ""),
    ("optim", "lr_decay_iters", ">=1", ""),
    ("optim", "lr_warmup_samples", ">=0", ""),
    ("optim", "lr_decay_samples", ">=1", ""),
    ("optim", "lr_warmup_fraction", "[0,1]", ""),
    ("optim", "weight_decay", ">=0 finite", " (0: no weight decay)"),
    ("optim", "adam_eps", ">0 finite", " (e.g. Megatron's default 1e-8)"),
    ("optim", "clip_grad", ">=0 finite", " (0: no clipping)"),
    ("comm", "gradient_alltoall_pipeline", ">=1", ""),
    ("data", "vocab_size", ">=1", ""),
    ("data", "num_workers", ">=0", " (0: load data in the training process)"),
    ("train", "micro_batch_size", ">=1", ""),
    ("train", "global_batch_size", ">=1", ""),
    ("train", "train_iters", ">=1", ""),
    ("train", "train_samples", ">=1", ""),
    ("train", "seed", "seed", ""),
    ("train", "eval_interval", ">=0", " (0: only at the end of training)"),
    ("train", "eval_iters", ">=0", " (0: no validation)"),
    ("train", "exit_interval", ">=1", " (leave it out to run all --train-iters)"),
    ("train", "max_skipped_iterations", ">=1", ""),
    ("train", "recompute_num_layers", ">=1", ""),
    ("train", "inter_node_gbps", ">0 finite", " (Gb/s per GPU, e.g. 400)"),
    ("logging", "peak_tflops", ">0 finite", ""),
    ("checkpoint", "save_interval", ">=1", ""),
    ("checkpoint", "exit_duration_in_mins", ">=0 finite", " (0: save and exit at the first check)"),
)


def _range_errors(cfg: MegacoatConfig) -> list:
    """One message per flag outside its valid range. Checked first: later checks divide by these
    values, and a bad one would otherwise surface as a traceback from deep inside the run."""
    errors = []
    for section, name, rule, hint in _RANGES:
        value = getattr(getattr(cfg, section), name)
        ok, requirement = _RULES[rule]
        if value is not None and not ok(value):
            errors.append(f"{_flag(name)} {value} {requirement}{hint}.")
    o, lg, c = cfg.optim, cfg.logging, cfg.checkpoint
    beta1_ok = True
    for flag, beta in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        # The optimizers compute in fp32: a beta that rounds to 1 there zeroes a bias correction.
        if not 0.0 <= round_to_fp32(beta) < 1.0:
            errors.append(f"{flag} {beta} must be >= 0 and < 1 in fp32.")
            beta1_ok = beta1_ok and flag != "--adam-beta1"
    if not (math.isfinite(o.lr) and o.lr > 0):
        errors.append(f"--lr {o.lr} must be > 0 and finite (GPT pretraining uses about 1e-4 to 1e-2).")
    elif beta1_ok and o.lr / (1.0 - round_to_fp32(o.adam_beta1)) > _FP32_MAX:
        # AdamW's first step moves each weight by up to lr / (1 - beta1): beyond fp32 it cannot be computed.
        errors.append(f"--lr {o.lr} is too large: AdamW's first step size lr / (1 - --adam-beta1) overflows fp32 "
                      "(GPT pretraining uses about 1e-4 to 1e-2).")
    if lg.log_interval < 1:
        errors.append(f"--log-interval {lg.log_interval} must be >= 1 (iterations per log line; the last "
                      f"iteration is always logged, so --log-interval {cfg.train.train_iters or 'N'} with "
                      "--train-iters N logs only at the end).")
    if c.save_retain is not None and c.save_retain < 1:
        errors.append("--save-retain must be >= 1 (the newest checkpoint is always kept).")
    try:
        if cfg.data.split is not None:
            split_fractions(cfg.data.split)
    except ConfigError as e:
        errors.append(str(e))
    return errors


def split_fractions(split: str) -> List[float]:
    """--split '949,50,1' (or '949/50/1', Megatron's spellings) -> train, valid, test fractions (missing ones 0)."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or not all(math.isfinite(x) and x >= 0 for x in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three non-negative weights for train, valid and test "
                          "with a positive sum, e.g. 949,50,1")
    parts += [0.0] * (3 - len(parts))
    return [x / sum(parts) for x in parts]


def _raise_config_errors(errors: list) -> None:
    if len(errors) == 1:  # one problem: one line
        raise ConfigError(f"invalid configuration: {errors[0]}")
    raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def validate_config(cfg: MegacoatConfig, world_size: int) -> None:
    """Check everything that can be checked before allocating; raise ConfigError naming the flags."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    errors = _range_errors(cfg)
    if errors:
        _raise_config_errors(errors)
    resolve_model_defaults(m)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        errors.append(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                      f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes.")
    dp = max(world_size // (tp * pp), 1)
    if m.num_attention_heads % tp:
        errors.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                      f"--tensor-model-parallel-size {tp}.")
    if m.num_query_groups % tp:
        errors.append(f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}.")
    if m.num_attention_heads % m.num_query_groups:
        errors.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups "
                      f"{m.num_query_groups}.")
    if m.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}.")
    if p.sequence_parallel and m.seq_length % tp:
        errors.append(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                      "(needed by --sequence-parallel).")
    if m.position_embedding_type == "rope" and m.kv_channels % 2:
        errors.append(f"RoPE needs an even head dimension, got {m.kv_channels}.")
    if m.max_position_embeddings < m.seq_length:
        errors.append(f"--max-position-embeddings {m.max_position_embeddings} < --seq-length {m.seq_length}: raise it to "
                      f"at least {m.seq_length}, or leave it out (it defaults to --seq-length).")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp):
        errors.append(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                      f"{t.micro_batch_size} x data-parallel size {dp} (= world {world_size} / (TP {tp} x PP {pp})).")
    else:
        errors += _pipeline_errors(m.num_layers, pp, p, t.global_batch_size // (t.micro_batch_size * dp))
    errors += _sample_schedule_errors(cfg, dp)  # before --lr-decay-iters defaults to --train-iters
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        errors.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict: pick one.")
    if t.fp16:
        errors.append("--fp16 is not supported: use --bf16 (same memory, no loss scaling).")
    if t.bf16 and t.fp32:
        errors.append("--bf16 and --fp32 conflict: pick one.")
    if t.use_cpu and p.distributed_backend == "nccl":  # NCCL runs on GPUs only
        errors.append("--distributed-backend nccl needs GPUs and --use-cpu runs on the CPU: use --distributed-backend "
                      "gloo, or leave it at auto (nccl on GPUs, gloo on the CPU).")
    errors += _lr_schedule_errors(cfg)
    if o.lr_decay_iters is None and t.train_samples is None:
        o.lr_decay_iters = t.train_iters
    d = cfg.data
    if d.mock_data and (d.data_path or d.train_data_path):
        errors.append("--mock-data conflicts with --data-path/--train-data-path: pick one.")
    if d.data_path and (d.train_data_path or d.valid_data_path or d.test_data_path):
        errors.append("--data-path conflicts with --train-data-path/--valid-data-path/--test-data-path.")
    errors += _train_data_errors(d)
    if (p.overlap_grad_reduce or p.overlap_param_gather) and not p.use_distributed_optimizer:
        errors.append("--overlap-grad-reduce / --overlap-param-gather need --use-distributed-optimizer.")
    if p.grad_reduce_in_bf16 and p.accumulate_allreduce_grads_in_fp32:
        errors.append("--grad-reduce-in-bf16 conflicts with --accumulate-allreduce-grads-in-fp32.")
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        errors.append("--recompute-method / --recompute-num-layers need --recompute-granularity full.")
    c = cfg.checkpoint
    needs_save = [f for f, on in (("--save-interval", c.save_interval is not None), ("--async-save", c.async_save),
                                  ("--save-retain", c.save_retain is not None)) if on]
    if needs_save and not c.save:
        errors.append(f"{' / '.join(needs_save)} need{'s' if len(needs_save) == 1 else ''} --save DIR (the directory "
                      "checkpoints are written to).")
    lg = cfg.logging
    if (lg.wandb_entity or lg.wandb_save_dir or lg.wandb_exp_name) and not lg.wandb_project:
        errors.append("--wandb-entity / --wandb-save-dir / --wandb-exp-name need --wandb-project NAME.")
    errors += _method_errors(cfg)
    if errors:
        _raise_config_errors(errors)


def _lr_schedule_errors(cfg: MegacoatConfig) -> list:
    """Learning rates and warmup against decay. Megatron asserts warmup < decay; a decay span left at its
    default (the whole run) is not held to it: a run shorter than its warmup just never finishes warming up."""
    o, t, errors = cfg.optim, cfg.train, []
    if o.min_lr > o.lr:
        errors.append(f"--min-lr {o.min_lr} is larger than --lr {o.lr}.")
    if o.lr_decay_style == "constant" or o.lr_warmup_fraction is not None:
        return errors  # no decay span, or warmup defined as a share of it
    if t.train_samples is None:
        if o.lr_decay_iters not in (None, t.train_iters) and o.lr_warmup_iters >= o.lr_decay_iters:
            errors.append(f"--lr-warmup-iters {o.lr_warmup_iters} must be below --lr-decay-iters "
                          f"{o.lr_decay_iters} (warmup is part of the decay span).")
    elif o.lr_warmup_samples is not None and o.lr_decay_samples not in (None, t.train_samples) and \
            o.lr_warmup_samples >= o.lr_decay_samples:
        errors.append(f"--lr-warmup-samples {o.lr_warmup_samples} must be below --lr-decay-samples "
                      f"{o.lr_decay_samples} (warmup is part of the decay span).")
    return errors


def _train_data_errors(d: DataConfig) -> list:
    """Training data that is empty by the flags alone (the data files are checked when the datasets are built);
    resolves --split."""
    if d.train_data_path or d.valid_data_path or d.test_data_path:
        errors = []
        if not d.train_data_path:
            errors.append("--valid-data-path / --test-data-path need --train-data-path (the training data).")
        if d.split is not None:  # Megatron: "split and blend_per_split are incompatible"
            errors.append(f"--split {d.split} divides the documents of --data-path; --train-data-path / "
                          "--valid-data-path / --test-data-path give each split its own data: drop --split.")
        return errors
    if d.split is None:
        d.split = DEFAULT_SPLIT
    if d.mock_data:
        return []
    if split_fractions(d.split)[0] == 0:
        source = f"--data-path {' '.join(d.data_path)}" if d.data_path else "the default corpus"
        return [f"--split {d.split} leaves no documents of {source} for training: give the train split a "
                "positive share, e.g. --split 969,30,1."]
    return []


def _method_errors(cfg: MegacoatConfig) -> list:
    """COAT (FP8 compute, FP8 optimizer states) and SDP4Bit (quantized communication) flags."""
    errors = []
    o, pr, c, p = cfg.optim, cfg.precision, cfg.comm, cfg.parallel
    if pr.fp8_format is not None and cfg.train.fp32:
        errors.append("--fp8-format needs bf16 parameters: drop --fp32 (or use --bf16).")
    if not 1 <= pr.fp8_gemm_candidates <= 32:
        errors.append(f"--fp8-gemm-candidates {pr.fp8_gemm_candidates}: give 1 (cuBLASLt's heuristic choice) to 32.")
    if pr.fp8_format is None and pr.fp8_weight_cache != "auto":
        errors.append("--fp8-weight-cache needs --fp8-format (it chooses how FP8 weight copies are kept).")
    if not o.use_precision_aware_optimizer and (o.exp_avg_dtype != "fp32" or o.exp_avg_sq_dtype != "fp32"):
        errors.append("--exp-avg-dtype / --exp-avg-sq-dtype need --use-precision-aware-optimizer.")
    zero_flags = [f for f, on in (("--quantized-weights", c.quantized_weights),
                                  ("--quantized-gradients", c.quantized_gradients)) if on]
    if zero_flags and not p.use_distributed_optimizer:
        errors.append(f"{' and '.join(zero_flags)} need{'s' if len(zero_flags) == 1 else ''} "
                      "--use-distributed-optimizer (SDP4Bit compresses the ZeRO "
                      "optimizer's collectives).")
    if c.quantize_weights_directly and not c.quantized_weights:
        errors.append("--quantize-weights-directly is an ablation of --quantized-weights: add that flag.")
    if c.hadamard_transform and not c.quantized_gradients:
        errors.append("--hadamard-transform needs --quantized-gradients.")
    for name in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter"):
        g = getattr(c, name)
        if g < 32 or g & (g - 1) or g > 2048:
            errors.append(f"{_flag(name)} {g} must be a power of two in [32, 2048].")
    return errors


def rampup_batch_sizes(cfg: MegacoatConfig) -> Optional[tuple]:
    """(start, increment, ramp samples) of --rampup-batch-size, or None."""
    r = cfg.train.rampup_batch_size
    if not r:
        return None
    try:
        start, inc, samples = (int(v) for v in r)
    except ValueError as e:
        raise ConfigError(f"--rampup-batch-size takes three integers START INCREMENT SAMPLES, got {' '.join(r)}") from e
    return start, inc, samples


def global_batch_size_at(cfg: MegacoatConfig, consumed_samples: int) -> int:
    """The global batch of the step that starts after `consumed_samples` (Megatron's ramp: START
    growing by INCREMENT every SAMPLES / ((GBS - START) / INCREMENT) samples, up to GBS)."""
    ramp = rampup_batch_sizes(cfg)
    gbs = cfg.train.global_batch_size
    if ramp is None or consumed_samples >= ramp[2]:
        return gbs
    start, inc, samples = ramp
    per_increment = samples / ((gbs - start) // inc)
    return min(gbs, start + int(consumed_samples // per_increment) * inc)


def steps_within_train_samples(cfg: MegacoatConfig, consumed_samples: int) -> int:
    """Whole steps (each of global_batch_size_at) that fit between `consumed_samples` and --train-samples."""
    steps, consumed = 0, consumed_samples
    while True:
        gbs = global_batch_size_at(cfg, consumed)
        if consumed + gbs > cfg.train.train_samples:
            return steps
        consumed += gbs
        steps += 1


def _sample_schedule_errors(cfg: MegacoatConfig, dp: int) -> list:
    """--train-samples (with --lr-warmup-samples / --lr-decay-samples / --rampup-batch-size) and
    --lr-warmup-fraction; resolves --train-iters (from --train-samples, else its default) and --lr-warmup-iters.
    As in Megatron, a run counts its schedule in one unit: flags of the other unit are refused, not ignored."""
    t, o, errors = cfg.train, cfg.optim, []
    if o.lr_warmup_fraction is not None and o.lr_warmup_samples is not None:
        errors.append("--lr-warmup-fraction and --lr-warmup-samples conflict: pick one.")
    if o.lr_warmup_fraction is not None and o.lr_warmup_iters:
        errors.append("--lr-warmup-fraction and --lr-warmup-iters conflict: pick one (the fraction is of the decay "
                      "span).")
    if t.train_samples is None:
        named = [f for f, v in (("--lr-warmup-samples", o.lr_warmup_samples), ("--lr-decay-samples", o.lr_decay_samples),
                                ("--rampup-batch-size", t.rampup_batch_size)) if v]
        if named:
            errors.append(f"{' / '.join(named)} need{'s' if len(named) == 1 else ''} --train-samples (the schedule "
                          "counts samples then).")
        if t.train_iters is None:
            t.train_iters = DEFAULT_TRAIN_ITERS
        if o.lr_warmup_iters is None:
            o.lr_warmup_iters = 0 if o.lr_warmup_fraction is not None else DEFAULT_WARMUP_ITERS
        return errors
    named = [f for f, v in (("--lr-warmup-iters", o.lr_warmup_iters), ("--lr-decay-iters", o.lr_decay_iters)) if v]
    if named:
        errors.append(f"{' / '.join(named)} count{'s' if len(named) == 1 else ''} iterations, but --train-samples "
                      "counts this run's schedule in samples: use --lr-warmup-samples / --lr-decay-samples (or "
                      "--lr-warmup-fraction) instead.")
    if o.lr_warmup_iters is None:
        o.lr_warmup_iters = 0
    unit = t.micro_batch_size * dp
    try:
        ramp = rampup_batch_sizes(cfg)
    except ConfigError as e:
        return errors + [str(e)]
    if ramp is not None:
        start, inc, samples = ramp
        if start < 1 or inc < 1 or samples < 0 or start > t.global_batch_size or \
                (t.global_batch_size - start) % inc:
            return errors + [f"--rampup-batch-size {start} {inc} {samples}: START and INCREMENT must be >= 1 and "
                             f"(--global-batch-size {t.global_batch_size} - START) a multiple of INCREMENT."]
        if start % unit or inc % unit:
            return errors + [f"--rampup-batch-size {start} {inc} {samples}: START and INCREMENT must be multiples of "
                             f"--micro-batch-size x DP = {unit}."]
        pp = cfg.parallel.pipeline_model_parallel_size
        if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None and pp > 1 and \
                ((start // unit) % pp or (inc // unit) % pp):
            return errors + [f"--rampup-batch-size {start} {inc} {samples} with the interleaved schedule: every "
                             f"step's micro-batches must be a multiple of --pipeline-model-parallel-size {pp}, so "
                             f"START and INCREMENT must be multiples of {unit * pp}."]
    iters = steps_within_train_samples(cfg, 0)
    if iters < 1:
        return errors + [f"--train-samples {t.train_samples} is less than one global batch."]
    if t.train_iters not in (None, iters):  # (validating twice finds the number it set)
        return errors + [f"--train-iters {t.train_iters} and --train-samples {t.train_samples} ({iters} steps of "
                         f"--global-batch-size {t.global_batch_size}) disagree: give only one of them."]
    t.train_iters = iters
    if o.lr_decay_samples is None:
        o.lr_decay_samples = t.train_samples
    return errors


def _pipeline_errors(num_layers: int, pp: int, p: ParallelConfig, num_micro: int) -> list:
    """Layer split over pipeline stages (even, uneven first/last, interleaved virtual stages)."""
    errors = []
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    vp_layers = p.num_layers_per_virtual_pipeline_stage
    if pp == 1:
        if first is not None or last is not None or vp_layers is not None:
            errors.append("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers / "
                          "--num-layers-per-virtual-pipeline-stage need --pipeline-model-parallel-size > 1.")
        return errors
    if vp_layers is not None:
        if first is not None or last is not None:
            errors.append("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                          "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
        elif num_layers % (pp * vp_layers):
            errors.append(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                          f"--num-layers-per-virtual-pipeline-stage {vp_layers}: each PP rank must hold a whole "
                          "number of model chunks.")
        elif num_layers // (pp * vp_layers) > 1 and num_micro % pp:
            errors.append(f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage {vp_layers}) needs the "
                          f"number of micro-batches per step ({num_micro} = --global-batch-size / (--micro-batch-size "
                          f"x DP)) to be a multiple of --pipeline-model-parallel-size {pp}.")
        return errors
    if first is None and last is None:
        if num_layers % pp:
            errors.append(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; use "
                          "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers for an uneven split.")
        return errors
    given = [(f, n) for f, n in (("--decoder-first-pipeline-num-layers", first),
                                 ("--decoder-last-pipeline-num-layers", last)) if n is not None]
    rest, middle = num_layers - sum(n for _, n in given), pp - len(given)
    names = " + ".join(f"{f} {n}" for f, n in given)
    if middle == 0 and rest != 0:
        errors.append(f"{names} = {num_layers - rest} layers, but --num-layers is {num_layers} "
                      f"(with --pipeline-model-parallel-size {pp} these stages hold every layer).")
    elif middle > 0 and (rest < middle or rest % middle):
        errors.append(f"{names} leave {rest} of --num-layers {num_layers} for the other {middle} pipeline stage(s): "
                      "that must be a positive multiple of their number.")
    return errors


def num_microbatches(cfg: MegacoatConfig, dp: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
