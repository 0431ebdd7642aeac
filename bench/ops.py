"""Where the batch-1 gap to Inductor comes from, measured below the model level.

`--ops`: single ops at the sizes of the bench's tiny GPT-2 (128 tokens, hidden 64, 4 heads, vocab
1000), eager PyTorch (what Inductor's extern kernels call for matmuls) against our executable
called directly, medians of `--calls`; `--convs`: the same for the convolutions of SD1.5's UNet
and VAE decoder.
`--pauses`: the executable of one decode step (the bench's tiny Llama with the dynamic cache)
called back to back and after pauses of Python busy work, an eager op or a sleep, as generate()
calls it between steps: the same execute costs more when XLA's worker threads have parked and the
vCPU has idled.

    .venv/bin/python bench/ops.py --ops --pauses
    .venv/bin/python bench/ops.py --convs --calls 20
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench import median_ms, recorded_executions  # noqa: E402
from models import build  # noqa: E402


def median_us(f: Callable[[], Any], calls: int, before: Callable[[], Any] = lambda: None) -> float:
    for _ in range(10):
        f()
    return median_ms(f, calls, lambda: None, before) * 1e3


def gpt2_ops() -> dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]]:
    x, heads = torch.randn(128, 64), [torch.randn(1, 4, 128, 16) for _ in range(3)]
    return {
        "LM head x @ wte.T (128x64 @ 64x1000)": (lambda x, w: x @ w.T, (x, torch.randn(1000, 64))),
        "linear 64 -> 192 (c_attn)": (F.linear, (x, torch.randn(192, 64), torch.randn(192))),
        "causal SDPA (4 heads, 128x128)": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), tuple(heads)
        ),
        "tanh GELU 128x256": (lambda x: F.gelu(x, approximate="tanh"), (torch.randn(128, 256),)),
        "layer norm 128x64": (
            lambda x, w, b: F.layer_norm(x, (64,), w, b), (x, torch.randn(64), torch.randn(64))
        ),
    }


def sd15_convs() -> dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]]:
    """The 3x3 convolutions of SD1.5's UNet at 32x32 latents, batch 2 (the `unet-sd15` model),
    one per width, and its stride-2 downsampling one at the deepest level; then those of its
    VAE's decoder turning 32x32 latents into a 256x256 image (`vae-sd15-decode`), batch 1."""
    def conv(batch: int, channels: int, size: int, stride: int = 1) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
        weight = torch.randn(channels, channels, 3, 3) * 0.02
        inputs = (torch.randn(batch, channels, size, size), weight, torch.randn(channels))
        return (lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=1)), inputs

    unet = [(320, 32, 1), (640, 16, 1), (1280, 8, 1), (1280, 8, 2), (1280, 4, 1)]
    vae = [(512, 32), (512, 64), (512, 128), (256, 256), (128, 256)]
    return {
        **{
            f"UNet conv 3x3 {c} ch at {s}x{s}{' stride 2' if stride == 2 else ''}": conv(2, c, s, stride)
            for c, s, stride in unet
        },
        **{f"VAE conv 3x3 {c} ch at {s}x{s}": conv(1, c, s) for c, s in vae},
    }


def run_ops(ops: dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]], calls: int) -> None:
    print("| op | eager µs | ours µs (executable) | ours/eager |\n|---|---|---|---|")
    for name, (fn, args) in ops.items():
        compiled = torch.compile(fn, backend="tpu", fullgraph=True)
        executable, inputs, sizes = recorded_executions(lambda: compiled(*args))[-1]
        eager = median_us(lambda: fn(*args), calls)
        ours = median_us(lambda: executable(list(inputs), *sizes), calls)
        print(f"| {name} | {eager:.0f} | {ours:.0f} | {ours / eager:.2f} |", flush=True)


def busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def run_pauses(calls: int) -> None:
    case = build("llama-decode", "cpu", torch.float32)
    case.module.model.compile(backend="tpu", fullgraph=True)
    case.module(*case.inputs)
    steps = recorded_executions(lambda: case.module(*case.inputs))
    executable, inputs, sizes = steps[len(steps) // 2]  # a step from the middle of generate()
    logits = torch.randn(1, 1000)

    def eager_step_ops() -> None:
        for _ in range(10):
            logits.argmax(-1), torch.cat([logits, logits], -1), logits.softmax(-1)

    pauses = {
        "none (back to back)": lambda: None,
        "50 µs of Python": lambda: busy(50),
        "200 µs of Python": lambda: busy(200),
        "1 ms of Python": lambda: busy(1000),
        "30 small eager ops": eager_step_ops,
        "sleep 1 ms": lambda: time.sleep(0.001),
    }
    print("| before each call | our call µs (median) |\n|---|---|")
    for label, before in pauses.items():
        print(f"| {label} | {median_us(lambda: executable(list(inputs), *sizes), calls, before):.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", action="store_true", help="single ops, eager vs our executable")
    parser.add_argument("--convs", action="store_true", help="SD1.5 UNet's and VAE's convolutions, eager vs our executable")
    parser.add_argument("--pauses", action="store_true", help="a decode step's executable after pauses")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with torch.no_grad():
        if args.ops:
            run_ops(gpt2_ops(), args.calls)
        if args.convs:
            run_ops(sd15_convs(), args.calls)
        if args.pauses:
            run_pauses(args.calls)


if __name__ == "__main__":
    main()
