"""Issue #7: symbolic graphs are converted once and specialized per shape in Rust."""
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import tpu_dynamo
from tpu_dynamo import convert

from conftest import compile_tpu, dynamic_marks
from test_generate import IDS, generate, tiny

LENGTHS = [3, 5, 8, 13, 21]


@pytest.fixture
def conversions(monkeypatch):
    """Counts FX -> IR conversions (symbolic or per shape) made in Python."""
    count = [0]
    build = convert._Builder.build

    def counted(self):
        count[0] += 1
        return build(self)

    monkeypatch.setattr(convert._Builder, "build", counted)
    return count


def stat(*names):
    s = tpu_dynamo.stats()
    return tuple(s[n] for n in names)


def test_llama_forward_dynamic_one_conversion_one_compile_per_length(conversions):
    model = tiny("llama")
    run = torch.compile(model, backend="tpu", dynamic=True)
    torch._dynamo.utils.counters.clear()
    ids = [torch.randint(1, 128, (1, s), generator=torch.Generator().manual_seed(s)) for s in LENGTHS]
    with torch.no_grad():
        for _ in range(2):
            for x in ids:
                torch.testing.assert_close(run(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
            assert stat("compiles", "symbolic_graphs", "specializations") == (len(LENGTHS), 1, len(LENGTHS))
            assert conversions[0] == 1


def test_gpt2_generate_dynamic_cache_matches_eager(conversions):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    expected = generate(model, IDS, 8)
    model.forward = compile_tpu(model.forward)  # dynamic=None: symbolic after the 2nd shape
    assert torch.equal(generate(model, IDS, 8), expected)
    graphs, shapes, compiles = stat("symbolic_graphs", "specializations", "compiles")
    assert graphs >= 1 and shapes > graphs
    # One conversion per static graph compiled, one per symbolic graph: none per shape.
    assert conversions[0] == compiles - shapes + graphs


def test_sizes_that_keep_changing_are_reported_once(caplog):
    """Every new size of a symbolic graph is another XLA compile; after SIZES_BEFORE_WARNING of
    them the user is told once, with what to do (fixed sizes, or buckets)."""
    from tpu_dynamo.symbolic import SIZES_BEFORE_WARNING

    f = torch.compile(lambda x: torch.tanh(x) * 2, backend="tpu", dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        # From 2: Dynamo compiles size 1 as a static graph of its own.
        for count, n in enumerate(range(2, SIZES_BEFORE_WARNING + 5), start=1):
            x = torch.randn(n)
            torch.testing.assert_close(f(x), torch.tanh(x) * 2)
            warned = [r for r in caplog.records if "input sizes so far" in r.getMessage()]
            assert len(warned) == (count >= SIZES_BEFORE_WARNING)
    message = warned[0].getMessage()
    assert f"compiled for {SIZES_BEFORE_WARNING} input sizes" in message
    assert 'cache_implementation="static"' in message and "bucket_size" in message


def test_the_report_suggests_buckets_only_where_padding_is_safe(caplog):
    """A graph that prepends along its varying size cannot run padded (the padding would sit
    inside the result): the report says why instead of suggesting buckets."""
    from tpu_dynamo.symbolic import SIZES_BEFORE_WARNING

    f = torch.compile(lambda x: torch.cat([x.new_ones(1), x]) * 2, backend="tpu", dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        for n in range(2, SIZES_BEFORE_WARNING + 2):
            x = torch.randn(n)
            torch.testing.assert_close(f(x), torch.cat([x.new_ones(1), x]) * 2)
    (message,) = [r.getMessage() for r in caplog.records if "input sizes so far" in r.getMessage()]
    assert "cannot help this graph" in message and "aten.cat" in message, message
    assert "bucket_size" not in message


def test_unrepresentable_size_falls_back_to_python_per_shape(caplog):
    def f(x):
        return x * (x.shape[1] / 3)  # a SymFloat: the IR has integer sizes only

    run = compile_tpu(f)
    with caplog.at_level("INFO", logger="tpu_dynamo"):
        for s in LENGTHS[:3]:
            x = torch.randn(2, s)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(run(x), f(x))
    assert "specializing per shape in Python" in caplog.text
    assert stat("compiles", "symbolic_graphs") == (3, 0)


SCRIPT = textwrap.dedent("""
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    from tpu_dynamo import _native
    from tpu_dynamo.backend import decompositions
    from tpu_dynamo.convert import InputKind, convert_symbolic

    def capture(gm, example_inputs):
        def fw(aten_gm, _):
            kinds = [InputKind.USER] * len(aten_gm.graph.find_nodes(op="placeholder"))
            sym = _native.SymbolicGraph(convert_symbolic(aten_gm, kinds).json)
            concrete = sym.specialize([[2, 5, 4], [7]], [5, 7]).graph_hash
            print(sym.graph_hash, concrete)
            return aten_gm
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, decompositions=decompositions())

    def f(x, y):
        b, s, h = x.shape
        pos = torch.arange(s, dtype=x.dtype)
        z = (x.reshape(b, s * h) + pos.repeat_interleave(h)).sum(0)
        return torch.cat([z, y]).softmax(-1)

    x, y = torch.randn(2, 3, 4), torch.randn(6)
    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(y, 0)
    torch.compile(f, backend=capture, fullgraph=True)(x, y)
""")


def test_symbolic_ir_is_the_same_in_two_processes():
    out = [
        subprocess.run([sys.executable, "-c", SCRIPT], check=True, capture_output=True, text=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.split()
        for seed in (1, 2)
    ]
    assert len(out[0]) == 2 and out[0] == out[1]


def test_sizes_a_graph_returns_are_the_calls_own():
    """A graph that returns sizes computed from its inputs' (as Mistral's sliding-window decode
    step does): they come back as integers for each call's sizes, next to the tensors."""

    def f(x, y):
        return torch.cat([x, y]) * 2, x.shape[0] + y.shape[0], x.shape[0] * 3

    run = torch.compile(f, backend="tpu", fullgraph=True, dynamic=True)
    for a, b in ((3, 4), (5, 2), (3, 4)):
        x, y = torch.randn(a, 2), torch.randn(b, 2)
        got, want = run(x, y), f(x, y)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1:] == want[1:]
    assert tpu_dynamo.stats()["compiles"] == 2


def test_sizes_that_keep_changing_pad_to_powers_of_two_after_a_warning(caplog):
    """A graph whose sizes keep changing (not a decode step feeding its outputs back) compiles
    SIZES_BEFORE_WARNING exact sizes, then pads to powers of two where that is proven safe."""
    from tpu_dynamo.symbolic import SIZES_BEFORE_WARNING

    def f(x):
        return (x * 2).cumsum(0) + 1

    run = torch.compile(f, backend="tpu", fullgraph=True)
    with caplog.at_level("WARNING", logger="tpu_dynamo"):
        for n in range(3, 14):
            x = torch.randn(n, 4)
            torch.testing.assert_close(run(x), f(x))
    # 3 is Dynamo's static graph; 4-11 exact; 12 and 13 share 16.
    assert tpu_dynamo.stats()["compiles"] == 1 + SIZES_BEFORE_WARNING + 1
    assert "from now on this graph runs with its sizes padded to the next power of two" in caplog.text


def test_an_integer_used_only_as_a_number_is_read_at_run_time():
    """An integer argument that changes between calls (Dynamo makes it symbolic, as a
    sliding-window cache's count of tokens seen) and only enters arithmetic is an input of the
    executable, not a constant in it: one compile serves every value, including expressions of
    it (max, floor division, modulo on negative values) and the numbers the graph returns."""

    def f(x, n):
        return x * (n - 3) + torch.arange(4) + max(n - 5, 0) - n // 3 + n % 4, n + 1, n * 2

    run = torch.compile(f, backend="tpu", fullgraph=True)
    for n in (1, 2, 7, 9, -4, -7, 2):
        x = torch.randn(4)
        got, want = run(x, n), f(x, n)
        torch.testing.assert_close(got[0], want[0])
        assert got[1:] == want[1:]
    # n = 1 is Dynamo's static graph; from n = 2 on one symbolic graph, one executable.
    assert tpu_dynamo.stats()["compiles"] == 2


def test_a_symbolic_graph_is_called_without_aotautograds_wrapper(monkeypatch):
    """A graph traced with symbolic sizes is called directly, like a static one, when
    AOTAutograd's runtime wrapper would only call it; it marks its outputs' symbolic dims as that
    wrapper did, and a dynamic cache's outputs fed back in (automatic dynamic shapes) trace no
    further graph."""
    from tpu_dynamo import direct

    calls = []
    call = direct.Direct.__call__
    monkeypatch.setattr(direct.Direct, "__call__", lambda self, *args: calls.append(1) or call(self, *args))

    def grow(cache, x):
        return torch.cat([cache, x * 2.0], dim=0), cache.sum(0)

    step = compile_tpu(grow)  # dynamic=None: symbolic from the second length on
    torch._dynamo.utils.counters.clear()
    cache = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 4)
            (got, total), (want, want_total) = step(cache, x), grow(cache, x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(total, want_total)
            cache = got
    assert len(calls) == 5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert dynamic_marks(got) == {0}
    assert stat("symbolic_graphs") == (1,)


def test_a_symbolic_graph_returning_an_input_it_updates_returns_that_tensor():
    """With symbolic sizes too, an output that is an input updated in place (a static cache's
    `index_copy_`) is that very tensor, marked like the graph's other symbolic outputs."""

    def update(cache, position, x):
        return cache.index_copy_(0, position, x), cache.sum(0)

    step = compile_tpu(update, dynamic=True)
    with torch.no_grad():
        for rows in (4, 6, 9):
            cache, position, x = torch.randn(rows, 8), torch.tensor([1]), torch.randn(1, 8)
            want = cache.clone().index_copy_(0, position, x)
            got, total = step(cache, position, x)
            assert got is cache and 0 in dynamic_marks(got)
            torch.testing.assert_close(cache, want)
            torch.testing.assert_close(total, want.sum(0))
    assert stat("symbolic_graphs") == (1,)


def test_call_sizes_are_read_once_and_only_for_their_executable(monkeypatch):
    """A padded call's sizes are read by the native side once per size (`CallShape`), and an
    executable refuses sizes read against another."""
    from tpu_dynamo.executable import Executable

    calls = []
    call = Executable.__call__

    def recording(self, args, sizes=None):
        calls.append((self, sizes))
        return call(self, args, sizes)

    monkeypatch.setattr(Executable, "__call__", recording)

    def f(x):
        return (x + 1).cumsum(0) * 3

    run = torch.compile(f, backend="tpu", fullgraph=True)
    for n in [*range(3, 14), 13]:
        x = torch.randn(n, 4)
        torch.testing.assert_close(run(x), f(x))
    padded = [(exe, sizes) for exe, sizes in calls if sizes is not None and sizes.given]
    # 12 and 13 share the executable of 16; 13 twice, with the sizes read for its first call.
    assert len(padded) == 3 and padded[-1][1].shape is padded[-2][1].shape is not None
    exe, sizes = padded[-1]
    other = next(e for e, _ in calls if e is not exe)
    with pytest.raises(ValueError, match="another executable"):
        other.native.run([], [], [], [], sizes.shape)
