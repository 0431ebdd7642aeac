//! Solves with a Bunch-Kaufman `L D L^T` factorization in LAPACK's (sytrf, lower) format.

use super::lu::solve_square;
use super::{
    bmm, broadcast_batch, check_float, cmp_idx, column, entry, flat, flat_rows, iota, keep, row,
    spread, unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.linalg_ldl_solve.default"], ldl_solve);
}

/// `x` with columns `k` (0-d) and `p[B]` exchanged where `on[B]` holds.
fn swap_cols<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    k: &Val<'a>,
    p: &Val<'a>,
    on: &Val<'a>,
) -> R<Val<'a>> {
    let cols = iota(b, x.shape(), 2)?;
    let (xk, xp) = (column(b, x, k)?, column(b, x, p)?);
    let swapped = b.select(
        &cmp_idx(b, &cols, k, "EQ")?,
        &spread(b, &xp, x.shape(), 2)?,
        &b.select(
            &cmp_idx(b, &cols, p, "EQ")?,
            &spread(b, &xk, x.shape(), 2)?,
            x,
        )?,
    )?;
    b.select(&b.broadcast_in_dim(on, x.shape(), &[0])?, &swapped, x)
}

/// `x` plus `x m` added into column `k` where `on[B]` holds (`m[B, n]`).
fn add_into_col<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    m: &Val<'a>,
    k: &Val<'a>,
    on: &Val<'a>,
) -> R<Val<'a>> {
    let shape = x.shape().to_vec();
    let xm = b.reshape(
        &bmm(b, x, &b.reshape(m, &[shape[0], shape[1], 1])?)?,
        &[shape[0], shape[1]],
    )?;
    let xm = keep(b, &b.broadcast_in_dim(on, xm.shape(), &[0])?, &xm)?;
    let at = cmp_idx(b, &iota(b, &shape, 2)?, k, "EQ")?;
    b.add(x, &keep(b, &at, &spread(b, &xm, &shape, 2)?)?)
}

/// The matrix `L D L^T` that `ld[B, n, n]` and the 1-based `pivots[B, n]` describe: `L = P(1)
/// L(1) P(2) L(2) ...` where a positive pivot is a 1x1 block of `D` with rows `k` and
/// `pivots[k]` swapped, and a negative pair a 2x2 block with rows `k+1` and `-pivots[k]`
/// swapped; `L(k)` holds the block's multipliers below it.
fn reconstruct<'a>(b: &Builder<'a>, ld: &Val<'a>, pivots: &Val<'a>) -> R<Val<'a>> {
    let (bsz, n) = (ld.shape()[0], ld.shape()[1]);
    let shape = [bsz, n, n];
    let eye = b.convert(
        &b.compare(&iota(b, &shape, 1)?, &iota(b, &shape, 2)?, "EQ")?,
        ld.dtype(),
    )?;
    let zeros = b.splat(Scalar::Int(0), &TensorType::new(ld.dtype(), shape.to_vec()))?;
    let skip = b.splat(
        Scalar::Bool(false),
        &TensorType::new(DType::Bool, vec![bsz]),
    )?;
    let piv = b.convert(pivots, DType::I64)?;
    let out = b.fori_loop(n, &[&eye, &zeros, &skip, ld, &piv], |b, k, s| {
        step(&b, &k, s)
    })?;
    let (l, d) = (&out[0], &out[1]);
    bmm(b, &bmm(b, l, d)?, &super::mt(b, l)?)
}

/// `linalg_ldl_solve(LD, pivots, B, hermitian)`: solves `A x = B` for the `A` that sytrf
/// factored, batch dims broadcast. The factored matrix is rebuilt and solved with pivoted LU
/// (the solution is unique; sytrs's substitution order only changes rounding).
fn ldl_solve(n: NodeCtx<'_>) -> Res<'_> {
    let (ld, pivots, rhs) = (
        n.tensor(0, "LD")?,
        n.tensor(1, "pivots")?,
        n.tensor(2, "B")?,
    );
    check_float(&n.op, &ld)?;
    let b = &n.b;
    let (ld_b, rhs_b, batch) = broadcast_batch(b, &ld, &rhs)?;
    let a = reconstruct(b, &flat(b, &ld_b)?, &flat_rows(b, &pivots, &batch)?)?;
    let x = solve_square(b, &a, &flat(b, &rhs_b)?)?;
    Ok(vec![unflat(b, &x, &batch)?])
}

/// One column of `reconstruct`: the loop state is `(L, D, skip, ld, pivots)`, `skip` marking
/// the second column of a 2x2 block.
fn step<'x>(b: &Builder<'x>, k: &Val<'x>, s: Vec<Val<'x>>) -> R<Vec<Val<'x>>> {
    let (l, d, skip, ld, piv) = (&s[0], &s[1], &s[2], &s[3], &s[4]);
    let (bsz, n) = (ld.shape()[0], ld.shape()[1]);
    let shape = [bsz, n, n];
    let pk = entry(b, piv, k)?;
    let zero = b.full_like(Scalar::Int(0), &pk)?;
    let live = b.unary("not", skip)?;
    let one = b.binary("and", &live, &b.compare(&pk, &zero, "GT")?)?;
    let two = b.binary("and", &live, &b.compare(&pk, &zero, "LT")?)?;
    let kp = b.sub(&b.unary("abs", &pk)?, &b.full_like(Scalar::Int(1), &pk)?)?;
    let k1 = b.add(k, &b.scalar(Scalar::Int(1), DType::I64)?)?;
    let rv = iota(b, &[bsz, n], 1)?;
    // One block: swap, then the multipliers below it into the block's columns.
    let l = swap_cols(b, l, k, &kp, &one)?;
    let l = swap_cols(b, &l, &k1, &kp, &two)?;
    let below = |c: &Val<'x>, first: &Val<'x>| -> R<Val<'x>> {
        keep(b, &cmp_idx(b, &rv, first, "GT")?, &column(b, ld, c)?)
    };
    let l = add_into_col(b, &l, &below(k, k)?, k, &one)?;
    let l = add_into_col(b, &l, &below(k, &k1)?, k, &two)?;
    let l = add_into_col(b, &l, &below(&k1, &k1)?, &k1, &two)?;
    // D: the diagonal entry, or the symmetric 2x2 block.
    let (rows, cols) = (iota(b, &shape, 1)?, iota(b, &shape, 2)?);
    let in_block = |r: &Val<'x>, c: &Val<'x>, on: &Val<'x>| -> R<Val<'x>> {
        let at = b.binary(
            "and",
            &cmp_idx(b, &rows, r, "EQ")?,
            &cmp_idx(b, &cols, c, "EQ")?,
        )?;
        b.binary("and", &at, &b.broadcast_in_dim(on, &shape, &[0])?)
    };
    let both = b.binary("or", &one, &two)?;
    let d = b.select(&in_block(k, k, &both)?, ld, d)?;
    let d = b.select(&in_block(&k1, &k1, &two)?, ld, &d)?;
    let d = b.select(&in_block(&k1, k, &two)?, ld, &d)?;
    let sub = entry(b, &row(b, ld, &k1)?, &k)?;
    let d = b.select(
        &in_block(k, &k1, &two)?,
        &b.broadcast_in_dim(&sub, &shape, &[0])?,
        &d,
    )?;
    Ok(vec![l, d, two, ld.clone(), piv.clone()])
}
