"""Values computed from weights alone run once per weight version (python/tpu_dynamo/hoist.py)."""
import logging

import torch

import tpu_dynamo
from tpu_dynamo.convert import InputKind
from tpu_dynamo.hoist import split_weight_work

from conftest import compile_tpu


class WeightNormed(torch.nn.Module):
    """A weight-normed linear layer (WavLM's, HiFi-GAN's): its weight is computed from two
    parameters on every call, and a position table from a buffer."""

    def __init__(self, n: int = 512):
        super().__init__()
        self.g = torch.nn.Parameter(torch.rand(n, 1) + 0.5)
        self.v = torch.nn.Parameter(torch.randn(n, n))
        self.register_buffer("freq", torch.rand(n) + 0.1)

    def forward(self, x):
        w = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        table = torch.sin(torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * self.freq)
        return torch.nn.functional.linear(x + table, w)


def executions():
    return tpu_dynamo.stats()["executions"]


def weight_normed(n: int = 512, batch: int = 4):
    torch.manual_seed(0)
    return WeightNormed(n), torch.randn(batch, 8, n)


def check(compiled, m, x):
    torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)


def test_weight_work_runs_once_and_again_after_an_in_place_update(caplog):
    m, x = weight_normed()
    c = compile_tpu(m)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tpu_dynamo"):
        for _ in range(3):
            check(c, m, x)
        # The weight (512x512) and the table (8x512).
        assert "2 values computed from weights alone (1.0 MiB) are kept" in caplog.text
        # The prep graph once, the main graph per call.
        assert executions() == 1 + 3
        m.v.mul_(-2.0)
        m.freq.add_(1.0)
        check(c, m, x)
        assert executions() == 1 + 3 + 2
        c(x)
        assert executions() == 1 + 3 + 2 + 1


def test_a_replaced_weight_of_the_same_size_is_seen():
    m, x = weight_normed()
    c = compile_tpu(m)
    with torch.no_grad():
        c(x)
        for _ in range(3):
            # A new tensor may take the freed one's address, at the same version (0).
            m.v = torch.nn.Parameter(torch.randn(512, 512))
            check(c, m, x)


def test_inference_tensor_weights_are_computed_on_every_call(caplog):
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="tpu_dynamo"):
        m, x = weight_normed()
        c = compile_tpu(m)
        check(c, m, x)
        m.v.mul_(-2.0)  # no version counter tells of this
        check(c, m, x)
        assert executions() == 4
    # Said once, with what to do about it.
    assert caplog.text.count("computed again on every call") == 1
    assert "outside inference_mode" in caplog.text


def test_precompute_weights_false_computes_them_in_the_graph():
    m, x = weight_normed()
    c = compile_tpu(m, options={"precompute_weights": False})
    with torch.no_grad():
        for _ in range(3):
            check(c, m, x)
    assert executions() == 3


def test_autocast_keeps_one_low_precision_copy_of_each_weight():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    x = torch.randn(8, 512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm, kinds = graph_of(m, x)
        hoisted = split_weight_work(gm, kinds).prep.graph.output_node().args[0]
        # Both weights and both biases, cast once.
        assert [(n.target, n.meta["val"].dtype) for n in hoisted] == [(torch.ops.aten._to_copy.default, torch.bfloat16)] * 4
        torch._dynamo.reset()
        tpu_dynamo.reset_stats()
        c = compile_tpu(m)
        with torch.no_grad():
            for _ in range(2):
                got, want = c(x), m(x)
                assert got.dtype == want.dtype == torch.bfloat16
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert executions() == 1 + 2


def graph_of(fn, *args):
    """The ATen graph AOTAutograd hands the backend for `fn(*args)`, with its input kinds."""
    from tpu_dynamo import backend

    got = []
    real = backend.compile_graph

    def keep(gm, kinds, *rest):
        got.append((gm, kinds))
        return real(gm, kinds, *rest)

    backend.compile_graph = keep
    try:
        with torch.no_grad():
            compile_tpu(fn)(*args)
    finally:
        backend.compile_graph = real
    return got[0]


def test_a_derived_value_larger_than_its_weights_is_not_kept():
    class Dequantized(torch.nn.Module):
        """int8 weights with a scale: the f32 weight is 4x the memory, so it stays per call."""

        def __init__(self):
            super().__init__()
            self.register_buffer("q", torch.randint(-127, 127, (1024, 1024), dtype=torch.int8))
            self.register_buffer("scale", torch.rand(1024, 1) / 64)

        def forward(self, x):
            return x @ (self.q.to(torch.float32) * self.scale).t()

    m = Dequantized()
    x = torch.randn(4, 1024)
    gm, kinds = graph_of(m, x)
    assert InputKind.BUFFER in kinds
    assert split_weight_work(gm, kinds) is None
    with torch.no_grad():
        torch.testing.assert_close(compile_tpu(m)(x), m(x), rtol=1e-5, atol=1e-4)


def test_views_of_a_derived_value_stay_in_the_graph_and_updated_inputs_are_not_weights():
    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(512, 512) / 8)
            self.register_buffer("count", torch.zeros(512))

        def forward(self, x):
            w = self.w.exp()
            self.count.add_(self.w.sum(0))  # an input the graph updates is no weight
            return x @ w.t() + x @ w[:256].repeat(2, 1) + self.count

    torch.manual_seed(0)
    m = Views()
    x = torch.randn(4, 512)
    gm, kinds = graph_of(m, x)
    split = split_weight_work(gm, kinds)
    hoisted = split.prep.graph.output_node().args[0]
    # The exponential, the sum and the repeated rows are kept; the transpose and the slice of the
    # exponential are views in the main graph, not copies of it.
    aten = torch.ops.aten
    assert sorted(str(n.target) for n in hoisted) == ["aten.exp.default", "aten.repeat.default", "aten.sum.dim_IntList"]
    main_ops = {n.target for n in split.main.graph.nodes}
    assert aten.permute.default in main_ops or aten.t.default in main_ops
    assert aten.exp.default not in main_ops and aten.repeat.default not in main_ops
    m = Views()
    eager = Views()
    eager.load_state_dict(m.state_dict())
    c = compile_tpu(m)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(c(x), eager(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.count, eager.count)


def test_a_graph_with_symbolic_sizes_shares_its_derived_values_across_sizes():
    m, _ = weight_normed()
    c = compile_tpu(m, dynamic=True)
    batches = (2, 3, 5, 3)
    with torch.no_grad():
        for batch in batches:
            check(c, m, torch.randn(batch, 8, 512))
        assert executions() == 1 + len(batches)
        m.g.add_(1.0)
        check(c, m, torch.randn(7, 8, 512))
        assert executions() == 1 + len(batches) + 2


def test_weight_work_too_small_to_pay_for_an_executable_stays_in_the_graph():
    m, x = weight_normed(32)  # 4 KiB of weights: a prep graph would cost more than it saves
    assert split_weight_work(*graph_of(m, x)) is None


class Rotary(torch.nn.Module):
    """A rotary table as Llama computes it on every forward (`inv_freq` ⊗ positions, cos and
    sin), applied to the input: 32 KiB of table, but 8192 calls of libm's `sinf`/`cosf`."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, x):
        freqs = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + x.flip(-1) * emb.sin()


def test_a_small_rotary_table_is_computed_once_for_its_transcendental_work():
    torch.manual_seed(0)
    m, x = Rotary(), torch.randn(2, 128, 32)
    assert split_weight_work(*graph_of(m, x)) is not None
    torch._dynamo.reset()
    # A few hundred elements do not pay for an executable.
    assert split_weight_work(*graph_of(m, torch.randn(2, 8, 32))) is None
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    c = compile_tpu(m)
    with torch.no_grad():
        for _ in range(3):
            check(c, m, x)
        assert executions() == 1 + 3
        m.inv_freq.mul_(0.5)
        check(c, m, x)
        assert executions() == 1 + 3 + 2


def test_a_graph_found_in_the_disk_cache_brings_its_prep_graph():
    m, x = weight_normed()
    for found in (False, True):
        # As a new process would call it: no Dynamo or in-memory state (`reset_stats` empties
        # the in-memory executables).
        torch._dynamo.reset()
        tpu_dynamo.reset_stats()
        with torch.no_grad():
            check(compile_tpu(m), m, x)
        s = tpu_dynamo.stats()
        assert (s["graph_hits"], s["executions"]) == (int(found), 2)
        if found:
            assert (s["compiles"], s["disk_hits"]) == (0, 2)  # the main and the prep graph


def test_parametrized_weight_norm_is_computed_once():
    """`torch.nn.utils.parametrizations.weight_norm` (vocoders, speech encoders) recomputes the
    weight from `original0` and `original1` on every forward."""
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(256, 256, 5, padding=2))
    x = torch.randn(2, 256, 64)
    c = compile_tpu(conv)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(c(x), conv(x), rtol=1e-4, atol=1e-4)
        assert executions() == 1 + 3
        conv.parametrizations.weight.original0.mul_(0.5)
        torch.testing.assert_close(c(x), conv(x), rtol=1e-4, atol=1e-4)
        assert executions() == 1 + 3 + 2
