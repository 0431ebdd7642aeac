"""Where a steady call's time goes, function by function (cProfile), ours beside Inductor's.

    python bench/profile_call.py --model micro --device cuda --dtype bf16 --calls 2000

For a gap the benchmark's table shows but cannot explain (2026-12-04, H200: the micro graph's
call 0.32 ms, 0.12 of it in our callable, Inductor's whole call 0.07): each backend's calls after
warm-up, each followed by the device synchronization the benchmark makes, profiled, and the
functions that take the most time of their own printed.

    python bench/profile_call.py --model llama-b8 --segments --calls 300

With `--segments` (the CPU plugin), no profiler: each of our steady calls after warm-up is cut
where its time goes, by clocks read as it enters and leaves our callable (`Direct`) and its
native run: before our callable (Dynamo's guards and frame, and the model's own Python, e.g. a
`generate()` loop), our Python around the native run, the native run, and after our callable
(Dynamo rebuilding the model's output); beside them the bare execute of the same executables,
right after each call (same phase of the machine, warm caches). The clocks cost ~1 µs a call.
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import DTYPES, _around_executables, _compiled, _sync, recorded_executions, warm_up  # noqa: E402
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


class _TimedRun:
    """An executable's native object, its `run` clocked into `clock` (entry and exit)."""

    def __init__(self, native: Any, clock: Callable[[str], None]) -> None:
        self.native, self.clock = native, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.native, name)

    def run(self, *args: Any) -> Any:
        self.clock("run")
        try:
            return self.native.run(*args)
        finally:
            self.clock("ran")


@contextlib.contextmanager
def _clocked(clock: Callable[[str], None]) -> Iterator[None]:
    """Clocks every `Direct.__call__` (entry "in", exit "out") and every native run under it."""
    from tpu_dynamo import direct

    wrapped: list[Any] = []

    def around(call: Callable[..., Any], exe: Any, args: list[Any], *sizes: Any) -> Any:
        if not isinstance(exe.native, _TimedRun):
            exe.native = _TimedRun(exe.native, clock)
            wrapped.append(exe)
        return call(exe, args, *sizes)

    def direct_call(self: Any, *args: Any) -> Any:
        clock("in")
        try:
            return plain(self, *args)
        finally:
            clock("out")

    plain = direct.Direct.__call__
    direct.Direct.__call__ = direct_call  # type: ignore[method-assign]
    try:
        with _around_executables(around):
            yield
    finally:
        direct.Direct.__call__ = plain  # type: ignore[method-assign]
        for exe in wrapped:
            exe.native = exe.native.native


_OPENS = {"call": "before our callable", "in": "our Python", "run": "native run", "ran": "our Python", "out": "before our callable"}
_PARTS = ("before our callable", "our Python", "native run", "after our callable")


def _split(marks: list[tuple[str, int]]) -> dict[str, float]:
    """A call's µs per part, from its clock marks: the time between two marks is the part the
    first one opens; after our callable's last return it is Dynamo's (the output), between two
    of our calls the model's Python and Dynamo's before the next."""
    spent = dict.fromkeys(_PARTS, 0.0)
    last = len(marks) - 2
    for i, ((what, at), (_, until)) in enumerate(zip(marks, marks[1:])):
        part = "after our callable" if what == "out" and i == last else _OPENS[what]
        spent[part] += (until - at) / 1e3
    return spent


def segments(model: str, dtype: torch.dtype, calls: int) -> str:
    """Where our steady calls' time goes on the CPU plugin (see the module's docstring),
    medians per call in µs."""
    case = build(model, "cpu", dtype)
    marks: list[tuple[str, int]] = []
    per_call: dict[str, list[float]] = {part: [] for part in (*_PARTS, "whole", "bare")}
    with torch.no_grad():
        fn = _compiled(case, "tpu")
        fn()
        warm_up(fn)
        executions = recorded_executions(fn)
        with _clocked(lambda what: marks.append((what, time.perf_counter_ns()))):
            for _ in range(calls):
                marks.clear()
                marks.append(("call", time.perf_counter_ns()))
                fn()
                marks.append(("end", time.perf_counter_ns()))
                for part, us in _split(marks).items():
                    per_call[part].append(us)
                per_call["whole"].append((marks[-1][1] - marks[0][1]) / 1e3)
                bare = sum(exe.bench_execute(list(args), 1, *sizes)[0] for exe, args, sizes in executions)
                per_call["bare"].append(bare * 1e6)
    median = {part: statistics.median(times) for part, times in per_call.items()}
    runs = sum(what == "run" for what, _ in marks)
    return (
        f"== tpu: {model} on cpu, {calls} calls, {runs} native run(s) a call; medians in µs: whole {median['whole']:.1f}"
        f" = {', '.join(f'{part} {median[part]:.1f}' for part in _PARTS)}; bare executes {median['bare']:.1f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro", choices=list(MODELS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="f32", choices=list(DTYPES))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--segments", action="store_true", help="where our calls' time goes, unprofiled (above)")
    args = p.parse_args()
    import tpu_dynamo

    tpu_dynamo.device_info()
    if args.segments:
        if args.device != "cpu":
            p.error("--segments times the CPU plugin's calls (--device cpu)")
        print(segments(args.model, DTYPES[args.dtype], args.calls), flush=True)
        return
    for backend in ("tpu", "inductor"):
        torch._dynamo.reset()
        print(profile(backend, args.model, args.device, DTYPES[args.dtype], args.calls, args.top), flush=True)


if __name__ == "__main__":
    main()
