"""The training loop: token-weighted loss over accumulation and ranks, clipping, AdamW, metrics."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import get_scheduler

from .checkpoint import load_checkpoint, resolve_state_dict_type, save_checkpoint
from .config import ConfigError, TrainConfig
from .data import IGNORE_INDEX, build_dataloader, model_inputs, optimizer_step_batches
from .distributed import DistEnv, print_rank0
from .metrics import MetricsLogger
from .sharding import gradient_sync, original_ndims


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (the 1-D parameters) get no weight decay.

    The fused implementation (one kernel per step for all parameters, DTensor shards included) on CUDA and CPU;
    the foreach one (a few kernels per parameter group) on any other device.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    ndims = original_ndims(model)
    groups = [
        {"params": [p for p in params if ndims[id(p)] >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if ndims[id(p)] < 2], "weight_decay": 0.0},
    ]
    # torch's set_optimizer_state_dict gives an empty group the hyperparameters of another group, which then has none.
    groups = [g for g in groups if g["params"]]
    fused = all(p.device.type in ("cuda", "cpu") for p in params)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             fused=fused, foreach=None if fused else True)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the label tokens, in fp32."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def step_token_counts(micro_batches: list[dict], device: torch.device) -> tuple[float, float, float]:
    """(label tokens, real input tokens, all token slots incl. padding) of the step, summed over all ranks.

    Counted on the host before any compute: one all-reduce per step, no device sync inside the loop.
    """
    counts = torch.tensor(
        [sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches),
         sum(int(mb["attention_mask"].sum()) for mb in micro_batches),
         sum(mb["attention_mask"].numel() for mb in micro_batches)],
        dtype=torch.float64, device=device,
    )
    dist.all_reduce(counts)
    return tuple(counts.tolist())


def forward_backward(model: nn.Module, micro_batches: list[dict], label_tokens: float, world_size: int,
                     device: torch.device, sync_every_micro_batch: bool = True) -> torch.Tensor:
    """Accumulate the gradient of (sum of per-token losses of the step) / label_tokens; return this rank's sum.

    label_tokens counts the whole step on all ranks. FSDP averages gradients over ranks, so each rank scales by
    world_size to turn that average back into the global sum. Without sync_every_micro_batch, gradients are
    reduced after the last micro-batch only.
    """
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        with gradient_sync(model, sync_every_micro_batch or i == len(micro_batches) - 1):
            mb_loss_sum = token_loss_sum(model(**model_inputs(mb)).logits, mb["labels"])
            (mb_loss_sum * (world_size / label_tokens)).backward()
        loss_sum += mb_loss_sum.detach()
    return loss_sum


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks' shards (the same value on every rank), clipped when max_norm > 0."""
    max_norm = max_norm if max_norm > 0 else math.inf
    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm)  # FSDP1's shards are plain tensors: it reduces the norm itself
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def count_total_steps(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    steps_per_epoch = micro_batches_per_epoch // cfg.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"one epoch gives each rank {micro_batches_per_epoch} micro-batches, fewer than "
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}: lower it or add data"
        )
    if cfg.max_steps > 0:
        return cfg.max_steps
    return math.ceil(cfg.num_train_epochs * steps_per_epoch)


def train(cfg: TrainConfig, env: DistEnv, model: nn.Module, tokenizer, train_dataset, logger: MetricsLogger,
          resume_from: str | None = None) -> None:
    """Train to total_steps, from step 0 or from the checkpoint `resume_from` (already validated)."""
    loader = build_dataloader(train_dataset, cfg, tokenizer, env.rank, env.world_size)
    total_steps = count_total_steps(cfg, len(loader))
    steps_per_epoch = len(loader) // cfg.gradient_accumulation_steps
    optimizer = build_optimizer(model, cfg)
    scheduler = get_scheduler(
        cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps
    )
    if cfg.save_steps:
        resolve_state_dict_type(cfg)  # a format the project cannot write fails now, not at the first save
    start_step = load_checkpoint(resume_from, model, optimizer, scheduler)["step"] if resume_from else 0
    logger.start_at(start_step)
    batches = optimizer_step_batches(loader, cfg.gradient_accumulation_steps, start_step)
    wandb_run_id = logger.wandb_run.id if logger.wandb_run is not None else None
    print_rank0(f"training: {total_steps} steps of {cfg.gradient_accumulation_steps} x "
                f"{cfg.per_device_train_batch_size} sequences on each of {env.world_size} ranks")

    model.train()
    for step in range(start_step + 1, total_steps + 1):
        start = time.perf_counter()
        micro_batches = next(batches)
        label_tokens, input_tokens, token_slots = step_token_counts(micro_batches, env.device)
        loss_sum = forward_backward(model, micro_batches, label_tokens, env.world_size, env.device,
                                    sync_every_micro_batch=cfg.gradient_sync == "every_micro_batch")

        grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step % cfg.logging_steps == 0 or step == total_steps:
            dist.all_reduce(loss_sum)
            step_time = time.perf_counter() - start
            logger.log({
                "step": step,
                "loss": loss_sum.item() / label_tokens,
                "learning_rate": learning_rate,
                "grad_norm": grad_norm.item(),
                "tokens": int(label_tokens),
                "input_tokens": int(input_tokens),
                "real_token_share": input_tokens / token_slots,
                "tokens_per_second": input_tokens / step_time,
                "step_time": step_time,
            })
            print_rank0(f"step {step}/{total_steps} loss {loss_sum.item() / label_tokens:.4f} "
                        f"lr {learning_rate:.2e} grad_norm {grad_norm.item():.3f}")
        if cfg.save_steps and (step % cfg.save_steps == 0 or step == total_steps):
            save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, step, step // steps_per_epoch, wandb_run_id)
