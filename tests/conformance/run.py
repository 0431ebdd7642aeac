"""OpInfo conformance: every float32 CPU sample of PyTorch's `op_db`, compiled through
backend="tpu" with fullgraph=True under no_grad, against eager.

Each sample is classified as pass / mismatch / lowering (no or failing rule, op named) /
backend (another error of ours) / dynamo (Dynamo or AOTAutograd failed before our compiler) /
crash (the process died) / timeout / skip (with the reason). Ops run in chunks in worker
subprocesses that log each sample before running it, so a crash (e.g. a PJRT abort) is
recorded against that sample and the run resumes after it.

    python tests/conformance/run.py [--cap N] [--jobs J] [--ops a,b] [--report PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# assert_close's float32 rtol is 1.3e-6; compiled transcendental ops differ by a few ulp, so the
# default (used where the OpInfo gives no float32 tolerance override) is slightly looser.
DEFAULT_TOL = {"rtol": 1e-5, "atol": 1e-5}
SAMPLE_TIMEOUT_S = 60
OURS = ("mismatch", "lowering", "backend", "crash", "timeout")
# Why the known failures fail: (substring of the op key or of the reason, explanation).
KNOWN = [
    ("_scaled_dot_product_flash_attention_for_cpu", "PyTorch's decomposition gives logsumexp an extra dim"
     " (aot_eager with the same table agrees with us); the attention output matches"),
    ("with_effects", "with_effects of an effectful op other than _linalg_check_errors"),
    ("empty", "uninitialized memory (empty, new_empty_strided): eager's values are arbitrary, nothing to match"),
    ("linear_cross_entropy", "torch_nn's chunked linear + cross-entropy custom ops (label smoothing, gradients"
     " precomputed in the forward) have no ATen decomposition; not lowered"),
    ("narrow", "narrow with a tensor start reads it with .item(): the slice start is a data-dependent"
     " scalar, which the static-shape compiler cannot bind"),
    ("symbolic shape", "data-dependent output shape; the compiler needs static shapes"),
    ("data-dependent scalar", "data-dependent scalar (.item()) in the graph; static shapes only"),
    ("SymInt", "data-dependent scalar (.item()) in the graph; static shapes only"),
    ("is not supported", "dtype outside the IR (complex128, complex32, wide unsigned)"),
    ("linalg.eigh", "eigenvectors are unique up to sign: Jacobi's columns differ from LAPACK's by"
     " a factor -1 (eigenvalues and |eigenvectors| match)"),
    ("linalg_eig.", "general (nonsymmetric) eig has complex results and no rule"),
    ("matrix_exp", "f32 cancellation: on the 5x5x5 sample (entries ~1e5) small entries of ours and of eager"
     " are each ~1e-3 relative off the f64 exponential (ours 9.6e-4, eager 2.4e-3), so they differ by more"
     " than the tolerance"),
]


def known_reason(op: str, reason: str) -> str:
    return next((why for key, why in KNOWN if key in op or key in reason), "")


def op_list():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def tolerance(op) -> dict:
    """The loosest float32 tolerance any of the OpInfo's `toleranceOverride` decorators gives."""
    import torch

    tol = dict(DEFAULT_TOL)
    for info in op.decorators:
        for dec in getattr(info, "decorators", ()):
            t = getattr(dec, "d", {}).get(torch.float32)
            if t is not None:
                tol = {"rtol": max(tol["rtol"], t.rtol), "atol": max(tol["atol"], t.atol)}
    return tol


def _lowering_op(message: str) -> str | None:
    for prefix in ("unsupported op ", ""):
        if message.startswith(prefix):
            head = message[len(prefix):].split("(")[0].split(" ")[0]
            if head.startswith(("aten.", "prims.", "transformers.")):
                return head
    return None


def classify_error(exc: BaseException) -> tuple[str, str]:
    """(category, reason) for an exception raised by the compiled call."""
    from tpu_dynamo import _native

    inner = getattr(exc, "inner_exception", None) or exc
    message = f"{type(inner).__name__}: {inner}".splitlines()[0][:300]
    if isinstance(inner, _native.LowerError):
        op = _lowering_op(str(inner))
        return "lowering", f"{op or '?'}: {message}"
    frames = traceback.extract_tb(inner.__traceback__)
    ours = any(f"tpu_dynamo{os.sep}" in f.filename and not f.filename.endswith("backend.py") for f in frames)
    if ours or type(exc).__name__ != "BackendCompilerFailed" and "tpu_dynamo" in message:
        return "backend", message
    return "dynamo", message


def run_sample(op, sample, tol) -> tuple[str, str]:
    import torch

    def fn(inp, *args):
        return op(inp, *args, **sample.kwargs)

    args = (sample.input, *sample.args)
    try:
        want = fn(*args)
        again = fn(*args)
    except Exception as e:  # noqa: BLE001 - any eager failure makes the sample unusable
        return "skip", f"eager raised {type(e).__name__}"
    try:
        torch.testing.assert_close(again, want, equal_nan=True, rtol=0, atol=0)
    except Exception:  # noqa: BLE001
        return "skip", "nondeterministic in eager"
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)(*args)
    except Exception as e:  # noqa: BLE001
        return classify_error(e)
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
    except Exception as e:  # noqa: BLE001
        return "mismatch", str(e).strip().splitlines()[0][:200]
    return "pass", ""


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def worker(first: int, last: int, cap: int, only: set[str], log: Path, skip: tuple[int, int] | None) -> None:
    """Runs ops `first..last` of op_db, appending one JSON line per event to `log`; `skip` is the
    (op index, sample) of a crash to resume after."""
    import torch

    torch._dynamo.config.cache_size_limit = 64
    signal.signal(signal.SIGALRM, _alarm)
    ops = op_list()[first:last]
    with open(log, "a") as out:
        def emit(**rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()

        for i, op in enumerate(ops, first):
            key = op_key(op)
            if only and key not in only and op.name not in only:
                continue
            if torch.float32 not in op.supported_dtypes("cpu"):
                emit(op=key, index=i, sample=-1, status="skip", reason="no float32 on CPU")
                continue
            tol = tolerance(op)
            try:
                samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:cap]
            except Exception as e:  # noqa: BLE001
                emit(op=key, index=i, sample=-1, status="skip", reason=f"sample_inputs raised {type(e).__name__}")
                continue
            for s, sample in enumerate(samples):
                if skip and (i, s) <= skip:
                    continue
                emit(op=key, index=i, sample=s, status="start")
                signal.alarm(SAMPLE_TIMEOUT_S)
                try:
                    with torch.no_grad():
                        status, reason = run_sample(op, sample, tol)
                except _Timeout:
                    status, reason = "timeout", f"over {SAMPLE_TIMEOUT_S} s"
                finally:
                    signal.alarm(0)
                emit(op=key, index=i, sample=s, status=status, reason=reason)


def _records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def run_chunk(first: int, last: int, cap: int, ops: str, log: Path) -> None:
    """Runs ops `first..last` in worker subprocesses until done; when a worker dies, its open
    sample is recorded as a crash and a new worker resumes right after it."""
    resume = ""
    while True:
        cmd = [sys.executable, __file__, "--worker", f"{first}:{last}", "--cap", str(cap), "--ops", ops,
               "--log", str(log), "--resume", resume]
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        recs = _records(log)
        if rc == 0 or not recs or recs[-1]["status"] != "start":
            return
        last_rec = recs[-1]
        with open(log, "a") as out:
            out.write(json.dumps({**last_rec, "status": "crash", "reason": f"worker died (exit code {rc})"}) + "\n")
        first, resume = last_rec["index"], f"{last_rec['index']}:{last_rec['sample']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # All samples of all ops would take well over 20 minutes on 2 cores; the first 8 per op
    # keep `make conformance` near 10 minutes and still cover each op's shape kinds.
    ap.add_argument("--cap", type=int, default=8, help="samples per op (first N)")
    ap.add_argument("--jobs", type=int, default=2, help="worker subprocesses in parallel")
    ap.add_argument("--chunk", type=int, default=25, help="ops per worker")
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    ap.add_argument("--report", default=str(HERE / "REPORT.md"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--resume", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    only = {o for o in a.ops.split(",") if o}
    if a.worker:
        first, last = map(int, a.worker.split(":"))
        skip = tuple(map(int, a.resume.split(":"))) if a.resume else None
        worker(first, last, a.cap, only, Path(a.log), skip)
        return
    from concurrent.futures import ThreadPoolExecutor

    n = len(op_list())
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        chunks = [(i, min(i + a.chunk, n), Path(tmp) / f"{i}.jsonl") for i in range(0, n, a.chunk)]
        with ThreadPoolExecutor(a.jobs) as pool:
            list(pool.map(lambda c: run_chunk(c[0], c[1], a.cap, a.ops, c[2]), chunks))
        recs = [r for _, _, log in chunks for r in _records(log) if r["status"] != "start"]
    Path(a.report).write_text(report(recs, a.cap, time.time() - start, a.jobs))
    print(Path(a.report).read_text().split("\n## ")[0])


def summarize(recs: list[dict]) -> dict[str, Counter]:
    per_op: dict[str, Counter] = defaultdict(Counter)
    for r in recs:
        per_op[r["op"]][r["status"]] += 1
    return per_op


def report(recs: list[dict], cap: int, seconds: float, jobs: int) -> str:
    per_op = summarize(recs)
    total = Counter(r["status"] for r in recs if r["sample"] >= 0)
    samples = sum(total.values())
    ours = total["pass"] + sum(total[k] for k in OURS)
    pct = lambda a, b: f"{100 * a / b:.1f} %" if b else "n/a"  # noqa: E731
    lines = [
        "# OpInfo conformance report",
        "",
        "Generated by `make conformance` (`tests/conformance/run.py`): every entry of PyTorch's `op_db`, its",
        f"float32 CPU samples (the first {cap} per op), compiled with `backend=\"tpu\", fullgraph=True` under",
        "`no_grad` and compared with eager by `torch.testing.assert_close(equal_nan=True)` using the OpInfo's",
        f"float32 `toleranceOverride` where it has one, else rtol={DEFAULT_TOL['rtol']}, atol={DEFAULT_TOL['atol']}.",
        "",
        f"- Ops: {len(per_op)}; samples run: {samples}; wall time {seconds / 60:.1f} min with {jobs} workers.",
        f"- Overall pass rate: {total['pass']} / {samples} = {pct(total['pass'], samples)}.",
        f"- Pass rate among samples whose outcome is ours (pass + {' + '.join(OURS)}): "
        f"{total['pass']} / {ours} = {pct(total['pass'], ours)}.",
        "- Outcomes: " + ", ".join(f"{k} {v}" for k, v in total.most_common()) + ".",
        "",
        "Categories: *lowering* = our compiler has no rule or its rule failed (op named); *backend* = another",
        "error in tpu_dynamo; *dynamo* = Dynamo/AOTAutograd failed before our compiler ran (not ours); *skip* =",
        "no float32 CPU support, eager raised, or eager is nondeterministic (random ops).",
        "",
        "## Failing ops (ours)",
        "",
        "| op | failures | reason (first) | why |",
        "|---|---|---|---|",
    ]
    first_reason: dict[str, str] = {}
    for r in recs:
        if r["status"] in OURS:
            first_reason.setdefault(r["op"], f"{r['status']}: {r['reason']}")
    for op in sorted(first_reason):
        c = per_op[op]
        reason = first_reason[op].replace("|", "\\|").replace("\n", " ")
        why = known_reason(op, reason)
        lines.append(f"| `{op}` | {sum(c[k] for k in OURS)} | {reason} | {why} |")
    by_reason = Counter(
        r["reason"].split(":")[0] for r in recs if r["status"] == "lowering"
    )
    lines += ["", "## Lowering errors by op", "", "| op | samples |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in by_reason.most_common()]
    lines += ["", "## Per-op counts", "", "| op | pass | mismatch | lowering | backend | crash | timeout | dynamo | skip |",
              "|---|---|---|---|---|---|---|---|---|"]
    for op in sorted(per_op):
        c = per_op[op]
        lines.append(f"| `{op}` | " + " | ".join(str(c[k]) for k in
                     ("pass", "mismatch", "lowering", "backend", "crash", "timeout", "dynamo", "skip")) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
