"""The README's claim about HF's Trainer and the router load-balancing loss, checked against transformers' own
Trainer: it weights the loss gradient_accumulation_steps x world size times more than this project's trainer."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer, TrainingArguments

from fsdp_recipes.data_formats import IGNORE_INDEX
from fsdp_recipes.trainer import forward_backward


def test_hf_trainer_weights_the_router_loss_gradient_accumulation_steps_times_more(tmp_path):
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    ids = torch.randint(5, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    micro_batches = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2]),
                      "labels": ids[i:i + 2]} for i in (0, 2)]
    label_tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)

    def grads():
        result = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return result

    # One optimizer step of HF's Trainer: 2 micro-batches, each with the step's label count, as its loop passes it.
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=args)
    for mb in micro_batches:
        trainer.training_step(model, dict(mb), num_items_in_batch=torch.tensor(label_tokens))
    hf = grads()

    router = "model.layers.0.mlp.gate.weight"
    forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))
    assert not torch.allclose(grads()[router], hf[router], rtol=1e-3)  # the same coefficient: another gradient
    model.config.router_aux_loss_coef = 0.1 * 2  # x gradient_accumulation_steps (x world size: 1 process)
    forward_backward(model, micro_batches, label_tokens, 1, torch.device("cpu"))
    ours = grads()
    for name in ours:
        torch.testing.assert_close(ours[name], hf[name], rtol=1e-5, atol=1e-7, msg=name)
