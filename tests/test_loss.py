"""Token-weighted loss: one optimizer step has the same gradient however its global batch is split.

The loss of a step is the sum of per-token losses over all micro-batches and all ranks, divided by the number of
label tokens in the whole step (see tests/drivers/loss_grads.py for the cases).
"""

import json

import torch

from fsdp_recipes.data import IGNORE_INDEX
from fsdp_recipes.trainer import token_loss_sum

from conftest import torchrun


def test_token_loss_sum_is_the_sum_of_next_token_cross_entropies():
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[3, IGNORE_INDEX, 2, 5]])  # position 0 is never predicted; 1 is masked
    log_probs = logits.log_softmax(-1)
    expected = -(log_probs[0, 1, 2] + log_probs[0, 2, 5])
    assert abs(token_loss_sum(logits, labels) - expected) < 1e-6


def test_gradients_equal_across_accumulation_ranks_and_packing(tiny, tmp_path):
    out = tmp_path / "grads.json"
    torchrun("tests/drivers/loss_grads.py", out, "--model_name_or_path", tiny["model"])
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert result["label_tokens"] == 87 and result["packed_rows"] < 8
    for case in ["accumulation_2", "accumulation_4", "packed", "ranks_2_accumulation_1", "ranks_2_accumulation_2"]:
        assert result[case] < 1e-6, case  # largest absolute deviation of any gradient entry from 1 x 8 on 1 rank
    for case in ["ranks_2_accumulation_1_loss", "ranks_2_accumulation_2_loss"]:
        assert result[case] < 1e-6, case
    # Averaging per micro-batch instead is off by far more than the tolerance: the comparison can fail.
    assert result["per_micro_batch_mean"] > 1e-3
    assert result["grad_scale"] > 1e-2
