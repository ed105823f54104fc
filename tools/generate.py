#!/usr/bin/env python
"""Sample text from a megacoat checkpoint with its own tokenizer (a quick sanity check).

    python tools/generate.py --load ckpt --prompt "def fibonacci(n):" --max-new-tokens 64
    python tools/generate.py --load ckpt --prompt "import os" --greedy
    python tools/generate.py --load ckpt --prompt "class" --temperature 0.8 --top-k 50 --top-p 0.95

No KV cache: each new token re-runs the (truncated) context; fine for a sanity check.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
                generator: torch.Generator) -> int:
    """logits [vocab] -> one token id (greedy, or temperature + top-k + nucleus sampling)."""
    if greedy or temperature == 0:
        return int(logits.argmax())
    # The likeliest at 0 before scaling: however small the temperature, no inf - inf (NaN) in the softmax;
    # float64 keeps a temperature below float32's range from rounding to 0.
    logits = (logits.double() - logits.max()) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model, ids, max_new_tokens, context, stop_id=None, vocab_size=None, **sampling):
    """Samples only ids below `vocab_size` (the tokenizer's): an embedding with more rows than the tokenizer has
    ids (padding, a smaller tokenizer passed by flag) would otherwise give ids the tokenizer cannot decode."""
    ids = list(ids)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        nxt = sample_next(model(x)[0, -1, :vocab_size], **sampling)
        ids.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return ids


def check_sampling_flags(a) -> None:
    if a.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens} is negative; give the number of tokens to add")
    if not math.isfinite(a.temperature):
        raise ValueError(f"--temperature {a.temperature} is not a number; give one > 0 (or --greedy)")
    if a.temperature < 0:
        raise ValueError(f"--temperature {a.temperature} is negative; give one > 0 (0 or --greedy: the likeliest "
                         "token)")
    if not 0 < a.top_p <= 1:
        raise ValueError(f"--top-p {a.top_p} is outside (0, 1]; 1 keeps every token (use --greedy for the likeliest)")
    if a.top_k < 0:
        raise ValueError(f"--top-k {a.top_k} is negative; 0 keeps every token")


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device torch knows; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices; use cuda:0 .. "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return device


def tokenize_prompt(tokenizer, text: str, vocab_size: int):
    """The prompt's ids (the end-of-document id for an empty prompt), each one the model has an embedding for."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes of another encoding reach sys.argv as lone surrogates
        raise ValueError(f"--prompt is not UTF-8 text (bytes {os.fsencode(text[e.start:e.end])!r} at character "
                         f"{e.start}); give the prompt in UTF-8") from None
    try:
        ids = tokenizer.tokenize(text) if text else []
    except ValueError as e:  # NullTokenizer: text that is not ids
        raise ValueError(f"--prompt {text!r} cannot be tokenized by the checkpoint's {type(tokenizer).__name__} "
                         f"({e}); a NullTokenizer takes token ids separated by spaces") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt holds token id {bad[0]}, outside the model's vocabulary (ids 0..{vocab_size - 1})")
    return ids or [tokenizer.eod]  # no prompt: start from a document boundary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megacoat --save directory or one iter_* directory")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0, help="0: the likeliest token, as --greedy.")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="Default: the saved weights' dtype.")
    g = p.add_argument_group("tokenizer (default: the copy saved in the checkpoint)")
    g.add_argument("--tokenizer-type", default=None, help="e.g. HuggingFaceTokenizer, GPT2BPETokenizer")
    g.add_argument("--tokenizer-model", default=None, help="HF tokenizer.json directory or SentencePiece .model")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, eod N")
    a = p.parse_args(argv)
    import megacoat
    from megacoat.checkpoint import CheckpointError
    from megacoat.checkpoint.model_io import load_tokenizer
    try:
        check_sampling_flags(a)
        from megacoat.data.tokenizer import build_tokenizer_by_type, check_vocab_size, unused_tokenizer_flags
        stray = unused_tokenizer_flags(a.tokenizer_type, tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
                                       merge_file=a.merge_file, vocab_size=a.vocab_size)
        if stray and not a.tokenizer_type:  # the checkpoint's own tokenizer would be used, these flags ignored
            raise ValueError(f"{', '.join(stray)} without --tokenizer-type would be ignored (the checkpoint's "
                             "tokenizer is used); add --tokenizer-type, or leave them out")
        if stray:
            raise ValueError(f"{', '.join(stray)} would be ignored by --tokenizer-type {a.tokenizer_type}: leave "
                             "them out, or choose the tokenizer type that reads them")
        device = check_device(a.device)
        model = megacoat.load_model(a.load, device=device, dtype=a.dtype)
        if a.tokenizer_type:
            tokenizer = build_tokenizer_by_type(a.tokenizer_type, a.tokenizer_model, a.vocab_size, a.vocab_file,
                                                a.merge_file)
            check_vocab_size(tokenizer.vocab_size, model.vocab_size)
        else:
            tokenizer = load_tokenizer(a.load)
            try:  # a checkpoint without a tokenizer copy names one by its saved flags: it may not be this model's
                check_vocab_size(tokenizer.vocab_size, model.vocab_size)
            except ValueError as e:
                raise ValueError(f"{e}. The checkpoint's tokenizer does not fit its model: pass the --tokenizer-* "
                                 "flags the data was made with") from None
        prompt = tokenize_prompt(tokenizer, a.prompt, model.vocab_size)
    except (CheckpointError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    ids = generate(model, prompt, a.max_new_tokens, model.m.max_position_embeddings, stop_id=tokenizer.eod,
                   vocab_size=tokenizer.vocab_size, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                   greedy=a.greedy, generator=g)
    print(tokenizer.detokenize([i for i in ids if i != tokenizer.eod]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
