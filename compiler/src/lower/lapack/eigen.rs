//! Symmetric eigendecomposition (two-sided cyclic Jacobi) and SVD (one-sided Jacobi on the
//! columns), and what only needs their unique parts: pseudo-inverse and polar decomposition.
//! Eigen/singular vectors are unique only up to sign; Jacobi's signs are not LAPACK's.

use super::qr::fill_basis;
use super::{
    batch_of, bmm, check_float, cmp_idx, column, entry, flat, iota, keep, mt, row, spread,
    triangle, unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Combiner, Scalar, Val, R};
use crate::lower::sorting::sort_dim;
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten._linalg_eigh.default"], eigh);
    r.add(&["aten._linalg_svd.default"], svd);
    r.add(&["aten.linalg_pinv.atol_rtol_tensor"], pinv);
    r.add(&["aten.linalg_polar.default"], polar);
}

/// Cyclic sweeps over all pairs: Jacobi converges quadratically, so this many leave the
/// off-diagonal part far below f32/f64 rounding for the matrix sizes this is meant for.
fn sweeps(dtype: DType) -> i64 {
    if dtype == DType::F64 {
        16
    } else {
        12
    }
}

/// The Jacobi rotation `(c, s)` (each `[B]`) that diagonalizes `[[app, apq], [apq, aqq]]`
/// (Golub & Van Loan's symmetric Schur decomposition); the identity where `apq` is zero or the
/// pair is inactive.
fn rotation<'a>(
    b: &Builder<'a>,
    app: &Val<'a>,
    aqq: &Val<'a>,
    apq: &Val<'a>,
    active: &Val<'a>,
) -> R<(Val<'a>, Val<'a>)> {
    let zero = b.full_like(Scalar::Int(0), apq)?;
    let one = b.full_like(Scalar::Int(1), apq)?;
    let rotate = b.binary(
        "and",
        &b.compare(apq, &zero, "NE")?,
        &b.broadcast_in_dim(active, apq.shape(), &[])?,
    )?;
    let safe = b.select(&rotate, apq, &one)?;
    let zeta = b.div(&b.sub(aqq, app)?, &b.mul_scalar(&safe, 2.0)?)?;
    let sign = b.select(
        &b.compare(&zeta, &zero, "GE")?,
        &one,
        &b.unary("negate", &one)?,
    )?;
    let root = b.unary("sqrt", &b.add(&one, &b.mul(&zeta, &zeta)?)?)?;
    let t = b.div(&sign, &b.add(&b.unary("abs", &zeta)?, &root)?)?;
    let t = b.select(&rotate, &t, &zero)?;
    let c = b.unary("rsqrt", &b.add(&one, &b.mul(&t, &t)?)?)?;
    let s = b.mul(&t, &c)?;
    Ok((c, s))
}

/// `x J` (`dim` 2: columns p, q) or `J^T x` (`dim` 1: rows p, q) for the rotation `J` with
/// `J[p,p] = J[q,q] = c`, `J[p,q] = s`, `J[q,p] = -s`.
fn rotate<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    p: &Val<'a>,
    q: &Val<'a>,
    c: &Val<'a>,
    s: &Val<'a>,
    dim: usize,
) -> R<Val<'a>> {
    let get = |k: &Val<'a>| {
        if dim == 2 {
            column(b, x, k)
        } else {
            row(b, x, k)
        }
    };
    let (xp, xq) = (get(p)?, get(q)?);
    let c = b.broadcast_in_dim(c, xp.shape(), &[0])?;
    let s = b.broadcast_in_dim(s, xp.shape(), &[0])?;
    let np = b.sub(&b.mul(&c, &xp)?, &b.mul(&s, &xq)?)?;
    let nq = b.add(&b.mul(&s, &xp)?, &b.mul(&c, &xq)?)?;
    let idx = iota(b, x.shape(), dim)?;
    let rest = b.select(
        &cmp_idx(b, &idx, q, "EQ")?,
        &spread(b, &nq, x.shape(), dim)?,
        x,
    )?;
    b.select(
        &cmp_idx(b, &idx, p, "EQ")?,
        &spread(b, &np, x.shape(), dim)?,
        &rest,
    )
}

/// Runs `sweeps` cyclic sweeps over the pairs `p < q` of `n` indices; `step(b, p, q, active,
/// state)` applies one rotation.
fn sweep_pairs<'a, F>(
    b: &Builder<'a>,
    n: i64,
    dtype: DType,
    init: &[&Val<'a>],
    step: F,
) -> R<Vec<Val<'a>>>
where
    F: for<'x> Fn(&Builder<'x>, &Val<'x>, &Val<'x>, &Val<'x>, Vec<Val<'x>>) -> R<Vec<Val<'x>>>,
{
    b.fori_loop(sweeps(dtype) * n * n, init, |b, t, s| {
        let nn = b.full_like(Scalar::Int(n), &t)?;
        let p = b.binary("remainder", &b.div(&t, &nn)?, &nn)?;
        let q = b.binary("remainder", &t, &nn)?;
        let active = b.compare(&p, &q, "LT")?;
        step(&b, &p, &q, &active, s)
    })
}

/// Reorders the columns of `x[B, r, k]` by `idx[B, k]` (column j of the result is column
/// `idx[j]` of `x`).
fn take_cols<'a>(b: &Builder<'a>, x: &Val<'a>, idx: &Val<'a>) -> R<Val<'a>> {
    let (bsz, k) = (idx.shape()[0], idx.shape()[1]);
    let shape = [bsz, k, k];
    let pick = b.compare(
        &iota(b, &shape, 1)?,
        &b.broadcast_in_dim(idx, &shape, &[0, 2])?,
        "EQ",
    )?;
    bmm(b, x, &b.convert(&pick, x.dtype())?)
}

/// Eigenvalues (ascending, `[B, n]`) and eigenvectors (columns) of the symmetric matrix that
/// the `lower` (else upper) triangle of `a[B, n, n]` describes.
fn jacobi_eigh<'a>(b: &Builder<'a>, a: &Val<'a>, lower: bool) -> R<(Val<'a>, Val<'a>)> {
    let n = a.shape()[1];
    let tri = triangle(b, a, lower, 0)?;
    let strict = triangle(b, a, lower, if lower { -1 } else { 1 })?;
    let sym = b.add(&tri, &mt(b, &strict)?)?;
    let v = b.convert(
        &b.compare(&iota(b, a.shape(), 1)?, &iota(b, a.shape(), 2)?, "EQ")?,
        a.dtype(),
    )?;
    let out = sweep_pairs(b, n, a.dtype(), &[&sym, &v], |b, p, q, active, s| {
        let (a, v) = (&s[0], &s[1]);
        let rp = row(b, a, p)?;
        let (app, apq) = (entry(b, &rp, p)?, entry(b, &rp, q)?);
        let aqq = entry(b, &row(b, a, q)?, q)?;
        let (c, s) = rotation(b, &app, &aqq, &apq, active)?;
        let a = rotate(b, &rotate(b, a, p, q, &c, &s, 2)?, p, q, &c, &s, 1)?;
        Ok(vec![a, rotate(b, v, p, q, &c, &s, 2)?])
    })?;
    let eye = b.compare(&iota(b, a.shape(), 1)?, &iota(b, a.shape(), 2)?, "EQ")?;
    let w = b.reduce(&keep(b, &eye, &out[0])?, &[2], Combiner::Add, false)?;
    let (w, idx) = sort_dim(b, &w, 1, false, false)?;
    Ok((w, take_cols(b, &out[1], &idx)?))
}

/// Row-wise dot products of `u[B, r]` and `w[B, r]`.
fn dot<'a>(b: &Builder<'a>, u: &Val<'a>, w: &Val<'a>) -> R<Val<'a>> {
    b.reduce(&b.mul(u, w)?, &[1], Combiner::Add, false)
}

/// Thin SVD of `a[B, m, n]`: `(U[B, m, K], S[B, K] descending, V[B, n, K])`. Wide matrices
/// are done transposed.
fn jacobi_svd<'a>(b: &Builder<'a>, a: &Val<'a>) -> R<(Val<'a>, Val<'a>, Val<'a>)> {
    let (m, n) = (a.shape()[1], a.shape()[2]);
    if m < n {
        let (u, s, v) = jacobi_svd(b, &mt(b, a)?)?;
        return Ok((v, s, u));
    }
    let vshape = [a.shape()[0], n, n];
    let v = b.convert(
        &b.compare(&iota(b, &vshape, 1)?, &iota(b, &vshape, 2)?, "EQ")?,
        a.dtype(),
    )?;
    let out = sweep_pairs(b, n, a.dtype(), &[a, &v], |b, p, q, active, s| {
        let (x, v) = (&s[0], &s[1]);
        let (xp, xq) = (column(b, x, p)?, column(b, x, q)?);
        let (c, s) = rotation(
            b,
            &dot(b, &xp, &xp)?,
            &dot(b, &xq, &xq)?,
            &dot(b, &xp, &xq)?,
            active,
        )?;
        Ok(vec![
            rotate(b, x, p, q, &c, &s, 2)?,
            rotate(b, v, p, q, &c, &s, 2)?,
        ])
    })?;
    let (x, v) = (&out[0], &out[1]);
    let norms = b.unary(
        "sqrt",
        &b.reduce(&b.mul(x, x)?, &[1], Combiner::Add, false)?,
    )?;
    let (s, idx) = sort_dim(b, &norms, 1, true, false)?;
    let x = take_cols(b, x, &idx)?;
    let zero = b.full_like(Scalar::Int(0), &s)?;
    let inv = b.select(
        &b.compare(&s, &zero, "GT")?,
        &b.div(&b.full_like(Scalar::Int(1), &s)?, &s)?,
        &zero,
    )?;
    let u = b.mul(&x, &spread(b, &inv, x.shape(), 1)?)?;
    // Columns of U for zero singular values are zero so far: fill them from the complement.
    let u = fill_basis(b, &u, &b.compare(&s, &zero, "GT")?, n)?;
    Ok((u, s, take_cols(b, v, &idx)?))
}

/// `_linalg_eigh(A, UPLO, compute_v) -> (eigenvalues, eigenvectors)`.
fn eigh(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "A")?;
    check_float(&n.op, &a)?;
    let lower = match n.str_or(1, "UPLO", "L")?.as_str() {
        "L" => true,
        "U" => false,
        other => {
            return Err(format!(
                "_linalg_eigh: UPLO must be \"L\" or \"U\", got {other:?}"
            ))
        }
    };
    let b = &n.b;
    let batch = batch_of(&a)?;
    let (w, v) = jacobi_eigh(b, &flat(b, &a)?, lower)?;
    let v = if n.bool_or(2, "compute_v", true)? {
        unflat(b, &v, &batch)?
    } else {
        b.splat(Scalar::Int(0), n.out(1)?)?
    };
    Ok(vec![unflat(b, &w, &batch)?, v])
}

/// `_linalg_svd(A, full_matrices, compute_uv) -> (U, S, Vh)`; without `compute_uv`, `U` and
/// `Vh` are empty as in PyTorch. `full_matrices` completes the shorter factor to a square
/// orthogonal one (the completion is as non-unique as LAPACK's).
fn svd<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let a = n.tensor(0, "A")?;
    check_float(&n.op, &a)?;
    let (full, uv) = (
        n.bool_or(1, "full_matrices", false)?,
        n.bool_or(2, "compute_uv", true)?,
    );
    let b = &n.b;
    let batch = batch_of(&a)?;
    let (u, s, v) = jacobi_svd(b, &flat(b, &a)?)?;
    let s = unflat(b, &s, &batch)?;
    if !uv {
        return Ok(vec![
            b.splat(Scalar::Int(0), n.out(0)?)?,
            s,
            b.splat(Scalar::Int(0), n.out(2)?)?,
        ]);
    }
    let square = |x: Val<'a>| -> R<Val<'a>> {
        let (bsz, r, k) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        if !full || r == k {
            return Ok(x);
        }
        let all = b.splat(
            Scalar::Bool(true),
            &TensorType::new(DType::Bool, vec![bsz, k]),
        )?;
        fill_basis(b, &x, &all, r)
    };
    let (u, v) = (square(u)?, square(v)?);
    Ok(vec![
        unflat(b, &u, &batch)?,
        s,
        unflat(b, &mt(b, &v)?, &batch)?,
    ])
}

/// `linalg_pinv(A, *, atol, rtol, hermitian)`, as ATen: singular values (hermitian: absolute
/// eigenvalues) above `max(atol, rtol * largest)` are inverted, the rest dropped; by default
/// `rtol = eps * max(m, n)` unless a positive `atol` is given. Tolerances compare in f64.
fn pinv<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let a = n.tensor(0, "self")?;
    check_float(&n.op, &a)?;
    let (atol, rtol) = (n.opt_tensor(1, "atol")?, n.opt_tensor(2, "rtol")?);
    let hermitian = n.bool_or(3, "hermitian", false)?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let r = a.rank();
    let (m, cols) = (a.shape()[r - 2], a.shape()[r - 1]);
    let fa = flat(b, &a)?;
    // Spectrum `s[B, K]` and factors with `A = left diag(s) right^T`.
    let (left, s, right) = if hermitian {
        let (w, v) = jacobi_eigh(b, &fa, true)?;
        (v.clone(), w, v)
    } else {
        jacobi_svd(b, &fa)?
    };
    let k = s.shape()[1];
    let mag = b.convert(&b.unary("abs", &s)?, DType::F64)?;
    let eps = if a.dtype() == DType::F64 {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    };
    let zero_b = b.scalar(Scalar::Int(0), DType::F64)?;
    let default_rtol = b.scalar(Scalar::Float(eps * m.max(cols) as f64), DType::F64)?;
    let bsz = fa.shape()[0];
    let per_batch = |t: &Option<Val<'a>>| -> R<Option<Val<'a>>> {
        t.as_ref()
            .map(|t| b.reshape(&b.broadcast_to(&b.convert(t, DType::F64)?, &batch)?, &[bsz]))
            .transpose()
    };
    let atol_v = per_batch(&atol)?.map_or_else(|| b.broadcast_in_dim(&zero_b, &[bsz], &[]), Ok)?;
    let rtol_v = match (per_batch(&rtol)?, &atol) {
        (Some(r), _) => r,
        (None, Some(_)) => {
            let positive = b.compare(&atol_v, &b.broadcast_in_dim(&zero_b, &[bsz], &[])?, "GT")?;
            b.select(
                &positive,
                &b.broadcast_in_dim(&zero_b, &[bsz], &[])?,
                &b.broadcast_in_dim(&default_rtol, &[bsz], &[])?,
            )?
        }
        (None, None) => b.broadcast_in_dim(&default_rtol, &[bsz], &[])?,
    };
    let largest = b.reduce(&mag, &[1], Combiner::Max, false)?;
    let largest = if k == 0 {
        b.broadcast_in_dim(&zero_b, &[bsz], &[])?
    } else {
        largest
    };
    let tol = b.binary("maximum", &atol_v, &b.mul(&rtol_v, &largest)?)?;
    let kept = b.compare(&mag, &b.broadcast_in_dim(&tol, mag.shape(), &[0])?, "GT")?;
    let zero = b.full_like(Scalar::Int(0), &s)?;
    let inv = b.select(&kept, &b.div(&b.full_like(Scalar::Int(1), &s)?, &s)?, &zero)?;
    // pinv = right diag(inv) left^T
    let scaled = b.mul(&right, &spread(b, &inv, right.shape(), 1)?)?;
    let p = bmm(b, &scaled, &mt(b, &left)?)?;
    Ok(vec![unflat(b, &p, &batch)?])
}

/// `linalg_polar(A) -> (U, H)`: `A = U H` with `U = W V^T` and `H = V diag(S) V^T` from the SVD
/// `A = W diag(S) V^T` (unique for nonsingular `A`).
fn polar(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "A")?;
    check_float(&n.op, &a)?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let (w, s, v) = jacobi_svd(b, &flat(b, &a)?)?;
    let u = bmm(b, &w, &mt(b, &v)?)?;
    let h = bmm(b, &b.mul(&v, &spread(b, &s, v.shape(), 1)?)?, &mt(b, &v)?)?;
    Ok(vec![unflat(b, &u, &batch)?, unflat(b, &h, &batch)?])
}
