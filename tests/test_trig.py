"""`sin` and `cos` of large f32 tensors on the CPU plugin (compiler/src/lower/trig.rs): an
argument reduction exact over the whole f32 range (2/π's parts below 2^24, a table by exponent
for a tensor with larger values) and f64 polynomials, against the f64 value (correctly rounded
but for f64's own rounding) and eager (NaN, signed zero, subnormals)."""
import math

import pytest
import torch

from tpu_dynamo import _native

from conftest import compile_tpu

LARGE = 1 << 16  # at least VECTOR_TRIG_MIN_ELEMENTS (1 << 15), so the vector form applies


def specials(below: float = math.inf) -> torch.Tensor:
    """Non-finite values, signed zeros, subnormals, the extremes, and the f32 values nearest
    multiples of π/2 (where the reduction must not lose the remainder to cancellation); of the
    finite ones only those below `below`."""
    near = (torch.arange(1, 2001, dtype=torch.float64) * (math.pi / 2)).float()
    far = (torch.tensor([1e5, 1e7, 1e9, 1e12], dtype=torch.float64).repeat_interleave(16)
           + torch.arange(64, dtype=torch.float64)).mul(math.pi / 2).float()
    fixed = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-40, 2e-38, -3e-39, 1e-30,
                          2.0**-12, 2.0**-13, 3.4028235e38, -3.4028235e38, 2.0**24, 2.0**24 + 2, 16367173.0 * 2.0**72])
    every = torch.cat([fixed, near, -near, far, torch.tensor([2.0**24 - 1, -(2.0**24 - 1), 2.0**24 - 3])])
    return every[~every.isfinite() | (every.abs() < below)]


def arguments(scale: float, seed: int) -> torch.Tensor:
    """Random arguments of `scale` with the specials in front. Up to 1e4 every finite one is
    below 2^24, where the lowering needs no table; larger scales take the table's form."""
    torch.manual_seed(seed)
    x = (torch.rand(LARGE) * 2 - 1) * scale if scale > 1e30 else torch.randn(LARGE) * scale
    extra = specials() if scale > 1e4 else specials(below=2.0**24)
    x[: extra.numel()] = extra
    return x


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the f32 spacing at `exact` (finite elements)."""
    e = exact.float().abs()
    spacing = (torch.nextafter(e, torch.tensor(math.inf)) - e).double()
    d = (got.double() - exact).abs() / spacing
    return d[torch.isfinite(d)]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0, 1e4, 1e8, 1e20, 3e38])
def test_large_sin_and_cos_are_correctly_rounded_and_match_eager(scale, compiled):
    x = arguments(scale, seed=int(math.log10(scale)) + 10)
    fn = lambda x: (torch.sin(x), torch.cos(x))  # noqa: E731
    with torch.no_grad():
        got = compile_tpu(fn)(x)
    for ours, ref in zip(got, (torch.sin, torch.cos)):
        want = ref(x)
        assert ours.dtype == torch.float32 and ours.shape == x.shape
        assert ulps(ours, ref(x.double())).max().item() <= 0.5001
        assert torch.equal(ours.isnan(), want.isnan())
        zeros = ours == 0
        assert torch.equal(zeros, want == 0) and torch.equal(ours[zeros].signbit(), want[zeros].signbit())
    # sin(x) = x below 2^-12, subnormals included (XLA:CPU's arithmetic would flush them).
    tiny = x.abs() < 2.0**-12
    assert torch.equal(got[0][tiny], x[tiny])
    ((graph_json, _),) = compiled
    text = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert "stablehlo.sine" not in text and "stablehlo.cosine" not in text


def test_small_tensors_keep_xlas_sine_and_cosine(compiled):
    """Below the threshold the loop would be split across threads for too little work."""
    x = torch.randn(1000) * 10
    fn = lambda x: torch.sin(x) * torch.cos(x)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(compile_tpu(fn)(x), fn(x), rtol=2e-6, atol=1e-6)
    ((graph_json, _),) = compiled
    text = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert "stablehlo.sine" in text and "stablehlo.cosine" in text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_inputs_are_rounded_once_from_f32(dtype):
    """Half inputs compute in f32, as eager's CPU kernels do, and round once: eager's f32 result
    is within 1 ulp of the exact value, so a rounding can differ from ours only where the f32
    value lies next to a half tie."""
    torch.manual_seed(0)
    x = (torch.randn(LARGE) * 20).to(dtype)
    fn = lambda x: torch.sin(x) + torch.cos(x) * 0  # noqa: E731  (both functions, one output)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x), fn(x)
    exact_rounded = torch.sin(x.double()).to(dtype)
    assert got.dtype == dtype
    assert (got != exact_rounded).sum().item() <= LARGE // 1000
    assert (got != want).sum().item() <= LARGE // 1000
