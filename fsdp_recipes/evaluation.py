"""The held-out split, divided among the ranks for evaluation: nothing dropped, nothing counted twice, and every
rank running the same number of forward passes (FSDP's collectives need every rank in each one)."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .data import collate
from .data_formats import IGNORE_INDEX


def eval_batches(dataset, batch_size: int, pad_token_id: int, rank: int, world_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches: examples rank, rank + world_size, ... in batches of batch_size.

    A rank with fewer examples than the others ends with batches of one fully masked padding token: they run a
    forward pass, so every rank takes part in the same number, and carry no loss.
    """
    rows = range(rank, len(dataset), world_size)
    batches_per_rank = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)
    dummy = {"input_ids": [pad_token_id], "labels": [IGNORE_INDEX]}
    for i in range(batches_per_rank):
        examples = [dataset[j] for j in rows[i * batch_size:(i + 1) * batch_size]]
        yield collate(examples or [dummy], pad_token_id)


def perplexity(loss: float) -> float:
    """exp(loss), inf past float64's range (a loss above 709) and NaN for a NaN loss."""
    return math.exp(loss) if loss < 709 else (math.nan if math.isnan(loss) else math.inf)
