"""Cold vs warm first compiled call of tiny GPT-2 and the tiny SD3 transformer (issue #5).

    .venv/bin/python bench/cache_warm_start.py [--runs 3] [--models gpt2 sd3]

For each model: `runs` fresh processes against an empty cache directory (cold: Dynamo tracing,
lowering, XLA compile, disk write) alternating with `runs` fresh processes against a directory
an earlier process filled (warm: Dynamo tracing, disk load, no compile, and for each graph found
by its Dynamo graph, a graph hit, no AOTAutograd or conversion). Reports the time of the
first compiled call (median, min, every run) and the split of our part from `tpu_dynamo.stats()`
(median over the runs): XLA compile (lowering included), lowering alone, disk load (read,
deserialize, load onto the device), disk store (serialize, write), plugin identity (hashing the
plugin file, once per process).

`--child MODEL OUT` is one such process: it builds the seeded model, times its first compiled
forward and saves the output and the stats to OUT (tests/test_disk_cache.py uses it too).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _model(name: str):
    """The module and its forward arguments; seeded, so every process builds the same ones."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    if name == "gpt2":
        import gpt2

        model, input_ids = gpt2.build()
        return model, (input_ids,)
    import sd3

    transformer = sd3.build_pipeline().transformer
    g = torch.Generator().manual_seed(0)
    # What the pipeline feeds it for a 64x64 image with classifier-free guidance (batch 2).
    return transformer, (
        torch.randn(2, 4, 32, 32, generator=g),  # hidden_states (latents)
        torch.randn(2, 8, 32, generator=g),  # encoder_hidden_states (prompt embeddings)
        torch.randn(2, 64, generator=g),  # pooled_projections
        torch.full((2,), 500.0),  # timestep
    )


def child(name: str, out: str) -> None:
    import torch

    import tpu_dynamo

    model, args = _model(name)
    compiled = torch.compile(model, backend="tpu", fullgraph=True, dynamic=False)
    tpu_dynamo.reset_stats()
    with torch.no_grad():
        start = time.perf_counter()
        output = compiled(*args, return_dict=False)[0]
        first_call_s = time.perf_counter() - start
    torch.save({"output": output, "first_call_s": first_call_s, "stats": tpu_dynamo.stats()}, out)


def run_child(name: str, cache_dir: str, out: str) -> dict:
    import torch

    env = {**os.environ, "TPU_DYNAMO_CACHE_DIR": cache_dir}
    subprocess.run([sys.executable, __file__, "--child", name, out], env=env, check=True)
    return torch.load(out)


def measure(name: str, runs: int, work: Path) -> dict[str, list[dict]]:
    """Alternates cold and warm processes so that background load hits both alike."""
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    warm_dir = work / f"{name}-warm"
    run_child(name, str(warm_dir), str(work / "out.pt"))  # fills the warm directory
    for i in range(runs):
        cold_dir = work / f"{name}-cold-{i}"
        results["cold"].append(run_child(name, str(cold_dir), str(work / "out.pt")))
        shutil.rmtree(cold_dir)
        results["warm"].append(run_child(name, str(warm_dir), str(work / "out.pt")))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["gpt2", "sd3"], choices=["gpt2", "sd3"])
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print("| model | process | first call: median (min) | runs | compiles | disk hits | graph hits | compile s"
          " | lower s | load s | store s | identity s | entry bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            for start, rows in measure(name, args.runs, Path(work)).items():
                first = [r["first_call_s"] * 1e3 for r in rows]
                stat = lambda key: statistics.median(r["stats"][key] for r in rows)  # noqa: E731
                s = rows[0]["stats"]
                split = " | ".join(f"{stat(k):.3f}" for k in (
                    "compile_seconds", "lower_seconds", "load_seconds", "store_seconds", "plugin_identity_seconds"))
                print(f"| {name} | {start} | {statistics.median(first):.0f} ms ({min(first):.0f} ms) |"
                      f" {', '.join(f'{t:.0f}' for t in first)} | {s['compiles']} | {s['disk_hits']} | {s['graph_hits']}"
                      f" | {split} |"
                      f" {s['disk_bytes_written'] or s['disk_bytes_read']} |", flush=True)


if __name__ == "__main__":
    main()
