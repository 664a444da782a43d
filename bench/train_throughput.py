"""Training throughput on CPU: the recipe's training step in one and two processes, FSDP1 and FSDP2, fp32 and bf16,
packed and padded, each as a ratio to a plain single-process PyTorch loop on the same model and the same batches.

    python bench/train_throughput.py --out /tmp/throughput.json

The model is a randomly initialised Llama with a real-sized vocabulary (32,000; 320 hidden, 4 layers, untied:
25.4M parameters). The data is instruction-like and tokenizer-free: random token ids, prompt and completion
lengths drawn from log-normal distributions (medians 40 and 50 tokens, long tails; loss on the completion only),
padded per micro-batch of 4 examples or packed into rows of 512 tokens, one per micro-batch (similar token slots
per micro-batch), by the project's own `collate` and `pack_examples`. Every variant trains on the same
optimizer steps: each step is `--micro_batches` micro-batches, split over the ranks (2 processes: half each, as
gradient accumulation; 1 process: all of them). "Same total cores": 1 process runs 2 threads, 2 processes 1 each.

Each run starts fresh processes: warm-up steps, then timed steps. `--repeats` rounds each run every variant once;
a variant's ratio to the reference is taken within each round and the median over rounds is reported, with the
median of its runs (all runs' figures are in the JSON). Reported: real (non-padding) input tokens per second over
all ranks, the share of token slots that are real, and the peak RSS of each rank (the largest over the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch

# name: (processes, engine, precision, data). engine "plain" is the reference loop (no FSDP).
VARIANTS = {
    "reference fp32 packed": (1, "plain", "no", "packed"),
    "reference fp32 padded": (1, "plain", "no", "padded"),
    "reference bf16 packed": (1, "plain", "bf16", "packed"),
    "recipe 1 process FSDP2 fp32 packed": (1, "fsdp2", "no", "packed"),
    "FSDP2 fp32 packed": (2, "fsdp2", "no", "packed"),
    "FSDP2 fp32 padded": (2, "fsdp2", "no", "padded"),
    "FSDP1 fp32 packed": (2, "fsdp1", "no", "packed"),
    # Fewer collectives: gathered layers kept from forward to backward, gradients reduced once per step.
    "FSDP2 fp32 packed no-reshard 1-sync": (2, "fsdp2", "no", "packed"),
    # The ceiling for 2 processes: each trains its own copy on its micro-batches, with no communication at all.
    "2 plain processes fp32 packed no comm": (2, "plain", "no", "packed"),
    "FSDP2 bf16 packed": (2, "fsdp2", "bf16", "packed"),
    "FSDP1 bf16 packed": (2, "fsdp1", "bf16", "packed"),
}
TOTAL_THREADS = 2


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                       intermediate_size=args.hidden_size * 8 // 3, num_hidden_layers=args.num_layers,
                       num_attention_heads=args.hidden_size // 64, num_key_value_heads=args.hidden_size // 64,
                       max_position_embeddings=args.max_seq_length, tie_word_embeddings=False, use_cache=False)


def instruction_examples(args, n: int) -> list[dict]:
    """Random token ids with instruction-like lengths: log-normal prompt and completion, loss on the completion."""
    from fsdp_recipes.data import IGNORE_INDEX

    rng = random.Random(args.seed)
    examples = []
    for _ in range(n):
        prompt = min(int(rng.lognormvariate(3.7, 0.8)), args.max_seq_length // 2)  # median 40 tokens
        completion = max(1, min(int(rng.lognormvariate(3.9, 0.9)), args.max_seq_length - prompt))  # median 50
        ids = [rng.randrange(8, args.vocab_size) for _ in range(prompt + completion)]
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return examples


def optimizer_steps(args, data: str) -> list[list[dict]]:
    """warmup + timed steps, each a list of `micro_batches` collated micro-batches (all ranks' together)."""
    import pyarrow as pa

    from fsdp_recipes.data import collate, pack_examples

    n_steps = args.warmup_steps + args.steps
    rows_needed = n_steps * args.micro_batches * (args.pack_batch_size if data == "packed" else args.pad_batch_size)
    # A packed row holds fewer than max_seq_length / 32 examples: their lengths do not grow with max_seq_length.
    examples = instruction_examples(args, rows_needed * (max(16, args.max_seq_length // 32) if data == "packed" else 1))
    if data == "packed":
        rows = pack_examples(pa.Table.from_pylist(examples), args.max_seq_length).to_pylist()
        batch = args.pack_batch_size
    else:
        rows, batch = examples, args.pad_batch_size
    if len(rows) < rows_needed:
        raise SystemExit(f"{len(rows)} {data} rows, {rows_needed} needed: generate more examples per row")
    micro = [collate(rows[i * batch:(i + 1) * batch], pad_token_id=0) for i in range(n_steps * args.micro_batches)]
    return [micro[s * args.micro_batches:(s + 1) * args.micro_batches] for s in range(n_steps)]


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM): rusage's ru_maxrss would also count a larger parent's peak, kept across
    fork and exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def worker(args) -> None:
    """One variant, in this process (and its peers under torchrun); rank 0 prints one RESULT line."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from fsdp_recipes.config import TrainConfig
    from fsdp_recipes.data import IGNORE_INDEX, model_inputs
    from fsdp_recipes.distributed import distributed, exit_process
    from fsdp_recipes.plan import resolve_plan
    from fsdp_recipes.sharding import shard_model
    from fsdp_recipes.trainer import (build_optimizer, clip_grad_norm, forward_backward, step_token_counts,
                                      token_loss_sum)

    _, engine, precision, data = VARIANTS[args.worker]
    with distributed() as env:
        steps = optimizer_steps(args, data)
        per_rank = args.micro_batches // env.world_size
        steps = [s[env.rank * per_rank:(env.rank + 1) * per_rank] for s in steps]
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(model_config(args))
        cfg = TrainConfig(model_name_or_path="bench", dataset_name="bench", mixed_precision=precision,
                          fsdp_version=2 if engine == "plain" else int(engine[-1]), learning_rate=1e-4)
        fewer_collectives = "1-sync" in args.worker
        if fewer_collectives:
            cfg.fsdp_reshard_after_forward, cfg.gradient_sync = False, "last_micro_batch"
        if engine == "plain":
            # The reference a user would write: no FSDP, autocast for bf16, the recipe's loss and AdamW (fused).
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, fused=True)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

            def train_step(micro_batches):
                label_tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
                for mb in micro_batches:
                    with autocast:
                        logits = model(**model_inputs(mb)).logits
                    loss = token_loss_sum(logits, mb["labels"]) / label_tokens
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        else:
            model = shard_model(model, resolve_plan(cfg), env.device)
            optimizer = build_optimizer(model, cfg)

            def train_step(micro_batches):
                # The body of trainer.train_steps()'s loop, without logging.
                label_tokens, *_ = step_token_counts(micro_batches)
                forward_backward(model, micro_batches, label_tokens, env.world_size, env.device,
                                 sync_every_micro_batch=not fewer_collectives)
                clip_grad_norm(model, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        model.train()
        for step in steps[:args.warmup_steps]:
            train_step(step)
        dist.barrier()
        start = time.perf_counter()
        for step in steps[args.warmup_steps:]:
            train_step(step)
        dist.barrier()
        seconds = time.perf_counter() - start
        timed = [mb for step in steps[args.warmup_steps:] for mb in step]
        counts = torch.tensor([float(sum(int(mb["attention_mask"].sum()) for mb in timed)),
                               float(sum(mb["attention_mask"].numel() for mb in timed))], dtype=torch.float64)
        dist.all_reduce(counts)
        rss = [None] * env.world_size
        dist.all_gather_object(rss, round(peak_rss_mb()))
        if env.is_main:
            params = sum(p.numel() for p in LlamaForCausalLM(model_config(args)).parameters())
            print("RESULT " + json.dumps({
                "variant": args.worker, "processes": env.world_size, "threads_per_process": torch.get_num_threads(),
                "parameters": params, "seconds": round(seconds, 3), "real_tokens": int(counts[0]),
                "real_tokens_per_second": round(counts[0].item() / seconds, 1),
                "real_token_share": round(counts[0].item() / counts[1].item(), 3), "peak_rss_mb_per_rank": rss,
            }), flush=True)
    exit_process(0)


def run_variant(name: str, passthrough: list[str]) -> dict:
    processes = VARIANTS[name][0]
    threads = TOTAL_THREADS // processes
    script = [os.path.abspath(__file__), "--worker", name, *passthrough]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *script]
    # A CPU benchmark: on a machine with GPUs the FSDP variants would run there, the reference on the CPU.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(results[0])


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_1_5_15": os.getloadavg(), "torch": torch.__version__}


def reference_of(name: str) -> str:
    """The single-process plain loop on the same precision and data."""
    _, _, precision, data = VARIANTS[name]
    return next(n for n, v in VARIANTS.items() if v == (1, "plain", precision, data))


def missing_references(names: list[str]) -> list[str]:
    """The references of the variants `names` that `names` leaves out: every variant's ratio is to the reference run
    of its round, which a subset such as --variants "FSDP2 fp32 packed" would otherwise lack."""
    return list(dict.fromkeys(reference_of(name) for name in names if reference_of(name) not in names))


def summarize(name: str, runs: dict[str, list[dict]]) -> dict:
    """A variant's median tokens/s over its runs, and the median of its ratios to the reference run of each round."""
    mine = runs[name]
    result = {k: mine[0][k] for k in ("variant", "processes", "threads_per_process", "parameters", "real_tokens",
                                      "real_token_share")}
    result["real_tokens_per_second"] = statistics.median(r["real_tokens_per_second"] for r in mine)
    result["real_tokens_per_second_of_each_run"] = [r["real_tokens_per_second"] for r in mine]
    result["peak_rss_mb_per_rank"] = [max(rss) for rss in zip(*(r["peak_rss_mb_per_rank"] for r in mine))]
    ratios = [r["real_tokens_per_second"] / ref["real_tokens_per_second"]
              for r, ref in zip(mine, runs[reference_of(name)])]
    result["ratio_to_reference_of_each_round"] = [round(x, 3) for x in ratios]
    result["ratio_to_reference"] = round(statistics.median(ratios), 2)
    return result


def print_table(results: list[dict]) -> None:
    header = f"{'variant':40s} {'procs x threads':>15s} {'real tok/s':>10s} {'vs ref':>7s} {'real share':>10s}  peak RSS per rank (MB)"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['variant']:40s} {r['processes']:>8d} x {r['threads_per_process']:<4d} "
              f"{r['real_tokens_per_second']:10.0f} {r['ratio_to_reference']:7.2f} {r['real_token_share']:10.2f}  "
              f"{', '.join(map(str, r['peak_rss_mb_per_rank']))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds, each running every variant once; medians are reported")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    model = parser.add_argument_group("model and data (passed on to every variant)")
    model.add_argument("--vocab_size", type=int, default=32000)
    model.add_argument("--hidden_size", type=int, default=320)
    model.add_argument("--num_layers", type=int, default=4)
    model.add_argument("--max_seq_length", type=int, default=512)
    model.add_argument("--pack_batch_size", type=int, default=1, help="packed rows per micro-batch")
    model.add_argument("--pad_batch_size", type=int, default=4, help="padded examples per micro-batch")
    model.add_argument("--micro_batches", type=int, default=4, help="per optimizer step, all ranks together")
    model.add_argument("--warmup_steps", type=int, default=1)
    model.add_argument("--steps", type=int, default=2)
    model.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # found before the runs, not after
        raise SystemExit(f"--out {args.out}: no such folder to write the JSON into")
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a round would run it twice, and its runs would pair with the wrong ones of the reference
        raise SystemExit(f"variants named more than once: {twice}; name each once")
    # Caught here, not as a traceback from the workers (or from the summary, after every run, for --repeats 0).
    for name in ["repeats", "steps", "micro_batches", "pack_batch_size", "pad_batch_size", "vocab_size",
                 "num_layers", "max_seq_length"]:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        raise SystemExit(f"--warmup_steps must be at least 0, got {args.warmup_steps}")
    if args.hidden_size < 64:  # one attention head per 64 of the hidden size
        raise SystemExit(f"--hidden_size must be at least 64 (one attention head per 64), got {args.hidden_size}")
    # 2 processes split each step's micro-batches: an odd count would leave one out of theirs, not the reference's.
    if args.micro_batches % 2 and any(VARIANTS[n][0] == 2 for n in names):
        raise SystemExit(f"--micro_batches {args.micro_batches} does not split over 2 processes: pass an even count")
    added = missing_references(names)
    if added:
        print(f"adding {', '.join(added)}: each variant's ratio is to the reference run of its round", flush=True)
        names = added + names
    passthrough = [f"--{k}={v}" for k, v in vars(args).items()
                   if k not in ("out", "variants", "repeats", "worker")]
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['load_average_1_5_15']}, "
          f"torch {info['torch']}", flush=True)
    runs = {name: [] for name in names}
    for round_ in range(args.repeats):
        # One round runs every variant once: a ratio compares two runs close in time, on a machine whose speed drifts.
        for name in names:
            runs[name].append(run_variant(name, passthrough))
            print(f"  round {round_ + 1}, {name}: {runs[name][-1]['real_tokens_per_second']:.0f} real tokens/s",
                  flush=True)
    results = [summarize(name, runs) for name in names]
    print()
    print_table(results)
    summary = {"machine": {**info, "load_average_after": os.getloadavg()}, "settings": vars(args), "results": results}
    by_name = {r["variant"]: r for r in results}
    if {"FSDP2 fp32 packed", "FSDP2 fp32 padded"} <= by_name.keys():
        summary["packing_speedup"] = round(by_name["FSDP2 fp32 packed"]["real_tokens_per_second"]
                                           / by_name["FSDP2 fp32 padded"]["real_tokens_per_second"], 2)
        print(f"\npacking raises FSDP2's real tokens/s by {summary['packing_speedup']}x over padding")
    print(f"load average at the end: {summary['machine']['load_average_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
