//! Bunch-Kaufman `L D L^T` in LAPACK's lower format: the factorization as sytf2 computes it
//! (unblocked, which is what sytrf runs for matrices narrower than its block), and solves by
//! sytrs's substitutions. The format: `L = P(1) L(1) P(2) L(2) ...`, where a positive pivot `k` is a 1x1
//! block of `D` with rows `k` and `pivots[k]` swapped, and a pair of equal negative pivots a
//! 2x2 block with rows `k+1` and `-pivots[k]` swapped; `L(k)` holds the block's multipliers
//! below it.

use super::{
    broadcast_batch, check_float, cmp_idx, column, entry, flat, flat_rows, iota, keep, outer,
    row, symmetric_from_lower, triangle, unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Combiner, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.linalg_ldl_solve.default"], ldl_solve);
    r.add(&["aten.linalg_ldl_factor_ex.default"], ldl_factor_ex);
}

/// `linalg_ldl_factor_ex(A, hermitian, check_errors) -> (LD, pivots, info)`: `A`'s lower
/// triangle factored; `info` is the 1-based index of the first zero column (left in place,
/// as sytf2 does), 0 when none.
fn ldl_factor_ex(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "self")?;
    check_float(&n.op, &a)?;
    let b = &n.b;
    let batch = super::batch_of(&a)?;
    let fa = flat(b, &a)?;
    let (bsz, dim) = (fa.shape()[0], fa.shape()[1]);
    let sym = symmetric_from_lower(b, &fa)?;
    let piv = b.splat(Scalar::Int(0), &TensorType::new(DType::I64, vec![bsz, dim]))?;
    let info = b.splat(Scalar::Int(0), &TensorType::new(DType::I32, vec![bsz]))?;
    let skip = b.splat(
        Scalar::Bool(false),
        &TensorType::new(DType::Bool, vec![bsz]),
    )?;
    let out = b.fori_loop(dim, &[&sym, &piv, &info, &skip], |b, k, s| {
        factor_step(&b, &k, s)
    })?;
    let ld = triangle(b, &out[0], true, 0)?;
    Ok(vec![
        unflat(b, &ld, &batch)?,
        unflat(b, &b.convert(&out[1], DType::I32)?, &batch)?,
        b.reshape(&out[2], &batch)?,
    ])
}

/// One column of sytf2 on the symmetric working matrix `s` (both triangles kept); the state
/// is `(s, pivots, info, skip)`, `skip` marking the second column of a 2x2 block.
fn factor_step<'x>(b: &Builder<'x>, k: &Val<'x>, st: Vec<Val<'x>>) -> R<Vec<Val<'x>>> {
    let (s, piv, info, skip) = (&st[0], &st[1], &st[2], &st[3]);
    let shape = s.shape().to_vec();
    let (bsz, n) = (shape[0], shape[1]);
    let dt = s.dtype();
    let rv = iota(b, &[bsz, n], 1)?;
    let vec_of = |v: f64| b.splat(Scalar::Float(v), &TensorType::new(dt, vec![bsz]));
    let alpha = vec_of((1.0 + 17f64.sqrt()) / 8.0)?;
    let live = b.unary("not", skip)?;
    let col = column(b, s, k)?;
    let absakk = b.unary("abs", &entry(b, &col, k)?)?;
    // colmax / imax: the first largest magnitude below the diagonal (isamax).
    let below_k = cmp_idx(b, &rv, k, "GT")?;
    let neg = b.splat(Scalar::Float(-1.0), &TensorType::new(dt, vec![bsz, n]))?;
    let mag = b.select(&below_k, &b.unary("abs", &col)?, &neg)?;
    let (colmax, imax) = first_max(b, &mag, n)?;
    let colmax = b.binary("maximum", &colmax, &vec_of(0.0)?)?;
    let zero_v = vec_of(0.0)?;
    let big = b.binary("maximum", &absakk, &colmax)?;
    let zero_col = b.unary("not", &b.compare(&big, &zero_v, "GT")?)?;
    // rowmax: the largest magnitude in row imax of the trailing block, off the diagonal.
    let srow = row(b, s, &imax)?;
    let in_trail = b.binary(
        "and",
        &cmp_idx(b, &rv, k, "GE")?,
        &b.compare(&rv, &b.broadcast_in_dim(&imax, &[bsz, n], &[0])?, "NE")?,
    )?;
    let (rowmax, _) = first_max(b, &b.select(&in_trail, &b.unary("abs", &srow)?, &neg)?, n)?;
    let aimax = b.unary("abs", &entry(b, &srow, &imax)?)?;
    let ac = b.mul(&alpha, &colmax)?;
    let keep_k = b.binary(
        "or",
        &b.compare(&absakk, &ac, "GE")?,
        &b.compare(&absakk, &b.mul(&ac, &b.div(&colmax, &rowmax)?)?, "GE")?,
    )?;
    let take_imax = b.compare(&aimax, &b.mul(&alpha, &rowmax)?, "GE")?;
    let not = |v: &Val<'x>| b.unary("not", v);
    let and = |p: &Val<'x>, q: &Val<'x>| b.binary("and", p, q);
    let one = and(&live, &not(&and(&not(&keep_k)?, &not(&take_imax)?)?)?)?;
    let one = b.binary("or", &one, &and(&live, &zero_col)?)?;
    let two = and(&live, &not(&one)?)?;
    let kb = b.broadcast_in_dim(k, &[bsz], &[])?;
    let kp = b.select(&b.binary("or", &keep_k, &zero_col)?, &kb, &imax)?;
    let k1 = b.add(k, &b.scalar(Scalar::Int(1), DType::I64)?)?;
    let kk = b.select(&two, &b.broadcast_in_dim(&k1, &[bsz], &[])?, &kb)?;
    // Symmetric swap of kk and kp inside the trailing block (rows and columns >= k).
    let live_nz = and(&live, &not(&zero_col)?)?;
    let s2 = sym_swap(b, s, k, &kk, &kp, &live_nz)?;
    // Elimination.
    let (xk, xk1) = (column(b, &s2, k)?, column(b, &s2, &k1)?);
    let (akk, ak1k, ak1k1) = (entry(b, &xk, k)?, entry(b, &xk, &k1)?, entry(b, &xk1, &k1)?);
    let one_v = vec_of(1.0)?;
    let x1 = keep(b, &below_k, &xk)?;
    let l1 = b.mul(
        &x1,
        &b.broadcast_in_dim(&b.div(&one_v, &akk)?, &[bsz, n], &[0])?,
    )?;
    let upd1 = outer(b, &x1, &l1)?;
    let below_k1 = cmp_idx(b, &rv, &k1, "GT")?;
    let (ck, ck1) = (keep(b, &below_k1, &xk)?, keep(b, &below_k1, &xk1)?);
    let d11 = b.div(&ak1k1, &ak1k)?;
    let d22 = b.div(&akk, &ak1k)?;
    let t = b.div(&one_v, &b.sub(&b.mul(&d11, &d22)?, &one_v)?)?;
    let d21 = b.div(&t, &ak1k)?;
    let per = |v: &Val<'x>| b.broadcast_in_dim(v, &[bsz, n], &[0]);
    let wk = b.mul(&per(&d21)?, &b.sub(&b.mul(&per(&d11)?, &ck)?, &ck1)?)?;
    let wk1 = b.mul(&per(&d21)?, &b.sub(&b.mul(&per(&d22)?, &ck1)?, &ck)?)?;
    let upd2 = b.add(&outer(b, &ck, &wk)?, &outer(b, &ck1, &wk1)?)?;
    let m3 = |v: &Val<'x>| b.broadcast_in_dim(v, &shape, &[0]);
    let do1 = and(&one, &not(&zero_col)?)?;
    let zero_m = b.full_like(Scalar::Int(0), s)?;
    let upd = b.select(&m3(&do1)?, &upd1, &b.select(&m3(&two)?, &upd2, &zero_m)?)?;
    let s3 = b.sub(&s2, &upd)?;
    // The multipliers replace the columns below the block.
    let cols = iota(b, &shape, 2)?;
    let put =
        |x: &Val<'x>, c: &Val<'x>, v: &Val<'x>, below: &Val<'x>, on: &Val<'x>| -> R<Val<'x>> {
            let at = and(
                &cmp_idx(b, &cols, c, "EQ")?,
                &b.broadcast_in_dim(below, &shape, &[0, 1])?,
            )?;
            let at = and(&at, &m3(on)?)?;
            b.select(&at, &b.broadcast_in_dim(v, &shape, &[0, 1])?, x)
        };
    let s4 = put(&s3, k, &l1, &below_k, &do1)?;
    let s4 = put(&s4, k, &wk, &below_k1, &two)?;
    let s4 = put(&s4, &k1, &wk1, &below_k1, &two)?;
    // Pivots (1-based; a 2x2 block's two entries are -kp-1) and info.
    let kp1 = b.add(&kp, &b.full_like(Scalar::Int(1), &kp)?)?;
    let code = b.select(&two, &b.unary("negate", &kp1)?, &kp1)?;
    let at_k = and(&cmp_idx(b, &rv, k, "EQ")?, &per(&live)?)?;
    let at_k1 = and(&cmp_idx(b, &rv, &k1, "EQ")?, &per(&two)?)?;
    let piv = b.select(&b.binary("or", &at_k, &at_k1)?, &per(&code)?, piv)?;
    let first = and(
        &and(&live, &zero_col)?,
        &b.compare(info, &b.full_like(Scalar::Int(0), info)?, "EQ")?,
    )?;
    let kinfo = b.convert(&kp1, DType::I32)?;
    let info = b.select(&first, &kinfo, info)?;
    Ok(vec![s4, piv, info, two])
}

/// The first largest entry of each row of `v[B, n]` and its index: `([B], [B] i64)`.
fn first_max<'x>(b: &Builder<'x>, v: &Val<'x>, n: i64) -> R<(Val<'x>, Val<'x>)> {
    let best = b.reduce(v, &[1], Combiner::Max, false)?;
    let rv = iota(b, v.shape(), 1)?;
    let hit = b.compare(v, &b.broadcast_in_dim(&best, v.shape(), &[0])?, "EQ")?;
    let idx = b.reduce(
        &b.select(&hit, &rv, &b.full_like(Scalar::Int(n), &rv)?)?,
        &[1],
        Combiner::Min,
        false,
    )?;
    // No hit (NaN, or nothing below the diagonal): index 0 is never chosen then.
    let idx = b.select(
        &b.compare(&idx, &b.full_like(Scalar::Int(n), &idx)?, "EQ")?,
        &b.full_like(Scalar::Int(0), &idx)?,
        &idx,
    )?;
    Ok((best, idx))
}

/// `s` with rows and columns `kk[B]` and `kp[B]` exchanged inside the block of indices `>= k`,
/// where `on[B]` holds.
fn sym_swap<'x>(
    b: &Builder<'x>,
    s: &Val<'x>,
    k: &Val<'x>,
    kk: &Val<'x>,
    kp: &Val<'x>,
    on: &Val<'x>,
) -> R<Val<'x>> {
    let shape = s.shape().to_vec();
    let swap_dim = |x: &Val<'x>, dim: usize| -> R<Val<'x>> {
        let idx = iota(b, &shape, dim)?;
        let get = |i: &Val<'x>| {
            if dim == 1 {
                row(b, x, i)
            } else {
                column(b, x, i)
            }
        };
        let (xa, xb) = (get(kk)?, get(kp)?);
        let dims = if dim == 1 { [0, 2] } else { [0, 1] };
        let (xa, xb) = (
            b.broadcast_in_dim(&xa, &shape, &dims)?,
            b.broadcast_in_dim(&xb, &shape, &dims)?,
        );
        b.select(
            &cmp_idx(b, &idx, kk, "EQ")?,
            &xb,
            &b.select(&cmp_idx(b, &idx, kp, "EQ")?, &xa, x)?,
        )
    };
    let swapped = swap_dim(&swap_dim(s, 1)?, 2)?;
    let trail = b.binary(
        "and",
        &cmp_idx(b, &iota(b, &shape, 1)?, k, "GE")?,
        &cmp_idx(b, &iota(b, &shape, 2)?, k, "GE")?,
    )?;
    let at = b.binary("and", &trail, &b.broadcast_in_dim(on, &shape, &[0])?)?;
    b.select(&at, &swapped, s)
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
