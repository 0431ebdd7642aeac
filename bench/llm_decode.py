"""LLM decode (issue #7): greedy `generate` on a tiny random-weight Llama, with a StaticCache
(one executable for every step) or HF's default dynamic cache (`--cache dynamic`: the cache
grows, so one executable per length, or per bucket of lengths with `--bucket-size`).

Reports each backend's first generate (compiles included) and decode tokens/s after it for eager,
Inductor and tpu_dynamo, the process's resident memory growth over each backend's generates, plus
tpu_dynamo's compiles, host->device uploads per decode step, and how each step's updated K/V
reached the host tensors (left in place where the executable wrote them, or copied back). Run:
`python bench/llm_decode.py [--tokens 64] [--repeat 3] [--hidden 64 --layers 2 --vocab 256]
[--cache static|dynamic] [--bucket-size 64] [--batch 4] [--prompt 8] [--model smollm-135m]`. With
`--batch`, the prompts are left-padded as batched serving pads them (row r's first r·prompt/(2·batch)
tokens are padding, masked out by the attention mask). `--model smollm-135m` decodes a Llama of
SmolLM-135M's configuration (bench/models.py) instead of the tiny one.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import tpu_dynamo
from models import build


def tiny_llama(hidden: int, layers: int, vocab: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(config).eval()


def generate(model, ids: torch.Tensor, mask: torch.Tensor, tokens: int, cache: str) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
            cache_implementation=cache, pad_token_id=0,
        )


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(
    model, ids: torch.Tensor, mask: torch.Tensor, tokens: int, repeat: int, cache: str
) -> tuple[float, float, torch.Tensor]:
    """Seconds of the first generate (which compiles), median seconds of one generate over
    `repeat` runs after it, and the tokens."""
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        out = generate(model, ids, mask, tokens, cache)
        times.append(time.perf_counter() - start)
    first, rest = times[0], sorted(times[1:])
    return first, rest[len(rest) // 2], out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"])
    parser.add_argument("--backends", default="eager,inductor,tpu")
    parser.add_argument("--bucket-size", type=int, default=0, help="tpu_dynamo's bucket_size option (0: exact sizes)")
    parser.add_argument("--batch", type=int, default=1, help="prompts, left-padded (see above)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm-135m"])
    args = parser.parse_args()
    tpu_dynamo.device_info()  # the plugin's allocator setting holds for every backend (bench.py)

    def fresh_model() -> transformers.PreTrainedModel:
        if args.model == "tiny":
            return tiny_llama(args.hidden, args.layers, args.vocab)
        return build("smollm-135m-b1", "cpu", torch.float32).module

    vocab = fresh_model().config.vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    padding = torch.arange(args.batch)[:, None] * args.prompt // (2 * args.batch)
    mask = (torch.arange(args.prompt) >= padding).long()
    ids = ids * mask
    names = args.backends.split(",")
    reference = None
    for name in names:
        model = fresh_model()
        if name != "eager":
            options = {"bucket_size": args.bucket_size} if name == "tpu" and args.bucket_size else None
            model.forward = torch.compile(model.forward, backend=name, fullgraph=True, options=options)
        torch._dynamo.reset()
        tpu_dynamo.reset_stats()
        before = resident_bytes()
        first, seconds, out = timed(model, ids, mask, args.tokens, args.repeat, args.cache)
        grown = (resident_bytes() - before) / 2**20
        reference = out if reference is None else reference
        line = f"{name:9s} {args.batch * args.tokens / seconds:8.1f} tokens/s  {seconds / args.tokens * 1e3:6.2f} ms/{'step' if args.batch > 1 else 'token'}"
        line += f"  first generate {first:.1f} s  resident memory +{grown:.0f} MiB"
        line += f"  same tokens as {names[0]}: {torch.equal(out, reference)}"
        if name == "tpu":
            s = tpu_dynamo.stats()
            runs = args.repeat + 1
            line += (
                f"\n          compiles {s['compiles']}, uploads/step"
                f" {s['uploads'] / (runs * args.tokens):.2f} ({s['uploads']} over {runs} generates),"
                f" updated inputs/step in place {s['updates_in_place'] / (runs * args.tokens):.2f},"
                f" copied back {s['updates_copied'] / (runs * args.tokens):.2f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
