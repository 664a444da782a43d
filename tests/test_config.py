"""The config: YAML defaults, command-line overrides, and clear errors for every mistake."""

import sys

import pytest

from fsdp_recipes.config import ConfigError, parse_config

from conftest import run


def write_yaml(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_gives_defaults_and_cli_overrides(tmp_path):
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nlearning_rate: 2e-5\nmax_steps: 7\n")
    cfg = parse_config(["--config", cfg_file, "--max_steps", "9", "--report_to", "wandb"])
    assert (cfg.model_name_or_path, cfg.dataset_name) == ("m", "d")
    assert cfg.learning_rate == 2e-5  # PyYAML reads 2e-5 as a string; argparse converts it
    assert cfg.max_steps == 9
    assert cfg.report_to == "wandb"


def test_unknown_yaml_key_is_named(tmp_path):
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nlearning_rat: 1e-4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rat' in .*recipe.yaml.*'learning_rate'"):
        parse_config(["--config", cfg_file])


def test_unknown_cli_flag_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'max_step' in the command line.*'max_steps'"):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--max_step", "3"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset_name", "d"], "model_name_or_path is required"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--gradient_accumulation_steps", "0"],
         "gradient_accumulation_steps must be at least 1"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_steps", "0"], "max_steps must be -1"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--fsdp_version", "3"], "fsdp_version must be 1 or 2"),
    ],
)
def test_bad_values_are_explained(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(args)


def test_recipe_reports_a_bad_argument_in_one_line():
    proc = run([sys.executable, "recipes/llama_sft.py", "--config", "recipes/configs/demo.yaml", "--learning_rat", "1"],
               expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown config key 'learning_rat'")
    assert "Traceback" not in proc.stderr
