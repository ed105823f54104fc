"""Samples -> the micro-batch dict the model consumes (Megatron's get_ltor_masks_and_position_ids)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class BatchBuilder:
    """Picklable collate function for DataLoader workers."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def __call__(self, samples: List[np.ndarray]) -> Dict[str, Optional[torch.Tensor]]:
        data = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))
        tokens = data[:, :-1].contiguous()
        labels = data[:, 1:].contiguous()
        b, s = tokens.shape
        is_eod = tokens == self.eod
        loss_mask = torch.ones((b, s), dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)
        attention_mask = None
        if self.reset_position_ids or self.reset_attention_mask:
            # Position t belongs to the document counted by the eods strictly before t:
            # the eod token itself is the last token of its document.
            doc = torch.cumsum(is_eod.to(torch.int64), dim=1) - is_eod.to(torch.int64)
            if self.reset_position_ids:
                pos = torch.arange(s, dtype=torch.int64).expand(b, s)
                starts = torch.where(torch.cat([torch.ones(b, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1),
                                     pos, torch.zeros_like(pos))
                position_ids = pos - torch.cummax(starts, dim=1).values
            if self.reset_attention_mask:
                causal = torch.ones((s, s), dtype=torch.bool).tril()
                same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
                attention_mask = (same_doc & causal).unsqueeze(1)  # True = may attend
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": position_ids.contiguous(), "attention_mask": attention_mask}
