"""Sample generation reloads the exported folder as the run computed the model."""

import json
import sys

import pytest
import torch
from tokenizers import processors
from transformers import (AutoModelForCausalLM, Gemma2Config, GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM,
                          XGLMConfig, XGLMForCausalLM)

from conftest import run, write_tiny_model
from fsdp_recipes import demo
from fsdp_recipes.config import ConfigError, parse_config
from fsdp_recipes.generation import (check_generation_prompts, generate_samples, generation_dtype,
                                   load_exported_model, log_sample_generations)
from fsdp_recipes.metrics import MetricsLogger


def test_the_exported_model_is_reloaded_with_the_runs_attention_implementation(tiny):
    # config.json does not record it: without it, transformers picks sdpa.
    for attn in ("eager", "sdpa"):
        model = load_exported_model(tiny["model"], attn, torch.device("cpu"))
        assert model.config._attn_implementation == attn


def test_an_fp32_export_is_answered_in_bf16_under_a_flash_kernel(tiny, tmp_path):
    """Flash kernels refuse fp32 queries (transformers only warns at the load): an fp32 folder (save_dtype float32)
    loads in bf16 for them; other folders and other attention implementations keep the folder's dtype."""
    fp32 = write_tiny_model(tmp_path / "fp32", dtype=torch.float32)
    fp16 = write_tiny_model(tmp_path / "fp16", dtype=torch.float16)
    for attn in ("flash_attention_2", "kernels-community/flash-attn3"):
        assert generation_dtype(str(fp32), attn) == torch.bfloat16
        assert generation_dtype(tiny["model"], attn) == "auto"  # a bf16 folder
        assert generation_dtype(str(fp16), attn) == "auto"  # flash kernels take fp16 too
    assert generation_dtype(str(fp32), "sdpa") == "auto"
    assert load_exported_model(str(fp32), "sdpa", torch.device("cpu")).dtype == torch.float32


def test_a_run_generates_with_its_attention_implementation(tmp_path):
    """Gemma 2 soft-caps its attention scores in eager attention: transformers 5.17's sdpa skips the cap without a
    word (other answers here), 5.24's refuses Gemma 2. The run's eager must reach the generation."""
    tokenizer = demo.build_tokenizer()
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=1.0,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # large scores, so that the cap decides the answers
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cfg = parse_config(["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", "d", "--output_dir",
                        str(tmp_path / "run"), "--attn_implementation", "eager", "--generation_prompts",
                        "reverse: abcdef", "reverse: hello", "--generation_max_new_tokens", "12",
                        "--generation_use_chat_template", "true"])
    log_sample_generations(cfg, str(tmp_path / "model"), torch.device("cpu"), MetricsLogger(cfg, is_main=True))
    written = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    eager = generate_samples(str(tmp_path / "model"), cfg.generation_prompts, 12, True, torch.device("cpu"), "eager")
    assert written == eager and len(written) == 2



def test_a_run_without_generation_prompts_writes_no_samples(tiny, tmp_path):
    # Nothing asked: no model reloaded after the run, and no empty samples.jsonl beside its metrics.
    cfg = parse_config(["--model_name_or_path", str(tiny["model"]), "--dataset_name", "d", "--output_dir",
                        str(tmp_path / "run")])
    log_sample_generations(cfg, str(tiny["model"]), torch.device("cpu"), MetricsLogger(cfg, is_main=True))
    assert list((tmp_path / "run").iterdir()) == []


def test_a_plain_text_prompt_starts_with_one_bos_where_the_tokenizer_adds_one(tiny, tmp_path):
    # Llama's tokenizers put BOS in front of every encoding: the prompt, BOS and text, must not get a second one.
    import shutil

    from transformers import AutoTokenizer

    folder = shutil.copytree(tiny["model"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer("reverse: abc", return_tensors="pt")["input_ids"]
    assert ids[0, :2].tolist() == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("r")]
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
    [sample] = generate_samples(str(folder), ["reverse: abc"], 6, False, torch.device("cpu"), "sdpa")
    assert sample["completion"] == tokenizer.decode(greedy[ids.shape[1]:], skip_special_tokens=True)


def test_samples_stop_at_the_stop_strings_of_the_folders_generation_config(tiny, tmp_path):
    """transformers needs the tokenizer for stop_strings: without it, generation fails after the whole run."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    folder = shutil.copytree(tiny["model"], tmp_path / "model")
    generation_config = GenerationConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer("reverse: abc", return_tensors="pt")["input_ids"]
    free = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    stop = tokenizer.decode(free[0, ids.shape[1] + 2:ids.shape[1] + 3])  # a string the answer reaches
    generation_config.stop_strings = [stop]
    generation_config.save_pretrained(folder)
    [sample] = generate_samples(str(folder), ["reverse: abc"], 8, False, torch.device("cpu"), "sdpa")
    assert sample["completion"].endswith(stop) and len(sample["completion"]) < len(tokenizer.decode(
        free[0, ids.shape[1]:], skip_special_tokens=True))


def test_samples_are_greedy_and_plain_text_whatever_the_folders_generation_config(tiny, tmp_path):
    """A folder whose generation_config.json samples (Llama 3 Instruct's do_sample true) is answered greedily, and its
    answer is text: the EOS that ends it (here forced as the last token) is no part of it."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    folder = shutil.copytree(tiny["model"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation_config = GenerationConfig.from_pretrained(folder)
    generation_config.update(do_sample=True, temperature=50.0, top_k=0, forced_eos_token_id=tokenizer.eos_token_id)
    generation_config.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer(tokenizer.bos_token + "reverse: abc", add_special_tokens=False, return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
    assert greedy[-1] == tokenizer.eos_token_id and len(greedy) == ids.shape[1] + 6
    torch.manual_seed(0)
    [sample] = generate_samples(str(folder), ["reverse: abc"], 6, False, torch.device("cpu"), "sdpa")
    assert sample["completion"] == tokenizer.decode(greedy[ids.shape[1]:-1])


def test_a_folder_whose_generation_config_asks_for_beam_search_is_answered_greedily(tiny, tmp_path):
    """generate takes num_beams from the folder's generation_config.json: do_sample false alone ran beam search."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    folder = shutil.copytree(tiny["model"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation_config = GenerationConfig.from_pretrained(folder)
    generation_config.update(num_beams=4)
    generation_config.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompts = ["reverse: abcd", "reverse: deadbeef", "reverse: xyz"]
    answers = {}
    for num_beams in (1, 4):
        for prompt in prompts:
            ids = tokenizer(tokenizer.bos_token + prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            output = model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=num_beams,
                                    pad_token_id=tokenizer.pad_token_id)[0]
            answers.setdefault(num_beams, []).append(tokenizer.decode(output[ids.shape[1]:], skip_special_tokens=True))
    assert answers[1] != answers[4]  # beam search answers otherwise here
    samples = generate_samples(str(folder), prompts, 8, False, torch.device("cpu"), "sdpa")
    assert [s["completion"] for s in samples] == answers[1]


def test_a_prompt_whose_answer_would_pass_a_learned_position_table_is_refused_before_training(tiny, tmp_path):
    """GPT-2's positions are a table: generation past it fails with an IndexError (a device-side assert on a GPU),
    after the whole run. The recipe refuses such a prompt before the first step."""
    tokenizer = demo.build_tokenizer()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=24,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    prompt = "reverse: abcdefgh"  # 20 tokens through the demo's chat template: <|user|>, 17 characters, 2 more
    args = ["recipes/sft.py", "--config", "recipes/configs/sft.yaml", "--model_name_or_path", tmp_path / "gpt2",
            "--dataset_name", tiny["data"], "--max_seq_length", "24", "--max_steps", "1",
            "--output_dir", tmp_path / "out", "--generation_prompts", "reverse: ab", prompt]
    proc = run([sys.executable, *args, "--generation_max_new_tokens", "6"], expect_rc=2)
    assert proc.stderr.endswith(
        "error: generation_prompts: prompt 2 takes 20 tokens as sent, and with generation_max_new_tokens 6 its answer "
        "would reach past the model's position table (24 positions): shorten the prompt, or set "
        "generation_max_new_tokens 5 or less\n")
    assert "training:" not in proc.stdout
    # 5 is what the table holds: the 5th answer token is predicted from its last position (23).
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert gpt2.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False).shape[1] == 25
    with pytest.raises(IndexError):
        gpt2.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    run([sys.executable, *args, "--generation_max_new_tokens", "5"])
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 2
    # A prompt that fills the table leaves room for 1 answer token (predicted from its last position); one that
    # passes it, for none: then shortening the prompt is the only advice. A tokenizer that puts BOS in front of every
    # encoding (Llama's post-processor) has it counted once.
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    for prompt, advice in [("x" * 23, ", or set generation_max_new_tokens 1 or less"), ("x" * 24, "")]:
        cfg = parse_config(["--model_name_or_path", str(tmp_path / "gpt2"), "--dataset_name", "d",
                            "--generation_prompts", prompt, "--generation_max_new_tokens", "2"])
        with pytest.raises(ConfigError) as error:
            check_generation_prompts(cfg, tokenizer, gpt2)
        assert str(error.value).endswith(f"(24 positions): shorten the prompt{advice}")


def test_a_prompt_past_computed_positions_is_answered_not_refused(tmp_path):
    """XGLM's sinusoidal positions grow as needed and RWKV has none: max_position_embeddings is no limit there."""
    tokenizer = demo.build_tokenizer()
    torch.manual_seed(1)  # a model whose greedy answer is not EOS at once
    xglm = XGLMForCausalLM(XGLMConfig(vocab_size=len(tokenizer), d_model=16, ffn_dim=32, num_layers=1,
                                      attention_heads=2, max_position_embeddings=8,
                                      pad_token_id=tokenizer.pad_token_id))
    xglm.save_pretrained(tmp_path / "xglm")
    tokenizer.save_pretrained(tmp_path / "xglm")
    prompt = "reverse: abcdefghijkl"  # 22 tokens with BOS; 8 positions
    cfg = parse_config(["--model_name_or_path", str(tmp_path / "xglm"), "--dataset_name", "d",
                        "--generation_prompts", prompt, "--generation_max_new_tokens", "4"])
    check_generation_prompts(cfg, tokenizer, xglm)
    [sample] = generate_samples(str(tmp_path / "xglm"), [prompt], 4, False, torch.device("cpu"), "eager")
    ids = tokenizer(tokenizer.bos_token + prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    output = xglm.eval().generate(ids, max_new_tokens=4, do_sample=False)  # eval: no dropout
    assert ids.shape[1] == 22 and output.shape[1] == 22 + 4
    assert sample["completion"] == tokenizer.decode(output[0, 22:], skip_special_tokens=True)
    # OPT's positions are a table (2 rows of offset beside max_position_embeddings): refused there.
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=8, word_embed_proj_dim=16))
    with pytest.raises(ConfigError, match=r"takes 22 tokens as sent, .* the model's position table "
                                          r"\(8 positions\): shorten the prompt\Z"):
        check_generation_prompts(cfg, tokenizer, opt)


def test_an_empty_plain_text_prompt_without_a_bos_token_is_refused(tiny, tmp_path):
    """Nothing to answer: generate() would fail on a prompt of no tokens after the whole run (Qwen's tokenizers
    have no BOS)."""
    import shutil

    from transformers import AutoTokenizer

    folder = shutil.copytree(tiny["model"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.bos_token = None
    tokenizer.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        generate_samples(str(folder), ["reverse: ab", ""], 4, False, torch.device("cpu"), "sdpa")

    def check(*prompts, chat_template):
        cfg = parse_config(["--model_name_or_path", str(folder), "--dataset_name", "d", "--generation_prompts",
                            *prompts, "--generation_use_chat_template", str(chat_template).lower()])
        check_generation_prompts(cfg, tokenizer, model)

    with pytest.raises(ConfigError) as error:
        check("reverse: ab", "", chat_template=False)
    assert str(error.value) == ("generation_prompts: prompt 2 is empty, and the tokenizer has no BOS token to send "
                                "before it as plain text: the model would have no token to answer; write a prompt")
    check("", chat_template=True)  # the template's user turn holds tokens
    tokenizer.bos_token = "<|bos|>"
    check("", chat_template=False)
