"""The training loop: token-weighted loss over accumulation and ranks, clipping, AdamW, evaluation, metrics."""

from __future__ import annotations

import inspect
import math
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import get_scheduler

from .checkpoint import (apply_retention, load_checkpoint, point_latest_at, resolve_state_dict_type, save_checkpoint,
                         training_data_identity)
from .config import ConfigError, TrainConfig
from .data import (IGNORE_INDEX, build_dataloader, check_model_reads_data, check_packing_separates_examples,
                   model_inputs, optimizer_step_batches)
from .device_stats import flops_model, mfu, peak_memory_across_ranks
from .distributed import DistEnv, SigtermNote, StoppedBySigterm, print_rank0, sigterm_noted
from .evaluation import eval_batches, perplexity
from .flops import peak_flops, training_flops_per_token
from .generation import check_generation_prompts
from .metrics import MetricsLogger
from .output_dir import check_earlier_run_removed
from .progress import TrainingProgress, use_progress_bars
from .schedule import count_total_steps, describe_schedule
from .sharding import gradient_sync, original_ndims, reshard


class TrainingDiverged(ConfigError):
    """The global gradient norm is not finite: the optimizer step has turned weights into NaN. A ConfigError: its fix
    is in the config (learning rate, warm-up), and run_main prints it as one line on each rank, exit code 2."""


def check_finite_grad_norm(grad_norm: float, step: int, last_checked: int, cfg: TrainConfig) -> None:
    """Stop a diverged run before it saves, evaluates or exports NaN weights (and retention removes good
    checkpoints). The norm is global, so every rank stops at the same step."""
    if math.isfinite(grad_norm):
        return
    since = f", finite at step {last_checked}" if last_checked else ""
    raise TrainingDiverged(
        f"training diverged: the gradient norm is {grad_norm} at step {step} (checked at logging, saving and "
        f"evaluation steps{since}), so the optimizer step made weights NaN, and no checkpoint holds them (`latest` in "
        f"{cfg.output_dir} names the newest, if any). Start again with a lower --learning_rate (now "
        f"{cfg.learning_rate:g}) or a longer --warmup_steps (now {cfg.warmup_steps:g}): a resume keeps the learning "
        f"rate and repeats the same steps"
    )


# transformers.Trainer's names for biases and norm weights (get_decay_parameter_names): by name, so that the 2-D ones
# (Cohere's per-head q_norm and k_norm, gpt-oss's expert biases) get no decay either.
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decays_weight(model: nn.Module) -> dict[int, bool]:
    """id(parameter) -> whether AdamW decays it: not a bias, a norm weight (by name or nn.LayerNorm) or any other
    parameter that is 1-D in the model's definition."""
    ndims = original_ndims(model)
    return {id(p): not (ndims[id(p)] < 2 or isinstance(module, nn.LayerNorm)
                        or NO_DECAY_NAMES.search(f"{module_name}.{name}".lower()))
            for module_name, module in model.named_modules() for name, p in module.named_parameters(recurse=False)}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Fused AdamW (one kernel per step for all parameters, DTensor shards included, on CPU and CUDA); biases and
    norm weights get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decays = decays_weight(model)
    groups = [
        {"params": [p for p in params if decays[id(p)]], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if not decays[id(p)]], "weight_decay": 0.0},
    ]
    # torch's set_optimizer_state_dict gives an empty group the hyperparameters of another group, which then has none.
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             fused=True)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the label tokens, in fp32."""
    # Shift the labels, not the logits: a slice of the logits would cost one more logits-sized copy in backward.
    labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def step_token_counts(micro_batches: list[dict], sigterm_received: bool = False
                      ) -> tuple[float, float, float, bool]:
    """(label tokens, real input tokens, all token slots incl. padding) of the step, summed over all ranks, and whether
    any rank has received a SIGTERM.

    Counted on the host from the CPU batches before any compute, and reduced on the CPU (gloo): a device tensor would
    make the host wait for the previous step's work, twice. The SIGTERM flag rides along, so that every rank sees it
    at the same step without a reduction of its own.
    """
    counts = torch.tensor(
        [sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches),
         sum(int(mb["attention_mask"].sum()) for mb in micro_batches),
         sum(mb["attention_mask"].numel() for mb in micro_batches),
         float(sigterm_received)],
        dtype=torch.float64,
    )
    dist.all_reduce(counts)
    label_tokens, input_tokens, token_slots, sigterms = counts.tolist()
    return label_tokens, input_tokens, token_slots, sigterms > 0


def any_rank_received_sigterm(sigterm_received: bool) -> bool:
    """Once per run, after the last step: a SIGTERM that came after the last step's reduction."""
    flag = torch.tensor([float(sigterm_received)], dtype=torch.float64)  # on the CPU, as step_token_counts
    dist.all_reduce(flag)
    return flag.item() > 0


def stop_message(step: int, checkpoint: str | None, trained: bool) -> str:
    """What a SIGTERM stop prints: `checkpoint` is the one the stop saved (None: the run saves none), or, for a run
    that trained no step, the one it resumed from."""
    if not trained:  # the checkpoint resumed from holds the run; `auto` misses one outside output_dir
        return (f"stopped by SIGTERM after step {step}, before the run's end: nothing trained, so nothing saved; "
                f"resume with --resume_from_checkpoint {checkpoint}")
    if checkpoint is None:
        return (f"stopped by SIGTERM after step {step}: nothing saved, as this run saves no checkpoints "
                f"(--save_steps 0; set it to make a stopped run resumable)")
    return f"stopped by SIGTERM after step {step}: saved {checkpoint}; resume with --resume_from_checkpoint auto"


def forward_backward(model: nn.Module, micro_batches: list[dict], label_tokens: float, world_size: int,
                     device: torch.device, sync_every_micro_batch: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accumulate the gradient of (sum of per-token losses of the step) / label_tokens; return this rank's sum,
    and this rank's sum of the micro-batches' router load-balancing losses (None unless the model returns one).

    label_tokens counts the whole step on all ranks. FSDP averages gradients over ranks, so each rank scales by
    world_size to turn that average back into the global sum. Without sync_every_micro_batch, gradients are
    reduced after the last micro-batch only.
    """
    loss_sum = torch.zeros((), device=device)
    aux_loss_sum = None
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        with gradient_sync(model, sync_every_micro_batch or i == len(micro_batches) - 1):
            outputs = model(**model_inputs(mb))
            mb_loss_sum = token_loss_sum(outputs.logits, mb["labels"])
            loss = mb_loss_sum * (world_size / label_tokens)
            aux_loss = getattr(outputs, "aux_loss", None)  # MoE models with output_router_logits
            if aux_loss is not None and "position_ids" in mb:
                aux_loss = packed_router_loss(model, outputs.router_logits, mb["attention_mask"])
            if aux_loss is not None:
                # coef x the router loss's mean over the step's micro-batches and (through FSDP's gradient average)
                # ranks, as the model's own loss weighs it for one batch. HF's Trainer weighs it
                # gradient_accumulation_steps x world size times more (each micro-batch's coef x aux_loss, whole).
                loss = loss + model.config.router_aux_loss_coef * aux_loss / len(micro_batches)
                aux_loss_sum = aux_loss.detach() if aux_loss_sum is None else aux_loss_sum + aux_loss.detach()
            loss.backward()
        loss_sum += mb_loss_sum.detach()
    return loss_sum, aux_loss_sum


def packed_router_loss(model: nn.Module, router_logits: tuple[torch.Tensor, ...],
                       attention_mask: torch.Tensor) -> torch.Tensor:
    """The router load-balancing loss of a packed batch over its real tokens. Packed batches reach the model without
    attention_mask (model_inputs), so the model's own aux_loss also counts the padding that ends each row; this
    calls the function the model's forward calls, with the mask (check_packed_router_loss checks it exists)."""
    causal_lm = model.module if isinstance(model, FSDP) else model
    loss_function = inspect.getmodule(causal_lm.forward).load_balancing_loss_func
    return loss_function(router_logits, causal_lm.num_experts, causal_lm.num_experts_per_tok, attention_mask)


def check_packed_router_loss(model: nn.Module) -> None:
    """Packing with the router loss on needs what packed_router_loss calls; checked before the first step."""
    causal_lm = model.module if isinstance(model, FSDP) else model
    if not (hasattr(inspect.getmodule(causal_lm.forward), "load_balancing_loss_func")
            and hasattr(causal_lm, "num_experts") and hasattr(causal_lm, "num_experts_per_tok")):
        raise ConfigError(f"packing with the router load-balancing loss on: {type(causal_lm).__name__} does not "
                          f"compute that loss as transformers' MoE models do (load_balancing_loss_func with "
                          f"num_experts and num_experts_per_tok), so the padding of packed rows cannot be left out "
                          f"of it. Set packing false, or output_router_logits false")


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks' shards (the same value on every rank), clipped when max_norm > 0."""
    max_norm = max_norm if max_norm > 0 else math.inf
    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm)  # FSDP1's shards are plain tensors: it reduces the norm itself
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@torch.no_grad()
def evaluate(model: nn.Module, eval_dataset, cfg: TrainConfig, tokenizer, env: DistEnv) -> dict[str, float]:
    """Token-weighted loss over the whole held-out split (all ranks take part), and its perplexity."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, label tokens
    for batch in eval_batches(eval_dataset, cfg.per_device_eval_batch_size, tokenizer.pad_token_id, env.rank,
                              env.world_size):
        batch = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
        sums[0] += token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"])
        sums[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    dist.all_reduce(sums)
    reshard(model)  # FSDP2 would keep the root gathered until the next backward
    model.train()
    loss = (sums[0] / sums[1]).item()
    return {"eval/loss": loss, "eval/perplexity": perplexity(loss)}


def train(cfg: TrainConfig, env: DistEnv, model: nn.Module, tokenizer, train_dataset, logger: MetricsLogger,
          resume_from: str | None = None, eval_dataset=None) -> None:
    """Train to total_steps, from step 0 or from the checkpoint `resume_from` (already validated); evaluate on
    eval_dataset (if any) every eval_steps and at the end, and at the checkpoint's step if that evaluation is not in
    metrics.jsonl.

    A SIGTERM (a pre-emption, a time limit) on any rank stops every rank after the same step, saved as a checkpoint
    if save_steps is on: StoppedBySigterm says what was saved."""
    with sigterm_noted() as sigterm:
        train_steps(cfg, env, model, tokenizer, train_dataset, logger, resume_from, eval_dataset, sigterm)


def train_steps(cfg: TrainConfig, env: DistEnv, model: nn.Module, tokenizer, train_dataset, logger: MetricsLogger,
                resume_from: str | None, eval_dataset, sigterm: SigtermNote) -> None:
    # Checked before the first step: what would otherwise go wrong later in the run, or after it.
    check_earlier_run_removed(cfg)
    check_model_reads_data(model, tokenizer, cfg.max_seq_length, train_dataset, eval_dataset)
    check_generation_prompts(cfg, tokenizer, model)  # found now, not when final/ answers them after the run
    if cfg.packing:
        check_packing_separates_examples(model, cfg, env.device)
        if getattr(model.config, "output_router_logits", False):
            check_packed_router_loss(model)

    # Data, optimizer and schedule; a resumed run then loads their state from its checkpoint.
    loader = build_dataloader(train_dataset, cfg, tokenizer, env.rank, env.world_size,
                              pin_memory=env.device.type == "cuda")
    total_steps = count_total_steps(cfg, train_dataset, env.world_size)
    steps_per_epoch = len(loader) // cfg.gradient_accumulation_steps
    warmup_steps = cfg.num_warmup_steps(total_steps)
    optimizer = build_optimizer(model, cfg)
    scheduler = get_scheduler(
        cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )
    if cfg.save_steps:
        resolve_state_dict_type(cfg)  # a format the project cannot write fails now, not at the first save
    # Recorded in each checkpoint (rank 0 writes the state), so that a resume notices data changed in place.
    train_data = training_data_identity(train_dataset) if cfg.save_steps and env.is_main else None
    start_step = load_checkpoint(resume_from, model, optimizer, scheduler)["step"] if resume_from else 0
    if resume_from:
        point_latest_at(cfg.output_dir, resume_from)
        if start_step == total_steps and env.is_main:
            # A run killed in (or just before) its last save's retention is only finished from here: no later save
            # would remove what that retention left, an older checkpoint or a partly removed .old one.
            apply_retention(cfg, start_step)
    logger.start_at(start_step)
    batches = optimizer_step_batches(loader, cfg.gradient_accumulation_steps, start_step)
    # MFU only where the device's peak FLOP/s is known; FLOPs are counted on a parameter-free copy of the model.
    device_peak_flops = peak_flops(env.device)
    architecture = flops_model(model, cfg.trust_remote_code) if device_peak_flops else None
    print_rank0(describe_schedule(cfg, total_steps, warmup_steps, steps_per_epoch, len(train_dataset), env.world_size))
    logger.add_to_config({"schedule": {"total_steps": total_steps, "warmup_steps": warmup_steps,
                                       "steps_per_epoch": steps_per_epoch, "train_sequences": len(train_dataset)}})
    progress = TrainingProgress(total_steps, start_step, use_progress_bars(env.is_main))

    def evaluate_and_log(step: int) -> None:
        eval_metrics = evaluate(model, eval_dataset, cfg, tokenizer, env)
        logger.log({"step": step, "epoch": step / steps_per_epoch, **eval_metrics})  # epoch: W&B's x-axis too
        progress.write(f"eval at step {step}: loss {eval_metrics['eval/loss']:.4f} "
                       f"perplexity {eval_metrics['eval/perplexity']:.3f}")

    if resume_from and eval_dataset is not None and ((cfg.eval_steps and start_step % cfg.eval_steps == 0)
                                                     or start_step == total_steps):
        # A step saves its checkpoint before it evaluates: an evaluation that failed (out of memory) runs now, as the
        # resumed run starts after that step (at the last step, a resume only finishes the run). Rank 0's
        # metrics.jsonl says whether it did; every rank takes part.
        evaluated = [logger.evaluated(start_step)]
        dist.broadcast_object_list(evaluated, src=0)
        if not evaluated[0]:
            evaluate_and_log(start_step)

    # Throughput over the steps since the last log: only logging steps wait for the device, so a single step's
    # host time says little; the interval's does. Evaluation and checkpoint saves are not counted.
    interval = {"seconds": 0.0, "steps": 0, "input_tokens": 0.0, "token_slots": 0.0, "rows": 0}
    last_checked = start_step  # the last step whose gradient norm was checked and finite (a checkpoint's was)
    model.train()
    checkpoint = resume_from  # the newest checkpoint of the run
    step, stopping = start_step, False
    while step < total_steps and not stopping:
        step += 1
        start = time.perf_counter()
        micro_batches = next(batches)
        # Read before the step's compute, the same on every rank: the step is trained, then logged and saved as a last
        # step would be (its evaluation left to the resume, which runs it); a stop waits one step more than the signal.
        label_tokens, input_tokens, token_slots, stopping = step_token_counts(micro_batches, sigterm.received)
        log_now = stopping or step % cfg.logging_steps == 0 or step == total_steps
        evaluate_now = not stopping and eval_dataset is not None and ((cfg.eval_steps and step % cfg.eval_steps == 0)
                                                                      or step == total_steps)
        save_now = cfg.save_steps and (stopping or step % cfg.save_steps == 0 or step == total_steps)
        loss_sum, aux_loss_sum = forward_backward(model, micro_batches, label_tokens, env.world_size, env.device,
                                                  sync_every_micro_batch=cfg.gradient_sync == "every_micro_batch")

        grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        interval["steps"] += 1
        interval["input_tokens"] += input_tokens
        interval["token_slots"] += token_slots
        # Rows as the sampler batches them: flash attention's packed batches arrive concatenated into one row.
        interval["rows"] += cfg.per_device_train_batch_size * len(micro_batches) * env.world_size
        progress.advance()  # before progress.logged: the bar shows the step it counts with that step's loss

        if log_now:
            dist.all_reduce(loss_sum)
            loss = loss_sum.item() / label_tokens  # waits for the device: the interval's work is done
            memory = peak_memory_across_ranks(env.device)
            interval["seconds"] += time.perf_counter() - start
            tokens_per_second = interval["input_tokens"] / interval["seconds"]
            router = {}
            if aux_loss_sum is not None:  # the mean over the step's micro-batches and ranks, before the coefficient
                dist.all_reduce(aux_loss_sum)
                router = {"router_aux_loss": aux_loss_sum.item() / (len(micro_batches) * env.world_size)}
            metrics = {
                "step": step,
                "epoch": step / steps_per_epoch,  # as HF Trainer logs it: 1.5 is halfway through the second epoch
                "loss": loss,
                "learning_rate": learning_rate,
                "grad_norm": grad_norm.item(),
                "tokens": int(label_tokens),
                "input_tokens": int(input_tokens),
                "real_token_share": input_tokens / token_slots,
                "tokens_per_second": tokens_per_second,
                "tokens_per_second_per_device": tokens_per_second / env.world_size,
                "step_time": interval["seconds"] / interval["steps"],
                **memory,
                **router,
            }
            if architecture is not None:
                mean_row_length = interval["token_slots"] / interval["rows"]
                metrics["mfu"] = mfu(metrics["tokens_per_second_per_device"],
                                     training_flops_per_token(architecture, round(mean_row_length)), device_peak_flops)
            logger.log(metrics)
            progress.logged(metrics)
            interval = dict.fromkeys(interval, 0)
        else:
            if (evaluate_now or save_now) and env.device.type == "cuda":
                torch.cuda.synchronize(env.device)  # the step's queued work belongs to the step, not the eval or save
            interval["seconds"] += time.perf_counter() - start

        # Only where the run waits for the device anyway: a NaN step logs its metrics first, then stops the run.
        if log_now or save_now or evaluate_now:
            check_finite_grad_norm(grad_norm.item(), step, last_checked, cfg)
            last_checked = step
        if save_now:  # before the evaluation: an evaluation that fails (out of memory) loses no trained step
            checkpoint = save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, step, step // steps_per_epoch,
                                         logger.wandb_run_state, train_data)
        if evaluate_now:
            evaluate_and_log(step)
    progress.close()
    if stopping or any_rank_received_sigterm(sigterm.received):
        trained = step > start_step  # false: resumed at the run's last step, stopped in its evaluation
        raise StoppedBySigterm(stop_message(step, checkpoint if cfg.save_steps or not trained else None, trained))
