"""The run's length in optimizer steps, from its config and its training data."""

from __future__ import annotations

import math

from .config import ConfigError, TrainConfig
from .distributed import on_each_rank


def count_total_steps(cfg: TrainConfig, dataset, world_size: int) -> int:
    """The run's optimizer steps: max_steps, or num_train_epochs times the steps one epoch of `dataset` gives."""
    if len(dataset) < world_size * cfg.per_device_train_batch_size:
        raise ConfigError(f"{len(dataset)} examples cannot fill one batch of {cfg.per_device_train_batch_size} "
                          f"{on_each_rank(world_size)}: lower per_device_train_batch_size or add data")
    # The micro-batches build_dataloader gives each rank: its DistributedSampler and DataLoader both drop_last.
    micro_batches_per_epoch = len(dataset) // world_size // cfg.per_device_train_batch_size
    steps_per_epoch = micro_batches_per_epoch // cfg.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"one epoch gives each rank {micro_batches_per_epoch} micro-batches, fewer than "
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}: lower it or add data"
        )
    if cfg.max_steps > 0:
        return cfg.max_steps
    # Rounded first: 1.1 epochs of 100 steps is 110.00000000000001 in floats, which ceil would make 111.
    total_steps = math.ceil(round(cfg.num_train_epochs * steps_per_epoch, 6))
    if total_steps == 0:  # a run that would export the model untouched
        raise ConfigError(f"num_train_epochs {cfg.num_train_epochs} of {steps_per_epoch} steps an epoch is no "
                          f"optimizer step: raise num_train_epochs, or set max_steps")
    return total_steps


def check_run_length(cfg: TrainConfig, dataset, world_size: int) -> None:
    """The run length's and the warm-up's errors, raised before the model loads rather than once training starts."""
    cfg.num_warmup_steps(count_total_steps(cfg, dataset, world_size))


def describe_schedule(cfg: TrainConfig, total_steps: int, warmup_steps: int, steps_per_epoch: int, num_sequences: int,
                      world_size: int) -> str:
    """The line that opens training: its steps and batches, and the sequences an epoch leaves out (those that do not
    fill a global batch; the sampler reshuffles, so others each epoch)."""
    global_batch = world_size * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    left_out = num_sequences - steps_per_epoch * global_batch
    one = left_out == 1  # 'the 1 that does not fill a global batch of 8 is left out'
    return (f"training: {total_steps} steps ({warmup_steps} of warm-up) of {cfg.gradient_accumulation_steps} "
            f"x {cfg.per_device_train_batch_size} sequences {on_each_rank(world_size)}"
            + (f"; an epoch trains {num_sequences - left_out} of its {num_sequences} sequences (the "
               f"{left_out} that {'does' if one else 'do'} not fill a global batch of {global_batch} "
               f"{'is' if one else 'are'} left out, others each epoch)"
               if left_out else ""))
