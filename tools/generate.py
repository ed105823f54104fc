#!/usr/bin/env python
"""Sample text from a megacoat checkpoint with its own tokenizer (a quick sanity check).

    python tools/generate.py --load ckpt --prompt "def fibonacci(n):" --max-new-tokens 64
    python tools/generate.py --load ckpt --prompt "import os" --greedy
    python tools/generate.py --load ckpt --prompt "class" --temperature 0.8 --top-k 50 --top-p 0.95

No KV cache: each new token re-runs the (truncated) context; fine for a sanity check.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
                generator: torch.Generator) -> int:
    """logits [vocab] -> one token id (greedy, or temperature + top-k + nucleus sampling)."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
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
def generate(model, ids, max_new_tokens, context, stop_id=None, **sampling):
    ids = list(ids)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        nxt = sample_next(model(x)[0, -1], **sampling)
        ids.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megacoat --save directory or one iter_* directory")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
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
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(a.dtype)
        model = megacoat.load_model(a.load, device=a.device, dtype=dtype)
        from megacoat.data.tokenizer import build_tokenizer_by_type, check_vocab_size
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
    except (CheckpointError, ValueError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.tokenize(a.prompt) if a.prompt else []
    if not prompt:
        prompt = [tokenizer.eod]  # start from a document boundary
    g = torch.Generator().manual_seed(a.seed)
    ids = generate(model, prompt, a.max_new_tokens, model.m.max_position_embeddings, stop_id=tokenizer.eod,
                   temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, greedy=a.greedy, generator=g)
    print(tokenizer.detokenize([i for i in ids if i != tokenizer.eod]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
