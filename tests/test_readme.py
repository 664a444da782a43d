"""Every command the README shows runs here (the GPU command with local stand-ins for the hub model and data)."""

import importlib
import re
import shlex
import sys

import pytest
import yaml

from conftest import REPO, read_metrics, run


def readme_commands() -> list[str]:
    """Shell commands from the README's bash blocks, with line continuations joined."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("#")[0].strip()
            if command:
                commands.append(" ".join(command.split()))
    return commands


def test_readme_shows_the_commands_the_tests_run():
    # make demo: test_demo.py; make test: CI. Each of the others is taken from the README by the test that runs
    # it, so there must be one of each: accelerate launch: below; the converter: test_checkpoint.py; the memory
    # planner: test_estimate.py; sbatch: test_launch.py (which also runs the recipe under torchrun and alone);
    # make new-recipe: test_recipes.py.
    tested = ("accelerate launch ", "python -m fsdp_recipes.convert ", "python -m fsdp_recipes.estimate ",
              "sbatch ", "make new-recipe ")
    commands = readme_commands()
    assert commands[:2] == ["make demo", "make test"]
    assert sorted(prefix for c in commands[2:] for prefix in tested if c.startswith(prefix)) == sorted(tested)
    assert len(commands) == 2 + len(tested)  # nothing else


def test_gpu_command_runs_with_local_model_and_data(tiny, tmp_path):
    [command] = [c for c in readme_commands() if c.startswith("accelerate launch")]
    args = shlex.split(command)
    local = {"meta-llama/Llama-3.2-1B": str(tiny["model"]), "my_data.jsonl": str(tiny["data"]),
             "outputs/llama": str(tmp_path / "out")}
    args = [local.get(a, a) for a in args]
    assert args[:4] == ["accelerate", "launch", "--config_file", "accelerate_configs/fsdp2.yaml"]
    # The GPU config asks for 8 processes; run 2 here, on a free port, for 2 short steps.
    launch = [sys.executable, "-m", "accelerate.commands.launch", *args[2:4], "--num_processes", "2",
              "--main_process_port", "0", *args[4:],
              "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "64"]
    proc = run(launch)
    assert "over 2 ranks" in proc.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [2]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_the_gpu_commands_config_starts_the_processes_the_readme_says():
    # "fsdp2.yaml starts 8 processes, one per GPU of an 8-GPU node": the count a node of another size overrides.
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp2.yaml").read_text())
    assert (config["num_machines"], config["num_processes"]) == (1, 8)
    assert "`fsdp2.yaml` starts 8 processes, one per GPU of an 8-GPU node" in (REPO / "README.md").read_text()


def test_help_lists_the_config_keys():
    proc = run([sys.executable, "recipes/llama_sft.py", "--help"])
    for key in ["--model_name_or_path", "--dataset_name", "--gradient_accumulation_steps", "--config"]:
        assert key in proc.stdout


@pytest.mark.parametrize("name", ["convert", "estimate", "new_recipe", "demo"])
def test_usage_names_the_command_the_readme_runs(name, monkeypatch, capsys):
    # argparse names the file (convert.py), which is not how the README runs the module, nor a file in the root.
    module = importlib.import_module(f"fsdp_recipes.{name}")
    monkeypatch.setattr(sys, "argv", [module.__file__, "--help"])  # as `python -m` sets it
    with pytest.raises(SystemExit) as exit:
        module.main()
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m fsdp_recipes.{name} ")
