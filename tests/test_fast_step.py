"""The fast training step: the recipe's AdamW, torch.compile'd decoder layers and data-loader workers give the
numbers of the plain step."""

import itertools
import json

import datasets
import pytest
import torch
from conftest import torchrun

from fsdp_recipes import demo
from fsdp_recipes.config import ConfigError, TrainConfig, parse_config
from fsdp_recipes.data import build_dataloader, optimizer_step_batches
from fsdp_recipes.plan import resolve_plan


def test_recipe_adamw_and_compiled_layers_match_the_plain_step(tiny, tmp_path):
    out = tmp_path / "fast_step.json"
    torchrun("tests/drivers/fast_step.py", out, "--model_name_or_path", tiny["model"])
    result = json.loads(out.read_text())
    assert result["fused"] is True
    # The recipe's AdamW against the single-tensor reference, after 3 steps on 2 ranks.
    assert result["fused_state_deviation"] < 1e-6
    assert max(abs(a - b) for a, b in zip(result["fused_losses"], result["reference_losses"])) < 1e-6
    # Compiled layers (inductor fuses element-wise ops, so rounding differs a little: measured 8.9e-6).
    assert result["eager"] == {"compiled_layers": 0, "graphs": 0, "plan_says_compiled": False}
    compiled = result["compiled"]
    # "All layers share one graph": with the KV cache left on in training, each layer compiled a graph of its own.
    assert compiled["compiled_layers"] == 2 and compiled["graphs"] == 1 and compiled["plan_says_compiled"]
    assert result["compiled_state_deviation"] < 2e-5
    assert max(abs(a - b) for a, b in zip(result["compiled_losses"], result["reference_losses"])) < 2e-5
    assert result["reference_losses"][2] < result["reference_losses"][0]  # the steps train: the check has teeth


def test_dataloader_workers_give_the_batches_of_the_main_process():
    tokenizer = demo.build_tokenizer()
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in range(3, 35)]
    dataset = datasets.Dataset.from_list(rows)
    loaders = [build_dataloader(dataset, TrainConfig(model_name_or_path="m", dataset_name="d", dataloader_num_workers=n,
                                                     per_device_train_batch_size=4), tokenizer, rank=1, world_size=2,
                                pin_memory=False)
               for n in (0, 2)]
    assert loaders[1].num_workers == 2 and loaders[1].persistent_workers
    for epoch in (0, 1):  # the sampler's epoch reaches the persistent workers' order
        batches = []
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
            batches.append(list(loader))
        assert len(batches[0]) == 4
        for a, b in zip(*batches):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_torch_compile_needs_fsdp2():
    with pytest.raises(ConfigError, match="torch_compile needs fsdp_version 2"):
        resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--torch_compile", "true",
                                   "--fsdp_version", "1"]))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_data_stream_leaves_the_global_rng_to_the_model(workers):
    # Dropout draws from the global RNG: the data stream must not, or the training would depend on
    # dataloader_num_workers and on the step a resumed run starts from.
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in range(3, 35)]
    cfg = TrainConfig(model_name_or_path="m", dataset_name="d", dataloader_num_workers=workers,
                      per_device_train_batch_size=4)
    loader = build_dataloader(datasets.Dataset.from_list(rows), cfg, demo.build_tokenizer(), rank=0, world_size=2,
                              pin_memory=False)
    for start_step in (0, 1, 3):  # 2 steps an epoch: three epoch starts, in and after the first
        torch.manual_seed(0)
        expected = torch.rand(3)
        torch.manual_seed(0)
        list(itertools.islice(optimizer_step_batches(loader, accumulation=2, start_step=start_step), 6))
        assert torch.equal(torch.rand(3), expected)
