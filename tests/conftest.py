"""Shared test helpers: tiny models and data written to temporary folders, and subprocess launchers."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

# The suite runs on the CPU (gloo) even where there are GPUs, as in CI: its 2-process launches would otherwise put
# both ranks on a node's GPUs, or fail on one GPU. bench/gpu_sharding_check.sh sets FSDP_RECIPES_GPU_TESTS=1 to run
# the GPU tests on them. Set before torch first looks for a device, and inherited by every launched process.
if os.environ.get("FSDP_RECIPES_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
import torch.distributed as dist

from fsdp_recipes import demo

REPO = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """The benchmark script bench/<name>.py as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def subprocess_env(**extra: str) -> dict:
    env = os.environ.copy()
    # stdout buffered, as in a batch job's log file: a line a process prints must reach it however the process ends,
    # not only where the caller's environment (this machine's sets PYTHONUNBUFFERED=1) flushes every write.
    env.pop("PYTHONUNBUFFERED", None)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # Launched scripts import this checkout's package, whatever checkout the venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_on_terminal(cmd: list, timeout: int = 600, columns: int = 200, **env: str) -> subprocess.CompletedProcess:
    """Run cmd with stdout and stderr on a pseudo-terminal of `columns` columns (200: as in a shell); its stdout is
    what the terminal received."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50 if columns else 0, columns, 0, 0))
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=subprocess_env(**env), stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    received, deadline = [], time.monotonic() + timeout
    while select.select([leader], [], [], max(deadline - time.monotonic(), 0))[0]:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: every process that held the terminal has exited
            break
        received.append(chunk)
    os.close(leader)
    if time.monotonic() > deadline:
        proc.kill()
    output = b"".join(received).decode(errors="replace")
    if proc.wait() != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- terminal ---\n{output[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=output, stderr="")


def run(cmd: list[str], expect_rc: int = 0, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Run `cmd` in the repository root; on an unexpected exit code, fail with its output. A run stopped early (its
    timeout, pytest-timeout's) is sent SIGTERM first: torchrun starts its workers in sessions of their own, out of
    reach of a kill of torchrun alone, and stops them itself on SIGTERM."""
    with subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=subprocess_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except BaseException:
            child.terminate()
            try:
                child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    if proc.returncode != expect_rc:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}, expected {expect_rc}\n"
                    f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def torchrun(script: str | Path, *args, nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                script, *args], **kw)


def accelerate_launch(config_file: str, script: str, *args, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
                "--main_process_port", "0", script, *args], **kw)


def write_tiny_model(path: Path, dtype=torch.bfloat16, **config_overrides) -> Path:
    tokenizer = demo.build_tokenizer()
    torch.manual_seed(0)
    model = demo.LlamaForCausalLM(demo.tiny_llama_config(tokenizer, **config_overrides)).to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextlib.contextmanager
def file_size_limit(size: int):
    """In this process, a write past `size` bytes of a file fails with OSError EFBIG, as a full disk fails a write
    (RLIMIT_FSIZE, with SIGXFSZ ignored: it would end the process)."""
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture
def one_process_group():
    """A one-process group in memory, for the code that runs on every rank, called in the test's process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer Llama (untied and tied embeddings) with the demo tokenizer, and 256 demo examples."""
    root = tmp_path_factory.mktemp("tiny")
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    train, _ = demo.make_split(seed=1, n_train=256, n_eval=0)
    demo.write_jsonl(root / "train.jsonl", train)
    return {
        "model": write_tiny_model(root / "model", **small),
        "tied_model": write_tiny_model(root / "tied_model", tie_word_embeddings=True, **small),
        "data": root / "train.jsonl",
        "root": root,
    }


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
