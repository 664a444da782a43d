"""Checkpoint cost as the model grows: time and peak memory of a sharded save, a full save, a resume from each, and
the conversion of the sharded checkpoint to a Hugging Face folder.

    python bench/checkpoint_bench.py --work_dir /tmp/checkpoint_bench [--num_layers 1,5,15,34]

Llamas of 1024 hidden and a 32k vocabulary (untied) with 1, 5, 15 and 34 layers hold 0.31, 0.52, 1.03 and 2.01 GB
of fp32 weights. Each size runs in 2 fresh processes (FSDP2, gloo): the model is sharded, and one AdamW step on zero
gradients fills the optimizer state (twice the model), so the checkpoints have their real size. Each phase first
returns the memory that earlier phases freed to the system (glibc's malloc_trim: a phase reusing it would not raise
the RSS), resets the kernel's peak-RSS counter of both ranks (/proc/self/clear_refs) and reports the largest peak of
the two, and the larger of the two ranks' increases, a rank's peak minus its RSS before the phase ("extra"). The conversion runs as its own process (as a user runs
it), with --max_shard_size 100MB, so that the largest output file is the largest tensor; its "extra" is its peak
anonymous memory above that of a process that only imports the converter (anonymous: the RSS also counts shared
library pages, which vary between processes by up to 100 MB with a CUDA build of torch). Each size's files are
deleted before the next.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_bench import measure  # noqa: E402  (a sibling script)


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def return_freed_heap_memory() -> None:
    """Give the pages of freed memory that glibc keeps in its heaps back to the system (malloc_trim). An earlier
    phase's freed tensors stay there otherwise, and a later phase that reuses them adds nothing to the RSS: its own
    memory would go uncounted. Not glibc: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def measure_phase(name: str, fn) -> dict:
    """Run `fn` on every rank; its time, the largest peak RSS of the ranks, and the largest increase of a rank's
    peak over its RSS before the phase."""
    dist.barrier()
    return_freed_heap_memory()
    before = rss_mb("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (rss_mb("VmHWM:"), rss_mb("VmHWM:") - before))
    return {"phase": name, "seconds": round(seconds, 2), "peak_rss_mb": round(max(p[0] for p in peaks)),
            "extra_rss_mb": round(max(p[1] for p in peaks))}


def worker(work_dir: str, num_layers: int, hidden_size: int, vocab_size: int) -> None:
    """On each of 2 ranks: build, shard, step, then time each phase; rank 0 prints one RESULT line."""
    from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

    from fsdp_recipes import demo
    from fsdp_recipes.checkpoint import load_checkpoint, save_checkpoint
    from fsdp_recipes.config import TrainConfig
    from fsdp_recipes.distributed import distributed, exit_process
    from fsdp_recipes.plan import resolve_plan
    from fsdp_recipes.sharding import shard_model
    from fsdp_recipes.trainer import build_optimizer

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
                         num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
                         num_key_value_heads=hidden_size // 64, tie_word_embeddings=False, use_cache=False)
    with distributed() as env:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest_tensor = max(p.numel() * p.element_size() for p in model.parameters())
        cfg = TrainConfig(model_name_or_path="bench", dataset_name="bench", output_dir=work_dir,
                          mixed_precision="no", save_steps=1)
        model = shard_model(model, resolve_plan(cfg), env.device)
        optimizer = build_optimizer(model, cfg)
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # fills exp_avg and exp_avg_sq: the optimizer state gets its real size
        optimizer.zero_grad(set_to_none=True)
        scheduler = get_scheduler("constant", optimizer)
        tokenizer = demo.build_tokenizer()
        paths = {}

        def save(fmt, step):
            cfg.save_state_dict_type = fmt
            paths[fmt] = save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, step, 0, None)

        phases = [measure_phase("sharded save", lambda: save("sharded", 1)),
                  measure_phase("full save", lambda: save("full", 2)),
                  measure_phase("resume (sharded)", lambda: load_checkpoint(paths["sharded"], model, optimizer,
                                                                            scheduler)),
                  measure_phase("resume (full)", lambda: load_checkpoint(paths["full"], model, optimizer, scheduler))]
        if env.is_main:
            print("RESULT " + json.dumps({"num_layers": num_layers, "model_bytes": model_bytes,
                                          "largest_tensor_bytes": largest_tensor, "sharded_checkpoint": paths["sharded"],
                                          "phases": phases}), flush=True)
    exit_process(0)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", required=True, help="a new or empty folder (needs about 7x the largest model)")
    parser.add_argument("--num_layers", default="1,5,15,34", help="comma-separated: one model size each")
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.work_dir, args.worker, args.hidden_size, args.vocab_size)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # found before the runs, not after
        raise SystemExit(f"--out {args.out}: no such folder to write the JSON into")
    if os.path.exists(args.work_dir) and os.listdir(args.work_dir):
        raise SystemExit(f"{args.work_dir} is not empty: the benchmark writes fresh checkpoints there")
    # Caught here, not as a traceback (a ValueError, or the workers' errors for a model of 0 layers or heads).
    sizes = args.num_layers.split(",")
    if not all(n.strip().isdigit() and int(n) > 0 for n in sizes):
        raise SystemExit(f"--num_layers must be comma-separated positive integers, got {args.num_layers!r}")
    if args.hidden_size < 64 or args.vocab_size < 1:  # one attention head per 64 of the hidden size
        raise SystemExit(f"--hidden_size must be at least 64 (one attention head per 64) and --vocab_size at least 1, "
                         f"got {args.hidden_size} and {args.vocab_size}")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # the CPU's memory is measured
    _, _, import_anon_mb = measure([sys.executable, "-c", "import fsdp_recipes.convert"])
    print(f"load average {os.getloadavg()}; the converter's imports alone: {import_anon_mb:.0f} MB anonymous",
          flush=True)
    results = []
    for num_layers in map(int, sizes):
        run_dir = os.path.join(args.work_dir, f"layers_{num_layers}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), "--work_dir", run_dir, "--worker", str(num_layers),
               "--hidden_size", str(args.hidden_size), "--vocab_size", str(args.vocab_size)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{num_layers} layers failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(lines[0])
        result["sharded_checkpoint_bytes"] = folder_bytes(result["sharded_checkpoint"])
        hf_dir = os.path.join(run_dir, "hf")
        seconds, peak_mb, peak_anon_mb = measure([sys.executable, "-m", "fsdp_recipes.convert",
                                                  result["sharded_checkpoint"], hf_dir, "--max_shard_size", "100MB"])
        largest_file = max(os.path.getsize(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir)
                           if n.endswith(".safetensors"))
        result["phases"].append({"phase": "convert (100MB files)", "seconds": round(seconds, 2),
                                 "peak_rss_mb": round(peak_mb), "extra_rss_mb": round(peak_anon_mb - import_anon_mb)})
        result["largest_output_file_bytes"] = largest_file
        results.append(result)
        shutil.rmtree(run_dir)
        print(f"  {result['model_bytes'] / 1e9:.2f} GB done", flush=True)

    print(f"\n{'model':>9s} {'checkpoint':>10s}  {'phase':22s} {'time s':>7s} {'peak RSS MB':>11s} {'extra MB':>8s}")
    for r in results:
        for i, p in enumerate(r["phases"]):
            size = (f"{r['model_bytes'] / 1e9:6.2f} GB", f"{r['sharded_checkpoint_bytes'] / 1e9:7.2f} GB") if i == 0 \
                else ("", "")
            print(f"{size[0]:>9s} {size[1]:>10s}  {p['phase']:22s} {p['seconds']:7.1f} {p['peak_rss_mb']:11d} "
                  f"{p['extra_rss_mb']:8d}")
        convert_extra = r["phases"][-1]["extra_rss_mb"]
        print(f"{'':21s}  converter extra / largest output file ({r['largest_output_file_bytes'] / 2**20:.0f} MB): "
              f"{convert_extra / (r['largest_output_file_bytes'] / 2**20):.2f}")
    print(f"load average at the end: {os.getloadavg()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_average_after": os.getloadavg(), "converter_import_anon_mb": import_anon_mb,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
