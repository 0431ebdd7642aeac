"""LAPACK-style ops (compiler/src/lower/lapack/) through backend="tpu" vs eager, f32.

Inputs are random normal matrices (shifted by a multiple of the identity where the op needs a
well-conditioned or definite one), so every output is unique and compared directly with rtol =
atol = 1e-4. Eigen/singular vectors are unique only up to sign: those are compared through
products that are sign-free and by magnitude.
"""
import pytest
import torch
from torch._higher_order_ops.effects import has_effects

from conftest import compile_tpu

TOL = {"rtol": 1e-4, "atol": 1e-4}


def rnd(*shape, shift=0.0):
    g = torch.Generator().manual_seed(sum(shape) * 7 + len(shape))
    x = torch.randn(*shape, generator=g)
    if shift:
        x = x + shift * torch.eye(shape[-1])
    return x


def spd(*shape):
    x = rnd(*shape)
    return x @ x.mT + shape[-1] * torch.eye(shape[-1])


def sym(*shape):
    x = rnd(*shape)
    return x + x.mT


def qr_parts(a):
    return torch.geqrf(a)


SQ = rnd(2, 4, 4, shift=3.0)
CASES = [
    ("lu_factor", torch.linalg.lu_factor, [rnd(2, 4, 4)]),
    ("lu_factor_tall", torch.linalg.lu_factor_ex, [rnd(5, 3)]),
    ("lu_factor_wide", torch.linalg.lu_factor_ex, [rnd(3, 5)]),
    ("lu", torch.linalg.lu, [rnd(2, 3, 5)]),
    ("lu_unpack", lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), [rnd(5, 3)]),
    ("lu_solve", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), [SQ, rnd(2, 4, 3)]),
    ("lu_solve_adjoint", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True),
     [SQ, rnd(4, 3)]),
    ("lu_solve_right", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False),
     [SQ, rnd(2, 3, 4)]),
    ("solve_vector", torch.linalg.solve, [SQ, rnd(2, 4)]),
    ("solve_bcast", torch.linalg.solve, [SQ, rnd(4, 2)]),
    ("solve_right", lambda a, b: torch.linalg.solve(a, b, left=False), [SQ, rnd(2, 3, 4)]),
    ("solve_ex", torch.linalg.solve_ex, [SQ, rnd(2, 4, 1)]),
    ("inv", torch.linalg.inv, [SQ]),
    ("inv_ex", torch.linalg.inv_ex, [rnd(3, 3, shift=2.0)]),
    ("det", torch.linalg.det, [rnd(3, 4, 4)]),
    ("slogdet", torch.linalg.slogdet, [rnd(3, 4, 4)]),
    ("logdet", torch.logdet, [spd(4, 4)]),
    ("matrix_power_neg", lambda a: torch.linalg.matrix_power(a, -2), [SQ]),
    ("triangular_solve", lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=True),
     [rnd(2, 4, 3), SQ.tril()]),
    ("solve_triangular_unit", lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, unitriangular=True),
     [SQ.triu(), rnd(4, 2)]),
    ("solve_triangular_right", lambda a, b: torch.linalg.solve_triangular(a, b, upper=False, left=False),
     [SQ.tril(), rnd(2, 3, 4)]),
    ("cholesky_solve", torch.cholesky_solve, [rnd(2, 4, 3), torch.linalg.cholesky(spd(2, 4, 4))]),
    ("cholesky_solve_upper", lambda b, u: torch.cholesky_solve(b, u, upper=True),
     [rnd(4, 3), torch.linalg.cholesky(spd(4, 4), upper=True)]),
    ("cholesky", torch.linalg.cholesky, [spd(2, 4, 4)]),
    ("cholesky_upper", lambda a: torch.linalg.cholesky(a, upper=True), [spd(4, 4)]),
    ("cholesky_ex_info", lambda a: torch.linalg.cholesky_ex(a)[1], [spd(3, 4, 4) * torch.tensor([1.0, -1.0, 1.0])[:, None, None]]),
    ("cholesky_inverse", torch.cholesky_inverse, [torch.linalg.cholesky(spd(4, 4))]),
    ("geqrf", torch.geqrf, [rnd(5, 3)]),
    ("geqrf_wide", torch.geqrf, [rnd(2, 3, 5)]),
    ("qr", torch.linalg.qr, [rnd(2, 5, 3)]),
    ("qr_complete", lambda a: torch.linalg.qr(a, mode="complete"), [rnd(5, 3)]),
    ("qr_r", lambda a: torch.linalg.qr(a, mode="r"), [rnd(3, 5)]),
    ("householder_product", lambda a: torch.linalg.householder_product(*qr_parts(a)), [rnd(2, 5, 3)]),
    ("ormqr", lambda a, c: torch.ormqr(*qr_parts(a), c), [rnd(5, 3), rnd(5, 2)]),
    ("ormqr_right_t", lambda a, c: torch.ormqr(*qr_parts(a), c, left=False, transpose=True),
     [rnd(5, 3), rnd(2, 5)]),
    ("eigvalsh", torch.linalg.eigvalsh, [rnd(2, 5, 5)]),
    ("eigvalsh_upper", lambda a: torch.linalg.eigvalsh(a, UPLO="U"), [rnd(5, 5)]),
    ("eigh_sign_free", lambda a: (lambda w, v: (w, v.abs(), v @ torch.diag_embed(w) @ v.mT))(*torch.linalg.eigh(a)),
     [sym(2, 4, 4)]),
    ("svdvals_tall", torch.linalg.svdvals, [rnd(2, 5, 3)]),
    ("svdvals_wide", torch.linalg.svdvals, [rnd(3, 5)]),
    ("svd_sign_free", lambda a: (lambda u, s, vh: (s, u.abs(), vh.abs(), u @ torch.diag_embed(s) @ vh))(
        *torch.linalg.svd(a, full_matrices=False)), [rnd(5, 3)]),
    ("pinv", torch.linalg.pinv, [rnd(2, 5, 3)]),
    ("pinv_hermitian", lambda a: torch.linalg.pinv(a, hermitian=True), [sym(4, 4)]),
    ("pinv_atol", lambda a: torch.linalg.pinv(a, atol=1.0), [rnd(4, 3)]),
    ("pinv_singular", lambda a, b: torch.linalg.pinv(a @ b.mT), [rnd(4, 2), rnd(4, 2)]),
    ("matrix_rank", torch.linalg.matrix_rank, [rnd(5, 2) @ rnd(2, 4)]),
    ("matrix_norm_2", lambda a: torch.linalg.matrix_norm(a, 2), [rnd(2, 4, 3)]),
    ("matrix_norm_nuc", lambda a: torch.linalg.matrix_norm(a, "nuc"), [rnd(3, 4)]),
    # torch.linalg.polar is new in torch 2.15 (scripts/test-torch.sh runs older releases).
    *([("polar", torch.linalg.polar, [rnd(2, 4, 4)])] if hasattr(torch.linalg, "polar") else []),
    ("matrix_exp", torch.linalg.matrix_exp, [rnd(2, 4, 4)]),
    ("matrix_exp_scaled", torch.linalg.matrix_exp, [rnd(3, 3) * 3]),
    ("ldl_factor", torch.linalg.ldl_factor_ex, [sym(2, 6, 6)]),
    ("ldl_factor_2x2", torch.linalg.ldl_factor_ex, [sym(6, 6) * (1 - torch.eye(6))]),
    ("ldl_factor_zero", torch.linalg.ldl_factor_ex, [torch.zeros(3, 3)]),
    ("ldl_solve", torch.linalg.ldl_solve, [*torch.linalg.ldl_factor(sym(2, 5, 5)), rnd(5, 2)]),
    # A zero diagonal forces sytrf's 2x2 pivot blocks.
    ("ldl_solve_2x2", torch.linalg.ldl_solve, [*torch.linalg.ldl_factor(sym(5, 5) * (1 - torch.eye(5))), rnd(5, 3)]),
    ("det_empty", torch.linalg.det, [torch.ones(2, 0, 0)]),
    ("slogdet_singular", torch.linalg.slogdet, [torch.ones(3, 3)]),
    ("lu_factor_singular", torch.linalg.lu_factor_ex, [torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 1.0, 1.0]])]),
    ("svdvals_empty", torch.linalg.svdvals, [torch.ones(0, 3)]),
]


@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")  # the op under test
def test_linalg_matches_eager(name, fn, args):
    with torch.no_grad():
        want = fn(*args)
        got = compile_tpu(fn, dynamic=False)(*args)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.skipif(
    not has_effects(torch.ops.aten._linalg_check_errors.default),
    reason="this torch's AOTAutograd drops the check for every backend (torch 2.11's does)",
)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_singular_inverse_raises_like_eager(dynamic):
    """`linalg.inv`'s error check (`with_effects`) raises PyTorch's own error from `info`."""
    a = torch.stack([torch.eye(3), torch.ones(3, 3)])
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        torch.linalg.inv(a)
    inv = compile_tpu(torch.linalg.inv, dynamic=dynamic)
    with torch.no_grad():
        torch.testing.assert_close(inv(a[:1] * 2), torch.linalg.inv(a[:1] * 2), **TOL)
        with pytest.raises(torch.linalg.LinAlgError) as ours:
            inv(a)
    assert str(ours.value) == str(eager.value)


def test_unsupported_case_names_op_and_shape():
    """LU without pivoting (which PyTorch's CPU kernel rejects too) is not lowered; the error
    names the op and its argument types."""
    from tpu_dynamo import _native

    with torch.no_grad(), pytest.raises(Exception) as e:
        compile_tpu(lambda a: torch.linalg.lu_factor_ex(a, pivot=False), dynamic=False)(rnd(3, 3))
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, _native.LowerError)
    assert "aten.linalg_lu_factor_ex" in str(inner) and "f32[3, 3]" in str(inner) and "pivoting" in str(inner)


@pytest.mark.parametrize("full", [False, True], ids=["thin", "full"])
@pytest.mark.parametrize(
    "a",
    [rnd(5, 3), rnd(2, 3, 5), torch.cat([rnd(4, 2), torch.zeros(4, 1)], 1), torch.zeros(3, 2)],
    ids=["tall", "wide", "zero_column", "zero"],
)
def test_svd_factors_are_orthonormal(a, full):
    """Singular vectors are unique only up to sign (and not at all for zero singular values), so
    the factors are checked for what defines them: orthonormal, reconstructing A, S as eager."""
    with torch.no_grad():
        u, s, vh = compile_tpu(lambda x: torch.linalg.svd(x, full_matrices=full), dynamic=False)(a)
    m, n = a.shape[-2:]
    k = min(m, n)
    torch.testing.assert_close(s, torch.linalg.svdvals(a), **TOL)
    torch.testing.assert_close(u.mT @ u, torch.eye(u.shape[-1]).expand_as(u.mT @ u), **TOL)
    torch.testing.assert_close(vh @ vh.mT, torch.eye(vh.shape[-2]).expand_as(vh @ vh.mT), **TOL)
    torch.testing.assert_close(u[..., :k] @ torch.diag_embed(s) @ vh[..., :k, :], a, **TOL)
