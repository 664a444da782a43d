"""Tokens per second, MFU and peak memory of the recipe's training step on one GPU, within 8 minutes on an H100/H200.

    python bench/gpu_mfu.py --out gpu_mfu.json
    python bench/gpu_mfu.py --variants "meta-llama/Llama-3.1-8B compile + AC"   # any model's shape

A variant is a model and a mode. The model is "1B" or "3B" (Llama 3.2's published shapes: 128k vocabulary, tied
embeddings) or a Hugging Face config (a hub id or a local directory, read by AutoConfig); the mode is "eager" or
"compile" (torch.compile of each decoder layer), with " + AC" for activation checkpointing. Every model is
randomly initialised on the device. FSDP2 on a one-rank mesh, bf16 compute with fp32 master weights, fused AdamW,
rows of up to --seq_len tokens packed from instruction-like examples (log-normal lengths, position_ids restarting per
example, sdpa). Each variant runs in its own process: a warm-up pass over the steps it times (so that every row
length, and both a row of one example, which has no mask, and of several, are compiled there, not in the timed
window), then the same steps again, timed between two device synchronisations.
MFU = model FLOPs per token (fsdp_recipes.flops: 6 x matmul parameters + attention, recomputation not counted)
x tokens per second / the GPU's dense bf16 peak (989 TFLOP/s for H100 SXM and H200). Attention is counted over the
mean row length, as the trainer's mfu metric counts it (sdpa computes each whole row, the other examples masked);
`mfu_attention_per_example` counts each packed example attending to itself only, the FLOPs the model needs.
Without a GPU it runs on the CPU, slowly (its test runs a tiny config there), with MFU only given --peak_tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

SHAPES = {  # Llama 3.2's published shapes
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
}
MODES = {  # mode: (activation checkpointing, torch.compile)
    "eager": (False, False),
    "compile": (False, True),
    "eager + AC": (True, False),
    "compile + AC": (True, True),
}
# The 3B shape first: its MFU is the target, and a variant not started within the budget is skipped.
DEFAULT_VARIANTS = ["3B eager", "3B compile", "3B compile + AC", "3B eager + AC", "1B eager", "1B compile"]


def parse_variant(name: str) -> tuple[str, bool, bool]:
    """'3B compile + AC' -> ('3B', True, True): the model, activation checkpointing, torch.compile."""
    for mode, (checkpointing, compiled) in MODES.items():
        if name.endswith(" " + mode):
            return name[:-len(mode) - 1], checkpointing, compiled
    raise ValueError(f"variant {name!r} must be a model followed by one of the modes: {', '.join(MODES)}")


def model_config(model: str, seq_len: int):
    from transformers import AutoConfig, LlamaConfig

    config = (LlamaConfig(max_position_embeddings=seq_len, **SHAPES[model]) if model in SHAPES
              else AutoConfig.from_pretrained(model))
    config.use_cache = False
    return config


def packed_steps(args, n_steps: int, vocab_size: int) -> list[list[dict]]:
    """n_steps optimizer steps of `accumulation` micro-batches of `batch_size` packed rows (pinned on a GPU)."""
    import pyarrow as pa

    from fsdp_recipes.data import IGNORE_INDEX, collate, pack_examples

    rng = random.Random(0)
    rows_needed = n_steps * args.accumulation * args.batch_size
    ids, labels = [], []
    while sum(map(len, ids)) < (rows_needed + 1) * args.seq_len:
        prompt, completion = int(rng.lognormvariate(5.0, 1.0)) + 1, int(rng.lognormvariate(5.5, 1.0)) + 1
        example = [rng.randrange(8, vocab_size) for _ in range(min(prompt + completion, args.seq_len))]
        ids.append(example)
        labels.append([IGNORE_INDEX] * min(prompt, len(example) - 1) + example[min(prompt, len(example) - 1):])
    rows = pack_examples(pa.table({"input_ids": ids, "labels": labels}), args.seq_len).to_pylist()[:rows_needed]
    pin = torch.cuda.is_available()
    micro = [{k: v.pin_memory() if pin else v for k, v in collate(rows[i:i + args.batch_size], 0).items()}
             for i in range(0, rows_needed, args.batch_size)]
    return [micro[s * args.accumulation:(s + 1) * args.accumulation] for s in range(n_steps)]


def attention_lengths(micro_batches: list[dict]) -> tuple[float, list[int]]:
    """(mean row length; the length of each packed example, real tokens only). Examples start where position_ids
    restart at 0; collate's padding is a sequence of its own, all masked, so it counts as no example."""
    lengths = []
    for mb in micro_batches:
        for positions, mask in zip(mb["position_ids"].tolist(), mb["attention_mask"].tolist()):
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            lengths += [sum(mask[start:end]) for start, end in zip(starts, starts[1:])]
    slots = sum(mb["attention_mask"].numel() for mb in micro_batches)
    rows = sum(mb["attention_mask"].shape[0] for mb in micro_batches)
    return slots / rows, [n for n in lengths if n]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args) -> None:
    from transformers import AutoModelForCausalLM

    from fsdp_recipes.config import TrainConfig
    from fsdp_recipes.device_stats import local_peak_memory
    from fsdp_recipes.distributed import distributed, exit_process
    from fsdp_recipes.flops import peak_flops, training_flops_per_token
    from fsdp_recipes.plan import resolve_plan
    from fsdp_recipes.sharding import shard_model
    from fsdp_recipes.trainer import build_optimizer, clip_grad_norm, forward_backward, step_token_counts

    model_name, checkpointing, compiled = parse_variant(args.worker)
    with distributed() as env:
        config = model_config(model_name, args.seq_len)
        torch.manual_seed(0)
        with env.device:  # initialised on the GPU: seconds instead of minutes on the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        cfg = TrainConfig(model_name_or_path="bench", dataset_name="bench", mixed_precision="bf16",
                          fsdp_activation_checkpointing=checkpointing, torch_compile=compiled)
        model = shard_model(model, resolve_plan(cfg), env.device)
        optimizer = build_optimizer(model, cfg)
        steps = packed_steps(args, args.steps, config.vocab_size)

        def train_step(micro_batches):
            label_tokens, input_tokens, *_ = step_token_counts(micro_batches)
            loss_sum, _ = forward_backward(model, micro_batches, label_tokens, env.world_size, env.device)
            clip_grad_norm(model, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return input_tokens, loss_sum / label_tokens

        model.train()
        warmup_start = time.perf_counter()
        for step in steps:
            train_step(step)
        synchronize(env.device)
        warmup_seconds = time.perf_counter() - warmup_start
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        start = time.perf_counter()
        # A recompilation here would be timed as training: the warm-up compiled every variant of these steps.
        with torch.compiler.set_stance("fail_on_recompile" if compiled else "default"):
            timed = [train_step(step) for step in steps]
        synchronize(env.device)
        seconds = time.perf_counter() - start
        tokens_per_second = sum(tokens for tokens, _ in timed) / seconds
        row_length, examples = attention_lengths([mb for step in steps for mb in step])
        flops = training_flops_per_token(model, round(row_length))
        # Each token attends within its example: the token-weighted mean of each example's FLOPs per token (so a
        # sliding window applies example by example).
        per_length = {n: training_flops_per_token(model, n) for n in set(examples)}
        flops_per_example = sum(n * per_length[n] for n in examples) / sum(examples)
        example_length = sum(n * n for n in examples) / sum(examples)  # the keys a token attends to, on average
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(env.device)
        print("RESULT " + json.dumps({
            "variant": args.worker, "device": device_name(env.device),
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokens_per_step": sum(tokens for tokens, _ in timed) / args.steps,
            "last_step_loss": round(timed[-1][1].item(), 4),  # read after timing: no sync inside the steps
            "warmup_seconds": round(warmup_seconds, 1), "tokens_per_second": round(tokens_per_second),
            "flops_per_token": flops, "tflops_per_second": round(flops * tokens_per_second / 1e12, 1),
            "mfu": round(flops * tokens_per_second / peak, 4) if peak else None,
            "mean_row_length": round(row_length, 1), "mean_example_length": round(example_length, 1),
            "mfu_attention_per_example": round(flops_per_example * tokens_per_second / peak, 4) if peak else None,
            **{key: round(value, 1) for key, value in local_peak_memory(env.device).items()},
        }), flush=True)
    exit_process(0)


def run_variant(name: str, passthrough: list[str], timeout: float, budget_s: float) -> dict:
    """One variant in a process of its own: its RESULT, or the error that stopped it."""
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, *passthrough],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # the error says what to change: a larger model needs a longer budget
        return {"variant": name, "error": f"timed out: --budget_s {budget_s:g} ran out: raise --budget_s to finish it"}
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    error = proc.stderr.strip()[-300:] or f"exited {proc.returncode} without a result"
    return json.loads(lines[0]) if lines else {"variant": name, "error": error}


def mfu_text(mfu: float | None) -> str:
    """A percentage, as the table shows it; "-" where the device's peak is unknown (the CPU without --peak_tflops)."""
    return "-" if mfu is None else f"{mfu:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated, run in this order; default: %(default)s")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=1, help="packed rows per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps, each also run once before as warm-up")
    parser.add_argument("--peak_tflops", type=float, help="the device's dense bf16 peak, when fsdp_recipes.flops lacks it")
    parser.add_argument("--budget_s", type=float, default=450, help="variants not started by then, less 30 s (too little for one), are skipped")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # found before the runs, not after
        raise SystemExit(f"--out {args.out}: no such folder to write the JSON into")
    names = [n.strip() for n in args.variants.split(",")]
    try:
        for name in names:
            parse_variant(name)
    except ValueError as error:
        raise SystemExit(str(error))
    # Caught here, not as each variant's worker traceback (a division by zero for --steps 0).
    for name in ["seq_len", "batch_size", "accumulation", "steps"]:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    passthrough = [f"--{k}={v}" for k, v in vars(args).items() if v is not None and k not in ("out", "variants", "worker")]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(f"{device_name(device)}, torch {torch.__version__}, sequence {args.seq_len}, "
          f"{args.batch_size} x {args.accumulation} packed rows per step", flush=True)
    start, results = time.perf_counter(), []
    for name in names:
        left = args.budget_s - (time.perf_counter() - start)
        result = (run_variant(name, passthrough, left, args.budget_s) if left >= 30
                  else {"variant": name, "error": f"skipped: under 30 s of --budget_s {args.budget_s:g} left: raise "
                                                  f"--budget_s to run it"})
        results.append(result)
        done = f"{result['tokens_per_second']} tokens/s, MFU {mfu_text(result['mfu'])}" if "error" not in result else ""
        print(f"  {name}: " + (done or result["error"].splitlines()[-1]), flush=True)
        if args.out:  # after each variant: a run cut short by an outer time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"settings": vars(args), "results": results}, f, indent=2)
    width = max(map(len, names)) + 1
    memory = "peak_allocated_gib" if device.type == "cuda" else "peak_rss_gib"
    print(f"\n{'variant':{width}s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'MFU/ex':>6s} {memory:>18s} "
          f"{'warm-up s':>9s} {'loss':>6s}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:{width}s} {r['error'].splitlines()[-1][:80]}")
        else:
            mfu, per_example = (mfu_text(r[key]) for key in ("mfu", "mfu_attention_per_example"))
            print(f"{r['variant']:{width}s} {r['tokens_per_second']:9d} {r['tflops_per_second']:8.1f} {mfu:>6s} "
                  f"{per_example:>6s} {r[memory]:18.1f} {r['warmup_seconds']:9.1f} {r['last_step_loss']:6.2f}")


if __name__ == "__main__":
    main()
