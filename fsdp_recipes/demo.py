"""The demo task, built here so that it runs with no hub access: reverse a string of letters.

`prepare` writes a character-level tokenizer with a chat template, a tiny randomly initialised Llama, and a
train/eval split of chat examples; `evaluate` reloads a model folder with `from_pretrained`, answers the held-out
prompts greedily and prints the exact-match accuracy. An untrained model scores 0; a trained one near 100%.

    python -m fsdp_recipes.demo prepare --out_dir demo
    python -m fsdp_recipes.demo evaluate --model demo/output/final --data demo/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .progress import configure_progress_bars

LETTERS = string.ascii_lowercase[:16]
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (lower-case letters, digits, space, some punctuation), plus the chat tokens."""
    chars = string.ascii_lowercase + string.digits + " :.,?!-"
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(chars))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_example(rng: random.Random) -> dict:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 8)))
    return {"messages": [{"role": "user", "content": f"reverse: {word}"}, {"role": "assistant", "content": word[::-1]}]}


def make_split(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train and eval examples: no eval prompt is ever seen in training."""
    rng = random.Random(seed)
    examples, seen = [], set()
    while len(examples) < n_train + n_eval:
        example = make_example(rng)
        prompt = example["messages"][0]["content"]
        if prompt not in seen:
            seen.add(prompt)
            examples.append(example)
    return examples[:n_train], examples[n_train:]


def tiny_llama_config(tokenizer, **overrides) -> LlamaConfig:
    values = dict(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def prepare(out_dir: str, n_train: int = 4000, n_eval: int = 200, seed: int = 0) -> None:
    """Write <out_dir>/base_model (tokenizer + random tiny Llama), train.jsonl and eval.jsonl."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer)).to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(os.path.join(out_dir, "base_model"))
    tokenizer.save_pretrained(os.path.join(out_dir, "base_model"))
    train, held_out = make_split(seed, n_train, n_eval)
    write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "eval.jsonl"), held_out)
    print(f"demo: wrote {out_dir}/base_model, {len(train)} train and {len(held_out)} held-out examples")


@torch.no_grad()
def evaluate(model_dir: str, data_file: str, batch_size: int = 50) -> float:
    """Exact-match accuracy of greedy answers to the held-out prompts."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # generation appends on the right
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with open(data_file) as f:
        rows = [json.loads(line) for line in f]
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [tokenizer.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in chunk]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(a.strip() == r["messages"][1]["content"] for a, r in zip(answers, chunk))
    accuracy = correct / len(rows)
    print(f"demo: held-out accuracy of {model_dir}: {accuracy:.1%} ({correct}/{len(rows)})")
    return accuracy


def fraction(text: str) -> float:
    """--min_accuracy, a share of the prompts as `make demo` gives it (0.9): 90 would fail every model."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1] (0.9 for 90%), got {text}")
    return value


def main() -> None:
    # Named as the README runs it: argparse alone would name the file, which no command runs.
    parser = argparse.ArgumentParser(f"python -m {__spec__.name}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the base model, tokenizer and data")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--n_train", type=int, default=4000)
    p.add_argument("--n_eval", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("evaluate", help="held-out accuracy of a model folder")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--min_accuracy", type=fraction, default=0.0, help="exit 1 below this accuracy (0.9: 90%%)")
    args = parser.parse_args()
    # Checked before the model loads: transformers' and open's tracebacks would not say which flag is wrong.
    if args.command == "evaluate" and not os.path.isfile(os.path.join(args.model, "config.json")):
        e.error(f"--model {args.model} is not a model folder (no config.json): give a run's final/, a converted "
                f"checkpoint or the demo's base_model")
    if args.command == "evaluate" and not os.path.isfile(args.data):
        e.error(f"--data {args.data}: no such file (the demo's eval.jsonl, written by prepare)")
    configure_progress_bars(True)  # transformers' saving and loading bars, in a terminal only, as the recipe's
    if args.command == "prepare":
        prepare(args.out_dir, args.n_train, args.n_eval, args.seed)
    else:
        accuracy = evaluate(args.model, args.data)
        if accuracy < args.min_accuracy:
            raise SystemExit(f"demo: accuracy {accuracy:.1%} is below the required {args.min_accuracy:.0%}")


if __name__ == "__main__":
    main()
