//! digamma, `polygamma(n, x)` (digamma for n = 0, trigamma for n = 1, (-1)^(n+1) n! ζ(n+1, x)
//! beyond) and Hurwitz ζ, with ζ in double as PyTorch's CPU kernel accumulates it.

use super::super::builder::{opmath, Builder, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use super::{float_out, iterate, polevl, Ops};
use crate::ir::{DType, TensorType};
use std::f64::consts::PI;

pub fn register(r: &mut Registry) {
    r.add(&["aten.polygamma.default"], polygamma);
    r.add(
        &["aten.digamma.default", "prims.digamma.default"],
        digamma_rule,
    );
    r.add(
        &[
            "prims.zeta.default",
            "aten.special_zeta.default",
            "aten.special_zeta.self_scalar",
            "aten.special_zeta.other_scalar",
        ],
        zeta_rule,
    );
}

fn digamma_rule(n: NodeCtx<'_>) -> Res<'_> {
    let out = float_out(&n)?;
    let x = n.b.convert(&n.tensor(0, "self")?, opmath(out))?;
    Ok(vec![n.b.convert(&digamma(&n.b, &x)?, out)?])
}

/// ζ's accumulator, `at::acc_type` on CPU: double for float and double, float for half types.
fn zeta_acc(out: DType) -> DType {
    if matches!(out, DType::F16 | DType::Bf16) {
        DType::F32
    } else {
        DType::F64
    }
}

fn zeta_rule(n: NodeCtx<'_>) -> Res<'_> {
    let out = float_out(&n)?;
    let b = &n.b;
    let operands = [&n.operand(0, "self")?, &n.operand(1, "other")?];
    let v = b.coerce(&operands, zeta_acc(out))?;
    Ok(vec![b.convert(&zeta(b, &v[0], &v[1])?, out)?])
}

fn polygamma(n: NodeCtx<'_>) -> Res<'_> {
    let order = n.int(0, "n")?;
    let out = float_out(&n)?;
    let b = &n.b;
    let x = b.convert(&n.tensor(1, "self")?, opmath(out))?;
    let y = match order {
        0 => digamma(b, &x)?,
        1 => trigamma(b, &x)?,
        k if k > 1 => {
            let q = b.convert(&x, zeta_acc(out))?;
            let s = b.full_like(Scalar::Float((k + 1) as f64), &q)?;
            let z = b.convert(&zeta(b, &s, &q)?, x.dtype())?;
            let fac: f64 = (2..=k).map(|i| i as f64).product();
            b.mul_scalar(&z, if k % 2 == 1 { fac } else { -fac })?
        }
        k => return Err(format!("polygamma: order n={k} must be non-negative")),
    };
    Ok(vec![b.convert(&y, out)?])
}

/// A constant computed in x's dtype (f32 arithmetic for f32, as the kernel's literals are).
fn in_dtype(x: &Val<'_>, v64: f64, v32: f32) -> f64 {
    if x.dtype() == DType::F64 {
        v64
    } else {
        v32 as f64
    }
}

/// Cephes' digamma as in `calc_digamma`: reflection for x < 0 (its cotangent term in double),
/// recurrence up to x ≥ 10, then the asymptotic series.
fn digamma<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    const A: [f64; 7] = [
        8.33333333333333333333E-2,
        -2.10927960927960927961E-2,
        7.57575757575757575758E-3,
        -4.16666666666666666667E-3,
        3.96825396825396825397E-3,
        -8.33333333333333333333E-3,
        8.33333333333333333333E-2,
    ];
    let o = Ops { b, like: x.clone() };
    let neg = o.cmp_f(x, 0.0, "LT")?;
    let mut v = b.select(&neg, &b.sub(&o.c(1.0)?, x)?, x)?;
    let mut result = o.c(0.0)?;
    for _ in 0..10 {
        let below = o.cmp_f(&v, 10.0, "LT")?;
        result = b.select(&below, &b.sub(&result, &b.div(&o.c(1.0)?, &v)?)?, &result)?;
        v = b.select(&below, &b.add_scalar(&v, 1.0)?, &v)?;
    }
    let z = b.div(&o.c(1.0)?, &b.mul(&v, &v)?)?;
    let tail = b.select(
        &o.cmp_f(&v, 1.0e17, "LT")?,
        &b.mul(&z, &polevl(b, &z, &A)?)?,
        &o.c(0.0)?,
    )?;
    let half_over = b.div(&o.c(0.5)?, &v)?;
    let series = b.sub(
        &b.sub(&b.add(&result, &b.unary("log", &v)?)?, &half_over)?,
        &tail,
    )?;
    let psi10 = b.add_scalar(&result, 2.25175258906672110764)?;
    let positive = b.select(&o.cmp_f(&v, 10.0, "EQ")?, &psi10, &series)?;
    // π / tan(π r), r the fractional part of x, in double.
    let xd = b.convert(x, DType::F64)?;
    let r = b.sub(&xd, &trunc(b, &xd)?)?;
    let pi = b.full_like(Scalar::Float(PI), &xd)?;
    let cot = b.div(&pi, &b.unary("tan", &b.mul(&pi, &r)?)?)?;
    let reflected = b.sub(&positive, &b.convert(&cot, x.dtype())?)?;
    let y = b.select(&neg, &reflected, &positive)?;
    let integer = b.compare(x, &trunc(b, x)?, "EQ")?;
    let y = b.select(&b.binary("and", &neg, &integer)?, &o.c(f64::NAN)?, &y)?;
    // ±0 gives ∓inf.
    let zero = o.cmp_f(x, 0.0, "EQ")?;
    b.select(&zero, &b.div(&o.c(-1.0)?, x)?, &y)
}

fn trunc<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let neg = b.compare(x, &b.full_like(Scalar::Int(0), x)?, "LT")?;
    b.select(&neg, &b.unary("ceil", x)?, &b.unary("floor", x)?)
}

/// `trigamma` of the kernel: reflection below 1/2, six recurrence steps, asymptotic series.
fn trigamma<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let low = o.cmp_f(x, 0.5, "LT")?;
    let pi = in_dtype(x, PI, std::f32::consts::PI);
    let pi2 = in_dtype(x, PI * PI, std::f32::consts::PI * std::f32::consts::PI);
    let s = b.unary("sine", &b.mul_scalar(x, pi)?)?;
    let refl = b.sub(&o.c(0.0)?, &b.div(&o.c(pi2)?, &b.mul(&s, &s)?)?)?;
    let mut result = b.select(&low, &refl, &o.c(0.0)?)?;
    let mut v = b.select(&low, &b.sub(&o.c(1.0)?, x)?, x)?;
    for _ in 0..6 {
        result = b.add(&result, &b.div(&o.c(1.0)?, &b.mul(&v, &v)?)?)?;
        v = b.add_scalar(&v, 1.0)?;
    }
    let ixx = b.div(&o.c(1.0)?, &b.mul(&v, &v)?)?;
    let inner = b.sub(
        &o.c(in_dtype(x, 1. / 30., 1f32 / 30.))?,
        &b.mul_scalar(&ixx, in_dtype(x, 1. / 42., 1f32 / 42.))?,
    )?;
    let inner = b.sub(
        &o.c(in_dtype(x, 1. / 6., 1f32 / 6.))?,
        &b.mul(&ixx, &inner)?,
    )?;
    let poly = b.add(
        &b.add(&o.c(1.0)?, &b.div(&o.c(1.0)?, &b.add(&v, &v)?)?)?,
        &b.mul(&ixx, &inner)?,
    )?;
    let result = b.add(&result, &b.div(&poly, &v)?)?;
    b.select(&low, &b.unary("negate", &result)?, &result)
}

/// Hurwitz ζ(s, q) as Cephes' `zeta`: direct sum until the terms are negligible or q + i > 9
/// (a while loop, since negative q needs more terms), then Euler-Maclaurin with its twelve
/// Bernoulli terms. `s` and `q` share one shape and the accumulator dtype.
fn zeta<'a>(b: &Builder<'a>, s: &Val<'a>, q: &Val<'a>) -> R<Val<'a>> {
    const A: [f64; 12] = [
        12.0,
        -720.0,
        30240.0,
        -1209600.0,
        47900160.0,
        -1.8924375803183791606e9,
        7.47242496e10,
        -2.950130727918164224e12,
        1.1646782814350067249e14,
        -4.5979787224074726105e15,
        1.8152105401943546773e17,
        -7.1661652561756670113e18,
    ];
    const MACHEP: f64 = 1.11022302462515654042E-16;
    let o = Ops { b, like: q.clone() };
    let nonpositive = o.cmp_f(q, 0.0, "LE")?;
    let int = |v: &Val<'a>| b.compare(v, &b.unary("floor", v)?, "EQ");
    let pole = b.binary("and", &nonpositive, &int(q)?)?;
    let undefined = b.binary("and", &nonpositive, &b.unary("not", &int(s)?)?)?;
    let at_one = o.cmp_f(s, 1.0, "EQ")?;
    let below_one = o.cmp_f(s, 1.0, "LT")?;
    let special = b.binary(
        "or",
        &b.binary("or", &at_one, &below_one)?,
        &b.binary("or", &pole, &undefined)?,
    )?;
    let neg_s = b.unary("negate", s)?;
    let i0 = b.splat(
        Scalar::Int(0),
        &TensorType::new(DType::I64, q.shape().to_vec()),
    )?;
    let state = [
        i0,
        q.clone(),
        b.binary("power", q, &neg_s)?,
        o.c(0.0)?,
        special.clone(),
        neg_s,
    ];
    let st = iterate(b, &state, &special, i64::MAX, |b, st| {
        let (i, a, sum, neg_s) = (&st[0], &st[1], &st[2], &st[5]);
        let i = b.binary("add", i, &b.full_like(Scalar::Int(1), i)?)?;
        let a = b.add_scalar(a, 1.0)?;
        let term = b.binary("power", &a, neg_s)?;
        let sum = b.add(sum, &term)?;
        let small = b.binary(
            "and",
            &b.compare(&b.mul_scalar(&sum, -MACHEP)?, &term, "LT")?,
            &b.compare(&term, &b.mul_scalar(&sum, MACHEP)?, "LT")?,
        )?;
        // The kernel loops while i < 9 or a <= 9.
        let few = b.compare(&i, &b.full_like(Scalar::Int(9), &i)?, "LT")?;
        let near = b.compare(&a, &b.full_like(Scalar::Float(9.0), &a)?, "LE")?;
        let more = b.binary("or", &few, &near)?;
        let stop = b.binary("or", &small, &b.unary("not", &more)?)?;
        Ok((vec![i, a, sum, term, small, neg_s.clone()], stop))
    })?;
    // Elements the direct sum finished (and special ones, which start finished) skip
    // Euler-Maclaurin.
    let (w, mut sum, mut term) = (st[1].clone(), st[2].clone(), st[3].clone());
    let mut done = st[4].clone();
    let direct = sum.clone();
    sum = b.add(&sum, &b.div(&b.mul(&term, &w)?, &b.add_scalar(s, -1.0)?)?)?;
    sum = b.sub(&sum, &b.mul_scalar(&term, 0.5)?)?;
    let mut a = o.c(1.0)?;
    let mut k = 0.0f64;
    for c in A {
        a = b.mul(&a, &b.add_scalar(s, k)?)?;
        term = b.div(&term, &w)?;
        let t = b.div(&b.mul(&a, &term)?, &o.c(c)?)?;
        let next = b.add(&sum, &t)?;
        sum = b.select(&done, &sum, &next)?;
        let conv = o.cmp_f(&b.unary("abs", &b.div(&t, &next)?)?, MACHEP, "LT")?;
        done = b.binary("or", &done, &conv)?;
        k += 1.0;
        a = b.mul(&a, &b.add_scalar(s, k)?)?;
        term = b.div(&term, &w)?;
        k += 1.0;
    }
    let mut y = b.select(&st[4], &direct, &sum)?;
    y = b.select(&undefined, &o.c(f64::NAN)?, &y)?;
    y = b.select(&pole, &o.c(f64::INFINITY)?, &y)?;
    y = b.select(&below_one, &o.c(f64::NAN)?, &y)?;
    b.select(&at_one, &o.c(f64::INFINITY)?, &y)
}
