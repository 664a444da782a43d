"""The recipe under every launcher: alone, `torchrun` on one node, and the README's SLURM command on 2 nodes x 1
process (two launchers on 127.0.0.1 meeting by c10d rendezvous). Same data, same steps: same losses and weights."""

import os
import socket
import stat
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import REPO, read_metrics, run, subprocess_env
from test_readme import readme_commands

# 4 sequences per step: 1 rank x 2 micro-batches of 2, or 2 ranks x 1 of 2. A learning rate large enough that
# steps 2 and 3 depend on the updates before them.
TRAIN_ARGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
              "--logging_steps", "1", "--learning_rate", "1e-3", "--warmup_steps", "0", "--mixed_precision", "no",
              "--save_dtype", "float32"]

# Stand-ins for SLURM on one machine: `scontrol show hostnames` names 127.0.0.1 as node 0, and `srun` starts its
# command once per node, at the same time, each with its SLURM_NODEID, and fails if either fails.
SCONTROL = '#!/bin/sh\necho 127.0.0.1\necho 127.0.0.1\n'
SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
SLURM_NODEID=0 "$@" & node0=$!
SLURM_NODEID=1 "$@" & node1=$!
wait $node0 && wait $node1
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses(out) -> list[float]:
    return [m["loss"] for m in read_metrics(out / "metrics.jsonl")]


def fake_slurm(bin_dir):
    bin_dir.mkdir()
    for name, text in [("scontrol", SCONTROL), ("srun", SRUN)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def test_two_nodes_torchrun_and_one_process_train_the_same(tiny, tmp_path):
    common = ["--model_name_or_path", tiny["model"], *TRAIN_ARGS]
    [sbatch] = [c for c in readme_commands() if c.startswith("sbatch ")]
    readme_args = sbatch.split()[2:]
    assert readme_args == ["--dataset_name", "my_data.jsonl", "--output_dir", "/shared/outputs/llama"]

    # 2 nodes x 1 process: the README's command, with bash for sbatch, each node running slurm/launch_node.sh.
    env = subprocess_env(PATH=os.pathsep.join([str(fake_slurm(tmp_path / "bin")), os.path.dirname(sys.executable),
                                               os.environ["PATH"]]),
                         SLURM_NNODES="2", SLURM_GPUS_ON_NODE="1", SLURM_JOB_NODELIST="node[0-1]",
                         SLURM_JOB_ID="1", MASTER_PORT=str(free_port()))
    nodes = subprocess.run(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", str(tiny["data"]),
                            "--output_dir", str(tmp_path / "nodes"), *map(str, common),
                            "--gradient_accumulation_steps", "1"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert nodes.returncode == 0, nodes.stdout[-4000:] + nodes.stderr[-4000:]
    # Replicated across the 2 nodes (accelerate's parallelism_config, set by launch_node.sh), sharded within each.
    assert "engine: FSDP2 (fully_shard) over 2 ranks" in nodes.stdout
    assert "strategy: HSDP (replicate x shard) mesh 2 x 1, reshard_after_forward=True" in nodes.stdout

    data = ["--config", "recipes/configs/llama_sft.yaml", "--dataset_name", tiny["data"], *common]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "recipes/llama_sft.py",
         *data, "--gradient_accumulation_steps", "1", "--output_dir", tmp_path / "torchrun"])
    alone = run([sys.executable, "recipes/llama_sft.py", *data, "--gradient_accumulation_steps", "2",
                 "--output_dir", tmp_path / "alone"])
    assert "over 1 ranks" in alone.stdout

    reference = losses(tmp_path / "alone")
    assert len(reference) == 3 and reference[2] < reference[0] - 0.1  # it trains
    weights = load_file(tmp_path / "alone" / "final" / "model.safetensors")
    for out in ["torchrun", "nodes"]:
        assert losses(tmp_path / out) == pytest.approx(reference, rel=1e-5), out
        exported = load_file(tmp_path / out / "final" / "model.safetensors")
        assert exported.keys() == weights.keys()
        for name, tensor in weights.items():
            assert (exported[name].float() - tensor.float()).abs().max() <= 1e-5, (out, name)
