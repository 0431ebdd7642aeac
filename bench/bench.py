"""`make bench`: eager vs Inductor vs backend="tpu" on identical inputs, one process per model.

    python bench/bench.py                              # the tiny-config models, CPU, float32
    python bench/bench.py --models gpt2-b1 micro       # a subset
    python bench/bench.py --device cuda --dtype bf16   # every backend on CUDA tensors; ours through
        # the PJRT plugin TPU_DYNAMO_PJRT_PLUGIN names (--host-inputs: ours fed CPU tensors instead)
    python bench/bench.py --models gpt2-124m-b1 smollm-135m-b1 --calls 20 --label full-size
        # real models' sizes (random weights): bench/RESULTS-full-size.md
    python bench/bench.py --models smollm-135m-decode --dtype bf16 --calls 20 --processes 1 --no-cold \
        --label cpu-bf16-decode-full-size   # its greedy decode in bf16
    python bench/bench.py --models gpt2-124m-1k smollm-135m-1k --calls 10 --processes 1 --label long-prompt
        # the same two forwards on a 1024-token prompt: bench/RESULTS-long-prompt.md
    python bench/bench.py --models smollm-135m-b1 smollm-135m-decode --autocast bf16 --calls 20 \
        --processes 1 --label cpu-autocast-bf16   # f32 weights, every call under torch.autocast
    python bench/bench.py --models sd35-medium-2l --calls 10 --label sd35-medium
        # two of SD3.5 Medium's layers at its real width: bench/RESULTS-sd35-medium.md
    python bench/bench.py --models smollm-135m-decode-b8 --calls 10 --processes 1 --no-cold --label decode-b8
        # eight prompts decoded together: bench/RESULTS-decode-b8.md (the same with smollm-135m-decode-static,
        # transformers' static cache: bench/RESULTS-decode-static.md)

Steady state: after warm-up, the median of `--calls` calls per backend, torch threads fixed, the
backends taking turns in blocks of 5 calls, each after one untimed call (this VM's slow phases,
seconds to minutes, then slow every backend alike), in `--processes` processes per model (every
model in turn, then again); each backend's lowest median counts.
Cold first call (compile included): a fresh process per backend and model, each with an empty
cache (TORCHINDUCTOR_CACHE_DIR, TPU_DYNAMO_CACHE_DIR), imports and model build before the clock;
warm first call: one more process of ours on the cache the cold one filled (the disk cache of
issue #5; Dynamo still traces); precompiled: two more under Dynamo's `caching_precompile`, the
first saving its frames, the second loading them (no tracing where Dynamo can reattach them; see
python/tpu_dynamo/precompile.py). The warm and precompiled first calls are divided by our cold
one (the saving process finds its executables on disk, so its first call is warm, not cold).
Backend overhead: our call / the bare PJRT execute of the same executables with device-resident
inputs (`Executable.bench_execute`); "in our callable": the part of a call spent inside our
executables, the rest being Dynamo's (and AOTAutograd's wrapper's).
Writes the table between the markers of bench/RESULTS.md (CPU f32; other runs write
bench/RESULTS-<device>-<dtype>.md, or bench/RESULTS-<label>.md with `--label`) and the ratio chart
beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import COLD, FULL_SIZE, MODELS, NEW_TOKENS, Case, build  # noqa: E402

HERE = Path(__file__).parent
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
WARMUP = 5
# Consecutive timed calls of one backend before the next takes its turn (`interleaved_ms`).
BLOCK = 5
# Untimed calls start each turn for at least this long (one call at least): eager's and Inductor's
# OpenMP worker spins ~10 ms for a next parallel region after their last one, on a core the next
# backend needs (2 vCPUs, AMD EPYC Zen 3: our tiny Llama at batch 8, the k-th call after eager's,
# 6.63, 5.93, 4.75, 4.56, 4.55 ms; under OMP_WAIT_POLICY=PASSIVE 5.14, 4.67, 4.55, 4.34, 4.21).
SETTLE_S = 0.02
TIMES = ("eager_ms", "inductor_ms", "tpu_ms", "inside_ms", "raw_ms")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def warm_up(fn: Callable[[], Any]) -> None:
    for _ in range(WARMUP):
        fn()
    # What compiling left for Python's collector is swept now, for every backend alike, so that a
    # full collection it owes does not fall into one backend's timed calls (a 0.3 s pause in decode).
    gc.collect()


def median_ms(
    fn: Callable[[], Any], calls: int, sync: Callable[[], None], before: Callable[[], Any] = lambda: None
) -> float:
    """Median of `calls` timed calls of `fn` (warmed up by the caller), each after an untimed
    `before()`."""
    return statistics.median(_timed(fn, calls, sync, before)) * 1e3


def _timed(
    fn: Callable[[], Any], calls: int, sync: Callable[[], None], before: Callable[[], Any] = lambda: None
) -> list[float]:
    times = []
    for _ in range(calls):
        before()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def interleaved_ms(
    fns: dict[str, tuple[Callable[[], Any], Callable[[], None]]], calls: int
) -> dict[str, float]:
    """Median of `calls` timed calls of each `fn` of `fns` (`key: (fn, sync)`, warmed up by the
    caller), taken in blocks of BLOCK calls that take turns: a slow phase of this VM (seconds to
    minutes) then slows every backend's calls alike instead of landing on one backend's block.
    Each block starts with untimed calls for SETTLE_S (one at least): the first calls after
    another backend's run slower (caches, and thread pools the other left spinning), which is
    not the steady state."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    while any(len(t) < calls for t in times.values()):
        for key, (fn, sync) in fns.items():
            settled = time.perf_counter() + SETTLE_S
            while True:
                fn()
                sync()
                if time.perf_counter() >= settled:
                    break
            times[key] += _timed(fn, min(BLOCK, calls - len(times[key])), sync)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def _tensor(out: Any) -> torch.Tensor:
    for attr in ("logits", "sample"):
        out = getattr(out, attr, out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.detach().float().cpu()


def _call(case: Case, fn: Callable[..., Any]) -> Callable[[], Any]:
    return lambda: fn(*case.inputs)


def _compiled(case: Case, backend: str) -> Callable[[], Any]:
    """Compiles as a user would: the model's forward (for decode, the model under generate())."""
    if case.decode:
        case.module.model.compile(backend=backend, fullgraph=True)
        return _call(case, case.module)
    return _call(case, torch.compile(case.module, backend=backend, fullgraph=True))


@contextlib.contextmanager
def _around_executables(around: Callable[..., Any]) -> Iterator[None]:
    """Routes every `Executable.__call__(self, args, *sizes)` through `around(call, self, args, *sizes)`."""
    from tpu_dynamo.executable import Executable

    call = Executable.__call__
    Executable.__call__ = lambda self, args, *sizes: around(call, self, args, *sizes)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Executable.__call__ = call  # type: ignore[method-assign]


def recorded_executions(fn: Callable[[], Any]) -> list[tuple[Any, list[Any], tuple[Any, ...]]]:
    """Every (Executable, inputs, sizes) one call of `fn` runs, for timing their bare execute."""
    seen: list[tuple[Any, list[Any], tuple[Any, ...]]] = []

    def recording(call: Callable[..., Any], self: Any, args: list[Any], *sizes: Any) -> Any:
        seen.append((self, list(args), sizes))
        return call(self, args, *sizes)

    with _around_executables(recording):
        fn()
    return seen


def _executables_obtained() -> int:
    import tpu_dynamo

    s = tpu_dynamo.stats()
    return s["compiles"] + s["disk_hits"] + s["memory_hits"]


def inside_ms(fn: Callable[[], Any], calls: int) -> float:
    """Median per call of `fn` of the time spent inside our executables (`Executable.__call__`):
    the call less what Dynamo (guards, frame, the model's output objects) and any AOTAutograd
    wrapper spend around them. A separate pass, so the timed calls carry no instrumentation."""
    return statistics.median(inside for inside, _ in inside_and_whole(fn, calls)) * 1e3


def inside_and_whole(fn: Callable[[], Any], calls: int) -> list[tuple[float, float]]:
    """Per call of `fn`: seconds inside our executables, and seconds of the whole call."""
    spent = [0.0]

    def timed(call: Callable[..., Any], self: Any, args: list[Any], *sizes: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(self, args, *sizes)
        finally:
            spent[0] += time.perf_counter() - start

    times = []
    with _around_executables(timed):
        for _ in range(calls):
            spent[0] = 0.0
            start = time.perf_counter()
            fn()
            times.append((spent[0], time.perf_counter() - start))
    return times


def _autocast(device: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device, dtype=dtype)


def steady(
    name: str, device: str, dtype: torch.dtype, calls: int, autocast: torch.dtype | None = None, ours_on: str = ""
) -> dict[str, Any]:
    """One model's steady state; `ours_on`: the device our backend's model and inputs are on
    (default `device`; "cpu" on a GPU feeds ours host tensors, host->device->host included)."""
    import tpu_dynamo

    # Starts the plugin first, so that its process-wide setting (glibc keeps freed memory for
    # reuse; README "Devices") holds for every backend measured here, not only for ours.
    tpu_dynamo.device_info()
    case = build(name, device, dtype)
    sync = _sync(device)
    row: dict[str, Any] = {"model": name, "decode": case.decode, "transformer": case.transformer}
    if case.decode:
        row["prompts"], row["cache"] = len(case.inputs[0]), case.module.cache_implementation
    with torch.no_grad(), _autocast(device, autocast):
        eager_fn = _call(case, case.module)
        reference = _tensor(eager_fn())
        warm_up(eager_fn)
        torch._dynamo.reset()
        # A decode compiles the model itself (`model.compile()`), so each backend gets its own copy
        # (same seed, same weights), as does ours on another device than the others'.
        inductor_fn = _compiled(build(name, device, dtype) if case.decode else case, "inductor")
        inductor_fn()
        warm_up(inductor_fn)
        # The sizes Dynamo saw change (automatic dynamic) are kept per code object, for every
        # backend: ours starts from none, as in a process of its own, with Inductor's graphs kept.
        torch._dynamo.pgo.reset_code_state()
        ours_on = ours_on or device
        ours = case if ours_on == device and not case.decode else build(name, ours_on, dtype)
        tpu_fn = _compiled(ours, "tpu")
        out = _tensor(tpu_fn())
        # Executables obtained after the warm-up (whether compiled or found in the memory or disk
        # cache): a decode's second generate still specializes its first step once.
        warm_up(tpu_fn)
        executables = _executables_obtained()
        row.update(
            interleaved_ms(
                {"eager_ms": (eager_fn, sync), "inductor_ms": (inductor_fn, sync), "tpu_ms": (tpu_fn, _sync(ours_on))},
                calls,
            )
        )
        row["recompiles"] = _executables_obtained() - executables
        row["graphs"] = executables
        if case.decode:
            row["mismatch"] = int((out != reference).sum())
        else:
            row["max_abs_diff"] = float((out - reference).abs().max())
        # A decode's: every step of one generate() (per token in the table).
        row["inside_ms"] = inside_ms(tpu_fn, calls)
        recorded = recorded_executions(tpu_fn)
        # An execute that updates its inputs in place (a static cache's) is given them to consume,
        # so it cannot be repeated on the same inputs: no raw time then.
        if not any(exe.mutations for exe, _, _ in recorded):
            raw = [statistics.median(exe.bench_execute(args, calls, *sizes)) for exe, args, sizes in recorded]
            row["raw_ms"] = sum(raw) * 1e3
    return row


def cold(
    name: str,
    backend: str,
    device: str,
    dtype: torch.dtype,
    precompile: bool,
    autocast: torch.dtype | None = None,
    ours_on: str = "",
) -> dict[str, Any]:
    """First call of a fresh compile in a fresh process. Not counted, in every process alike:
    imports (torch, Dynamo and AOTAutograd, the backend's own modules) and the model build.
    `precompile`: under Dynamo's `caching_precompile`, saved after the call (not timed) for the
    next process of the same cache directory to load."""
    import torch._dynamo
    import torch._functorch.aot_autograd  # noqa: F401

    torch._dynamo.lookup_backend(backend)
    if backend == "inductor":
        import torch._inductor.compile_fx  # noqa: F401
    torch._dynamo.config.caching_precompile = precompile
    on = (ours_on or device) if backend == "tpu" else device
    case = build(name, on, dtype)
    with torch.no_grad(), _autocast(device, autocast):
        start = time.perf_counter()
        _compiled(case, backend)()
        _sync(on)()
        seconds = time.perf_counter() - start
    if precompile:
        torch.compiler.save_cache_artifacts()
    return {"model": name, "backend": backend, "cold_s": seconds}


def _child(args: argparse.Namespace, *what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs this script in a new process; its last stdout line is the JSON result."""
    cmd = [sys.executable, __file__, *what, "--device", args.device, "--dtype", args.dtype,
           "--threads", str(args.threads), "--calls", str(args.calls)]
    if args.autocast:
        cmd += ["--autocast", args.autocast]
    if args.host_inputs:
        cmd += ["--host-inputs"]
    print("+", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        return {"error": _error_line(proc.stderr) or f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _error_line(stderr: str) -> str:
    """The line of a failed process's stderr that says what failed: the last one naming an error
    (Dynamo ends its own with advice on logging), else the last."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]]
    return (named or lines or [""])[-1]


def _lowest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's row from its processes: per backend the lowest median (a slow phase of this VM
    that outlasts a process slows all of its backends, seldom every process), the checks from the
    worst process, and every process's times."""
    errors = [r for r in runs if "error" in r]
    if errors:
        return errors[0]
    row = dict(runs[0])
    for key in TIMES:
        if key in row:
            row[key] = min(r[key] for r in runs)
    for key in ("max_abs_diff", "mismatch", "recompiles"):
        if key in row:
            row[key] = max(r[key] for r in runs)
    row["processes"] = [{k: r[k] for k in TIMES if k in r} for r in runs]
    return row


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def _per(ms: float | None, n: int) -> float | None:
    return None if ms is None else ms / n


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def table(rows: list[dict[str, Any]], colds: dict[tuple[str, str], float]) -> str:
    head = ("| model | eager ms | Inductor ms | tpu ms | tpu/Inductor | tpu/eager | raw execute ms "
            "| overhead (tpu/raw) | in our callable ms | callable/raw | cold Inductor s | cold tpu s | cold tpu/Inductor | warm first call tpu s "
            "| warm/cold | warm first call, precompiled s | precompiled/cold | max abs diff | recompiles |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |" + " |" * 17)
            continue
        ci, ct = colds.get((r["model"], "inductor")), colds.get((r["model"], "tpu"))
        warm, pre = colds.get((r["model"], "tpu-warm")), colds.get((r["model"], "tpu-precompiled"))
        unit = " (per token)" if r["decode"] else ""
        per = NEW_TOKENS if r["decode"] else 1
        check = f"{r['mismatch']} tokens differ" if r["decode"] else f"{r['max_abs_diff']:.1e}"
        lines.append(
            f"| {r['model']}{unit} | {_fmt(r['eager_ms'] / per)} | {_fmt(r['inductor_ms'] / per)} "
            f"| {_fmt(r['tpu_ms'] / per)} | {_fmt(_ratio(r['tpu_ms'], r['inductor_ms']))} "
            f"| {_fmt(_ratio(r['tpu_ms'], r['eager_ms']))} | {_fmt(_per(r.get('raw_ms'), per), 3)} "
            f"| {_fmt(_ratio(r['tpu_ms'], r.get('raw_ms')))} | {_fmt(_per(r.get('inside_ms'), per), 3)} "
            f"| {_fmt(_ratio(r.get('inside_ms'), r.get('raw_ms')))} | {_fmt(ci, 1)} | {_fmt(ct, 2)} "
            f"| {_fmt(_ratio(ct, ci))} | {_fmt(warm, 2)} | {_fmt(_ratio(warm, ct))} | {_fmt(pre, 2)} "
            f"| {_fmt(_ratio(pre, ct))} | {check} "
            f"| {r['recompiles']} |"
        )
    decode = [r for r in rows if r.get("decode") and "error" not in r]
    for r in decode:
        prompts = r.get("prompts", 1)
        tps = {k: prompts * NEW_TOKENS / (r[f"{k}_ms"] / 1e3) for k in ("eager", "inductor", "tpu")}
        each = f" for each of {prompts} prompts" if prompts > 1 else ""
        if r.get("cache") == "static":
            cache, graphs = "static cache", f"{r['graphs']} executables: the prompt's and the steps'"
        else:
            cache, graphs = "default dynamic cache", (
                f"{r['graphs']} executables: the prompt, the first step, then the step graph exactly once"
                " and padded to powers of two from its second length"
            )
        lines.append("")
        lines.append(
            f"{r['model']}: greedy `generate()` of {NEW_TOKENS} tokens{each}, {cache}: "
            f"eager {tps['eager']:.0f} tokens/s, Inductor {tps['inductor']:.0f}, tpu {tps['tpu']:.0f} ({graphs})."
        )
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], colds: dict[tuple[str, str], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    series = {
        "tpu / Inductor (target ≤ 1.0)": [_ratio(r["tpu_ms"], r["inductor_ms"]) for r in ok],
        "tpu / eager (target ≤ 0.5)": [_ratio(r["tpu_ms"], r["eager_ms"]) for r in ok],
        "overhead: tpu / raw execute (target ≤ 1.2, micro)": [_ratio(r["tpu_ms"], r.get("raw_ms")) for r in ok],
        "cold first call tpu / Inductor (target ≤ 0.5)": [
            _ratio(colds.get((r["model"], "tpu")), colds.get((r["model"], "inductor"))) for r in ok
        ],
        "warm first call / cold (target ≤ 0.1)": [
            _ratio(colds.get((r["model"], "tpu-warm")), colds.get((r["model"], "tpu"))) for r in ok
        ],
        "precompiled first call / cold (target ≤ 0.1)": [
            _ratio(colds.get((r["model"], "tpu-precompiled")), colds.get((r["model"], "tpu"))) for r in ok
        ],
    }
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(ok))]
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    for y in (0.1, 0.5, 1.0, 1.2):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_xticks(range(len(ok)), [r["model"] for r in ok], rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("ratio (lower is better, log scale)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    ax.set_title("tpu_dynamo vs eager / Inductor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def header(args: argparse.Namespace) -> str:
    import diffusers
    import transformers

    import tpu_dynamo

    info = tpu_dynamo.device_info()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    ours = (
        "CPU tensors in and out (host->device->host included)"
        if args.host_inputs
        else f"{args.device.upper()} tensors in and out"
    )
    return "\n".join([
        f"- date: {datetime.date.today()}; command: `{' '.join(['python', 'bench/bench.py', *sys.argv[1:]])}`",
        f"- machine: {platform.node()}, {cpu}, {os.cpu_count()} cores; device {args.device}, dtype {args.dtype}"
        + (f", every call under `torch.autocast` to {args.autocast}" if args.autocast else ""),
        f"- torch threads: {args.threads} (`torch.set_num_threads`); the XLA CPU plugin sizes its own pool",
        "- allocator: glibc with freed memory kept for reuse (tpu_dynamo's setting, made before any backend runs)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, diffusers {diffusers.__version__}, tpu_dynamo {tpu_dynamo.__version__}",
        f"- PJRT plugin: `{info['identity']}`; ours: {ours}",
        f"- steady state: median of {args.calls} calls after {WARMUP} warm-up calls, the backends taking "
        f"turns in blocks of {BLOCK} calls (each after untimed calls for {1e3 * SETTLE_S:.0f} ms, one at least), in each of {args.processes} "
        "processes per model (every model in turn, then again); per backend the lowest median; ms per call",
    ])


def write_results(args: argparse.Namespace, rows: list[dict[str, Any]], colds: dict[tuple[str, str], float]) -> None:
    if args.label:
        suffix = f"-{args.label}"
    elif (args.device, args.dtype, args.autocast) == ("cpu", "f32", None):
        suffix = ""
    else:
        suffix = f"-{args.device}-{args.dtype}" + (f"-autocast-{args.autocast}" if args.autocast else "")
    md, png = HERE / f"RESULTS{suffix}.md", HERE / f"ratios{suffix}.png"
    body = f"{BEGIN}\n{header(args)}\n\n{table(rows, colds)}\n\n![ratios]({png.name})\n{END}"
    text = md.read_text() if md.exists() else "# Measurements\n"
    if BEGIN not in text:
        text += f"\n## Eager vs Inductor vs backend=\"tpu\" (issue #6, `make bench`)\n\n{BEGIN}\n{END}\n"
    start, end = text.index(BEGIN), text.index(END) + len(END)
    md.write_text(text[:start] + body + text[end:])
    (HERE / f"results{suffix}.json").write_text(json.dumps({"rows": rows, "cold": [
        {"model": m, "backend": b, "cold_s": s} for (m, b), s in colds.items()]}, indent=1) + "\n")
    chart(rows, colds, png)
    print(table(rows, colds))
    print(f"wrote {md} and {png}")


def _ours_device(args: argparse.Namespace) -> str:
    return "cpu" if args.host_inputs else args.device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=[m for m in MODELS if m not in FULL_SIZE], choices=list(MODELS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="f32", choices=list(DTYPES))
    p.add_argument(
        "--autocast", choices=[d for d in DTYPES if d != "f32"],
        help="run every backend's calls under torch.autocast to this dtype (the weights stay DTYPE)",
    )
    p.add_argument(
        "--host-inputs", action="store_true",
        help="on a GPU, feed our backend CPU tensors (the model on the host; each call uploads and downloads)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--processes", type=int, default=2, help="steady-state processes per model")
    p.add_argument("--no-cold", action="store_true", help="skip the cold first-call processes")
    p.add_argument(
        "--label", help="write RESULTS-LABEL.md, ratios-LABEL.png, results-LABEL.json (default: DEVICE-DTYPE, "
        "none for cpu f32)"
    )
    p.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--cold", nargs=2, metavar=("BACKEND", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    autocast = DTYPES[args.autocast] if args.autocast else None
    if args.one:
        print(json.dumps(steady(args.one, args.device, dtype, max(args.calls, 20), autocast, _ours_device(args))))
        return
    if args.cold:
        print(json.dumps(cold(args.cold[1], args.cold[0], args.device, dtype, args.precompile, autocast, _ours_device(args))))
        return
    passes = [[{"model": m, **_child(args, "--one", m)} for m in args.models] for _ in range(args.processes)]
    rows = [_lowest(list(runs)) for runs in zip(*passes)]
    colds: dict[tuple[str, str], float] = {}
    for m in [] if args.no_cold else [m for m in COLD if m in args.models]:
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TPU_DYNAMO_CACHE_DIR": f"{cache}/tpu"}
            # The second "tpu" process finds the executables the first one wrote; the last two
            # run under Dynamo's caching precompile (saved by the first, loaded by the second).
            for label, backend, *flag in (
                ("inductor", "inductor"), ("tpu", "tpu"), ("tpu-warm", "tpu"),
                ("tpu-precompile", "tpu", "--precompile"), ("tpu-precompiled", "tpu", "--precompile"),
            ):
                r = _child(args, "--cold", backend, m, *flag, env=env)
                if "cold_s" in r:
                    colds[(m, label)] = r["cold_s"]
    write_results(args, rows, colds)


if __name__ == "__main__":
    main()
