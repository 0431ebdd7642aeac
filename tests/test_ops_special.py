"""Special functions through backend="tpu" vs eager PyTorch (which runs its own CPU kernels).

Inputs are random and nonzero, spanning each function's branches (e.g. both sides of the
Bessel switch points at 2, 5 and 8, Chebyshev's trigonometric form for n > 6 inside (-1, 1)),
plus the exact special points a kernel treats apart. Results must agree to rtol=atol=1e-5 in
float32 (the conformance default: XLA's sin/cos/exp/log differ from libm by an ulp, which
Chebyshev's cos((n + 1/2) acos x) amplifies by n) and 1e-12 in float64; NaN positions must agree.
"""
import pytest
import torch

from conftest import compile_tpu

S = torch.special
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 0.0}


def nonzero(n, lo, hi, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo
    return torch.where(t == 0, 0.5, t).to(dtype)


def check(fn, *args):
    with torch.no_grad():
        got, want = compile_tpu(fn)(*args), fn(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.dtype.is_floating_point:
            tol = TOL[g.dtype]
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True)
        else:
            assert torch.equal(g, w)


POLYNOMIALS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomial(name, dtype):
    # Degrees -2..12 (fractional ones truncate) against x in (-1.5, 1.5) and the ends ±1, 0, 1/2.
    x = torch.cat([nonzero(40, -1.5, 1.5, dtype), torch.tensor([1.0, -1.0, 0.0, 0.5], dtype=dtype)])
    n = torch.tensor([-2.0, 0.0, 1.0, 2.0, 3.0, 5.0, 7.5, 9.0, 12.0], dtype=dtype)
    check(getattr(S, name), x[:, None], n[None, :])


@pytest.mark.parametrize("name", ["chebyshev_polynomial_t", "hermite_polynomial_h"])
def test_polynomial_scalar_degree(name):
    x = nonzero(16, -2.0, 2.0, torch.float32)
    check(lambda t: getattr(S, name)(t, 4), x)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_polygamma(n):
    # Negative non-integers take the reflection (digamma) and the longer zeta sum.
    x = torch.cat([nonzero(40, -8.0, 12.0, torch.float32), torch.tensor([-2.5, 1e-3, 10.0, 30.0])])
    check(lambda t: torch.polygamma(n, t), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_digamma(dtype):
    # ±0 give ∓inf, negative integers NaN.
    x = torch.cat([nonzero(40, -9.0, 12.0, dtype), torch.tensor([0.0, -0.0, -3.0, 10.0, 1e20], dtype=dtype)])
    check(torch.digamma, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_zeta(dtype):
    # s = 1 is a pole, s < 1 undefined; q <= 0 integers are poles, else need an integer s.
    s = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.5, 12.0], dtype=dtype)
    q = torch.cat([nonzero(16, -6.0, 12.0, dtype), torch.tensor([0.0, -2.0, 1e-3, 80.0], dtype=dtype)])
    check(S.zeta, s[:, None], q[None, :])


BESSEL = [
    ("i0", torch.i0), ("i0e", S.i0e), ("i1", S.i1), ("i1e", S.i1e),
    ("bessel_j0", S.bessel_j0), ("bessel_j1", S.bessel_j1), ("bessel_y0", S.bessel_y0), ("bessel_y1", S.bessel_y1),
    ("modified_bessel_i0", S.modified_bessel_i0), ("modified_bessel_i1", S.modified_bessel_i1),
    ("modified_bessel_k0", S.modified_bessel_k0), ("modified_bessel_k1", S.modified_bessel_k1),
    ("scaled_modified_bessel_k0", S.scaled_modified_bessel_k0),
    ("scaled_modified_bessel_k1", S.scaled_modified_bessel_k1),
    ("spherical_bessel_j0", S.spherical_bessel_j0), ("airy_ai", S.airy_ai),
    ("erfcx", S.erfcx), ("log_ndtr", S.log_ndtr),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,fn", BESSEL, ids=[b[0] for b in BESSEL])
def test_unary_special(name, fn, dtype):
    x = torch.cat([nonzero(64, -12.0, 12.0, dtype), torch.tensor([0.0, 60.0, -30.0, float("inf"), float("nan")], dtype=dtype)])
    check(fn, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_ndtri(dtype):
    p = torch.cat([nonzero(64, 1e-6, 1.0, dtype), torch.tensor([0.0, 1.0, 1e-20, -0.5, 1.5], dtype=dtype)])
    check(S.ndtri, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_frexp(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.cat([nonzero(32, -1e4, 1e4, torch.float64).to(dtype),
                   torch.tensor([tiny / 3, -tiny / 1000, 0.0, -0.0, 1.0, float("inf"), float("nan")], dtype=dtype)])
    check(torch.frexp, x)


def test_kaiser_window():
    # The window is built from i0 inside the graph.
    check(lambda x: torch.signal.windows.kaiser(7, beta=6.0, sym=True, dtype=x.dtype) * x, nonzero(7, 0.5, 2.0, torch.float32))


# One dtype each: these graphs take XLA a second or two to compile.
@pytest.mark.parametrize("fn,dtype", [(torch.igamma, torch.float32), (torch.igammac, torch.float64)],
                         ids=["igamma-f32", "igammac-f64"])
def test_incomplete_gamma(fn, dtype):
    # Every branch: both series, the continued fraction, the asymptotic expansion (a > 20 with
    # x near a), and the boundary values (0, inf, NaN, negatives).
    a = torch.cat([nonzero(24, 0.01, 12.0, dtype), nonzero(8, 25.0, 400.0, dtype, seed=1),
                   torch.tensor([0.0, float("inf"), -1.0, float("nan")], dtype=dtype)])
    x = torch.cat([nonzero(16, 0.01, 12.0, dtype, seed=2), torch.tensor([0.3, 1.05, 30.0, 150.0, 390.0], dtype=dtype),
                   torch.tensor([0.0, float("inf"), -1.0], dtype=dtype)])
    check(fn, a[:, None], x[None, :])
