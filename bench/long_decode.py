"""Long-context decode: one greedy step of a SmolLM-135M-configured Llama (f32, random weights,
HF's default dynamic cache) after a long prompt, for eager, Inductor and backend="tpu" in turns in
one process (each its own copy of the model). A step is (generate(1 + N) - generate(1)) / N, so
the prompt's prefill cancels out; each backend's median over the rounds.

    python bench/long_decode.py --prompt 1024 --tokens 16 --rounds 5
    python bench/long_decode.py --dtype bf16 --backends eager tpu   # bf16 weights; two backends
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import tpu_dynamo

sys.path.insert(0, str(Path(__file__).parent))
from bench import DTYPES  # noqa: E402
from models import _smollm_135m_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=list(DTYPES), default="f32")
    parser.add_argument("--backends", nargs="+", choices=["eager", "inductor", "tpu"], default=["eager", "inductor", "tpu"])
    args = parser.parse_args()
    # The plugin's allocator setting (README "Devices") holds for every backend, as in bench.py.
    tpu_dynamo.device_info()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    eager = _smollm_135m_model().eval().to(DTYPES[args.dtype])
    ids = torch.randint(0, eager.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    models = {name: eager if name == "eager" else copy.deepcopy(eager) for name in args.backends}
    for name, model in models.items():
        if name != "eager":
            model.compile(backend=name, fullgraph=True)

    def generate(model: torch.nn.Module, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    tokens = {}
    for name, model in models.items():
        start = time.perf_counter()
        tokens[name] = generate(model, 1 + args.tokens)
        generate(model, 1)
        print(f"{name}: first generates (compiles included) {time.perf_counter() - start:.1f} s", flush=True)
    steps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            generate(model, 1)
            prompt_only = time.perf_counter()
            generate(model, 1 + args.tokens)
            end = time.perf_counter()
            steps[name].append(((end - prompt_only) - (prompt_only - start)) / args.tokens * 1e3)
    median = {name: statistics.median(ms) for name, ms in steps.items()}
    for name, ms in steps.items():
        print(f"{name}: ms per step {[round(m, 1) for m in ms]}, median {median[name]:.1f}")
    for other in ("inductor", "eager"):
        if "tpu" in median and other in median:
            print(f"tpu / {other} {median['tpu'] / median[other]:.2f}")
    if "eager" in tokens:
        print("the same tokens as eager:", {name: bool(torch.equal(t, tokens["eager"])) for name, t in tokens.items()})


if __name__ == "__main__":
    main()
