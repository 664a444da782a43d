"""The config: YAML defaults, command-line overrides, and clear errors for every mistake."""

import dataclasses
import inspect
import re
import sys
from typing import Optional

import pytest

from fsdp_recipes.config import ConfigError, TrainConfig, parse_config, shard_size_in_bytes
from fsdp_recipes.plan import resolve_plan

from conftest import REPO, run


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


def test_a_recipe_run_without_a_config_is_warned_of_the_yaml_it_left_out(capsys, monkeypatch, tmp_path):
    """Without --config a recipe takes the dataclass defaults: Qwen3-MoE's would train without its router loss,
    every family at the built-in learning rate and sequence length. Said once, by rank 0."""
    args = ["--model_name_or_path", "m", "--dataset_name", "d"]
    cfg = parse_config(args, recipe="recipes/qwen3_moe_sft.py")
    assert cfg.router_aux_loss_coef is None and cfg.max_seq_length == 1024
    assert capsys.readouterr().out == (
        "warning: no --config: this run takes the built-in defaults of every key it does not set (see --help), not a "
        "recipe YAML's; pass --config recipes/configs/qwen3_moe_sft.yaml for the recipe's settings\n")
    parse_config(args, recipe="recipes/gemma_sft.py")  # gemma2_sft.yaml and gemma3_sft.yaml: one per generation
    assert capsys.readouterr().out.endswith("pass --config with one of recipes/configs/*.yaml for the recipe's "
                                            "settings\n")
    # A recipe copied into a folder of its own, without configs/: no folder that does not exist is named.
    parse_config(args, recipe=str(tmp_path / "my_sft.py"))
    assert capsys.readouterr().out.endswith(f"pass --config with your copy of its YAML config (the project's are in "
                                            f"{REPO}/recipes/configs) for the recipe's settings\n")
    cfg = parse_config([*args, "--config", "recipes/configs/qwen3_moe_sft.yaml"], recipe="recipes/qwen3_moe_sft.py")
    assert cfg.router_aux_loss_coef == 0.001 and capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "1")
    parse_config(args, recipe="recipes/qwen3_moe_sft.py")
    assert capsys.readouterr().out == ""


def test_the_command_line_sets_a_key_back_to_null(tmp_path):
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\neval_split: test\nsave_total_limit: 2\n"
                                    "save_steps: 10\nmixed_precision: bf16\nfsdp_offload_params: true\n"
                                    "run_name: mine\nreport_to: wandb\n")
    cfg = parse_config(["--config", cfg_file, "--eval_split", "null", "--eval_fraction", "0.1", "--save_total_limit",
                        "Null", "--mixed-precision=null", "--fsdp_offload_params", "NULL", "--run_name", "x",
                        "--run_name", "null"])
    assert (cfg.eval_split, cfg.eval_fraction, cfg.save_total_limit) == (None, 0.1, None)
    assert (cfg.mixed_precision, cfg.fsdp_offload_params, cfg.run_name) == (None, None, None)
    # YAML's words only: a run named none keeps its name.
    assert parse_config(["--config", cfg_file, "--run_name", "none"]).run_name == "none"
    # The last value wins; a key that cannot be null refuses the word.
    last = parse_config(["--config", cfg_file, "--save_total_limit", "null", "--save_total_limit", "3"])
    assert last.save_total_limit == 3
    with pytest.raises(ConfigError, match="^the command line: argument --max_steps/--max-steps: invalid integer "
                                          "value: 'null'$"):
        parse_config(["--config", cfg_file, "--max_steps", "null"])


def test_save_steps_0_on_the_command_line_drops_the_yamls_checkpoint_keys(tmp_path):
    """As --report_to none over a YAML that logs to W&B: a smoke test without checkpoints from a YAML that saves."""
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nsave_steps: 500\nsave_total_limit: 2\n"
                                    "save_state_dict_type: full\n")
    cfg = parse_config(["--config", cfg_file, "--save_steps", "0"])
    assert (cfg.save_steps, cfg.save_total_limit, cfg.save_state_dict_type) == (0, None, None)
    assert parse_config(["--config", cfg_file, "--save-steps=0"]).save_total_limit is None
    # Set on the same command line, a key for checkpoints is still refused, as in the YAML beside save_steps 0.
    with pytest.raises(ConfigError, match="^save_total_limit applies to checkpoints, which save_steps 0 turns off"):
        parse_config(["--config", cfg_file, "--save_steps", "0", "--save_total_limit", "3"])
    with pytest.raises(ConfigError, match="^save_total_limit and save_state_dict_type apply to checkpoints"):
        parse_config(["--config", write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nsave_total_limit: 2"
                                                       "\nsave_state_dict_type: full\n")])


@dataclasses.dataclass
class OwnKeys(TrainConfig):
    """A copied recipe's keys of its own, beside every TrainConfig key."""
    min_answer_chars: int = 0
    reviewer: Optional[str] = None


def test_a_recipes_own_keys_are_read_checked_and_overridden_like_the_others(tmp_path):
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nmin_answer_chars: 5\nreviewer: ann\n")
    cfg = parse_config(["--config", cfg_file, "--min_answer_chars", "7", "--reviewer", "null"], config_class=OwnKeys)
    assert (type(cfg), cfg.min_answer_chars, cfg.reviewer, cfg.model_name_or_path) == (OwnKeys, 7, None, "m")
    assert cfg.to_dict()["min_answer_chars"] == 7  # as a checkpoint's trainer_state.json records the config
    with pytest.raises(ConfigError, match=r"^min_answer_chars in .*recipe.yaml must be an integer, got 'five'$"):
        parse_config(["--config", write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\n"
                                                       "min_answer_chars: five\n")], config_class=OwnKeys)
    # Without it, the key is unknown, and the error says where to declare it.
    with pytest.raises(ConfigError, match=r"unknown config key 'min_answer_chars' in .*recipe.yaml\. \(A key of your "
                                          r"own: declare it in a @dataclass subclass of TrainConfig, passed to "
                                          r"parse_config as config_class\.\) Run the recipe with --help to list the "
                                          r"keys\.$"):
        parse_config(["--config", cfg_file])

    class Undecorated(TrainConfig):  # its annotation alone makes no field
        min_answer_chars: int = 0
    with pytest.raises(TypeError, match="^config_class Undecorated must be decorated with @dataclass"):
        parse_config(["--config", cfg_file], config_class=Undecorated)

    @dataclasses.dataclass
    class Alone:  # its own keys without TrainConfig's: no model_name_or_path, nothing a recipe reads
        min_answer_chars: int = 0
    with pytest.raises(TypeError, match="^config_class must be a subclass of TrainConfig, got <class .*Alone'>$"):
        parse_config(["--config", cfg_file], config_class=Alone)


def test_unknown_yaml_key_is_named(tmp_path):
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nlearning_rat: 1e-4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rat' in .*recipe.yaml.*'learning_rate'"):
        parse_config(["--config", cfg_file])


def test_a_training_arguments_name_that_differs_here_is_named_with_this_configs_key(tmp_path):
    # "Names follow TrainingArguments" where the concept is the same; bf16 is mixed_precision here, and no key is
    # near enough for difflib to offer it.
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nbf16: true\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'bf16' in .*recipe.yaml\. TrainingArguments' bf16 is "
                                          r"mixed_precision: bf16 here\. Run the recipe with --help"):
        parse_config(["--config", cfg_file])
    with pytest.raises(ConfigError, match=r"^unknown config key 'gradient_checkpointing' in the command line\. "
                                          r"TrainingArguments' gradient_checkpointing is "
                                          r"fsdp_activation_checkpointing: true here\."):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--gradient_checkpointing", "true"])
    # argparse spells every key with hyphens too, as TrainingArguments' users may type them: the same advice.
    with pytest.raises(ConfigError, match=r"^unknown config key 'gradient-checkpointing' in the command line\. "
                                          r"TrainingArguments' gradient_checkpointing is "
                                          r"fsdp_activation_checkpointing: true here\."):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--gradient-checkpointing", "true"])


def test_an_accelerate_config_given_as_the_recipe_config_is_named_so(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as error:
        parse_config(["--config", "accelerate_configs/fsdp2_cpu.yaml"])
    assert str(error.value) == ("--config accelerate_configs/fsdp2_cpu.yaml is an accelerate config (it sets "
                                "compute_environment): pass it to accelerate launch --config_file, and a recipe "
                                "config (recipes/configs/<recipe>.yaml) as --config")
    # One written by hand, without the keys `accelerate config` writes first.
    (tmp_path / "launch.yaml").write_text("fsdp_config:\n  fsdp_version: 2\nnum_processes: 8\n")
    with pytest.raises(ConfigError, match=r"^--config .*launch.yaml is an accelerate config \(it sets fsdp_config\)"):
        parse_config(["--config", str(tmp_path / "launch.yaml")])
    # A CPU launch's whole config (accelerate_configs/fsdp2_cpu.yaml sets use_cpu among others).
    (tmp_path / "cpu.yaml").write_text("use_cpu: true\n")
    with pytest.raises(ConfigError, match=r"^--config .*cpu.yaml is an accelerate config \(it sets use_cpu\)"):
        parse_config(["--config", str(tmp_path / "cpu.yaml")])


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
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_steps", "-2"],
         r"^max_steps must be -1 \(use num_train_epochs\) or positive, got -2$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--num_train_epochs", "inf"],
         "^num_train_epochs must be positive when max_steps is -1, got inf$"),  # a run that never ends
        (["--model_name_or_path", "m", "--dataset_name", "d", "--logging_steps", "0"],
         "^logging_steps must be at least 1, got 0$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--dp_replicate_size", "0"],
         "^dp_replicate_size must be at least 1, got 0$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--dataloader_num_workers", "-1"],
         "^dataloader_num_workers must be 0 or more, got -1$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--fsdp_version", "3"], "fsdp_version must be 1 or 2"),
        # A size the Hub's splitter refuses would fail at the export, after the whole run.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_shard_size", "5G"],
         "max_shard_size must be a positive size such as 5GB, 500MB or 4GiB, got '5G'"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_shard_size", "0GB"], "max_shard_size must be"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--learning_rate=-1e-5"],
         "learning_rate must be a positive number"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--learning_rate", "inf"], "learning_rate must be"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--adam_beta2", "1"], r"adam_beta2 must be in \[0, 1\)"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--weight_decay", "-0.1"], "weight_decay must be 0 or"),
        # 0 is 0/0 in AdamW's update for a weight with no gradient: NaN weights, then a "diverged" run.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--adam_epsilon", "0"],
         r"^adam_epsilon must be a positive number, got 0.0: AdamW divides by sqrt\(v\) \+ adam_epsilon, so with 0 a "
         r"weight whose gradient is 0 \(the embedding row of a token not in the batch\) becomes NaN at the first "
         r"step. Set it to 1e-8, the default$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--adam_epsilon", "inf"], "adam_epsilon must be a "),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--seed", "-1"], r"seed must be in \[0, 2\*\*32\)"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--seed", str(2**32)],
         r"^seed must be in \[0, 2\*\*32\), got 4294967296$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--eval_fraction", "1"],
         r"^eval_fraction must be in \[0, 1\), got 1.0$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--eval_fraction", "0.1", "--per_device_eval_batch_size",
          "0"], "^per_device_eval_batch_size must be at least 1, got 0$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--save_steps", "5", "--save_total_limit", "0"],
         "^save_total_limit must be at least 1 or unset, got 0$"),
        # 0 saves no checkpoint at all, not one at the end: N saves one every N steps and at the end.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--save_steps", "-1"],
         r"^save_steps must be 0 \(no checkpoints: only final/ is saved\) or a positive N \(a checkpoint every N "
         r"steps and at the end\), got -1$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--router_aux_loss_coef", "-0.001"],
         r"^router_aux_loss_coef must be 0 or a positive number \(most of transformers' MoE models default to "
         r"0.001\), got -0.001$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--router_aux_loss_coef", "nan"],
         "^router_aux_loss_coef must be 0 or a positive number .*got nan$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_grad_norm", "nan"],
         "^max_grad_norm must be a number, got nan: set the norm to clip to, or 0 to disable clipping$"),
        # Settings that would do nothing: refused, not ignored.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--run_name", "mine"],
         "run_name names the W&B run, and report_to is none: pass --report_to wandb, or leave run_name unset"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--wandb_project", "mine"],
         "wandb_project names the W&B project, and report_to is none: pass --report_to wandb, or leave wandb_project "
         "unset"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--report_to", "none", "--wandb_project", "mine"],
         "wandb_project names the W&B project, and report_to is none"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--per_device_eval_batch_size", "8"],
         "per_device_eval_batch_size sizes the evaluation batches, and the run has no held-out split: set eval_split "
         "or eval_fraction, or leave per_device_eval_batch_size unset"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--generation_max_new_tokens", "64"],
         "generation_max_new_tokens applies to sample generation, and generation_prompts is unset: set "
         "generation_prompts, or leave generation_max_new_tokens unset"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--generation-use-chat-template=false"],
         "generation_use_chat_template applies to sample generation, and generation_prompts is unset"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_steps", "10", "--num_train_epochs", "3"],
         r"^num_train_epochs sets the run's length in epochs, and max_steps sets it: set max_steps -1 to count the "
         r"run in epochs, or leave num_train_epochs unset$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--gradient_sync", "last_micro_batch"],
         "gradient_sync last_micro_batch skips the reduction of all but the last micro-batch of a step, and "
         "gradient_accumulation_steps 1 has one: set gradient_accumulation_steps above 1, or gradient_sync "
         "every_micro_batch"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--resume_from_checkpoint", "true"],
         "resume_from_checkpoint true: set it to auto"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--resume_from_checkpoint", "False"],
         r"^resume_from_checkpoint false: leave it unset \(null\) to start fresh"),
        # Checkpoint settings without checkpoints: the run would save none, against what they say.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--save_total_limit", "2"],
         r"^save_total_limit applies to checkpoints, which save_steps 0 turns off \(only final/ is saved\): set "
         r"save_steps N to save one every N steps, or leave save_total_limit unset$"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--save_total_limit", "2", "--save_state_dict_type",
          "full"], r"^save_total_limit and save_state_dict_type apply to checkpoints"),
        (["--model_name_or_path", "m", "--dataset_name", "a.jsonl,b.jsonl", "--eval_split", ",",
          "--eval_steps", "5"], r"^eval_split ',' names no split: name the held-out split \(one for all data sets, or "
                                r"one per data set, comma-separated\), or leave eval_split unset$"),
        # argparse's own errors, as one line that names the command line.
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_steps", "ten"],
         "the command line: argument --max_steps/--max-steps: invalid integer value: 'ten'"),
        # A fraction is refused, not cut to a whole number of steps (1e8, a whole number, is taken).
        (["--model_name_or_path", "m", "--dataset_name", "d", "--max_steps", "1.5"],
         "the command line: argument --max_steps/--max-steps: invalid integer value: '1.5'"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--config"],
         "the command line: argument --config: expected one argument"),
        (["--config", "a.yaml", "--config", "b.yaml"], r"--config is given 2 times \(a.yaml, b.yaml\): pass one YAML"),
        (["--model_name_or_path", "m", "--dataset_name", "d", "--attn_implementation", "sdap"],
         "attn_implementation must be one of eager, flash_attention_2, .*sdpa, or a Hub kernel .*got 'sdap'"),
    ],
)
def test_bad_values_are_explained(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(args)


@pytest.mark.parametrize("text, message", [
    ("save_dtype: bf16", r"save_dtype must be one of auto, bfloat16, float16, float32, got 'bf16'"),
    ("gradient_sync: last", r"gradient_sync must be one of every_micro_batch, last_micro_batch, got 'last'"),
    ("report_to: [wandb]", r"report_to must be one of none, wandb, got \['wandb'\]"),
    ("mixed_precision: fp16", r"mixed_precision must be one of bf16, no, pure_bf16 or null, got 'fp16'"),
    ("learning_rate: [1]", r"learning_rate must be a number, got \[1\]"),
    ("save_steps: null", r"save_steps must be an integer, got None"),
    ("max_steps: 10.5", r"max_steps must be an integer, got 10.5"),
    # A boolean is no number, though Python counts True as 1: learning_rate: true would train at 1.0.
    ("max_steps: true", r"^max_steps must be an integer, got True"),
    ("learning_rate: true", r"^learning_rate must be a number, got True"),
    ("generation_prompts: 'reverse: abc'", r"generation_prompts must be a list of strings or null, got 'reverse: abc'"),
    ("lr_scheduler_type: reduce_lr_on_plateau", r"lr_scheduler_type must be one of linear, cosine, constant, "),
    ("lr_scheduler_type: constant\nwarmup_steps: 5", r"constant has no warm-up: use constant_with_warmup"),
    # A string where a number belongs: named with the file, not blamed on a command-line flag.
    ("max_steps: ten", r"max_steps in .*recipe.yaml must be an integer, got 'ten'"),
    ("packing: maybe", r"packing in .*recipe.yaml must be true or false, got 'maybe'"),
    ("output_dir: ~", r"output_dir must be a string, got None \(YAML reads ~ and an empty value as null\)"),
    # YAML keeps the last of two equal keys: an edit at the bottom of a copied recipe would silently lose or win.
    ("max_steps: 5\nmax_steps: 6", r"is not valid YAML: key 'max_steps' is set twice in .* line 4"),
    ("resume_from_checkpoint: true", "resume_from_checkpoint true: set it to auto"),
    # Not "quote it": a quoted false would name a checkpoint folder.
    ("resume_from_checkpoint: false", r"^resume_from_checkpoint false: leave it unset \(null\) to start fresh, or set "
                                      r"it to auto or to a checkpoint folder$"),
    ("mixed_precision: no", r"got False \(YAML reads an unquoted yes, no, on or off as true or false: quote it\)"),
    # A number for a text field, as argparse takes it from the command line (--dataset_weights 0.5).
    ("dataset_weights: 0.5", r"^dataset_weights must be a string or null, got 0.5 \(YAML reads an unquoted number as a "
                             r"number: quote it\)$"),
    ("run_name: 2024\nreport_to: wandb", r"^run_name must be a string or null, got 2024 \(YAML reads an unquoted "
                                         r"number as a number: quote it\)$"),
    # A mixture written as a YAML list: one comma-separated string, as on the command line.
    ("dataset_weights: [1, 0.5]", r"^dataset_weights must be a string or null, got \[1, 0.5\] \(write several as one "
                                  r"comma-separated string: '1,0.5'\)$"),
    ("run_name: [a, b]\nreport_to: wandb", r"^run_name must be a string or null, got \['a', 'b'\]$"),
    # A key that is not a name (a boolean, a number, a list) is named with its line, not a traceback.
    ("no: 3", r"key no is not a name \(YAML reads an unquoted yes, no, on, off, true or false as a boolean: quote it\)"
              r" in .* line 3"),
    ("1: x", r"is not valid YAML: key 1 is not a name in .* line 3"),
    ("[a]: x", r"is not valid YAML: key a list is not a name in .* line 3"),
    ("num_train_epochs: .nan", "num_train_epochs must be positive when max_steps is -1"),
])
def test_yaml_values_are_checked_like_the_command_line(tmp_path, text, message):
    """argparse checks only the command line; a YAML typo must not crash after training or change the run."""
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", write_yaml(tmp_path, f"model_name_or_path: m\ndataset_name: d\n{text}\n")])


def test_booleans_take_the_spellings_the_readme_gives(tmp_path):
    """README, Sharding: true/false or yes/no; the command line also 1/0, y/n, t/f (transformers' HfArgumentParser);
    YAML also on/off. Anything else names the key."""
    def offload(args, yaml_text=""):
        config = ["--config", write_yaml(tmp_path, f"model_name_or_path: m\ndataset_name: d\n{yaml_text}\n")]
        return parse_config(config + args).fsdp_offload_params

    for word, value in [("true", True), ("yes", True), ("1", True), ("y", True), ("T", True), ("false", False),
                        ("No", False), ("0", False), ("n", False), ("f", False)]:
        assert offload(["--fsdp_offload_params", word]) is value, word
    for word, value in [("true", True), ("yes", True), ("on", True), ("false", False), ("no", False), ("off", False)]:
        assert offload([], f"fsdp_offload_params: {word}") is value, word
    with pytest.raises(ConfigError, match=r"^the command line: argument --fsdp_offload_params.*: Truthy value "
                                          r"expected: got on"):
        offload(["--fsdp_offload_params", "on"])
    with pytest.raises(ConfigError, match=r"^fsdp_offload_params must be true or false or null, got 1$"):
        offload([], "fsdp_offload_params: 1")


def test_the_wandb_project_defaults_to_the_environments_as_wandb_reads_it(monkeypatch):
    args = ["--model_name_or_path", "m", "--dataset_name", "d", "--report_to", "wandb"]
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert parse_config(args).wandb_project == "fsdp-recipes"
    # Passed to wandb.init, the recipe's project would override the variable: it takes its place instead.
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert parse_config(args).wandb_project == "from-env"
    assert parse_config(args + ["--wandb_project", "mine"]).wandb_project == "mine"
    # An empty name (an unset shell variable, --wandb_project "$PROJECT"): W&B would file the run under its default.
    for key in ("wandb_project", "run_name"):
        with pytest.raises(ConfigError, match=f"^{key} is empty: give it a name, or leave it out"):
            parse_config(args + [f"--{key}", " "])
    monkeypatch.setenv("WANDB_PROJECT", " ")
    with pytest.raises(ConfigError, match=r"^WANDB_PROJECT=' ' names no W&B project: give it a name, unset it, or pass "
                                          r"--wandb_project <name>$"):
        parse_config(args)
    assert parse_config(args[:-2]).wandb_project is None  # nor read for a run that logs no W&B


def test_a_key_whose_feature_is_off_is_refused_unless_the_command_line_turns_the_feature_off(tmp_path):
    """A YAML that logs to W&B or generates samples may be run with the feature turned off on the command line;
    its keys for the feature then say nothing the user relies on. Set beside the feature turned off, they do."""
    cfg_file = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nreport_to: wandb\nwandb_project: p\n"
                                    "run_name: r\ngeneration_prompts: [hi]\ngeneration_max_new_tokens: 8\n"
                                    "generation_use_chat_template: false\neval_fraction: 0.1\n"
                                    "per_device_eval_batch_size: 2\neval_steps: 5\n")
    cfg = parse_config(["--config", cfg_file, "--report_to", "none", "--generation_prompts", "null",
                        "--eval_fraction", "0"])
    assert (cfg.report_to, cfg.generation_prompts, cfg.eval_fraction) == ("none", None, 0)
    assert (cfg.wandb_project, cfg.generation_max_new_tokens, cfg.per_device_eval_batch_size) == ("p", 8, 2)
    assert cfg.eval_steps == 5
    # `--eval_split null`, as the README's example of setting a key back to null.
    split = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\neval_split: validation\neval_steps: 5\n")
    assert parse_config(["--config", split, "--eval_split", "null"]).eval_split is None
    with pytest.raises(ConfigError, match="^eval_steps evaluates the held-out split every N steps, and the run has no "
                                          "held-out split: set eval_split or eval_fraction, or leave eval_steps unset"):
        parse_config(["--config", split, "--eval_split", "null", "--eval_steps", "5"])
    assert parse_config(["--config", split, "--eval_split", "null", "--eval_steps", "0"]).eval_steps == 0
    # The same key given again on the command line is relied on.
    with pytest.raises(ConfigError, match="^wandb_project names the W&B project, and report_to is none"):
        parse_config(["--config", cfg_file, "--report_to", "none", "--wandb_project", "q"])
    # The feature off in the YAML itself: refused.
    # Set to null, as the error says: left unset, in the YAML or on the command line.
    unset = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nrun_name: null\n")
    assert parse_config(["--config", unset, "--per_device_eval_batch_size", "null"]).run_name is None
    assert parse_config(["--config", cfg_file, "--report_to", "none", "--run_name", "null"]).run_name is None
    off = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nreport_to: none\nwandb_project: p\n")
    with pytest.raises(ConfigError, match="^wandb_project names the W&B project, and report_to is none"):
        parse_config(["--config", off])
    assert parse_config(["--config", off, "--report_to", "wandb"]).wandb_project == "p"
    # The recipes' YAMLs count the run in epochs: a command line's max_steps (a smoke test) takes over; a YAML that
    # sets both would train max_steps whatever its epochs say.
    epochs = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nnum_train_epochs: 3\n")
    assert parse_config(["--config", epochs, "--max_steps", "5"]).max_steps == 5
    both = write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nnum_train_epochs: 3\nmax_steps: 5\n")
    with pytest.raises(ConfigError, match="^num_train_epochs sets the run's length in epochs, and max_steps sets it"):
        parse_config(["--config", both])
    assert parse_config(["--config", both, "--max_steps", "-1"]).num_train_epochs == 3


def test_yaml_values_of_the_right_type_pass(tmp_path):
    cfg = parse_config(["--config", write_yaml(tmp_path, "model_name_or_path: m\ndataset_name: d\nnum_train_epochs: 3\n"
                                                        "generation_prompts: [a, b]\nfsdp_offload_params: true\n"
                                                        "fsdp_min_num_params: 1.0e+8\npacking: 'true'\n")])
    assert (cfg.num_train_epochs, cfg.generation_prompts, cfg.fsdp_offload_params) == (3, ["a", "b"], True)
    assert (cfg.fsdp_min_num_params, cfg.packing) == (100_000_000, True)
    # A merge key (`<<:`) is not a key set twice; a key beside it overrides the merged one, as YAML says.
    cfg = parse_config(["--config", write_yaml(tmp_path, "model_name_or_path: m\n<<: {dataset_name: d, seed: 3}\n"
                                                        "seed: 4\n")])
    assert (cfg.dataset_name, cfg.seed) == ("d", 4)
    assert [shard_size_in_bytes(size) for size in ("5GB", "4GiB", "1.5 mb")] == [5 * 10**9, 4 * 2**30, 1_500_000]
    assert parse_config(["--model_name_or_path", "m", "--dataset_name", "d",
                         "--fsdp_min_num_params", "1e8"]).fsdp_min_num_params == 100_000_000
    # The closed ends of the ranges: adam_beta1 0 (no momentum), router_aux_loss_coef 0 (no router loss).
    cfg = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--adam_beta1", "0",
                        "--router_aux_loss_coef", "0"])
    assert (cfg.adam_beta1, cfg.router_aux_loss_coef) == (0, 0)


def test_home_folder_paths_are_expanded_as_transformers_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_yaml(tmp_path, "model_name_or_path: ~/m\ndataset_name: a.jsonl,~/b.jsonl\n")
    cfg = parse_config(["--config=~/recipe.yaml", "--output_dir=~/out"])
    assert (cfg.model_name_or_path, cfg.output_dir) == (f"{tmp_path}/m", f"{tmp_path}/out")
    # The data set names are expanded where they are read (test_data.py): a checkpoint records them as written.
    assert cfg.dataset_name == "a.jsonl,~/b.jsonl"


def test_a_missing_or_malformed_config_file_is_explained(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read --config .*nope.yaml: No such file or directory"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match=r"recipe.yaml is not valid YAML: mapping values are not allowed here .* line 2"):
        parse_config(["--config", write_yaml(tmp_path, "a: 1\n b: [\n")])
    (tmp_path / "latin1.yaml").write_bytes("model_name_or_path: m\nrun_name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text: invalid continuation byte at byte 35"):
        parse_config(["--config", str(tmp_path / "latin1.yaml")])


def test_recipe_reports_a_bad_argument_in_one_line():
    proc = run([sys.executable, "recipes/llama_sft.py", "--config", "recipes/configs/demo.yaml", "--learning_rat", "1"],
               expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown config key 'learning_rat'")
    assert "Traceback" not in proc.stderr


def test_an_error_is_printed_before_the_process_group_is_torn_down():
    # Destroying an NCCL group while another rank is stuck in a collective can block: the error comes out first, and
    # the group is left to the end of the process.
    script = ("import torch.distributed as dist\n"
              "from fsdp_recipes.cli import run_main\n"
              "from fsdp_recipes.distributed import distributed\n"
              "def main():\n"
              "    with distributed():\n"
              "        dist.destroy_process_group = lambda *args: print('destroyed', flush=True)\n"
              "        raise RuntimeError('boom')\n"
              "run_main(main)\n")
    proc = run([sys.executable, "-c", script], expect_rc=1)
    assert proc.stderr.strip().splitlines()[-1] == "RuntimeError: boom" and "destroyed" not in proc.stdout


def test_help_gives_the_accelerate_configs_value_as_the_default_of_each_key_it_can_set():
    """Under accelerate launch, a sharding key the recipe config leaves unset takes the accelerate config's value
    (resolve_plan's pick): --help says so for each of them, not only the value that applies without accelerate."""
    from_accelerate = re.findall(r'pick\("(\w+)"', inspect.getsource(resolve_plan))
    assert len(from_accelerate) == 11
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(TrainConfig)}
    assert [key for key in from_accelerate if "Default: accelerate's" not in helps[key]] == []
    # With neither config setting it, a model without _no_split_modules is wrapped by its decoder layers.
    assert "else its decoder layers" in helps["fsdp_transformer_layer_cls_to_wrap"]
