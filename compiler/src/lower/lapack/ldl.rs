//! Solves with a Bunch-Kaufman `L D L^T` factorization in LAPACK's (sytrf, lower) format, by
//! sytrs's substitutions: `L = P(1) L(1) P(2) L(2) ...`, where a positive pivot `k` is a 1x1
//! block of `D` with rows `k` and `pivots[k]` swapped, and a pair of equal negative pivots a
//! 2x2 block with rows `k+1` and `-pivots[k]` swapped; `L(k)` holds the block's multipliers
//! below it.

use super::{
    broadcast_batch, check_float, cmp_idx, column, entry, flat, flat_rows, iota, keep, outer, row,
    unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Combiner, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.linalg_ldl_solve.default"], ldl_solve);
}

/// `linalg_ldl_solve(LD, pivots, B, hermitian)`: `A^-1 B` for the `A` that sytrf factored into
/// `LD`, batch dims broadcast (real matrices: `hermitian` changes nothing).
fn ldl_solve(n: NodeCtx<'_>) -> Res<'_> {
    let (ld, pivots, rhs) = (
        n.tensor(0, "LD")?,
        n.tensor(1, "pivots")?,
        n.tensor(2, "B")?,
    );
    check_float(&n.op, &ld)?;
    let b = &n.b;
    let (ld_b, rhs_b, batch) = broadcast_batch(b, &ld, &rhs)?;
    let ld = flat(b, &ld_b)?;
    let piv = b.convert(&flat_rows(b, &pivots, &batch)?, DType::I64)?;
    let x = flat(b, &rhs_b)?;
    let dim = ld.shape()[1];
    let skip = b.splat(
        Scalar::Bool(false),
        &TensorType::new(DType::Bool, vec![ld.shape()[0]]),
    )?;
    let fwd = b.fori_loop(dim, &[&x, &skip, &ld, &piv], |b, k, s| forward(&b, &k, s))?;
    let back = b.fori_loop(dim, &[&fwd[0], &skip, &ld, &piv], |b, j, s| {
        let k = b.sub(&b.scalar(Scalar::Int(dim - 1), DType::I64)?, &j)?;
        backward(&b, &k, s)
    })?;
    Ok(vec![unflat(b, &back[0], &batch)?])
}

/// Per batch: whether step `k` is a 1x1 block, a 2x2 block, and its swap partner (0-based).
fn kind<'x>(
    b: &Builder<'x>,
    k: &Val<'x>,
    skip: &Val<'x>,
    piv: &Val<'x>,
) -> R<(Val<'x>, Val<'x>, Val<'x>)> {
    let pk = entry(b, piv, k)?;
    let zero = b.full_like(Scalar::Int(0), &pk)?;
    let live = b.unary("not", skip)?;
    let one = b.binary("and", &live, &b.compare(&pk, &zero, "GT")?)?;
    let two = b.binary("and", &live, &b.compare(&pk, &zero, "LT")?)?;
    let kp = b.sub(&b.unary("abs", &pk)?, &b.full_like(Scalar::Int(1), &pk)?)?;
    Ok((one, two, kp))
}

/// `x` with rows `k` (0-d) and `p[B]` exchanged where `on[B]` holds.
fn swap_rows<'x>(
    b: &Builder<'x>,
    x: &Val<'x>,
    k: &Val<'x>,
    p: &Val<'x>,
    on: &Val<'x>,
) -> R<Val<'x>> {
    let rows = iota(b, x.shape(), 1)?;
    let (xk, xp) = (row(b, x, k)?, row(b, x, p)?);
    let bc = |v: &Val<'x>| b.broadcast_in_dim(v, x.shape(), &[0, 2]);
    let swapped = b.select(
        &cmp_idx(b, &rows, k, "EQ")?,
        &bc(&xp)?,
        &b.select(&cmp_idx(b, &rows, p, "EQ")?, &bc(&xk)?, x)?,
    )?;
    b.select(&b.broadcast_in_dim(on, x.shape(), &[0])?, &swapped, x)
}

/// Column `c` of `ld` below row `first` (zero elsewhere): `[B, n]`.
fn below<'x>(b: &Builder<'x>, ld: &Val<'x>, c: &Val<'x>, first: &Val<'x>) -> R<Val<'x>> {
    let rv = iota(b, &[ld.shape()[0], ld.shape()[1]], 1)?;
    keep(b, &cmp_idx(b, &rv, first, "GT")?, &column(b, ld, c)?)
}

/// `on[B]` broadcast over `x`'s shape.
fn mask<'x>(b: &Builder<'x>, on: &Val<'x>, x: &Val<'x>) -> R<Val<'x>> {
    b.broadcast_in_dim(on, x.shape(), &[0])
}

/// `x[B, n, p]` with row `k` replaced by `v[B, p]` where `on[B]` holds.
fn set_row<'x>(b: &Builder<'x>, x: &Val<'x>, k: &Val<'x>, v: &Val<'x>, on: &Val<'x>) -> R<Val<'x>> {
    let at = b.binary(
        "and",
        &cmp_idx(b, &iota(b, x.shape(), 1)?, k, "EQ")?,
        &mask(b, on, x)?,
    )?;
    b.select(&at, &b.broadcast_in_dim(v, x.shape(), &[0, 2])?, x)
}

/// Forward substitution with `P(k) L(k)` and the solve with `D`'s block at `k` (sytrs).
fn forward<'x>(b: &Builder<'x>, k: &Val<'x>, s: Vec<Val<'x>>) -> R<Vec<Val<'x>>> {
    let (x, skip, ld, piv) = (&s[0], &s[1], &s[2], &s[3]);
    let (one, two, kp) = kind(b, k, skip, piv)?;
    let k1 = b.add(k, &b.scalar(Scalar::Int(1), DType::I64)?)?;
    let x = swap_rows(b, x, k, &kp, &one)?;
    let x = swap_rows(b, &x, &k1, &kp, &two)?;
    let (xk, xk1) = (row(b, &x, k)?, row(b, &x, &k1)?);
    let upd1 = outer(b, &below(b, ld, k, k)?, &xk)?;
    let upd2 = b.add(
        &outer(b, &below(b, ld, k, &k1)?, &xk)?,
        &outer(b, &below(b, ld, &k1, &k1)?, &xk1)?,
    )?;
    let zero = b.full_like(Scalar::Int(0), &x)?;
    let upd = b.select(
        &mask(b, &one, &x)?,
        &upd1,
        &b.select(&mask(b, &two, &x)?, &upd2, &zero)?,
    )?;
    let x = b.sub(&x, &upd)?;
    // D: x[k] *= 1/d for a 1x1 block; the 2x2 block solved as dsytrs does.
    let ldk = row(b, ld, k)?;
    let ldk1 = row(b, ld, &k1)?;
    let (d, e, f) = (
        entry(b, &ldk, k)?,
        entry(b, &ldk1, k)?,
        entry(b, &ldk1, &k1)?,
    );
    let (xk, xk1) = (row(b, &x, k)?, row(b, &x, &k1)?);
    let per = |v: &Val<'x>| b.broadcast_in_dim(v, xk.shape(), &[0]);
    let one_v = b.full_like(Scalar::Int(1), &d)?;
    let x = set_row(b, &x, k, &b.mul(&xk, &per(&b.div(&one_v, &d)?)?)?, &one)?;
    let (akm1, ak) = (b.div(&d, &e)?, b.div(&f, &e)?);
    let denom = b.sub(&b.mul(&akm1, &ak)?, &one_v)?;
    let (bkm1, bk) = (b.div(&xk, &per(&e)?)?, b.div(&xk1, &per(&e)?)?);
    let new_k = b.div(&b.sub(&b.mul(&per(&ak)?, &bkm1)?, &bk)?, &per(&denom)?)?;
    let new_k1 = b.div(&b.sub(&b.mul(&per(&akm1)?, &bk)?, &bkm1)?, &per(&denom)?)?;
    let x = set_row(b, &x, k, &new_k, &two)?;
    let x = set_row(b, &x, &k1, &new_k1, &two)?;
    Ok(vec![x, two, ld.clone(), piv.clone()])
}

/// Back substitution with `L(k)^T P(k)` at `k`, descending; a 2x2 block is met at its second
/// column `k` and covers `k - 1` too (sytrs).
fn backward<'x>(b: &Builder<'x>, k: &Val<'x>, s: Vec<Val<'x>>) -> R<Vec<Val<'x>>> {
    let (x, skip, ld, piv) = (&s[0], &s[1], &s[2], &s[3]);
    let (one, two, kp) = kind(b, k, skip, piv)?;
    let km1 = b.sub(k, &b.scalar(Scalar::Int(1), DType::I64)?)?;
    let xdim = x.shape().to_vec();
    // dot of the multipliers below k with x's rows below k: [B, p]
    let dot = |c: &Val<'x>| -> R<Val<'x>> {
        let m = below(b, ld, c, k)?;
        let prod = b.mul(x, &b.broadcast_in_dim(&m, &xdim, &[0, 1])?)?;
        b.reduce(&prod, &[1], Combiner::Add, false)
    };
    let both = b.binary("or", &one, &two)?;
    let x1 = set_row(b, x, k, &b.sub(&row(b, x, k)?, &dot(k)?)?, &both)?;
    let x1 = set_row(b, &x1, &km1, &b.sub(&row(b, x, &km1)?, &dot(&km1)?)?, &two)?;
    let x1 = swap_rows(b, &x1, k, &kp, &both)?;
    Ok(vec![x1, two, ld.clone(), piv.clone()])
}
