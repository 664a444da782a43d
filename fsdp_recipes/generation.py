"""Sample generations from the exported model at the end of a run: what the model does, without another script."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .config import ConfigError, TrainConfig
from .data import position_table
from .distributed import run_on_rank0
from .metrics import MetricsLogger


def generation_dtype(model_dir: str, attn_implementation: str, trust_remote_code: bool = False):
    """The dtype to load the exported folder in: its own, but bf16 for an fp32 folder (save_dtype float32) under a
    flash kernel, which takes bf16 or fp16 only (transformers only warns, and the kernel refuses fp32 queries)."""
    if "flash" not in attn_implementation:
        return "auto"
    saved = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).dtype
    return "auto" if saved in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_exported_model(model_dir: str, attn_implementation: str, device: torch.device,
                        trust_remote_code: bool = False):
    """The exported folder in eval mode (in generation_dtype), with the run's attention implementation: config.json
    does not record it, and transformers' default (sdpa where the model allows it) would skip Gemma 2's attention
    soft-capping in 5.17."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation,
                                                 dtype=generation_dtype(model_dir, attn_implementation,
                                                                        trust_remote_code),
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def prompt_text(tokenizer, prompt: str, use_chat_template: bool) -> str:
    """The text the model is given for `prompt` (see generate_samples), to tokenize without special tokens."""
    if use_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return (tokenizer.bos_token or "") + prompt


def check_generation_prompts(cfg: TrainConfig, tokenizer, model: nn.Module) -> None:
    """Before the first step, what generation would fail on after the whole run: a prompt of no tokens (an empty
    prompt sent as plain text by a tokenizer without BOS: nothing to start from), or a prompt whose answer would run
    past a position table (GPT-2's, OPT's, BioGPT's, CTRL's, GPT-J's; a device-side assert on a GPU). Positions
    computed as needed (rotary from rope parameters, XGLM's sinusoids) have no table: transformers only warns there."""
    if not cfg.generation_prompts:
        return
    table = position_table(model)
    for i, prompt in enumerate(cfg.generation_prompts, 1):
        tokens = len(tokenizer(prompt_text(tokenizer, prompt, cfg.generation_use_chat_template),
                               add_special_tokens=False)["input_ids"])
        if tokens == 0:
            raise ConfigError(f"generation_prompts: prompt {i} is empty, and the tokenizer has no BOS token to send "
                              f"before it as plain text: the model would have no token to answer; write a prompt")
        # The last answer token is predicted, never read: the prompt and the other answer tokens take a position.
        if table and tokens + cfg.generation_max_new_tokens - 1 > table:
            raise ConfigError(f"generation_prompts: prompt {i} takes {tokens} tokens as sent, and with "
                              f"generation_max_new_tokens {cfg.generation_max_new_tokens} its answer would reach past "
                              f"the model's position table ({table} positions): shorten the prompt"
                              + (f", or set generation_max_new_tokens {table + 1 - tokens} or less"
                                 if tokens <= table else ""))


@torch.no_grad()
def generate_samples(model_dir: str, prompts: list[str], max_new_tokens: int, use_chat_template: bool,
                     device: torch.device, attn_implementation: str,
                     trust_remote_code: bool = False) -> list[dict]:
    """Greedy answers of the model folder `model_dir` (see load_exported_model) to each prompt, one at a time:
    sampling and beam search off, the folder's other generation settings (a repetition_penalty) kept, as a server
    applies them.

    With use_chat_template each prompt is a user turn followed by the assistant's generation prompt, as chat and
    instruction data are trained; otherwise it is plain text after the BOS token, as prompt/completion data are.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    model = load_exported_model(model_dir, attn_implementation, device, trust_remote_code)
    samples = []
    for prompt in prompts:
        inputs = tokenizer(prompt_text(tokenizer, prompt, use_chat_template), return_tensors="pt",
                           add_special_tokens=False).to(device)
        # The tokenizer: transformers needs it for a generation config's stop_strings.
        # num_beams 1: a folder's num_beams would otherwise make it beam search, which a server does not apply.
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
        completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        samples.append({"prompt": prompt, "completion": completion})
    return samples


def log_sample_generations(cfg: TrainConfig, model_dir: str, device: torch.device, logger: MetricsLogger) -> None:
    """Rank 0 answers cfg.generation_prompts with the exported model, prints the answers and logs them
    (samples.jsonl, a W&B table). The model must fit on one device; the other ranks wait (every rank calls this)."""
    if not cfg.generation_prompts:
        return

    def answer_and_log():
        samples = generate_samples(model_dir, cfg.generation_prompts, cfg.generation_max_new_tokens,
                                   cfg.generation_use_chat_template, device, cfg.attn_implementation,
                                   cfg.trust_remote_code)
        for sample in samples:
            print(f"sample: {sample['prompt']!r} -> {sample['completion']!r}", flush=True)
        logger.log_samples(samples)

    run_on_rank0(answer_and_log, "to answer the generation prompts")
