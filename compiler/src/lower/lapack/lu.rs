//! LU with partial pivoting (LAPACK getrf: the pivot is the first row of largest magnitude in
//! the column) and what is built on it: unpacking, solves, inverse, determinants.

use super::triangular::{tri_solve, Tri};
use super::{
    batch_of, bmm, broadcast_batch, check_float, cmp_idx, column, diagonal, entry, eye, flat,
    flat_rows, iota, keep, mt, outer, row, spread, triangle, unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Combiner, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.linalg_lu_factor_ex.default"], lu_factor_ex);
    r.add(&["aten.linalg_lu.default"], linalg_lu);
    r.add(&["aten.lu_unpack.default"], lu_unpack);
    r.add(&["aten.linalg_lu_solve.default"], lu_solve);
    r.add(&["aten._linalg_solve_ex.default"], solve_ex);
    r.add(&["aten.linalg_inv_ex.default"], inv_ex);
    r.add(&["aten._linalg_slogdet.default"], slogdet);
    r.add(&["aten._linalg_det.default"], det);
}

/// A factorization of `[B, m, n]`: `lu` packs unit-lower L and U, `pivots[B, min(m, n)]` are
/// LAPACK's 1-based row swaps (i32), `perm[B, m]` says which input row each row of `L U` is,
/// `info[B]` is the 1-based index of the first zero pivot (0: none), as getrf reports it.
struct Lu<'a> {
    lu: Val<'a>,
    pivots: Val<'a>,
    perm: Val<'a>,
    info: Val<'a>,
}

/// Right-looking elimination, one column per loop step.
fn factor<'a>(b: &Builder<'a>, a: &Val<'a>) -> R<Lu<'a>> {
    let (bsz, m, n) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let k_max = m.min(n);
    let perm = iota(b, &[bsz, m], 1)?;
    let pivots = b.splat(
        Scalar::Int(0),
        &TensorType::new(DType::I32, vec![bsz, k_max]),
    )?;
    let info = b.splat(Scalar::Int(0), &TensorType::new(DType::I32, vec![bsz]))?;
    let out = b.fori_loop(k_max, &[a, &perm, &pivots, &info], |b, k, s| {
        let (a, perm, pivots, info) = (&s[0], &s[1], &s[2], &s[3]);
        let shape = a.shape().to_vec();
        let (bsz, m) = (shape[0], shape[1]);
        let rv = iota(&b, &[bsz, m], 1)?;
        // The pivot: first row >= k of largest magnitude (NaN columns keep row k).
        let below = cmp_idx(&b, &rv, &k, "GE")?;
        let none = b.splat(
            Scalar::Float(-1.0),
            &TensorType::new(a.dtype(), vec![bsz, m]),
        )?;
        let mag = b.select(&below, &b.unary("abs", &column(&b, a, &k)?)?, &none)?;
        let best = b.reduce(&mag, &[1], Combiner::Max, false)?;
        let hit = b.compare(&mag, &b.broadcast_in_dim(&best, mag.shape(), &[0])?, "EQ")?;
        let p = b.reduce(
            &b.select(&hit, &rv, &b.full_like(Scalar::Int(m), &rv)?)?,
            &[1],
            Combiner::Min,
            false,
        )?;
        let kb = b.broadcast_in_dim(&k, p.shape(), &[])?;
        let p = b.select(
            &b.compare(&p, &b.full_like(Scalar::Int(m), &p)?, "EQ")?,
            &kb,
            &p,
        )?;
        // Swap rows k and p of the matrix and of the permutation.
        let rows = iota(&b, &shape, 1)?;
        let (at_k, at_p) = (cmp_idx(&b, &rows, &k, "EQ")?, cmp_idx(&b, &rows, &p, "EQ")?);
        let (rk, rp) = (row(&b, a, &k)?, row(&b, a, &p)?);
        let a = b.select(
            &at_k,
            &spread(&b, &rp, &shape, 1)?,
            &b.select(&at_p, &spread(&b, &rk, &shape, 1)?, a)?,
        )?;
        let perm = swap(&b, perm, &k, &p)?;
        // Multipliers below the pivot (left unscaled for a zero pivot, as getrf does), then
        // the rank-1 update of the trailing block.
        let col = column(&b, &a, &k)?;
        let pivot = entry(&b, &col, &k)?;
        let nonzero = b.compare(&pivot, &b.full_like(Scalar::Int(0), &pivot)?, "NE")?;
        let scaled = b.div(&col, &b.broadcast_in_dim(&pivot, col.shape(), &[0])?)?;
        let l = b.select(
            &b.broadcast_in_dim(&nonzero, col.shape(), &[0])?,
            &scaled,
            &col,
        )?;
        let l = keep(&b, &cmp_idx(&b, &rv, &k, "GT")?, &l)?;
        let cv = iota(&b, &[bsz, shape[2]], 1)?;
        let u = keep(&b, &cmp_idx(&b, &cv, &k, "GT")?, &row(&b, &a, &k)?)?;
        let a = b.sub(&a, &outer(&b, &l, &u)?)?;
        let cols = iota(&b, &shape, 2)?;
        let below_pivot = b.binary(
            "and",
            &cmp_idx(&b, &rows, &k, "GT")?,
            &cmp_idx(&b, &cols, &k, "EQ")?,
        )?;
        let a = b.select(&below_pivot, &spread(&b, &l, &shape, 2)?, &a)?;
        let kv = iota(&b, pivots.shape(), 1)?;
        let one = b.scalar(Scalar::Int(1), DType::I64)?;
        let p1 = b.convert(
            &b.add(&p, &b.broadcast_in_dim(&one, p.shape(), &[])?)?,
            DType::I32,
        )?;
        let pivots = b.select(
            &cmp_idx(&b, &kv, &k, "EQ")?,
            &b.broadcast_in_dim(&p1, pivots.shape(), &[0])?,
            pivots,
        )?;
        let first = b.binary(
            "and",
            &b.compare(info, &b.full_like(Scalar::Int(0), info)?, "EQ")?,
            &b.unary("not", &nonzero)?,
        )?;
        let k1 = b.convert(&b.add(&k, &one)?, DType::I32)?;
        let info = b.select(&first, &b.broadcast_in_dim(&k1, info.shape(), &[])?, info)?;
        Ok(vec![a, perm, pivots, info])
    })?;
    let mut it = out.into_iter();
    let mut next = || it.next().ok_or("the LU loop lost its state");
    Ok(Lu {
        lu: next()?,
        perm: next()?,
        pivots: next()?,
        info: next()?,
    })
}

/// `v[B, m]` with entries `k` (0-d) and `p[B]` exchanged.
fn swap<'a>(b: &Builder<'a>, v: &Val<'a>, k: &Val<'a>, p: &Val<'a>) -> R<Val<'a>> {
    let rv = iota(b, v.shape(), 1)?;
    let (vk, vp) = (entry(b, v, k)?, entry(b, v, p)?);
    let (vk, vp) = (
        b.broadcast_in_dim(&vk, v.shape(), &[0])?,
        b.broadcast_in_dim(&vp, v.shape(), &[0])?,
    );
    let rest = b.select(&cmp_idx(b, &rv, p, "EQ")?, &vk, v)?;
    b.select(&cmp_idx(b, &rv, k, "EQ")?, &vp, &rest)
}

/// The row permutation `perm[B, m]` that LAPACK's 1-based swaps `pivots[B, K]` apply.
fn perm_of_pivots<'a>(b: &Builder<'a>, pivots: &Val<'a>, m: i64) -> R<Val<'a>> {
    let bsz = pivots.shape()[0];
    let perm = iota(b, &[bsz, m], 1)?;
    let out = b.fori_loop(pivots.shape()[1], &[&perm, pivots], |b, k, s| {
        let (perm, pivots) = (&s[0], &s[1]);
        let one = b.full_like(Scalar::Int(1), &b.convert(pivots, DType::I64)?)?;
        let p = entry(&b, &b.sub(&b.convert(pivots, DType::I64)?, &one)?, &k)?;
        Ok(vec![swap(&b, perm, &k, &p)?, pivots.clone()])
    })?;
    Ok(out[0].clone())
}

/// The permutation matrix `P[B, m, m]` with `A = P L U`: `P[perm[i], i] = 1`.
fn perm_matrix<'a>(b: &Builder<'a>, perm: &Val<'a>, dtype: DType) -> R<Val<'a>> {
    let (bsz, m) = (perm.shape()[0], perm.shape()[1]);
    let shape = [bsz, m, m];
    let hit = b.compare(
        &iota(b, &shape, 1)?,
        &b.broadcast_in_dim(perm, &shape, &[0, 2])?,
        "EQ",
    )?;
    b.convert(&hit, dtype)
}

/// `(L, U)` of a packed `lu[B, m, n]`: unit-lower `[B, m, K]` and upper `[B, K, n]`.
fn unpack<'a>(b: &Builder<'a>, lu: &Val<'a>) -> R<(Val<'a>, Val<'a>)> {
    let (bsz, m, n) = (lu.shape()[0], lu.shape()[1], lu.shape()[2]);
    let k = m.min(n);
    let l = b.slice(lu, &[0, 0, 0], &[bsz, m, k], &[1, 1, 1])?;
    let unit = b.convert(
        &b.compare(&iota(b, l.shape(), 1)?, &iota(b, l.shape(), 2)?, "EQ")?,
        lu.dtype(),
    )?;
    let l = b.add(&triangle(b, &l, true, -1)?, &unit)?;
    let u = triangle(
        b,
        &b.slice(lu, &[0, 0, 0], &[bsz, k, n], &[1, 1, 1])?,
        false,
        0,
    )?;
    Ok((l, u))
}

/// Solves `A x = rhs` (`adjoint`: `A^T x = rhs`) for `A = P L U`, all `[B, ., .]`.
fn lu_solve_left<'a>(
    b: &Builder<'a>,
    lu: &Val<'a>,
    perm: &Val<'a>,
    rhs: &Val<'a>,
    adjoint: bool,
) -> R<Val<'a>> {
    let p = perm_matrix(b, perm, lu.dtype())?;
    let t = |lower, transpose| Tri {
        left: true,
        lower,
        unit: lower,
        transpose,
    };
    if adjoint {
        // A^T = U^T L^T P^T: x = P L^-T U^-T rhs.
        let y = tri_solve(b, lu, rhs, t(false, true))?;
        let y = tri_solve(b, lu, &y, t(true, true))?;
        bmm(b, &p, &y)
    } else {
        let y = bmm(b, &mt(b, &p)?, rhs)?;
        let y = tri_solve(b, lu, &y, t(true, false))?;
        tri_solve(b, lu, &y, t(false, false))
    }
}

/// `left`: `op(A) x = rhs`; otherwise `x op(A) = rhs`, i.e. `op(A)^T x^T = rhs^T`.
fn lu_solve_any<'a>(
    b: &Builder<'a>,
    lu: &Val<'a>,
    perm: &Val<'a>,
    rhs: &Val<'a>,
    left: bool,
    adjoint: bool,
) -> R<Val<'a>> {
    if left {
        lu_solve_left(b, lu, perm, rhs, adjoint)
    } else {
        mt(b, &lu_solve_left(b, lu, perm, &mt(b, rhs)?, !adjoint)?)
    }
}

fn factor_node<'a>(n: &NodeCtx<'a>, pos: usize) -> R<(Val<'a>, Vec<i64>, Lu<'a>)> {
    let a = n.tensor(pos, "A")?;
    check_float(&n.op, &a)?;
    let batch = batch_of(&a)?;
    let f = factor(&n.b, &flat(&n.b, &a)?)?;
    Ok((a, batch, f))
}

/// `linalg_lu_factor_ex(A, pivot, check_errors) -> (LU, pivots, info)`.
fn lu_factor_ex(n: NodeCtx<'_>) -> Res<'_> {
    if !n.bool_or(1, "pivot", true)? {
        return Err(
            "LU without pivoting is not lowered (PyTorch's CPU kernel rejects it too)".into(),
        );
    }
    let (_, batch, f) = factor_node(&n, 0)?;
    let b = &n.b;
    Ok(vec![
        unflat(b, &f.lu, &batch)?,
        unflat(b, &f.pivots, &batch)?,
        b.reshape(&f.info, &batch)?,
    ])
}

/// `linalg_lu(A, pivot) -> (P, L, U)`.
fn linalg_lu(n: NodeCtx<'_>) -> Res<'_> {
    if !n.bool_or(1, "pivot", true)? {
        return Err(
            "LU without pivoting is not lowered (PyTorch's CPU kernel rejects it too)".into(),
        );
    }
    let (a, batch, f) = factor_node(&n, 0)?;
    let b = &n.b;
    let (l, u) = unpack(b, &f.lu)?;
    let p = perm_matrix(b, &f.perm, a.dtype())?;
    Ok(vec![
        unflat(b, &p, &batch)?,
        unflat(b, &l, &batch)?,
        unflat(b, &u, &batch)?,
    ])
}

/// `lu_unpack(LU, pivots, unpack_data, unpack_pivots) -> (P, L, U)`; what is not unpacked is
/// empty, as in PyTorch.
fn lu_unpack(n: NodeCtx<'_>) -> Res<'_> {
    let (lu, pivots) = (n.tensor(0, "LU_data")?, n.tensor(1, "LU_pivots")?);
    check_float(&n.op, &lu)?;
    let (data, pivs) = (
        n.bool_or(2, "unpack_data", true)?,
        n.bool_or(3, "unpack_pivots", true)?,
    );
    let b = &n.b;
    let batch = batch_of(&lu)?;
    let flu = flat(b, &lu)?;
    let empty = |i: usize| b.splat(Scalar::Int(0), n.out(i)?);
    let p = if pivs {
        let fp = b.reshape(
            &pivots,
            &[flu.shape()[0], pivots.shape()[pivots.rank() - 1]],
        )?;
        let perm = perm_of_pivots(b, &fp, flu.shape()[1])?;
        unflat(b, &perm_matrix(b, &perm, lu.dtype())?, &batch)?
    } else {
        empty(0)?
    };
    let (l, u) = if data {
        let (l, u) = unpack(b, &flu)?;
        (unflat(b, &l, &batch)?, unflat(b, &u, &batch)?)
    } else {
        (empty(1)?, empty(2)?)
    };
    Ok(vec![p, l, u])
}

/// `linalg_lu_solve(LU, pivots, B, left, adjoint)`, batch dims broadcast.
fn lu_solve(n: NodeCtx<'_>) -> Res<'_> {
    let (lu, pivots, rhs) = (
        n.tensor(0, "LU")?,
        n.tensor(1, "pivots")?,
        n.tensor(2, "B")?,
    );
    check_float(&n.op, &lu)?;
    let (left, adjoint) = (n.bool_or(3, "left", true)?, n.bool_or(4, "adjoint", false)?);
    let b = &n.b;
    let (lu_b, rhs_b, batch) = broadcast_batch(b, &lu, &rhs)?;
    let flu = flat(b, &lu_b)?;
    let perm = perm_of_pivots(b, &flat_rows(b, &pivots, &batch)?, flu.shape()[1])?;
    let x = lu_solve_any(b, &flu, &perm, &flat(b, &rhs_b)?, left, adjoint)?;
    Ok(vec![unflat(b, &x, &batch)?])
}

/// `_linalg_solve_ex(A, B, left, check_errors) -> (result, LU, pivots, info)`. `B` is a
/// vector (or a batch of them) when it is 1-d or has exactly `A`'s batch dims, as in ATen.
fn solve_ex(n: NodeCtx<'_>) -> Res<'_> {
    let (a, batch_a, f) = factor_node(&n, 0)?;
    let rhs = n.tensor(1, "B")?;
    let left = n.bool_or(2, "left", true)?;
    let b = &n.b;
    let vector = rhs.rank() == 1
        || (rhs.rank() + 1 == a.rank() && rhs.shape() == &a.shape()[..a.rank() - 1]);
    let rhs_m = if vector {
        let mut s = rhs.shape().to_vec();
        s.insert(if left { s.len() } else { s.len() - 1 }, 1);
        b.reshape(&rhs, &s)?
    } else {
        rhs.clone()
    };
    let lu = unflat(b, &f.lu, &batch_a)?;
    let (lu_b, rhs_b, batch) = broadcast_batch(b, &lu, &rhs_m)?;
    let flu = flat(b, &lu_b)?;
    let fperm = flat_rows(b, &unflat(b, &f.perm, &batch_a)?, &batch)?;
    let x = lu_solve_any(b, &flu, &fperm, &flat(b, &rhs_b)?, left, false)?;
    let x = unflat(b, &x, &batch)?;
    let x = b.reshape(&x, &n.out(0)?.shape)?;
    Ok(vec![
        x,
        lu,
        unflat(b, &f.pivots, &batch_a)?,
        b.reshape(&f.info, &batch_a)?,
    ])
}

/// `linalg_inv_ex(A, check_errors) -> (inverse, info)`.
fn inv_ex(n: NodeCtx<'_>) -> Res<'_> {
    let (a, batch, f) = factor_node(&n, 0)?;
    let b = &n.b;
    let (bsz, m) = (f.lu.shape()[0], f.lu.shape()[1]);
    let x = lu_solve_left(b, &f.lu, &f.perm, &eye(b, bsz, m, a.dtype())?, false)?;
    Ok(vec![unflat(b, &x, &batch)?, b.reshape(&f.info, &batch)?])
}

/// `(sign, log|det|, det)` of the factored matrices, each `[B]`: the product of U's diagonal
/// times the parity of the row swaps.
fn det_parts<'a>(b: &Builder<'a>, f: &Lu<'a>) -> R<(Val<'a>, Val<'a>, Val<'a>)> {
    let d = diagonal(b, &f.lu)?;
    // Row k was swapped when its pivot is not k + 1.
    let p = b.convert(&f.pivots, DType::I64)?;
    let row_of = b.sub(&p, &b.full_like(Scalar::Int(1), &p)?)?;
    let swapped = b.compare(&row_of, &iota(b, f.pivots.shape(), 1)?, "NE")?;
    let count = b.reduce(
        &b.convert(&swapped, DType::I64)?,
        &[1],
        Combiner::Add,
        false,
    )?;
    let odd = b.convert(
        &b.binary("remainder", &count, &b.full_like(Scalar::Int(2), &count)?)?,
        d.dtype(),
    )?;
    // (-1)^count = 1 - 2 (count mod 2)
    let parity = b.sub(
        &b.full_like(Scalar::Int(1), &odd)?,
        &b.mul_scalar(&odd, 2.0)?,
    )?;
    let sign = b.mul(
        &parity,
        &b.reduce(&b.unary("sign", &d)?, &[1], Combiner::Mul, false)?,
    )?;
    let logabs = b.reduce(
        &b.unary("log", &b.unary("abs", &d)?)?,
        &[1],
        Combiner::Add,
        false,
    )?;
    let det = b.mul(&parity, &b.reduce(&d, &[1], Combiner::Mul, false)?)?;
    Ok((sign, logabs, det))
}

/// `_linalg_slogdet(A) -> (sign, logabsdet, LU, pivots)`.
fn slogdet(n: NodeCtx<'_>) -> Res<'_> {
    let (_, batch, f) = factor_node(&n, 0)?;
    let b = &n.b;
    let (sign, logabs, _) = det_parts(b, &f)?;
    Ok(vec![
        b.reshape(&sign, &batch)?,
        b.reshape(&logabs, &batch)?,
        unflat(b, &f.lu, &batch)?,
        unflat(b, &f.pivots, &batch)?,
    ])
}

/// `_linalg_det(A) -> (det, LU, pivots)`.
fn det(n: NodeCtx<'_>) -> Res<'_> {
    let (_, batch, f) = factor_node(&n, 0)?;
    let b = &n.b;
    let (_, _, det) = det_parts(b, &f)?;
    Ok(vec![
        b.reshape(&det, &batch)?,
        unflat(b, &f.lu, &batch)?,
        unflat(b, &f.pivots, &batch)?,
    ])
}
