"""The fp32 AdamW state codec: torch's AdamW (fused on GPU) over fp32 master tensors.

Shared by the non-sharded and the ZeRO optimizer. On GPU the clip factor and the
non-finite skip go to the fused kernel as `grad_scale` / `found_inf`, so the host never waits
for the gradient norm; on CPU the norm is read and the step skipped on the host.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch
from torch import nn

from ..config import OptimizerConfig
from .clip import clip_coefficient


def param_groups(params: List[nn.Parameter], no_decay: List[bool], weight_decay: float):
    """Megatron's rule: no weight decay on biases and norm weights (given per tensor)."""
    decay = [p for p, nd in zip(params, no_decay) if not nd]
    plain = [p for p, nd in zip(params, no_decay) if nd]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": plain, "weight_decay": 0.0}) if g["params"]]


class Fp32AdamW:
    """AdamW with fp32 moments on a list of fp32 master tensors (any views of larger buffers)."""

    name = "fp32"
    bytes_per_element = 8  # two fp32 moments

    def __init__(self, masters: List[nn.Parameter], no_decay: List[bool], cfg: OptimizerConfig, fused: bool):
        self.cfg, self.fused, self.masters = cfg, fused, masters
        self.opt = torch.optim.AdamW(param_groups(masters, no_decay, cfg.weight_decay), lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                     **({"fused": True} if fused else {"foreach": True}))
        self.opt.grad_scale = None  # read by torch's fused AdamW (see step)
        self.opt.found_inf = None
        for m in masters:  # torch creates state lazily; create it now so checkpoints can address it
            self.opt.state[m] = {
                "step": torch.zeros((), dtype=torch.float32, device=m.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(m),
                "exp_avg_sq": torch.zeros_like(m),
            }

    def step(self, lr: float, norm: torch.Tensor, scale_grads: Callable[[float], None]) -> torch.Tensor:
        """One AdamW step on the masters, whose `.grad` are set. Returns success (bool tensor)."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.fused:
            found_inf = (~torch.isfinite(norm)).float()
            self.opt.grad_scale = None
            if self.cfg.clip_grad > 0:
                # 1 / Megatron's clip coefficient max_norm / (norm + 1e-6), applied only when < 1.
                scale = torch.clamp((norm + 1e-6) / self.cfg.clip_grad, min=1.0)
                self.opt.grad_scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0)
            self.opt.found_inf = found_inf  # 1: parameters, moments and step count stay untouched
            self.opt.step()
            return found_inf == 0
        value = norm.item()
        if not math.isfinite(value):
            return torch.tensor(False)
        coeff = clip_coefficient(value, self.cfg.clip_grad)
        if coeff < 1.0:
            scale_grads(coeff)
        self.opt.step()
        return torch.tensor(True)

    def state_views(self, i: int) -> Dict[str, torch.Tensor]:
        st = self.opt.state[self.masters[i]]
        return {"exp_avg": st["exp_avg"].view(-1), "exp_avg_sq": st["exp_avg_sq"].view(-1)}

    def scalar_state(self) -> dict:
        steps = {float(self.opt.state[m]["step"]) for m in self.masters}
        if len(steps) > 1:
            raise RuntimeError(f"Adam step counts differ across tensors: {sorted(steps)}")
        return {"adam_step": steps.pop() if steps else 0.0}

    def load_scalar_state(self, d: dict) -> None:
        for m in self.masters:
            self.opt.state[m]["step"].fill_(d["adam_step"])
