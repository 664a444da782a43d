"""The training loop: token-weighted loss over accumulation and ranks, clipping, AdamW, metrics."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import get_scheduler

from .checkpoint import load_checkpoint, resolve_state_dict_type, save_checkpoint
from .config import ConfigError, TrainConfig
from .data import IGNORE_INDEX, build_dataloader, optimizer_step_batches
from .distributed import DistEnv, print_rank0
from .metrics import MetricsLogger


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (the 1-D parameters) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the label tokens, in fp32."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks' shards (the same value on every rank), clipped when max_norm > 0."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
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
    batches = optimizer_step_batches(loader, cfg.gradient_accumulation_steps, start_step)
    wandb_run_id = logger.wandb_run.id if logger.wandb_run is not None else None
    print_rank0(f"training: {total_steps} steps of {cfg.gradient_accumulation_steps} x "
                f"{cfg.per_device_train_batch_size} sequences on each of {env.world_size} ranks")

    model.train()
    for step in range(start_step + 1, total_steps + 1):
        start = time.perf_counter()
        micro_batches = next(batches)
        # Counted on the host before any compute: one all-reduce per step, no device sync inside the loop.
        counts = torch.tensor(
            [sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches),
             sum(int(mb["attention_mask"].sum()) for mb in micro_batches)],
            dtype=torch.float64, device=env.device,
        )
        dist.all_reduce(counts)
        label_tokens, input_tokens = counts.tolist()

        loss_sum = torch.zeros((), device=env.device)
        for mb in micro_batches:
            mb = {k: v.to(env.device, non_blocking=True) for k, v in mb.items()}
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            mb_loss_sum = token_loss_sum(logits, mb["labels"])
            # Divide by the label tokens of the whole step on all ranks; FSDP then averages gradients over
            # ranks, so scale by world_size to turn that average back into the global sum.
            (mb_loss_sum * (env.world_size / label_tokens)).backward()
            loss_sum += mb_loss_sum.detach()

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
                "tokens_per_second": input_tokens / step_time,
                "step_time": step_time,
            })
            print_rank0(f"step {step}/{total_steps} loss {loss_sum.item() / label_tokens:.4f} "
                        f"lr {learning_rate:.2e} grad_norm {grad_norm.item():.3f}")
        if cfg.save_steps and (step % cfg.save_steps == 0 or step == total_steps):
            save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, step, step // steps_per_epoch, wandb_run_id)
