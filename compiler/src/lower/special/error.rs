//! Error-function relatives: `erfcx` (scaled complementary error function, which PyTorch's
//! `log_ndtr` decomposition uses) and `ndtri` (inverse of the normal CDF).

use super::super::builder::{opmath, Builder, IndexMap, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use super::cephes::*;
use super::erfcx_table::ERFCX_Y100;
use super::{float_out, polevl, Ops};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "prims.erfcx.default",
            "aten.special_erfcx.default",
            "prims.ndtri.default",
            "aten.special_ndtri.default",
        ],
        unary,
    );
}

fn unary(n: NodeCtx<'_>) -> Res<'_> {
    let out = float_out(&n)?;
    let b = &n.b;
    let x = b.convert(&n.tensor(0, "self")?, opmath(out))?;
    let y = if n.op.contains("erfcx") {
        erfcx(b, &x)?
    } else {
        ndtri(b, &x)?
    };
    Ok(vec![b.convert(&y, out)?])
}

/// `calc_erfcx`: continued fraction above 50, the piecewise Chebyshev table on 4/(4+|x|) below,
/// and 2 exp(x²) - erfcx(-x) for negative x. The table's literals are doubles, so those parts
/// are evaluated in double as the kernel does.
fn erfcx<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let wide = |v: &Val<'a>| b.convert(v, DType::F64);
    let ax = b.unary("abs", x)?;
    let table = y100(b, &b.div(&o.c(400.0)?, &b.add_scalar(&ax, 4.0)?)?)?;
    // x > 50: ispi ((x²)(x² + 4.5) + 2) / (x ((x²)(x² + 5) + 3.75)).
    let ispi = o.c(0.56418958354775628694807945156)?;
    let x2 = wide(&b.mul(x, x)?)?;
    let num = b.add_scalar(&b.mul(&x2, &b.add_scalar(&x2, 4.5)?)?, 2.0)?;
    let den = b.mul(
        &wide(x)?,
        &b.add_scalar(&b.mul(&x2, &b.add_scalar(&x2, 5.0)?)?, 3.75)?,
    )?;
    let fraction = b.convert(&b.div(&b.mul(&wide(&ispi)?, &num)?, &den)?, x.dtype())?;
    let fraction = b.select(&o.cmp_f(x, 5e7, "GT")?, &b.div(&ispi, x)?, &fraction)?;
    let positive = b.select(
        &o.cmp_f(x, 50.0, "GT")?,
        &fraction,
        &b.convert(&table, x.dtype())?,
    )?;
    let twice = b.mul_scalar(&b.unary("exponential", &b.mul(x, x)?)?, 2.0)?;
    let reflected = b.convert(&b.sub(&wide(&twice)?, &table)?, x.dtype())?;
    // The kernel compares with double literals.
    let below = |v: f64| b.compare(&wide(x)?, &b.full_like(Scalar::Float(v), &x2)?, "LT");
    let mut negative = b.select(&below(-6.1)?, &twice, &reflected)?;
    negative = b.select(&below(-26.7)?, &o.c(f64::INFINITY)?, &negative)?;
    let y = b.select(&o.cmp_f(x, 0.0, "GE")?, &positive, &negative)?;
    b.select(&b.compare(x, x, "NE")?, x, &y)
}

/// `erfcx_y100`: piece k = trunc(y100) of the table in t = 2·y100 - (2k + 1) (in y's dtype),
/// the polynomial in double (the result is f64); 1 at y100 = 100 (|x| below 4 eps).
fn y100<'a>(b: &Builder<'a>, y: &Val<'a>) -> R<Val<'a>> {
    let k = b.convert(y, DType::I32)?;
    let last = b.compare(&k, &b.full_like(Scalar::Int(99), &k)?, "GT")?;
    let k = b.select(&last, &b.full_like(Scalar::Int(99), &k)?, &k)?;
    let odd = b.add(
        &b.mul(&k, &b.full_like(Scalar::Int(2), &k)?)?,
        &b.full_like(Scalar::Int(1), &k)?,
    )?;
    let t = b.sub(&b.mul_scalar(y, 2.0)?, &b.convert(&odd, y.dtype())?)?;
    let t = b.convert(&t, DType::F64)?;
    let mut idx_shape = k.shape().to_vec();
    idx_shape.push(1);
    let idx = b.reshape(&k, &idx_shape)?;
    let map = IndexMap {
        window_dims: vec![],
        collapsed: vec![0],
        index_to_operand: vec![0],
        index_vector_dim: k.rank(),
    };
    let coef = |i: usize| -> R<Val<'a>> {
        let column: Vec<f64> = ERFCX_Y100.iter().map(|row| row[i]).collect();
        b.gather(
            &b.table(&column, DType::F64)?,
            &idx,
            &map,
            &[1],
            k.shape().to_vec(),
        )
    };
    let mut acc = coef(6)?;
    for i in (0..6).rev() {
        acc = b.add(&coef(i)?, &b.mul(&acc, &t)?)?;
    }
    let one = b.full_like(Scalar::Float(1.0), &acc)?;
    b.select(&last, &one, &acc)
}

/// Cephes' `ndtri`: a rational function around 1/2, else one in 1/sqrt(-2 log y) on the
/// nearer tail.
fn ndtri<'a>(b: &Builder<'a>, y0: &Val<'a>) -> R<Val<'a>> {
    const EXP_M2: f64 = 0.13533528323661269189;
    let o = Ops {
        b,
        like: y0.clone(),
    };
    let one_minus = if y0.dtype() == DType::F64 {
        1.0 - EXP_M2
    } else {
        (1.0f32 - EXP_M2 as f32) as f64
    };
    let upper = o.cmp_f(y0, one_minus, "GT")?;
    let y = b.select(&upper, &b.sub(&o.c(1.0)?, y0)?, y0)?;
    let c = b.add_scalar(&y, -0.5)?;
    let c2 = b.mul(&c, &c)?;
    let r = b.div(
        &b.mul(&c2, &polevl(b, &c2, &NDTRI_P0)?)?,
        &polevl(b, &c2, &NDTRI_Q0)?,
    )?;
    let central = b.mul_scalar(&b.add(&c, &b.mul(&c, &r)?)?, 2.50662827463100050242E0)?;
    let x = b.unary("sqrt", &b.mul_scalar(&b.unary("log", &y)?, -2.0)?)?;
    let x0 = b.sub(&x, &b.div(&b.unary("log", &x)?, &x)?)?;
    let z = b.div(&o.c(1.0)?, &x)?;
    let tail = |p: &[f64], q: &[f64]| -> R<Val<'a>> {
        b.div(&b.mul(&z, &polevl(b, &z, p)?)?, &polevl(b, &z, q)?)
    };
    let x1 = b.select(
        &o.cmp_f(&x, 8.0, "LT")?,
        &tail(&NDTRI_P1, &NDTRI_Q1)?,
        &tail(&NDTRI_P2, &NDTRI_Q2)?,
    )?;
    let xt = b.sub(&x0, &x1)?;
    let xt = b.select(&upper, &xt, &b.unary("negate", &xt)?)?;
    let mut r = b.select(&o.cmp_f(&y, EXP_M2, "GT")?, &central, &xt)?;
    let outside = b.binary("or", &o.cmp_f(y0, 0.0, "LT")?, &o.cmp_f(y0, 1.0, "GT")?)?;
    r = b.select(&outside, &o.c(f64::NAN)?, &r)?;
    r = b.select(&o.cmp_f(y0, 1.0, "EQ")?, &o.c(f64::INFINITY)?, &r)?;
    b.select(&o.cmp_f(y0, 0.0, "EQ")?, &o.c(f64::NEG_INFINITY)?, &r)
}
