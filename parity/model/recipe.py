"""The training recipe both sides share: the optimizer. The sharded run and the reference
build it from here, so the reference needs nothing from the worker modules."""

from __future__ import annotations

import torch

LR, WEIGHT_DECAY = 1e-2, 0.1


def make_optimizer(params) -> torch.optim.Optimizer:
    """FP32 AdamW with non-zero weight decay."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
