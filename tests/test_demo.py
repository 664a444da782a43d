"""`make demo`, the README's first command: generate, train with FSDP2 on 2 processes, export, reload, evaluate."""

import json
import re
import sys

import pytest

from conftest import read_metrics, run, run_on_terminal
from fsdp_recipes import demo


def make_demo(tmp_path):
    # -o: the running venv is set up; make would reinstall into it (the editable install pointing at this checkout)
    # wherever requirements.txt is newer than its stamp, as in a fresh clone.
    return run(["make", "-o", f"{sys.prefix}/.installed", "demo", f"VENV={sys.prefix}", f"DEMO_DIR={tmp_path}"])


def accuracy_of(stdout: str, model_dir) -> float:
    match = re.search(rf"held-out accuracy of {re.escape(str(model_dir))}: ([\d.]+)%", stdout)
    assert match, stdout
    return float(match.group(1)) / 100


def test_demo_learns_the_task_with_the_plan_metrics_and_files_it_promises(tmp_path):
    """The demo as the README runs it; make fails unless held-out accuracy reaches 90%."""
    proc = make_demo(tmp_path)
    layers = json.loads((tmp_path / "base_model" / "config.json").read_text())["num_hidden_layers"]
    assert f"wrapped: {layers} x LlamaDecoderLayer, then the root" in proc.stdout
    assert "precision: bf16 compute, fp32 master weights, fp32 gradient reduction" in proc.stdout
    assert "over 2 ranks" in proc.stdout
    assert accuracy_of(proc.stdout, tmp_path / "base_model") < 0.05
    assert accuracy_of(proc.stdout, tmp_path / "output" / "final") >= 0.9

    metrics = read_metrics(tmp_path / "output" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(10, 401, 10))
    for m in metrics:
        assert {"step", "loss", "learning_rate", "grad_norm", "tokens", "tokens_per_second"} <= m.keys()
        assert m["tokens"] > 0 and m["tokens_per_second"] > 0 and m["grad_norm"] > 0
    assert metrics[-1]["loss"] < 0.8 * metrics[0]["loss"]
    # Without a terminal, each logged step's line: at step 40 the warm-up's last step trains at 39/40 of 2e-3.
    m = metrics[3]
    assert (f"step 40/400 loss {m['loss']:.4f} lr 1.95e-03 grad_norm {m['grad_norm']:.3f} tokens/s "
            f"{m['tokens_per_second']:.0f} time left ") in proc.stdout
    # The demo config's two prompts, answered by the exported model, printed and written to samples.jsonl.
    expected = [{"prompt": "reverse: deadbeef", "completion": "feebdaed"},
                {"prompt": "reverse: apple", "completion": "elppa"}]
    assert read_metrics(tmp_path / "output" / "samples.jsonl") == expected
    assert "sample: 'reverse: deadbeef' -> 'feebdaed'\nsample: 'reverse: apple' -> 'elppa'\n" in proc.stdout

    final = tmp_path / "output" / "final"
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja"]:
        assert (final / name).is_file(), name
    assert not (tmp_path / "output" / "final.tmp").exists()


def test_evaluate_refuses_bad_flags_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """A percentage for the fraction would fail every model after the whole evaluation; wrong paths were tracebacks.
    (In this process: the errors are argparse's, printed before anything is loaded.)"""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "eval.jsonl").write_text("")
    cases = {
        ("--min_accuracy", "90"): "argument --min_accuracy: must be a fraction in [0, 1] (0.9 for 90%), got 90",
        ("--model", tmp_path): f"--model {tmp_path} is not a model folder (no config.json): give a run's final/, a "
                               f"converted checkpoint or the demo's base_model",
        ("--data", tmp_path / "nope.jsonl"): f"--data {tmp_path}/nope.jsonl: no such file (the demo's eval.jsonl, "
                                             f"written by prepare)",
    }
    for (flag, value), message in cases.items():
        flags = {"--model": tmp_path / "model", "--data": tmp_path / "eval.jsonl", flag: value}
        monkeypatch.setattr(sys, "argv", [demo.__file__, "evaluate", *(str(x) for pair in flags.items() for x in pair)])
        with pytest.raises(SystemExit) as exit:
            demo.main()
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"python -m fsdp_recipes.demo evaluate: error: {message}"


def test_prepare_and_evaluate_draw_bars_on_a_terminal_and_none_into_a_log_file(tmp_path):
    # `make demo > demo.log`: transformers' saving and loading bars are a terminal's, as in the recipe.
    demo = [sys.executable, "-m", "fsdp_recipes.demo"]
    prepared = run([*demo, "prepare", "--out_dir", tmp_path, "--n_train", "4", "--n_eval", "2"])
    evaluated = run([*demo, "evaluate", "--model", tmp_path / "base_model", "--data", tmp_path / "eval.jsonl"])
    assert prepared.stdout == f"demo: wrote {tmp_path}/base_model, 4 train and 2 held-out examples\n"
    assert evaluated.stdout == f"demo: held-out accuracy of {tmp_path}/base_model: 0.0% (0/2)\n"
    assert "it/s" not in prepared.stderr + evaluated.stderr, prepared.stderr + evaluated.stderr
    # On a terminal they are drawn.
    on_terminal = run_on_terminal([*demo, "evaluate", "--model", tmp_path / "base_model", "--data",
                                   tmp_path / "eval.jsonl"])
    assert "\rLoading weights: 100%" in on_terminal.stdout, on_terminal.stdout


def test_make_clean_removes_the_venv_and_demo_folder_it_is_given(tmp_path):
    """`make clean DEMO_DIR=...` removes that folder, not ./demo (and leaves the running venv alone)."""
    venv, demo = tmp_path / "venv", tmp_path / "my_demo"
    for folder in (venv, demo):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "file").write_text("x")
    run(["make", "clean", f"VENV={venv}", f"DEMO_DIR={demo}"])
    assert not venv.exists() and not demo.exists()
