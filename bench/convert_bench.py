"""Time and peak memory of `python -m fsdp_recipes.convert` against `accelerate merge-weights`, on one checkpoint.

    python bench/convert_bench.py --work_dir /tmp/convert_bench [--hidden_size 1024 --num_layers 16] [--num_experts 16]

The default Llama (1024 hidden, 16 layers, 32k vocabulary, untied) has 270M parameters: 1.08 GB of fp32 weights.
With --num_experts, a Qwen3-MoE of those sizes instead (experts of intermediate size 2 x hidden), whose fused
expert tensors the converter writes as per-expert matrices.
It is written once with the project's own save_checkpoint (one process, sharded format), then each converter
runs in its own process, and its peak RSS (VmHWM) and anonymous memory are read from /proc. Both write fp32
safetensors; accelerate always writes one file, the project's converter files of at most --max_shard_size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
from safetensors import safe_open


def make_checkpoint(work_dir: str, hidden_size: int, num_layers: int, vocab_size: int, num_experts: int
                    ) -> tuple[str, int, int]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig, get_scheduler

    from fsdp_recipes import demo
    from fsdp_recipes.checkpoint import save_checkpoint
    from fsdp_recipes.config import TrainConfig
    from fsdp_recipes.distributed import distributed
    from fsdp_recipes.trainer import build_optimizer

    tokenizer = demo.build_tokenizer()
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=int(hidden_size * 2.75),
                 num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
                 num_key_value_heads=hidden_size // 64, tie_word_embeddings=False)
    config = (Qwen3MoeConfig(**sizes, head_dim=64, num_experts=num_experts, num_experts_per_tok=2,
                             moe_intermediate_size=2 * hidden_size) if num_experts else LlamaConfig(**sizes))
    cfg = TrainConfig(model_name_or_path="bench", dataset_name="bench", output_dir=work_dir, save_steps=1,
                      save_state_dict_type="sharded")
    with distributed():  # a one-process group in memory
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        optimizer = build_optimizer(model, cfg)  # no step taken: the save still fills Adam's moments, 2x the model
        scheduler = get_scheduler("constant", optimizer)
        path = save_checkpoint(cfg, model, optimizer, scheduler, tokenizer, step=1, epoch=0, wandb_run=None)
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return path, sum(sizes), max(sizes)


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """Wall time in seconds, peak RSS in MB and peak anonymous memory in MB of `cmd`, run as its own process.

    The peak RSS is the process's VmHWM, read from /proc (rusage's ru_maxrss would also count this large parent,
    whose memory the child shares until its exec). It includes the pages of the shared libraries the process has
    touched, which vary by up to 100 MB from run to run with a CUDA build of torch; the anonymous memory (RssAnon:
    what the process allocated, tensors included) does not, and is the largest of its values polled every 10 ms.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak_kb = peak_anon_kb = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                status = {line.split(":")[0]: int(line.split()[1])
                          for line in f if line.startswith(("VmHWM:", "RssAnon:"))}
            peak_kb, peak_anon_kb = max(peak_kb, status["VmHWM"]), max(peak_anon_kb, status["RssAnon"])
        except (FileNotFoundError, ProcessLookupError, KeyError):
            pass  # the process ended between poll() and open(), or while its status was read
        time.sleep(0.01)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return time.perf_counter() - start, peak_kb / 1024, peak_anon_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", required=True, help="an empty or new folder (needs about 5x the model size on disk)")
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--num_layers", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--max_shard_size", default="100MB")
    parser.add_argument("--num_experts", type=int, default=0, help="a Qwen3-MoE with this many experts per layer")
    args = parser.parse_args()
    if os.path.exists(args.work_dir) and os.listdir(args.work_dir):
        raise SystemExit(f"{args.work_dir} is not empty: the benchmark writes a fresh checkpoint there")
    from fsdp_recipes.config import ConfigError, shard_size_in_bytes

    try:  # the converter would refuse it only after the checkpoint is written (minutes at the default size)
        shard_size_in_bytes(args.max_shard_size)
    except ConfigError as error:
        raise SystemExit(f"--max_shard_size: {error}")

    checkpoint, size, largest_tensor = make_checkpoint(args.work_dir, args.hidden_size, args.num_layers,
                                                       args.vocab_size, args.num_experts)
    python = sys.executable
    tools = {
        "baseline (python -c 'import fsdp_recipes.convert')": [python, "-c", "import fsdp_recipes.convert"],
        f"fsdp_recipes.convert (--max_shard_size {args.max_shard_size})":
            [python, "-m", "fsdp_recipes.convert", checkpoint, os.path.join(args.work_dir, "ours"),
             "--dtype", "fp32", "--max_shard_size", args.max_shard_size],
        "baseline (python -c 'import accelerate.commands.accelerate_cli')":
            [python, "-c", "import accelerate.commands.accelerate_cli"],
        "accelerate merge-weights": [python, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                                     os.path.join(checkpoint, "model"), os.path.join(args.work_dir, "accelerate")],
    }
    results = {}
    for name, cmd in tools.items():
        seconds, peak_mb, peak_anon_mb = measure(cmd)
        results[name] = {"seconds": round(seconds, 2), "peak_rss_mb": round(peak_mb),
                         "peak_anon_mb": round(peak_anon_mb)}
    ours = os.path.join(args.work_dir, "ours")
    files = [os.path.join(ours, name) for name in os.listdir(ours) if name.endswith(".safetensors")]
    largest_file = max(os.path.getsize(file) for file in files)
    largest_output_tensor = 0  # fp32: 4 bytes an element
    for file in files:
        with safe_open(file, "pt") as f:
            largest_output_tensor = max(largest_output_tensor,
                                        *(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys()))
    print(f"checkpoint: {checkpoint}, model weights {size / 1e9:.2f} GB (fp32), largest tensor "
          f"{largest_tensor / 1e6:.0f} MB, largest output tensor {largest_output_tensor / 1e6:.0f} MB, largest "
          f"output file {largest_file / 1e6:.0f} MB")
    for name, r in results.items():
        print(f"{name:70s} {r['seconds']:8.2f} s {r['peak_rss_mb']:8d} MB peak RSS, "
              f"{r['peak_anon_mb']:8d} MB anonymous")
    print(json.dumps({"model_bytes": size, "largest_tensor_bytes": largest_tensor,
                      "largest_output_tensor_bytes": largest_output_tensor, "largest_output_file_bytes": largest_file,
                      "results": results}))


if __name__ == "__main__":
    main()
