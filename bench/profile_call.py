"""Where a steady call's time goes, function by function (cProfile), ours beside Inductor's.

    python bench/profile_call.py --model micro --device cuda --dtype bf16 --calls 2000

For a gap the benchmark's table shows but cannot explain (2026-12-04, H200: the micro graph's
call 0.32 ms, 0.12 of it in our callable, Inductor's whole call 0.07): each backend's calls after
warm-up, each followed by the device synchronization the benchmark makes, profiled, and the
functions that take the most time of their own printed.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import DTYPES, _compiled, _sync, warm_up  # noqa: E402
from models import MODELS, build  # noqa: E402


def profile(backend: str, model: str, device: str, dtype: torch.dtype, calls: int, top: int) -> str:
    case = build(model, device, dtype)
    sync = _sync(device)
    with torch.no_grad():
        fn = _compiled(case, backend)
        fn()
        warm_up(fn)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
            sync()
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return f"== {backend}: {model} on {device}, {calls} calls, {stats.total_tt / calls * 1e6:.1f} µs per call (profiled)\n" + out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro", choices=list(MODELS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="f32", choices=list(DTYPES))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import tpu_dynamo

    tpu_dynamo.device_info()
    for backend in ("tpu", "inductor"):
        torch._dynamo.reset()
        print(profile(backend, args.model, args.device, DTYPES[args.dtype], args.calls, args.top), flush=True)


if __name__ == "__main__":
    main()
