"""End to end through backend="tpu": numerics, caching, resident parameters, errors."""
import gc
import json
import logging
import os
import re
import subprocess
import sys
import time
import weakref

import numpy
import pytest
import torch

import tpu_dynamo
from tpu_dynamo import _native

from conftest import backend_error, compile_tpu


def needs(*ops):
    missing = sorted(set(ops) - set(_native.supported_ops()))
    return pytest.mark.skipif(bool(missing), reason=f"compiler lacks {missing}")


class ScaleShift(torch.nn.Module):
    """Elementwise-only model with a parameter, a buffer and a plain tensor attribute."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.register_buffer("b", torch.rand(n) + 0.1)
        self.c = torch.rand(n) + 0.2

    def forward(self, x):
        return torch.tanh(x * self.w + self.b) - self.c


def mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ).to(dtype)


@needs("aten.addmm.default", "aten.mm.default")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mlp_matches_eager(dtype, tol):
    m = mlp(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    with torch.no_grad():
        got, want = compile_tpu(m)(x), m(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_same_shape_compiles_once_new_shape_once_more(caplog):
    m = ScaleShift(16)
    f = compile_tpu(m)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tpu_dynamo"):
        x = torch.randn(4, 16)
        torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
        assert tpu_dynamo.stats()["compiles"] == 1
        start = time.perf_counter()
        for _ in range(10):
            f(x)
        per_call = (time.perf_counter() - start) / 10
        s = tpu_dynamo.stats()
        assert (s["compiles"], s["executions"]) == (1, 11)
        # parameter, buffer and constant stay on the device: only x is uploaded per call
        assert s["uploads"] == 4 + 10 and s["resident_hits"] == 30
        y = torch.randn(7, 16)
        torch.testing.assert_close(f(y), m(y), atol=1e-6, rtol=1e-6)
        f(y)
        assert tpu_dynamo.stats()["compiles"] == 2
    assert any("new graph" in r.message for r in caplog.records)
    print(f"steady-state call: {per_call * 1e6:.0f} us")


def test_in_place_parameter_update_is_uploaded_again():
    m = ScaleShift(8)
    f = compile_tpu(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = f(x)
        m.w.add_(1.0)
        after = f(x)
        torch.testing.assert_close(after, m(x), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before, after)
    assert tpu_dynamo.stats()["compiles"] == 1


def test_executables_of_one_model_share_its_parameters_on_the_device():
    """Each input shape gets its own executable (a decode step: one per length); all of them
    run on one device copy of each parameter, buffer and constant, uploaded once, not once per
    executable (a 177 MB Llama decoding 32 tokens held 3.9 GB). An in-place update is uploaded
    once more, by the first executable that sees it, and the others find that copy."""
    m = ScaleShift(16)
    f = compile_tpu(m)
    xs = [torch.randn(n, 16) for n in range(1, 6)]

    def check_all():
        for x in xs:
            torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)

    with torch.no_grad():
        check_all()
        s = tpu_dynamo.stats()
        assert s["compiles"] == 5
        assert (s["uploads"], s["resident_shared_hits"]) == (3 + 5, 3 * 4)
        m.w.add_(1.0)
        check_all()
        t = tpu_dynamo.stats()
        assert (t["uploads"] - s["uploads"], t["resident_shared_hits"] - s["resident_shared_hits"]) == (1 + 5, 4)
        assert t["compiles"] == 5


def test_a_resident_copy_keeps_its_host_memory_alive_until_replaced():
    """A resident copy is found by the host memory and version it was made from, so nothing else
    may come to live at that memory while the copy exists (a new tensor there would have version
    0 too, and the graph would run on the old value): the copy keeps the host storage alive, and
    lets it go when a new value replaces it. Seen through a buffer whose memory is a numpy array."""
    m = ScaleShift(64)
    f = compile_tpu(m)
    x = torch.randn(3, 64)
    with torch.no_grad():
        f(x)
        host = numpy.random.rand(64).astype(numpy.float32)
        alive = weakref.ref(host)
        m.b = torch.from_numpy(host)
        del host
        torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
        m.b = torch.rand(64)
        gc.collect()
        assert alive() is not None, "the resident copy's host memory was freed while the copy lives"
        torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
        f(x)
        gc.collect()
        assert alive() is None, "the replaced copy still holds its host memory"


def test_parameters_are_used_in_place_on_a_cpu_plugin():
    """On a CPU plugin the device buffer of a parameter or buffer is the host tensor's own
    memory, so the weights exist once, not twice (an MLP of 384 MiB grew the process by 491 MiB
    with a device copy, by 169 MiB in place). An in-place update is taken in place again."""
    m = mlp(torch.float32)
    f = compile_tpu(m)
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        s = tpu_dynamo.stats()
        assert s["uploads_in_place"] == len(list(m.parameters())) == 6
        m[0].weight.mul_(-1.5)
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        t = tpu_dynamo.stats()
        assert (t["uploads_in_place"] - s["uploads_in_place"], t["compiles"]) == (1, 1)


def test_a_result_never_shares_memory_with_an_input():
    """Inputs are handed to the plugin in place, so a result equal to an input (a clone of the
    argument or of a parameter) must still be memory of its own, as in eager."""

    class Clones(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(32))

        def forward(self, x):
            return x.clone(), self.w.clone(), x * 2

    m = Clones()
    x = torch.randn(32)
    with torch.no_grad():
        got = compile_tpu(m)(x)
        want = [t.clone() for t in m(x)]
        x.add_(1)
        m.w.add_(1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_results_are_handed_over_and_outlive_the_executable():
    """On a CPU plugin a result's buffer becomes the returned tensor's storage (no copy back):
    the tensor is writable, a compiled graph taking it uses that buffer (a view hit, no upload)
    and sees eager writes to it, and it stays valid after every compiled function is gone."""
    f = compile_tpu(lambda x: torch.sin(x) * 2)
    g = compile_tpu(lambda y: y + 1)
    x = torch.randn(64)
    want = torch.sin(x) * 2
    with torch.no_grad():
        y = f(x)
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
        before = tpu_dynamo.stats()
        z = g(y)
        after = tpu_dynamo.stats()
        assert (after["view_hits"] - before["view_hits"], after["uploads"] - before["uploads"]) == (1, 0)
        y.mul_(3)
        torch.testing.assert_close(g(y), want * 3 + 1, atol=1e-5, rtol=1e-6)
    del f, g
    torch._dynamo.reset()
    gc.collect()
    torch.testing.assert_close(z, want + 1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, want * 3, atol=1e-6, rtol=1e-6)


def test_one_value_returned_twice_gives_tensors_like_eager():
    """XLA may return one value twice (`y + 0` is `y`); the two results must not share memory."""

    def twice(x):
        y = x * 2
        return y, y + 0

    x = torch.randn(4, 4)
    with torch.no_grad():
        got, want = compile_tpu(twice)(x), twice(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    got[1].add_(1)
    torch.testing.assert_close(got[0], want[0])


def test_inference_graphs_skip_aotautograds_wrapper_only_when_it_has_nothing_to_do(monkeypatch):
    """A graph AOTAutograd's runtime wrapper would only call is called directly; one whose output
    is a view of an input keeps the wrapper, which makes that output a view as in eager."""
    from tpu_dynamo import direct

    calls = []
    call = direct.Direct.__call__
    monkeypatch.setattr(direct.Direct, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    x = torch.randn(4, 4)
    plain = compile_tpu(lambda x: (x * 2).sin())
    aliasing = compile_tpu(lambda x: (x.view(16), x * 2))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), (x * 2).sin())
        torch.testing.assert_close(plain(x), (x * 2).sin())
        assert len(calls) == 2
        view, doubled = aliasing(x)
    assert len(calls) == 2 and view._base is x
    torch.testing.assert_close(doubled, x * 2)


def test_an_updated_input_returned_is_that_tensor_without_the_wrapper(monkeypatch):
    """A graph returning an input it updates in place (a static cache's `update`) is called
    directly too, and returns that very tensor, as eager and AOTAutograd's wrapper do."""
    from tpu_dynamo import direct

    calls = []
    call = direct.Direct.__call__
    monkeypatch.setattr(direct.Direct, "__call__", lambda self, *args: calls.append(1) or call(self, *args))

    def update(cache, position, x):
        return cache.index_copy_(0, position, x), cache.sum(0)

    cache, position, x = torch.randn(4, 8), torch.tensor([1]), torch.randn(1, 8)
    want = cache.clone().index_copy_(0, position, x)
    with torch.no_grad():
        got, total = compile_tpu(update)(cache, position, x)
    assert len(calls) == 1 and got is cache
    torch.testing.assert_close(cache, want)
    torch.testing.assert_close(total, want.sum(0))


def test_in_place_update_bumps_the_version_once_without_the_wrapper():
    """Called directly, the executable bumps a mutated input's version itself, once, so
    version-keyed caches (ours: the resident copy) see the change, as after an eager `add_`."""
    buf = torch.randn(8)
    step = compile_tpu(lambda b: b.add_(1.0).sum())
    with torch.no_grad():
        want = buf + 1
        before = buf._version
        total = step(buf)
        assert buf._version == before + 1
        torch.testing.assert_close(buf, want)
        torch.testing.assert_close(total, want.sum())
        torch.testing.assert_close(step(buf), (want + 1).sum())


def test_a_compiled_graph_runs_once_on_zeros_before_its_first_call():
    """The first execute pays XLA's one-time setup, so the backend runs it on zeros in the
    background while Dynamo finishes the frame (python/src/warm_up.rs); the input the graph
    updates in place gets zeros of its own, so the user's tensor sees only the real update."""
    buf, w = torch.randn(64), torch.randn(64)
    step = compile_tpu(lambda b, x: (b.mul_(x).add_(w).tanh(), b.sum()))
    with torch.no_grad():
        want_buf = buf * 0.5 + w
        out, total = step(buf, torch.full((64,), 0.5))
    torch.testing.assert_close(buf, want_buf)
    torch.testing.assert_close(out, want_buf.tanh())
    torch.testing.assert_close(total, want_buf.sum())
    s = tpu_dynamo.stats()
    assert (s["warm_ups"], s["executions"]) == (1, 1) and s["warm_up_seconds"] > 0
    torch._dynamo.reset()
    with torch.no_grad():  # the same executable again: it has run, no second warm-up
        compile_tpu(lambda b, x: (b.mul_(x).add_(w).tanh(), b.sum()))(buf, torch.ones(64))
    assert tpu_dynamo.stats()["warm_ups"] == 1


def test_an_execute_too_dear_to_hide_gets_no_warm_up(compiled):
    """A big model's warm-up would delay its first call by most of an execute; the backend
    estimates one execute's arithmetic from the graph and skips it above ~10 GFLOP."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2560)
    with torch.no_grad():
        for x, y in ((a, b), (a[:64], b[:, :64])):
            torch.testing.assert_close(compile_tpu(torch.mm, dynamic=False)(x, y), x @ y, atol=1e-3, rtol=1e-4)
    assert [g.flops for _, g in compiled] == [2 * 2048 * 2048 * 2560, 2 * 64 * 2048 * 64]
    assert tpu_dynamo.stats()["warm_ups"] == 1  # the small product's only


def test_a_graph_loaded_in_the_background_raises_what_compile_raises(compiled):
    with torch.no_grad():
        compile_tpu(ScaleShift(8))(torch.randn(2, 8))
    ((graph, _),) = compiled
    loaded = _native.compile_in_background(graph).result()
    assert loaded.memory_hit and loaded.graph_hash == _native.graph_hash(graph)
    ir = json.loads(graph)
    ir["graph"]["nodes"][0]["op"] = "aten.no_such_op.default"
    loading = _native.compile_in_background(json.dumps(ir))
    with pytest.raises(tpu_dynamo.LowerError, match="aten.no_such_op.default"):
        loading.result()
    with pytest.raises(ValueError, match="failed before"):
        loading.result()
    with pytest.raises(ValueError, match="malformed graph IR JSON"):
        _native.compile_in_background("{")


EXIT_PROBE = """
import atexit, json, sys
# Registered before tpu_dynamo's own handler, so it runs after it.
atexit.register(lambda: print("warm-ups at exit:", sys.modules["tpu_dynamo"].stats()["warm_ups"]))
import torch, tpu_dynamo
from tpu_dynamo import _native
graphs = []
compile_now = _native.compile
_native.compile = lambda j, **kw: graphs.append(j) or compile_now(j, **kw)
m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
with torch.no_grad():
    torch.compile(m, backend="tpu")(torch.randn(256, 512))
tpu_dynamo.reset_stats()  # forgets the executable in memory: the next one comes from disk
_native.compile(graphs[0]).warm_up()
loading = _native.compile_in_background(graphs[0])  # never waited for
"""


def test_a_process_exits_after_its_background_work():
    """The process waits for a warm-up or a load in flight instead of tearing the plugin down
    under it."""
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["warm-ups", "at", "exit:", "1"]


def test_identical_graphs_share_an_executable():
    m1, m2 = ScaleShift(8), ScaleShift(8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        compile_tpu(m1)(x)
        torch._dynamo.reset()
        torch.testing.assert_close(compile_tpu(m2)(x), m2(x), atol=1e-6, rtol=1e-6)
    s = tpu_dynamo.stats()
    assert (s["compiles"], s["memory_hits"]) == (1, 1)


def test_inference_mode_and_debug_callback(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_DYNAMO_DUMP_DIR", str(tmp_path))
    seen = []
    f = torch.compile(lambda x: torch.sigmoid(x) * 2, backend="tpu",
                      options={"debug_callback": seen.append, "name": "sig"})
    with torch.inference_mode():
        x = torch.randn(5)
        torch.testing.assert_close(f(x), torch.sigmoid(x) * 2)
    (info,) = seen
    assert info["name"] == "sig" and "aten.sigmoid" in info["fx_code"] and "stablehlo" in info["stablehlo"]
    assert sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir()) == ["fx.py", "stablehlo.mlir"]


def test_linear_contracts_the_weight_in_place_without_a_transpose():
    """`x @ W.T` is one dot_general contracting W's dim 1: a transpose of W would make XLA:CPU copy
    the weight on every call (it did: ~42 MB per decode step of a hidden-512 Llama)."""
    seen = []
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))
    f = torch.compile(m, backend="tpu", options={"debug_callback": seen.append})
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    (info,) = seen
    dots = [line for line in info["stablehlo"].splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2
    for dot in dots:  # the weight (a function argument) itself, contracted on its dim 1
        assert re.search(r'dot_general"\(%\w+, %arg\d+\)', dot) and "rhs_contracting_dimensions = [1]" in dot, dot


def test_unsupported_op_raises_lower_error_naming_it():
    def f(x):
        return torch.linalg.eig(x * 2)  # no lowering rule and no decomposition

    assert "aten.linalg_eig.default" not in _native.supported_ops()
    with torch.no_grad(), pytest.raises(Exception) as excinfo:
        compile_tpu(f)(torch.randn(4, 4))
    err = backend_error(excinfo)
    assert isinstance(err, tpu_dynamo.LowerError) and isinstance(err, RuntimeError)
    assert "aten.linalg_eig.default" in str(err) and "f32[4, 4]" in str(err)
    assert "test_runtime.py" in str(err)  # the user's source line


MALLINFO_PROBE = """
import ctypes, torch, tpu_dynamo
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
tpu_dynamo.device_info()
before = libc.mallinfo2().hblks
big = torch.empty(64 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
@pytest.mark.parametrize("tuning, mapped", [("1", 0), ("0", 1)])
def test_cpu_plugin_keeps_freed_memory_in_the_heap(tuning, mapped):
    """With a CPU plugin large blocks come from the heap, not per-block mmaps that every execute
    would fault in again; TPU_DYNAMO_MALLOC_TUNING=0 keeps glibc's defaults."""
    env = {**os.environ, "TPU_DYNAMO_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", MALLINFO_PROBE], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == mapped


TRIM_PROBE = """
import resource, torch, tpu_dynamo
# u @ v, reduced along both dims, is a 17000 x 17000 f32 temporary: 1.16 GB, above the 1 GiB of
# free heap kept at first.
u, v = torch.randn(17000, 32), torch.randn(32, 17000)
f = torch.compile(lambda u, v: ((u @ v).sum(1), (u @ v).amax(0)), backend="tpu")
# The fewest faults of three steady calls: one call in a few runs still lands where the heap's
# layout has not settled (354 K faults once, then ~1 K), where a regression faults every call.
faults = []
with torch.no_grad():
    for _ in range(2):
        f(u, v)
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(u, v)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_steady_call_does_not_fault_its_temporaries_in_again():
    """An executable whose temporaries outgrow the free heap glibc keeps (1 GiB) raises that to
    twice what it takes per call: otherwise every call would hand its temporaries back to the
    system on return and fault them in again (354-358 K page faults a call here before, 32-1113
    after; SD1.5's UNet up-block at 16x16, 1.26 GB: 1.57-2.26 s per call against 1.23-1.31 s)."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    faults = int(out.stdout.split()[-1])
    assert faults < 30_000, faults  # a tenth of the temporaries' pages


FLAGS_PROBE = """
import torch, tpu_dynamo
try:
    torch.compile(lambda x: x * 2, backend="tpu")(torch.randn(3))
except Exception as e:
    print("raised:", e)
print("alive")
"""


def test_an_unknown_xla_flag_raises_instead_of_killing_the_process():
    """XLA aborts on an XLA_FLAGS flag its build does not know; the user gets an exception naming
    the flag and keeps the process."""
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_no_such_flag=1"}
    out = subprocess.run([sys.executable, "-c", FLAGS_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Unknown flag in XLA_FLAGS: --xla_no_such_flag=1" in out.stdout and "would abort the process" in out.stdout
    assert out.stdout.rstrip().endswith("alive")


def test_an_executable_pads_smaller_inputs_and_cuts_its_results_back():
    """A bucket's executable (symbolic.py) runs calls below its sizes: the native run zero-pads
    the inputs given smaller and hands the results asked for cut back, contiguous, in memory of
    their own; a result not cut keeps the executable's sizes (its padding computed on zeros)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tpu_dynamo.convert import InputKind
    from tpu_dynamo.executable import compile_graph
    from tpu_dynamo.options import parse

    gm = make_fx(lambda x, m: (x * 2 + 1, x - m))(torch.randn(2, 5, 4), torch.randn(2, 5, 4))
    exe = compile_graph(gm, [InputKind.USER, InputKind.USER], parse(None, None, None))
    for dims in ([2, 3, 4], [1, 5, 2], [2, 5, 4], [0, 5, 4]):
        x, m = torch.randn(dims), torch.randn(dims)
        doubled, diff = exe([x, m], exe.resized({0: dims, 1: dims}, {0: dims}))
        assert doubled.shape == x.shape and doubled.is_contiguous()
        assert torch.equal(doubled, x * 2 + 1)
        padded = torch.zeros(2, 5, 4)
        padded[: dims[0], : dims[1], : dims[2]] = x - m
        assert torch.equal(diff, padded)
    with pytest.raises(ValueError, match=r"input 0: .*\[2,6,4\] is not a corner of .*\[2,5,4\]"):
        exe([torch.randn(2, 6, 4), torch.randn(2, 5, 4)], exe.resized({0: [2, 6, 4]}, {}))


def test_small_inputs_are_copied_into_a_buffer_kept_for_them():
    """A user input of at most 16 KiB is copied into a buffer its executable keeps for it: every
    call reads its own values, a result returned earlier keeps its own (XLA copies an argument
    that is returned as it is), and threads calling at once each get theirs."""
    f = torch.compile(lambda x, big: (x * 2 + 1, x.clone(), big.sum() + x.sum()), backend="tpu", fullgraph=True)
    big = torch.randn(8192)  # 32 KiB: taken in place
    xs = [torch.randn(4, 8) for _ in range(6)]
    before = tpu_dynamo.stats()
    results = [f(x, big) for x in xs]
    after = tpu_dynamo.stats()
    for x, (doubled, same, total) in zip(xs, results):
        torch.testing.assert_close(doubled, x * 2 + 1)
        assert torch.equal(same, x)
        torch.testing.assert_close(total, big.sum() + x.sum(), rtol=1e-5, atol=1e-4)
    assert after["uploads_staged"] - before["uploads_staged"] == len(xs)
    assert after["uploads"] - before["uploads"] == 2 * len(xs)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: f(x, big)[0], xs * 20))
    for x, doubled in zip(xs * 20, got):
        torch.testing.assert_close(doubled, x * 2 + 1)


def test_a_weight_given_new_memory_is_seen_however_it_changed():
    """An unchanged resident input is recognized by its tensor, address and version alone, with
    no other question asked of it (Python) and no slot or buffer touched (Rust): every way of
    giving a weight a new value must still be seen on the next call."""
    m = ScaleShift(8)
    f = compile_tpu(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for change in (
            lambda: m.w.mul_(2.0),  # in place: a new version
            lambda: setattr(m.w, "data", torch.rand(8) + 3.0),  # new memory, same version
            lambda: m.w.set_(torch.rand(8) - 2.0),  # new memory, a new version
            lambda: setattr(m, "w", torch.nn.Parameter(torch.rand(8))),  # a new tensor
            lambda: m.b.copy_(torch.rand(8)),  # a buffer, in place
        ):
            torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
            change()
            torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(f(x), m(x), atol=1e-6, rtol=1e-6)
    assert tpu_dynamo.stats()["compiles"] == 1
