"""The recipe under every launcher: alone, `torchrun` on one node, and the README's SLURM command on 2 nodes x 1
process (two launchers on 127.0.0.1 meeting by c10d rendezvous). Same data, same steps: same losses and weights.
And what slurm/launch_node.sh asks of accelerate, through accelerate's and torchrun's own code."""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.run as torchrun
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import _filter_args, prepare_multi_gpu_env
from safetensors.torch import load_file
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from conftest import REPO, read_metrics, run, subprocess_env
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.distributed import check_started_by_a_launcher, init_distributed, long_wait_group
from fsdp_recipes.plan import resolve_plan
from fsdp_recipes.sharding import build_mesh
from test_accelerate_configs import process_group_of
from test_readme import readme_commands

# 4 sequences per step: 1 rank x 2 micro-batches of 2, or 2 ranks x 1 of 2. A learning rate large enough that
# steps 2 and 3 depend on the updates before them.
TRAIN_ARGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--max_seq_length", "64",
              "--logging_steps", "1", "--learning_rate", "1e-3", "--warmup_steps", "0", "--mixed_precision", "no",
              "--save_dtype", "float32"]

# Stand-ins for SLURM on one machine: `scontrol show hostnames` names 127.0.0.1 as node 0, and `srun` starts its
# command once per node, at the same time, each with its SLURM_NODEID (and the step's task count); as with
# --kill-on-bad-exit, a node that fails stops the other.
SCONTROL = '#!/bin/sh\necho 127.0.0.1\necho 127.0.0.1\n'
SRUN = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
export SLURM_STEP_NUM_TASKS=2
SLURM_NODEID=0 "$@" & node0=$!
SLURM_NODEID=1 "$@" & node1=$!
for _ in 0 1; do wait -n || { kill $node0 $node1 2>/dev/null; exit 1; }; done
"""


# A stand-in for the `accelerate` command: it records the arguments it is given, one a line, next to itself.
ACCELERATE = '#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\n'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses(out) -> list[float]:
    return [m["loss"] for m in read_metrics(out / "metrics.jsonl")]


# srun for a one-node job: the node's task alone.
SRUN_ONE_NODE = """#!/bin/bash
while [[ $1 == -* ]]; do shift; done
SLURM_STEP_NUM_TASKS=1 SLURM_NODEID=0 exec "$@"
"""


def fake_slurm(bin_dir, srun: str = SRUN):
    bin_dir.mkdir()
    for name, text in [("scontrol", SCONTROL), ("srun", srun)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def launch_node_args(tmp_path, node_rank: int, nnodes: int, gpus_per_node: int, port: int,
                     **env: str) -> argparse.Namespace:
    """The arguments slurm/launch_node.sh gives `accelerate launch` on node `node_rank` of `nnodes` x
    `gpus_per_node` (with MASTER_ADDR 127.0.0.1, and `env`: ACCELERATE_CONFIG), as accelerate's own launcher code
    parses and completes them before it starts torchrun."""
    bin_dir = tmp_path / f"node{node_rank}_bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "accelerate").write_text(ACCELERATE)
    (bin_dir / "accelerate").chmod(stat.S_IRWXU)
    run(["bash", "slurm/launch_node.sh", "recipes/llama_sft.py"], PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        NNODES=str(nnodes), NODE_RANK=str(node_rank), GPUS_PER_NODE=str(gpus_per_node), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), **env)
    command, *argv = (bin_dir / "accelerate.args").read_text().splitlines()
    assert command == "launch"
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    return args


def launch_node_env(tmp_path, nnodes: int, gpus_per_node: int, **env: str) -> dict[str, str]:
    """The environment each process of node 0 gets under slurm/launch_node.sh: what `accelerate launch` sets, and
    the WORLD_SIZE and LOCAL_WORLD_SIZE torchrun adds."""
    args = launch_node_args(tmp_path, 0, nnodes, gpus_per_node, free_port(), **env)
    env = prepare_multi_gpu_env(args)
    env.update(WORLD_SIZE=str(args.num_processes), LOCAL_WORLD_SIZE=args.nproc_per_node)
    return env


def test_launch_node_refuses_what_would_fail_late(tmp_path):
    """A config path that is not there (misspelt, or launch_node.sh run from outside the repository's root) would be
    accelerate's traceback on every node; node ranks counted from 1 would leave the rendezvous without a host, each
    node waiting 10 minutes for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text(ACCELERATE)
    (bin_dir / "accelerate").chmod(stat.S_IRWXU)
    nodes = dict(NNODES="2", NODE_RANK="1", GPUS_PER_NODE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def launch_node(cwd=REPO, **env: str) -> str:
        proc = subprocess.run(["bash", str(REPO / "slurm" / "launch_node.sh"), "recipes/llama_sft.py"], cwd=cwd,
                              env=subprocess_env(**{**nodes, **env}), capture_output=True, text=True)
        assert proc.returncode == 2 and not (bin_dir / "accelerate.args").exists()
        return proc.stderr

    assert launch_node(ACCELERATE_CONFIG="accelerate_configs/fsdp2_cpu.yml") == (
        f"error: ACCELERATE_CONFIG accelerate_configs/fsdp2_cpu.yml: no such file in {REPO}: set ACCELERATE_CONFIG to "
        "the config's path\n")
    assert launch_node(cwd=tmp_path, ACCELERATE_CONFIG="accelerate_configs/fsdp2.yaml").startswith(
        f"error: ACCELERATE_CONFIG accelerate_configs/fsdp2.yaml: no such file in {tmp_path}:")
    for wrong in [dict(NODE_RANK="2"), dict(NODE_RANK="-1"), dict(NNODES="two"), dict(GPUS_PER_NODE="0")]:
        values = {**nodes, **wrong}
        assert launch_node(**wrong) == (
            f"error: NNODES={values['NNODES']}, GPUS_PER_NODE={values['GPUS_PER_NODE']} and "
            f"NODE_RANK={values['NODE_RANK']}: the first two must be positive whole numbers, NODE_RANK one from 0 to "
            "NNODES-1\n")
    # From another directory (a recipe of one's own, run from its folder) the default config is the project's.
    subprocess.run(["bash", str(REPO / "slurm" / "launch_node.sh"), "train.py"], cwd=tmp_path,
                   env=subprocess_env(**{**nodes, "NODE_RANK": "0"}), check=True)
    assert (bin_dir / "accelerate.args").read_text().splitlines()[:3] == [
        "launch", "--config_file", f"{REPO}/accelerate_configs/fsdp2_hsdp_multinode.yaml"]


def test_each_node_waits_ten_minutes_for_the_rendezvous(tmp_path):
    """Node 0's launcher hosts the rendezvous store; another node's waits read_timeout seconds for it (torch's
    default, 60 s, gave up after about 2.5 minutes), node 0's waits join_timeout for the others (torch's default,
    600 s). launch_node.sh's read_timeout, as accelerate hands it to torchrun, reaches both nodes' store."""
    port = free_port()
    handlers = []  # kept open until both nodes have connected
    for node_rank in (0, 1):
        args = launch_node_args(tmp_path, node_rank, nnodes=2, gpus_per_node=1, port=port)
        assert args.use_fsdp  # accelerate starts FSDP runs through its multi_gpu_launcher, which does what follows
        prepare_multi_gpu_env(args)
        launcher = torchrun.config_from_args(_filter_args(args, torchrun.get_args_parser(), [
            "--training_script", args.training_script, "--training_script_args", args.training_script_args]))[0]
        assert launcher.rdzv_configs["is_host"] == str(node_rank == 0).lower()
        # What torchrun's agent then builds (its c10d handler): node 0 hosts the store on MASTER_PORT, node 1
        # connects to it.
        params = RendezvousParameters(launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.run_id,
                                      launcher.min_nodes, launcher.max_nodes, **launcher.rdzv_configs)
        assert params.endpoint == f"127.0.0.1:{port}"
        backend, store = create_backend(params)
        handlers.append(create_handler(store, backend, params))
        assert store.timeout == timedelta(seconds=600)
        assert handlers[-1].settings.timeout.join == timedelta(seconds=600)


def test_the_process_group_meets_on_a_port_of_rank_0_s_node(tmp_path):
    """The README: MASTER_PORT is the rendezvous' alone; the ranks' own store is on rank 0's node, at its hostname and
    a port torch picks."""
    script = tmp_path / "show_env.py"
    script.write_text("import json, os\nprint(json.dumps({k: os.environ[k] for k in ['RANK', 'MASTER_ADDR', "
                      "'MASTER_PORT']}))\n")
    port = free_port()
    nodes = dict(NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 ACCELERATE_CONFIG="accelerate_configs/fsdp2_cpu.yaml",
                 PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    launch = [["bash", "slurm/launch_node.sh", str(script)]] * 2
    node1 = subprocess.Popen(launch[1], cwd=REPO, env=subprocess_env(**nodes, NODE_RANK="1"), stdout=subprocess.PIPE,
                             text=True)
    node0 = run(launch[0], timeout=120, **nodes, NODE_RANK="0")
    assert node1.wait(timeout=120) == 0
    seen = [json.loads(line) for line in node0.stdout.splitlines() + node1.stdout.read().splitlines()
            if line.startswith("{")]
    node1.stdout.close()
    assert sorted(rank["RANK"] for rank in seen) == ["0", "1"]
    [(address, rank_0_port)] = {(rank["MASTER_ADDR"], rank["MASTER_PORT"]) for rank in seen}
    assert address == socket.getfqdn() and rank_0_port != str(port)


def test_the_launchers_give_their_ranks_the_time_sigterm_comes_early(tmp_path, monkeypatch):
    """sft_multinode.sbatch asks for SIGTERM 120 s before the time limit, and gives the launchers as long between their
    own SIGTERM and killing their ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch 2.12 and later), for a step and a
    save: the value reaches torchrun's launch config through accelerate's launcher code."""
    [signal_line] = [line for line in (REPO / "slurm" / "sft_multinode.sbatch").read_text().splitlines()
                     if line.startswith("#SBATCH --signal=")]
    assert signal_line == "#SBATCH --signal=TERM@120"
    # srun records the variable each node's launcher gets.
    bin_dir = fake_slurm(tmp_path / "bin", '#!/bin/sh\necho "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$0.env"\n')
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    run(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", "d.jsonl"], SLURM_NNODES="2", SLURM_CPUS_PER_TASK="1",
        SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    shutdown_timeout = (bin_dir / "srun.env").read_text().strip()
    assert shutdown_timeout == "120"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", shutdown_timeout)
    args = launch_node_args(tmp_path, 0, nnodes=2, gpus_per_node=1, port=free_port())
    launcher = torchrun.config_from_args(_filter_args(args, torchrun.get_args_parser(), [
        "--training_script", args.training_script, "--training_script_args", args.training_script_args]))[0]
    if torch.__version__ >= "2.12":  # torch 2.11 kills the ranks 30 s after the launcher's SIGTERM
        assert launcher.shutdown_timeout == 120


def test_a_preemption_sigterm_to_the_batch_script_reaches_srun(tmp_path):
    """SLURM signals the batch script too at a pre-emption: the script is srun (exec), which passes the signal on to
    the launchers, where a shell waiting for srun would die of it and end the job; and a requeued job, of the same
    job id, appends to its log."""
    assert "#SBATCH --open-mode=append" in (REPO / "slurm" / "sft_multinode.sbatch").read_text().splitlines()
    # srun records its pid, then waits for a SIGTERM, which it records.
    bin_dir = fake_slurm(tmp_path / "bin", '#!/bin/bash\ntrap \'echo TERM > "$0.term"; kill $!; exit 143\' TERM\n'
                                           'echo $$ > "$0.pid"\nsleep 60 & wait\n')
    env = subprocess_env(SLURM_NNODES="2", SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1",
                         PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "fsdp-sft-1.out"  # a file, as SLURM's: a pipe would stay open in a child the script left
    with open(log, "w") as out, subprocess.Popen(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", "d.jsonl"],
                                                 cwd=REPO, env=env, stdout=out) as script:
        for _ in range(200):
            if (bin_dir / "srun.pid").is_file() and (bin_dir / "srun.pid").read_text().strip():
                break
            time.sleep(0.05)
        srun_pid = int((bin_dir / "srun.pid").read_text())
        script.terminate()
        script.wait(timeout=30)
    if srun_pid != script.pid:  # a child of the dead script, still waiting
        os.kill(srun_pid, signal.SIGTERM)
    assert (srun_pid, script.returncode, (bin_dir / "srun.term").is_file()) == (script.pid, 143, True)
    assert log.read_text() == ("running recipes/llama_sft.py --config recipes/configs/llama_sft.yaml on 2 nodes of 8 "
                               "GPUs (rendezvous 127.0.0.1:20001)\n")


@pytest.mark.parametrize("accelerate_config, recipe_args, mesh", [
    # The default: HSDP, replicated across the nodes, sharded over each node's GPUs.
    (None, [], (2, 8)),
    # A config without parallelism_config: sharded over every GPU of every node; so is dp_replicate_size 1.
    ("accelerate_configs/fsdp2.yaml", [], (16,)),
    ("accelerate_configs/fsdp1.yaml", [], (16,)),  # any accelerate config: FSDP1's FULL_SHARD
    (None, ["--dp_replicate_size", "1"], (16,)),
    (None, ["--fsdp_version", "1", "--dp_replicate_size", "1"], (16,)),  # FSDP1's FULL_SHARD
    # Another layout on 2 nodes of 8 GPUs: the recipe config's dp_replicate_size wins.
    (None, ["--dp_replicate_size", "4"], (4, 4)),
])
def test_the_layout_on_2_nodes_of_8_gpus(tmp_path, monkeypatch, accelerate_config, recipe_args, mesh):
    """The meshes the README's Multi-node section gives for launch_node.sh, through accelerate's launcher code."""
    env = {"ACCELERATE_CONFIG": accelerate_config} if accelerate_config else {}
    for key, value in launch_node_env(tmp_path, nnodes=2, gpus_per_node=8, **env).items():
        monkeypatch.setenv(key, value)
    plan = resolve_plan(parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *recipe_args]))
    with process_group_of(16):
        build_mesh(plan, torch.device("cpu"))
    assert plan.mesh_shape == mesh


def test_two_nodes_torchrun_and_one_process_train_the_same(tiny, tmp_path):
    common = ["--model_name_or_path", tiny["model"], *TRAIN_ARGS]

    # 2 nodes x 1 process: the README's command, with bash for sbatch, each node running slurm/launch_node.sh.
    [sbatch] = [c for c in readme_commands() if c.startswith("sbatch ")]
    local = {"my_data.jsonl": str(tiny["data"]), "/shared/outputs/llama": str(tmp_path / "nodes")}
    command = ["bash", *[local.get(a, a) for a in sbatch.split()[1:]], *map(str, common),
               "--gradient_accumulation_steps", "1"]
    assert command[1] == "slurm/sft_multinode.sbatch" and str(tmp_path / "nodes") in command
    # What sbatch sets for a 2-node job of 1 GPU per node; the port is a free one here.
    slurm = dict(SLURM_NNODES="2", SLURM_GPUS_ON_NODE="1", SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="node[0-1]",
                 SLURM_JOB_ID="1", MASTER_PORT=str(free_port()))
    path = os.pathsep.join([str(fake_slurm(tmp_path / "bin")), os.path.dirname(sys.executable), os.environ["PATH"]])
    env = subprocess_env(PATH=path, **slurm)
    nodes = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert nodes.returncode == 0, nodes.stdout[-4000:] + nodes.stderr[-4000:]
    # Replicated across the 2 nodes (accelerate's parallelism_config, set by launch_node.sh), sharded within each.
    assert "engine: FSDP2 (fully_shard) over 2 ranks" in nodes.stdout
    assert "strategy: HSDP (replicate x shard) mesh 2 x 1, reshard_after_forward=True" in nodes.stdout

    # One node: torchrun with 2 processes (plan from the recipe config alone: FSDP2 over 2 ranks), and W&B logging.
    recipe = ["recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml", "--dataset_name", tiny["data"],
              *common]
    launched = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *recipe,
                    "--gradient_accumulation_steps", "1", "--output_dir", tmp_path / "torchrun",
                    "--report_to", "wandb"], WANDB_DIR=str(tmp_path))
    assert "engine: FSDP2 (fully_shard) over 2 ranks" in launched.stdout
    # Only rank 0 creates a W&B run, and it holds the logged metrics.
    [wandb_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    for key in [b"loss", b"grad_norm", b"tokens_per_second", b"learning_rate"]:
        assert key in wandb_file.read_bytes()

    # One process, no launcher: the same 4 sequences per step as 2 micro-batches.
    alone = run([sys.executable, *recipe, "--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "alone"])
    assert "engine: FSDP2 (fully_shard) over 1 rank on" in alone.stdout

    reference = losses(tmp_path / "alone")
    assert len(reference) == 3 and reference[2] < reference[0] - 0.1  # it trains
    weights = load_file(tmp_path / "alone" / "final" / "model.safetensors")
    for out in ["torchrun", "nodes"]:
        assert losses(tmp_path / out) == pytest.approx(reference, rel=1e-5), out
        exported = load_file(tmp_path / out / "final" / "model.safetensors")
        assert exported.keys() == weights.keys()
        for name, tensor in weights.items():
            assert (exported[name] - tensor).abs().max() <= 1e-5, (out, name)


def test_sbatch_runs_a_recipe_with_its_own_yaml_config(tmp_path):
    """RECIPE alone takes the recipe's YAML config (Qwen3-MoE's holds its router loss, which llama_sft.yaml would
    drop without a word); a recipe of several configs (gemma_sft.py) needs RECIPE_CONFIG."""
    # srun records what a node would run.
    bin_dir = fake_slurm(tmp_path / "bin", '#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\n')
    slurm = dict(SLURM_NNODES="2", SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def sbatch(expect_rc=0, **env):
        return run(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", "d.jsonl"], expect_rc=expect_rc,
                   **slurm, **env)

    def recipe_and_config() -> list[str]:
        args = (bin_dir / "srun.args").read_text().splitlines()
        return args[args.index("launch_node") + 1:]

    sbatch()
    assert recipe_and_config() == ["recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml",
                                   "--dataset_name", "d.jsonl"]
    sbatch(RECIPE="recipes/qwen3_moe_sft.py")
    assert recipe_and_config()[:3] == ["recipes/qwen3_moe_sft.py", "--config", "recipes/configs/qwen3_moe_sft.yaml"]
    sbatch(RECIPE="recipes/gemma_sft.py", RECIPE_CONFIG="recipes/configs/gemma3_sft.yaml")
    assert recipe_and_config()[:3] == ["recipes/gemma_sft.py", "--config", "recipes/configs/gemma3_sft.yaml"]
    (bin_dir / "srun.args").unlink()
    proc = sbatch(expect_rc=2, RECIPE="recipes/gemma_sft.py")
    assert proc.stderr == ("error: RECIPE recipes/gemma_sft.py has no YAML config of its name "
                           "(recipes/configs/gemma_sft.yaml): set RECIPE_CONFIG to the one of your model, from "
                           "recipes/configs\n")
    # A recipe copied into a folder of its own, its YAML beside it: no configs/ folder to point to.
    (tmp_path / "mine").mkdir()
    shutil.copy(REPO / "recipes" / "llama_sft.py", tmp_path / "mine" / "train.py")
    proc = sbatch(expect_rc=2, RECIPE=f"{tmp_path}/mine/train.py")
    assert proc.stderr == (f"error: RECIPE {tmp_path}/mine/train.py has no YAML config of its name "
                           f"({tmp_path}/mine/configs/train.yaml): set RECIPE_CONFIG to your recipe's YAML config\n")
    assert not (bin_dir / "srun.args").exists()
    # A misspelt RECIPE is named as such, not taken for a recipe without a YAML config.
    proc = sbatch(expect_rc=2, RECIPE="recipes/qwen3_moe.py")
    assert proc.stderr.startswith(f"error: RECIPE recipes/qwen3_moe.py: no such file in {REPO} (the recipes: ")
    listed = proc.stderr.removesuffix(")\n").split("(the recipes: ")[1].split()
    assert sorted(listed) == sorted(f"recipes/{path.name}" for path in (REPO / "recipes").glob("*.py"))
    proc = sbatch(expect_rc=2, RECIPE="recipes/qwen3_moe.py", RECIPE_CONFIG="recipes/configs/qwen3_moe_sft.yaml")
    assert proc.stderr.startswith("error: RECIPE recipes/qwen3_moe.py: no such file")
    assert not (bin_dir / "srun.args").exists()
    # A --config of the user's would be a second one, refused by the recipe on every node: refused before srun.
    for config in (["--config", "my.yaml"], ["--config=my.yaml"]):
        proc = run(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", "d.jsonl", *config], expect_rc=2, **slurm)
        assert proc.stderr == ("error: --config among the arguments: run RECIPE_CONFIG=<file> sbatch ... instead (this "
                               "script passes the recipe --config $RECIPE_CONFIG, by default the YAML config named "
                               "after RECIPE)\n")
        assert not (bin_dir / "srun.args").exists()
    # Called from another directory: its copy finds none of the repository's paths.
    proc = subprocess.run(["bash", str(REPO / "slurm" / "sft_multinode.sbatch")], cwd=tmp_path,
                          env=subprocess_env(**slurm), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == (f"error: no slurm/launch_node.sh in {tmp_path}: call sbatch from the repository's root, "
                           "or give it --chdir <root>\n")
    assert not (bin_dir / "srun.args").exists()
    del slurm["SLURM_CPUS_PER_TASK"]  # the #SBATCH --cpus-per-task line removed
    proc = sbatch(expect_rc=1)
    assert "SLURM_CPUS_PER_TASK: keep the #SBATCH --cpus-per-task line" in proc.stderr
    assert not (bin_dir / "srun.args").exists()


def test_a_requeued_job_resumes_its_run(tmp_path):
    """SLURM runs a requeued job (pre-emption with PreemptMode=REQUEUE, a failed node) with the first job's arguments:
    without --resume_from_checkpoint the recipe would refuse the checkpoints the first job saved."""
    bin_dir = fake_slurm(tmp_path / "bin", '#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\n')
    slurm = dict(SLURM_NNODES="2", SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1",
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def recipe_args(*args: str, **env: str) -> tuple[list[str], str]:
        """The recipe's arguments, and what the script prints before the line that says what it runs."""
        proc = run(["bash", "slurm/sft_multinode.sbatch", "--dataset_name", "d.jsonl", *args], **slurm, **env)
        srun_args = (bin_dir / "srun.args").read_text().splitlines()
        before, running, after = proc.stdout.rpartition("running recipes/llama_sft.py --config ")
        assert running and after.endswith("(rendezvous 127.0.0.1:20001)\n"), proc.stdout
        return srun_args[srun_args.index("--config") + 2:], before

    assert recipe_args() == (["--dataset_name", "d.jsonl"], "")
    assert recipe_args(SLURM_RESTART_COUNT="0") == (["--dataset_name", "d.jsonl"], "")
    assert recipe_args(SLURM_RESTART_COUNT="2") == (
        ["--dataset_name", "d.jsonl", "--resume_from_checkpoint", "auto"],
        "requeued (SLURM_RESTART_COUNT=2): the recipe continues with --resume_from_checkpoint auto\n")
    # A checkpoint of the user's is kept, in either spelling.
    for given in (["--resume_from_checkpoint", "auto"], ["--resume_from_checkpoint=out/checkpoint-4"]):
        assert recipe_args(*given, SLURM_RESTART_COUNT="1") == (["--dataset_name", "d.jsonl", *given], "")


def test_one_node_meets_on_master_port(tiny, tmp_path):
    """A one-node job: accelerate gives c10d no address there, so it would take torch's fixed port 29400 and collide
    with another job on the node. The sbatch script runs while a listener holds 29400 (another job's, or this
    test's)."""
    port = free_port()
    args = launch_node_args(tmp_path, 0, nnodes=1, gpus_per_node=2, port=port)
    prepare_multi_gpu_env(args)
    launcher = torchrun.config_from_args(_filter_args(args, torchrun.get_args_parser(), [
        "--training_script", args.training_script, "--training_script_args", args.training_script_args]))[0]
    assert launcher.rdzv_endpoint == f"127.0.0.1:{port}"

    slurm = dict(SLURM_NNODES="1", SLURM_GPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="node-a1",
                 SLURM_JOB_ID="1", MASTER_PORT=str(port))
    path = os.pathsep.join([str(fake_slurm(tmp_path / "bin", SRUN_ONE_NODE)), os.path.dirname(sys.executable),
                            os.environ["PATH"]])
    with socket.socket() as other_job:
        with contextlib.suppress(OSError):  # already held: by another job
            other_job.bind(("", 29400))
            other_job.listen()
        proc = run(["bash", "slurm/sft_multinode.sbatch", "--model_name_or_path", tiny["model"], "--dataset_name",
                    tiny["data"], "--output_dir", tmp_path / "out", *TRAIN_ARGS[:6]], PATH=path, **slurm)
    assert "engine: FSDP2 (fully_shard) over 2 ranks" in proc.stdout
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


def test_tasks_started_without_a_launcher_are_refused(tiny, tmp_path):
    """`srun --ntasks-per-node 2 python recipe.py`: each task has SLURM's variables but no RANK, and would train
    alone into the same output_dir."""
    proc = run([sys.executable, "recipes/llama_sft.py", "--config", "recipes/configs/llama_sft.yaml",
                "--model_name_or_path", tiny["model"], "--dataset_name", tiny["data"], "--output_dir", tmp_path / "out"],
               expect_rc=2, SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1")
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: this process is one of the 2 tasks of a SLURM job step (SLURM_STEP_NUM_TASKS), started without a "
        "launcher: each would train alone, into the same output_dir. Run one task per node that starts the node's "
        "processes with accelerate launch or torchrun (slurm/sft_multinode.sbatch runs slurm/launch_node.sh so)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("var, what", [("SLURM_STEP_NUM_TASKS", "SLURM job step"), ("OMPI_COMM_WORLD_SIZE", "MPI job"),
                                       ("PMI_SIZE", "MPI job")])
def test_each_task_manager_s_tasks_without_a_launcher_are_refused(monkeypatch, var, what):
    """SLURM's, Open MPI's and MPICH's (PMI) variables each say how many tasks were started: more than one without
    RANK is refused; one task, or a task whose launcher set RANK, runs."""
    for name in ["RANK", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, "4")
    with pytest.raises(ConfigError, match=rf"^this process is one of the 4 tasks of a {what} \({var}\), started "
                                          r"without a launcher: each would train alone"):
        check_started_by_a_launcher()
    monkeypatch.setenv("RANK", "3")
    check_started_by_a_launcher()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv(var, "1")
    check_started_by_a_launcher()


def test_a_process_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """A node that starts more processes than it has GPUs gets the setting that counts them, not CUDA's 'invalid
    device ordinal'; ACCELERATE_USE_CPU in any of accelerate's spellings of true keeps the process on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ConfigError, match=r"^local rank 4 has no GPU: this node shows 4 .* accelerate's "
                                          r"num_processes counts every node's processes"):
        init_distributed()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "on")
    env = init_distributed()
    try:
        assert env.device == torch.device("cpu") and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_new_process_group_gets_a_long_wait_group_of_its_own(one_process_group):
    """The long-wait group is made once per default group: a second run in the same process (a recipe's main called
    again) must not wait on the group of the first, which the new process group does not know."""
    first = long_wait_group()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert long_wait_group() is long_wait_group() is not first
    assert dist.get_process_group_ranks(long_wait_group()) == [0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines whose GPUs cannot be seen")
def test_a_cuda_build_that_sees_no_gpu_warns_unless_the_cpu_was_chosen(monkeypatch, capsys):
    """On a GPU node whose GPUs the run cannot see (a failed driver, a job given none), an 8-GPU config would train
    on the CPU without a word; a *_cpu.yaml config (CUDA_VISIBLE_DEVICES "") or `--cpu` chooses the CPU."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    for var in ("RANK", "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(var, raising=False)

    def warning_of_a_run() -> str:
        env = init_distributed()
        dist.destroy_process_group()
        assert env.device == torch.device("cpu")
        return capsys.readouterr().err

    assert warning_of_a_run() == (
        "warning: torch is built with CUDA 12.8 but sees no GPU: this run trains on the CPU (gloo). On a GPU node, "
        "check that its GPUs are visible (nvidia-smi, CUDA_VISIBLE_DEVICES unset); to train on the CPU on purpose, "
        "launch a *_cpu.yaml accelerate config or set CUDA_VISIBLE_DEVICES=\"\"\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert warning_of_a_run() == ""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert warning_of_a_run() == ""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)  # a CPU build: nothing to see
    assert warning_of_a_run() == ""
