//! Matrix functions: the exponential by scaling and squaring.

use super::{batch_of, bmm, check_float, eye, flat, unflat};
use crate::ir::DType;
use crate::lower::builder::{Combiner, Scalar};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.linalg_matrix_exp.default"], matrix_exp);
}

/// Taylor terms after scaling: with `|A / 2^s|_1 <= 1` the remainder is below 1/19! (~1e-17).
const TAYLOR_DEGREE: i64 = 18;
/// Most squarings: enough for the largest finite 1-norm (2^128 in f32, 2^1024 in f64).
fn max_squarings(dtype: DType) -> i64 {
    if dtype == DType::F64 {
        1024
    } else {
        128
    }
}

/// `linalg_matrix_exp(A)`: `exp(A / 2^s)` by its Taylor polynomial (Horner), squared `s`
/// times, where `s = max(0, ceil(log2 |A|_1))` per matrix.
fn matrix_exp(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "self")?;
    check_float(&n.op, &a)?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let fa = flat(b, &a)?;
    let (bsz, dim) = (fa.shape()[0], fa.shape()[1]);
    let col_sums = b.reduce(&b.unary("abs", &fa)?, &[1], Combiner::Add, false)?;
    let norm = b.reduce(&col_sums, &[1], Combiner::Max, false)?;
    let log2 = b.div(
        &b.unary("log", &norm)?,
        &b.full_like(Scalar::Float(std::f64::consts::LN_2), &norm)?,
    )?;
    let s = b.unary("ceil", &log2)?;
    let most = max_squarings(a.dtype());
    let lo = b.full_like(Scalar::Int(0), &s)?;
    let hi = b.full_like(Scalar::Int(most), &s)?;
    // NaN norms (and the -inf of an empty matrix) square nothing.
    let s = b.select(
        &b.compare(&s, &s, "NE")?,
        &lo,
        &b.binary("maximum", &b.binary("minimum", &s, &hi)?, &lo)?,
    )?;
    let scale = b.binary(
        "power",
        &b.full_like(Scalar::Int(2), &s)?,
        &b.unary("negate", &s)?,
    )?;
    let x = b.mul(&fa, &b.broadcast_in_dim(&scale, fa.shape(), &[0])?)?;
    let id = eye(b, bsz, dim, a.dtype())?;
    // I + x/1 (I + x/2 (I + ... (I + x/18)))
    let mut acc = id.clone();
    for k in (1..=TAYLOR_DEGREE).rev() {
        acc = b.add(&id, &b.mul_scalar(&bmm(b, &x, &acc)?, 1.0 / k as f64)?)?;
    }
    let steps = b.convert(&s, DType::I64)?;
    let out = b.fori_loop(most, &[&acc, &steps], |b, i, st| {
        let (m, steps) = (&st[0], &st[1]);
        let more = b.compare(&b.broadcast_in_dim(&i, steps.shape(), &[])?, steps, "LT")?;
        let sq = bmm(&b, m, m)?;
        Ok(vec![
            b.select(&b.broadcast_in_dim(&more, m.shape(), &[0])?, &sq, m)?,
            steps.clone(),
        ])
    })?;
    Ok(vec![unflat(b, &out[0], &batch)?])
}
