"""Attention masks built on the compute device from compact per-token document ids."""
import torch


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, 1, s, s] bool, True = may attend: causal and within one document.

    The data pipeline ships only the ids (s numbers per sample instead of s*s mask entries);
    the mask is made where attention runs, which costs microseconds on a GPU.
    """
    s = document_ids.shape[1]
    same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril_()
    return (same_doc & causal).unsqueeze(1)
