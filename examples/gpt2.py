"""Tiny random-weight GPT-2: compiled forward and greedy generate() against eager."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpu_dynamo
from _report import report


def build() -> tuple[GPT2LMHeadModel, torch.Tensor]:
    """The model (seeded, so every process builds the same weights) and a batch of token ids."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    model = GPT2LMHeadModel(config).eval()
    return model, torch.randint(0, config.vocab_size, (1, 16))


def main() -> dict:
    model, input_ids = build()
    with torch.no_grad():
        eager_logits = model(input_ids).logits
        eager_tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False, pad_token_id=0)

    model.compile(backend="tpu", fullgraph=True)
    tpu_dynamo.reset_stats()
    with torch.no_grad():
        logits = model(input_ids).logits
        model(input_ids)  # same size: no new compile
        tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    same_tokens = bool(torch.equal(tokens, eager_tokens))
    return report("gpt2", eager_logits, logits, generate_matches_eager=same_tokens)


if __name__ == "__main__":
    main()
