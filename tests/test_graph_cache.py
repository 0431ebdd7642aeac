"""Converted graphs found by their Dynamo graph in the disk cache (graph_cache.py): a compile
whose key matches skips AOTAutograd and conversion; anything its output depends on changes the
key; graphs the key cannot describe are not stored; damaged entries are dropped and rebuilt."""
import logging
import shutil
from pathlib import Path

import pytest
import torch

import tpu_dynamo
from tpu_dynamo import _native, backend, graph_cache

from conftest import compile_tpu


@pytest.fixture
def traced(monkeypatch):
    """How many times AOTAutograd traced a graph since the test began."""
    calls = []
    trace = backend.aot_module_simplified
    monkeypatch.setattr(backend, "aot_module_simplified", lambda *a, **k: calls.append(1) or trace(*a, **k))
    return calls


def run_fresh(fn, *args):
    """One compiled call as a new process would make it (no Dynamo or in-memory state)."""
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    with torch.no_grad():
        return compile_tpu(fn)(*args)


def graph_stats() -> tuple[int, int, int]:
    s = tpu_dynamo.stats()
    return s["graph_hits"], s["graph_writes"], s["compiles"]


# f32 through a 16-deep matmul, GELU and softmax: XLA's and PyTorch's roundings differ by ~1e-6.
F32 = {"rtol": 1e-5, "atol": 1e-5}


def mlp(x, w):
    return torch.nn.functional.gelu(x @ w).softmax(-1)


def test_found_graph_skips_aotautograd_and_conversion(traced):
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    assert graph_stats() == (0, 1, 1) and len(traced) == 1
    x2 = torch.randn(8, 16)
    torch.testing.assert_close(run_fresh(mlp, x2, w), mlp(x2, w), **F32)
    assert graph_stats() == (1, 0, 0) and len(traced) == 1  # executable from disk, nothing traced


@pytest.mark.parametrize(
    "other",
    [
        lambda x: x.double(),
        lambda x: torch.randn(9, 16),
        lambda x: x.t().contiguous().t(),  # same values and sizes, other strides
        lambda x: torch.randn(2, 8, 16)[1],  # a storage offset
    ],
    ids=["dtype", "shape", "strides", "offset"],
)
def test_inputs_that_trace_differently_have_their_own_entry(other, traced):
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    y = other(x)
    torch.testing.assert_close(run_fresh(mlp, y, w.to(y.dtype)), mlp(y, w.to(y.dtype)), **F32)
    assert graph_stats()[:2] == (0, 1) and len(traced) == 2


def test_autocast_state_is_part_of_the_key():
    """The same Dynamo graph traced under autocast has bf16 matmuls: another converted graph."""
    # Small logits, so that a bf16 rounding either side of a tie moves a probability by ~1e-3.
    x, w = torch.randn(8, 16) * 0.25, torch.randn(16, 32) * 0.25
    run_fresh(mlp, x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run_fresh(mlp, x, w)
        want = mlp(x, w)
    # The graph traced without autocast returns float32.
    assert got.dtype == want.dtype == torch.bfloat16 and graph_stats()[0] == 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


def test_inputs_sharing_storage_do_not_reuse_the_unshared_graph():
    """With `b` a view of `a`, the in-place update of `a` shows in `b`: traced, not reused."""

    def bump_then_read(a, b):
        a.add_(1.0)
        return b * 2.0

    a, b = torch.randn(4, 8), torch.randn(4, 8)
    run_fresh(bump_then_read, a, b)
    assert graph_stats()[1] == 1
    base = torch.randn(4, 8)
    view = base.view(4, 8)
    want = (base + 1.0) * 2.0
    torch.testing.assert_close(run_fresh(bump_then_read, base, view), want)
    assert graph_stats()[0] == 0


@pytest.fixture(scope="module")
def custom_op():
    lib = torch.library.Library("tpu_dynamo_graph_cache_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2.0, "CompositeImplicitAutograd")
    yield torch.ops.tpu_dynamo_graph_cache_test.twice
    lib._destroy()


def test_graph_with_a_custom_op_is_traced_every_time(custom_op, traced):
    """A custom op's Python may change between processes; the key cannot see it."""
    x = torch.randn(4, 8)
    for _ in range(2):
        torch.testing.assert_close(run_fresh(lambda t: custom_op(t) + 1.0, x), x * 2.0 + 1.0)
        assert graph_stats()[:2] == (0, 0)
    assert len(traced) == 2


def test_debug_output_is_made_by_a_trace(tmp_path, monkeypatch, traced):
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    monkeypatch.setenv("TPU_DYNAMO_DUMP_DIR", str(tmp_path / "dump"))
    run_fresh(mlp, x, w)
    assert graph_stats()[0] == 0 and len(traced) == 2
    assert list((tmp_path / "dump").glob("*.fx.py"))


def graph_files() -> list[Path]:
    return list((Path(tpu_dynamo.cache_info()["dir"]) / "graphs").glob("*.tpuexe"))


def test_damaged_entry_is_logged_removed_and_converted_again(caplog):
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    (path,) = graph_files()
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        torch.testing.assert_close(run_fresh(mlp, x, w), mlp(x, w), **F32)
    s = tpu_dynamo.stats()
    assert (s["graph_hits"], s["graph_rejects"], s["graph_writes"]) == (0, 1, 1)
    assert any(path.name in r.getMessage() and "checksum mismatch" in r.getMessage() for r in caplog.records)
    run_fresh(mlp, x, w)
    assert graph_stats()[0] == 1  # the rewritten entry is good


def test_unreadable_payload_is_logged_and_converted_again(caplog, monkeypatch):
    keys = []
    key = graph_cache.key
    monkeypatch.setattr(graph_cache, "key", lambda *args: keys.append(key(*args)) or keys[-1])
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    _native.graph_put(keys[-1], b"\x80\x05not a pickle")  # intact entry, unreadable payload
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        torch.testing.assert_close(run_fresh(mlp, x, w), mlp(x, w), **F32)
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert graph_stats()[1] == 1  # stored again over it
    torch.testing.assert_close(run_fresh(mlp, x, w), mlp(x, w), **F32)
    assert graph_stats() == (1, 0, 0)


def test_readonly_cache_serves_graphs_and_writes_none(monkeypatch, caplog):
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    run_fresh(mlp, x, w)
    monkeypatch.setenv("TPU_DYNAMO_CACHE", "readonly")
    run_fresh(mlp, x, w)
    assert graph_stats() == (1, 0, 0)
    run_fresh(mlp, torch.randn(9, 16), w)
    assert graph_stats() == (0, 0, 1)
    # A read-only cache some earlier build filled has no graphs/ at all: quietly none.
    shutil.rmtree(Path(tpu_dynamo.cache_info()["dir"]) / "graphs")
    monkeypatch.setenv("TPU_DYNAMO_CACHE_MAX_BYTES", "1G")  # reopens the caches
    with caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        run_fresh(mlp, x, w)
    assert graph_stats() == (0, 0, 0) and tpu_dynamo.stats()["disk_hits"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def cache_step(x, cache):
    cache.mul_(0.5)  # an input updated in place and returned
    y = torch.cat([cache, x], dim=0)
    return torch.tanh(y) * 2, y.shape[0] + 1, cache  # a number output from the sizes


def test_symbolic_graph_is_found_without_aotautograd(traced):
    """A graph traced with symbolic sizes is stored as its `symbolic.Traced`: found again, it
    serves sizes never seen, returns the size it computes and the input it updates."""
    def run(rows):
        x, cache = torch.randn(rows, 8), torch.randn(rows + 2, 8)
        want_cache = cache.clone()
        want = cache_step(x, want_cache)
        torch._dynamo.reset()
        with torch.no_grad():
            got = compile_tpu(cache_step, dynamic=True)(x, cache)
        torch.testing.assert_close(got[0], want[0], **F32)
        torch.testing.assert_close(cache, want_cache)
        assert got[1] == want[1] == 2 * rows + 3 and got[2] is cache

    tpu_dynamo.reset_stats()
    run(3)
    assert graph_stats()[:2] == (0, 1) and len(traced) == 1
    for rows in (3, 5):
        tpu_dynamo.reset_stats()
        run(rows)
        assert graph_stats() == (1, 0, 1 if rows == 5 else 0) and len(traced) == 1


def test_symbolic_graph_whose_trace_guards_its_sizes_is_traced_every_time(traced):
    """AOTAutograd's decomposition of `chunk` guards the chunk sizes (e.g. `(s0 + 1)//2 != 1`),
    which Dynamo's frame guards include only when AOTAutograd ran: not stored."""
    def halves_swapped(x):
        return torch.cat(torch.chunk(x, 2, 0)[::-1])

    for rows in (6, 6):
        x = torch.randn(rows, 4)
        torch._dynamo.reset()
        tpu_dynamo.reset_stats()
        with torch.no_grad():
            got = compile_tpu(halves_swapped, dynamic=True)(x)
        torch.testing.assert_close(got, halves_swapped(x))
        assert graph_stats()[:2] == (0, 0)
    assert len(traced) == 2
