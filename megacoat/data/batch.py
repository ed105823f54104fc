"""Samples -> the micro-batch dict the model consumes (Megatron's get_ltor_masks_and_position_ids).

DataLoader workers only read and stack samples (stack_samples): one numpy array per
micro-batch crosses the process boundary, which is far cheaper than several tensors in
shared memory. BatchBuilder then runs in the training process.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch


def stack_samples(samples: Sequence[np.ndarray]) -> np.ndarray:
    """DataLoader collate_fn: [b, seq_length + 1] int64."""
    return np.stack(samples).astype(np.int64, copy=False)


class BatchBuilder:
    def __init__(self, eod: int, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, vocab_size: Optional[int] = None):
        """`vocab_size`: refuse token ids at or above it (data made with another tokenizer)."""
        self.eod = eod
        self.vocab_size = vocab_size
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask

    def __call__(self, samples: Union[np.ndarray, List[np.ndarray]]) -> Dict[str, Optional[torch.Tensor]]:
        data = samples if isinstance(samples, np.ndarray) else stack_samples(samples)
        data = torch.from_numpy(np.ascontiguousarray(data, dtype=np.int64))
        if self.vocab_size is not None:
            self._check_ids(data)
        tokens = data[:, :-1].contiguous()
        labels = data[:, 1:].contiguous()
        b, s = tokens.shape
        is_eod = tokens == self.eod
        loss_mask = torch.ones((b, s), dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        position_ids = torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s)
        if self.reset_position_ids:
            position_ids = self._positions_within_documents(is_eod)
        document_ids = self._document_ids(is_eod) if self.reset_attention_mask else None
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": position_ids.contiguous(), "document_ids": document_ids}

    def _check_ids(self, data: torch.Tensor) -> None:
        # The datasets' first samples are checked when they are built; a rare id of another tokenizer further on
        # would otherwise stop training in the embedding or the loss with an IndexError traceback.
        low, top = (int(v) for v in torch.aminmax(data))  # one pass over the batch
        if top >= self.vocab_size or low < 0:
            from megacoat.data.dataset_builder import DataConfigError

            bad = top if top >= self.vocab_size else low
            raise DataConfigError(
                f"a micro-batch holds token id {bad} but the tokenizer has {self.vocab_size} ids; the data was made "
                "with another tokenizer: pass the --tokenizer-type/--tokenizer-model (or --vocab-size) used by "
                "tools/preprocess_data.py")

    @staticmethod
    def _positions_within_documents(is_eod: torch.Tensor) -> torch.Tensor:
        # A document starts at 0 and after every eod (the eod is the last token of its document).
        b, s = is_eod.shape
        pos = torch.arange(s, dtype=torch.int64).expand(b, s)
        starts_here = torch.zeros((b, s), dtype=torch.bool)
        starts_here[:, 1:] = is_eod[:, :-1]
        start = torch.where(starts_here, pos, torch.zeros_like(pos))
        return pos - torch.cummax(start, dim=1).values

    @staticmethod
    def _document_ids(is_eod: torch.Tensor) -> torch.Tensor:
        """[b, s] int32 index of each token's document within its sample (the eod ends its document).

        Shipped instead of the [b, 1, s, s] mask (4 MiB per sample at s = 2048); the trainer turns
        it into the block-causal mask on the compute device (megacoat.model.masks).
        """
        starts_here = torch.zeros_like(is_eod)
        starts_here[:, 1:] = is_eod[:, :-1]
        return torch.cumsum(starts_here, dim=1, dtype=torch.int32)
