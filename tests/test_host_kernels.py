"""Our host kernels for a bf16 vector times a weight (runtime/src/host_kernels.rs): a linear
layer at one token, a decode step's, through backend="tpu" on the CPU plugin, with the weight
stored `[N, K]` (`nn.Linear`) or `[K, N]` (GPT-2's `Conv1D`, `x @ W`)."""
import pytest
import torch

import tpu_dynamo
from tpu_dynamo import _native

from conftest import compile_tpu

# (K, N, bias): a decode step's projections at SmolLM-135M's width, an LM head's shape in small,
# and sizes off the kernels' blocks (K not a multiple of 32, N of the 64-output chunks).
LINEARS = [(576, 1536, False), (1536, 576, False), (576, 4099, False), (100, 7, False), (576, 192, True), (33, 130, True)]
# (K, N): GPT-2 small's attention and MLP projections, and sizes off the blocks.
CONV1DS = [(768, 2304), (3072, 768), (100, 7), (33, 130)]


def host_kernels() -> list[str]:
    return tpu_dynamo.device_info()["host_kernels"]


def test_the_embedded_plugin_runs_our_kernel():
    """On x86-64 with AVX2 (this CI's machines) the embedded plugin registers it."""
    assert host_kernels() == ["tpu_dynamo.bf16_matvec", "tpu_dynamo.bf16_vecmat"]


def check_product(fn, x, w, b, target, compiled):
    """Within one bf16 step of the exact (f64) product plus what f32 sums may lose (2^-16 of the
    sum of the terms' magnitudes), rounded as eager rounds but for rare ties summed in another
    order; the product is our custom call `target`, not XLA's dot."""
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w, b), fn(x, w, b)
    exact = fn(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    magnitudes = fn(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    assert ((got.double() - exact).abs() <= step + 2.0**-16 * magnitudes).all()
    nearest = exact.to(torch.bfloat16)
    assert ((got != nearest) & (want == nearest)).sum() <= max(2, exact.numel() // 500)
    ((graph_json, _),) = compiled
    assert target in _native.compile(graph_json, need_stablehlo=True).stablehlo


@pytest.mark.parametrize("k, n, bias", LINEARS)
def test_a_one_token_bf16_linear_matches_the_exact_product(k, n, bias, compiled):
    torch.manual_seed(k + n)
    x, w = torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    check_product(torch.nn.functional.linear, x, w, b, "tpu_dynamo.bf16_matvec", compiled)


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_few_rows_go_to_the_kernel_and_eight_do_not(rows, compiled):
    """A few prompts decoded together read each weight row once for all of them through our
    kernel (in fours, twos and ones); eight rows stay XLA's GEMM, as fast there."""
    torch.manual_seed(rows)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(rows, 1, 576, dtype=torch.bfloat16)
    check_product(torch.nn.functional.linear, x, w, None, "tpu_dynamo.bf16_matvec", compiled)
    x8 = torch.randn(8, 1, 576, dtype=torch.bfloat16)
    torch._dynamo.reset()  # a new shape would otherwise be traced with symbolic sizes
    with torch.no_grad():
        compile_tpu(torch.nn.functional.linear)(x8, w, None)
    assert "tpu_dynamo.bf16_matvec" not in _native.compile(compiled[-1][0], need_stablehlo=True).stablehlo


@pytest.mark.parametrize("k, n", CONV1DS)
def test_a_one_token_bf16_conv1d_matches_the_exact_product(k, n, compiled):
    """GPT-2's `Conv1D`: `addmm(bias, x, W)` with W stored `[K, N]`."""
    torch.manual_seed(k * n)
    x, w, b = torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    conv1d = lambda x, w, b: torch.addmm(b, x.view(-1, k), w).view(1, 1, n) if b is not None else (x @ w)
    check_product(conv1d, x, w, b, "tpu_dynamo.bf16_vecmat", compiled)


def test_nan_and_infinity_reach_the_outputs_they_touch():
    """A NaN or an infinite weight makes its output row NaN or infinite, as in eager."""
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    w[3, 5], w[70, 0] = float("nan"), float("inf")
    x[0, 0, 0] = 1.0
    fn = lambda x, w: torch.nn.functional.linear(x, w)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w), fn(x, w)
    assert got[0, 0, 3].isnan() and want[0, 0, 3].isnan()
    assert got[0, 0, 70] == want[0, 0, 70] == float("inf")
    assert torch.isfinite(got[0, 0, [0, 1, 2, 4, 69, 71]]).all()
