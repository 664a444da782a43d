"""Tokens per second, MFU and peak memory of the recipe's training step on one GPU, within 8 minutes on an H100/H200.

    python bench/gpu_mfu.py --out gpu_mfu.json

Randomly initialised Llama-3.2-1B- and 3B-shaped models (128k vocabulary, tied embeddings), FSDP2 on the GPU
(a one-rank mesh), bf16 compute with fp32 master weights, fused AdamW, sequences of 4,096 tokens packed from
instruction-like examples (log-normal lengths, position_ids restarting per example, sdpa), with and without
activation checkpointing and torch.compile of each decoder layer. Each variant runs in its own process: warm-up
steps (the compilation happens there), then timed steps between two device synchronisations.
MFU = model FLOPs per token (fsdp_recipes.flops: 6 x matmul parameters + attention, recomputation not counted)
x tokens per second / the GPU's dense bf16 peak (989 TFLOP/s for H100 SXM and H200).
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
               num_key_value_heads=8, head_dim=64),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
}
# name: (shape, activation checkpointing, torch.compile)
VARIANTS = {
    "1B eager": ("1B", False, False),
    "1B compile": ("1B", False, True),
    "3B eager": ("3B", False, False),
    "3B compile": ("3B", False, True),
    "3B eager + AC": ("3B", True, False),
    "3B compile + AC": ("3B", True, True),
}


def packed_steps(args, n_steps: int) -> list[list[dict]]:
    """n_steps optimizer steps of `accumulation` micro-batches of `batch_size` packed rows, in pinned memory."""
    from fsdp_recipes.data import IGNORE_INDEX, collate, pack_examples

    rng = random.Random(0)
    rows_needed = n_steps * args.accumulation * args.batch_size
    ids, labels = [], []
    while sum(map(len, ids)) < (rows_needed + 1) * args.seq_len:
        prompt, completion = int(rng.lognormvariate(5.0, 1.0)) + 1, int(rng.lognormvariate(5.5, 1.0)) + 1
        example = [rng.randrange(8, 128_000) for _ in range(min(prompt + completion, args.seq_len))]
        ids.append(example)
        labels.append([IGNORE_INDEX] * min(prompt, len(example) - 1) + example[min(prompt, len(example) - 1):])
    packed = pack_examples({"input_ids": ids, "labels": labels}, args.seq_len)
    rows = [dict(zip(packed, values)) for values in zip(*packed.values())][:rows_needed]
    micro = [{k: v.pin_memory() for k, v in collate(rows[i:i + args.batch_size], 0).items()}
             for i in range(0, rows_needed, args.batch_size)]
    return [micro[s * args.accumulation:(s + 1) * args.accumulation] for s in range(n_steps)]


def worker(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_recipes.config import TrainConfig
    from fsdp_recipes.distributed import distributed, exit_process
    from fsdp_recipes.flops import peak_flops, training_flops_per_token
    from fsdp_recipes.plan import resolve_plan
    from fsdp_recipes.sharding import shard_model
    from fsdp_recipes.trainer import build_optimizer, clip_grad_norm, forward_backward, step_token_counts

    shape, checkpointing, compiled = VARIANTS[args.worker]
    with distributed() as env:
        config = LlamaConfig(vocab_size=128256, max_position_embeddings=args.seq_len, rope_theta=500000.0,
                             tie_word_embeddings=True, use_cache=False, **SHAPES[shape])
        torch.manual_seed(0)
        with env.device:  # initialised on the GPU: seconds instead of minutes on the CPU
            model = LlamaForCausalLM(config)
        cfg = TrainConfig(model_name_or_path="bench", dataset_name="bench", mixed_precision="bf16",
                          fsdp_activation_checkpointing=checkpointing, torch_compile=compiled)
        model = shard_model(model, resolve_plan(cfg), env.device)
        optimizer = build_optimizer(model, cfg)
        steps = packed_steps(args, args.warmup_steps + args.steps)

        def train_step(micro_batches):
            label_tokens, input_tokens, _ = step_token_counts(micro_batches, env.device)
            forward_backward(model, micro_batches, label_tokens, env.world_size, env.device)
            clip_grad_norm(model, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return input_tokens

        model.train()
        warmup_start = time.perf_counter()
        for step in steps[:args.warmup_steps]:
            train_step(step)
        torch.cuda.synchronize()
        warmup_seconds = time.perf_counter() - warmup_start
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        tokens = sum(train_step(step) for step in steps[args.warmup_steps:])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens_per_second = tokens / seconds
        flops = training_flops_per_token(model, args.seq_len)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(env.device)
        print("RESULT " + json.dumps({
            "variant": args.worker, "gpu": torch.cuda.get_device_name(env.device),
            "parameters": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens / args.steps,
            "warmup_seconds": round(warmup_seconds, 1), "tokens_per_second": round(tokens_per_second),
            "tflops_per_second": round(flops * tokens_per_second / 1e12, 1),
            "mfu": round(flops * tokens_per_second / peak, 4) if peak else None,
            "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 1),
        }), flush=True)
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=1, help="packed rows per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak_tflops", type=float, help="the GPU's dense bf16 peak, when fsdp_recipes.flops lacks it")
    parser.add_argument("--budget_s", type=float, default=450, help="variants not started by then are skipped")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_mfu.py needs a CUDA GPU")
    names = [n.strip() for n in args.variants.split(",")]
    if unknown := [n for n in names if n not in VARIANTS]:
        raise SystemExit(f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
    passthrough = [f"--{k}={v}" for k, v in vars(args).items() if v is not None and k not in ("out", "variants", "worker")]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, sequence {args.seq_len}, "
          f"{args.batch_size} x {args.accumulation} packed rows per step", flush=True)
    start, results = time.perf_counter(), []
    for name in names:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            results.append({"variant": name, "error": "skipped: time budget spent"})
            continue
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, *passthrough],
                                  capture_output=True, text=True, timeout=left)
            lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[0]) if lines else {"variant": name, "error": proc.stderr.strip()[-300:]}
        except subprocess.TimeoutExpired:
            result = {"variant": name, "error": "timed out: time budget spent"}
        results.append(result)
        print(f"  {name}: " + (f"{result['tokens_per_second']} tokens/s, MFU {result['mfu']}" if "error" not in result
                              else result["error"].splitlines()[-1]), flush=True)
    print(f"\n{'variant':18s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak alloc GB':>13s} {'warm-up s':>9s}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:18s} {r['error'].splitlines()[-1][:80]}")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            print(f"{r['variant']:18s} {r['tokens_per_second']:9d} {r['tflops_per_second']:8.1f} {mfu:>6s} "
                  f"{r['peak_allocated_gb']:13.1f} {r['warmup_seconds']:9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
