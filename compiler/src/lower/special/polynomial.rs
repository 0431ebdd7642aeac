//! Orthogonal polynomials with a per-element tensor degree (`torch.special.*_polynomial_*`).
//!
//! Each rule follows PyTorch's CPU kernel (ATen/native/Math.h) branch by branch: the special
//! cases (n < 0, |x| = 1, ...), the trigonometric closed forms Chebyshev uses for large n inside
//! (-1, 1), and otherwise the three-term recurrence, run as a `stablehlo.while` up to the
//! largest degree with finished elements masked, so results agree to float ulps.

use super::super::builder::{opmath, Builder, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use super::{iterate, Ops};
use crate::ir::DType;

const CHEBYSHEV: &[&str] = &[
    "chebyshev_polynomial_t",
    "chebyshev_polynomial_u",
    "chebyshev_polynomial_v",
    "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w",
];
const OTHERS: &[&str] = &[
    "hermite_polynomial_h",
    "hermite_polynomial_he",
    "laguerre_polynomial_l",
    "legendre_polynomial_p",
];

pub fn register(r: &mut Registry) {
    for name in CHEBYSHEV.iter().chain(OTHERS) {
        for overload in ["default", "x_scalar", "n_scalar"] {
            let op: &'static str =
                Box::leak(format!("aten.special_{name}.{overload}").into_boxed_str());
            r.add(&[op], polynomial);
        }
    }
}

fn polynomial(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let b = &n.b;
    let v = b.coerce(&[&n.operand(0, "x")?, &n.operand(1, "n")?], opmath(out))?;
    let (x, deg) = (&v[0], &v[1]);
    if !x.dtype().is_float() {
        return Err(format!(
            "{}: needs a float result, got {}",
            n.op,
            out.name()
        ));
    }
    let name = n.op.trim_start_matches("aten.special_");
    let name = &name[..name.find('.').unwrap_or(name.len())];
    let y = match name {
        "hermite_polynomial_h" | "hermite_polynomial_he" => {
            hermite(b, x, deg, name.ends_with('e'))?
        }
        "laguerre_polynomial_l" => laguerre(b, x, deg)?,
        "legendre_polynomial_p" => legendre(b, x, deg)?,
        _ => chebyshev(b, x, deg, name)?,
    };
    Ok(vec![b.convert(&y, out)?])
}

/// The kernels' `static_cast<int64_t>(n)`: truncation, and on x86 INT64_MIN (so "n < 0") for
/// NaN, ±inf and anything out of range.
fn degree<'a>(b: &Builder<'a>, deg: &Val<'a>) -> R<Val<'a>> {
    let limit = b.full_like(Scalar::Float(2f64.powi(63)), deg)?;
    let in_range = b.compare(&b.unary("abs", deg)?, &limit, "LT")?;
    let n = b.convert(deg, DType::I64)?;
    b.select(&in_range, &n, &b.full_like(Scalar::Int(-1), &n)?)
}

/// One step of a recurrence: `(b, k, x, p, q) -> r`, `k` the kernel's loop counter as a float.
type Step = for<'x> fn(&Builder<'x>, &Val<'x>, &Val<'x>, &Val<'x>, &Val<'x>) -> R<Val<'x>>;

/// `r = step(k, p, q); p = q; q = r` for k = 1..=iters per element, stopping early where q is
/// NaN as the kernels do; returns the final q (which is the kernels' r once a step ran).
fn recurrence<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    iters: &Val<'a>,
    p0: &Val<'a>,
    q0: &Val<'a>,
    step: Step,
) -> R<Val<'a>> {
    let one = b.full_like(Scalar::Int(1), iters)?;
    let none = b.compare(iters, &one, "LT")?;
    let done = b.binary("or", &none, &b.compare(q0, q0, "NE")?)?;
    let state = [one, iters.clone(), x.clone(), p0.clone(), q0.clone()];
    let s = iterate(b, &state, &done, i64::MAX, |b, s| {
        let (k, iters, x, p, q) = (&s[0], &s[1], &s[2], &s[3], &s[4]);
        let r = step(b, &b.convert(k, x.dtype())?, x, p, q)?;
        let k = b.binary("add", k, &b.full_like(Scalar::Int(1), k)?)?;
        let stop = b.binary(
            "or",
            &b.compare(&k, iters, "GT")?,
            &b.compare(&r, &r, "NE")?,
        )?;
        Ok((vec![k, iters.clone(), x.clone(), q.clone(), r], stop))
    })?;
    Ok(s[4].clone())
}

/// T, U, V, W and their shifted forms (y = 2x - 1 in place of x).
fn chebyshev<'a>(b: &Builder<'a>, x: &Val<'a>, deg: &Val<'a>, name: &str) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let shifted = name.starts_with("shifted");
    let kind = name.chars().last().unwrap_or('t');
    let n = degree(b, deg)?;
    let y = if shifted {
        b.sub(&b.add(x, x)?, &o.c(1.0)?)?
    } else {
        x.clone()
    };
    let nf = o.f(&n)?;
    let (n_plus_1, two_n_plus_1) = (o.lin(&n, 1, 1)?, o.lin(&n, 2, 1)?);
    let one = o.c(1.0)?;
    let yy = b.add(&y, &y)?;
    let q0 = match kind {
        't' => y.clone(),
        'u' => yy.clone(),
        'v' => b.sub(&yy, &one)?,
        _ => b.add(&yy, &one)?,
    };
    // The values at the ends: x = 1 ("top"), and x = -1 (shifted: x = 0, "bottom").
    let (top, bottom) = match kind {
        't' => (one.clone(), o.parity(&n, &one)?),
        'u' => (n_plus_1.clone(), o.parity(&n, &n_plus_1)?),
        'v' => (one.clone(), o.parity(&n, &two_n_plus_1)?),
        _ => (two_n_plus_1.clone(), o.parity(&n, &one)?),
    };
    let threshold = match (kind, shifted) {
        ('t', _) => 6,
        (_, false) => 8,
        ('w', true) => 4,
        _ => 6,
    };
    let at_top = o.cmp_f(x, 1.0, "EQ")?;
    let at_bottom = o.cmp_f(x, if shifted { 0.0 } else { -1.0 }, "EQ")?;
    let trig_region = b.binary(
        "and",
        &o.cmp_i(&n, threshold, "GT")?,
        &o.cmp_f(&b.unary("abs", &y)?, 1.0, "LT")?,
    )?;
    let theta = b.op("chlo.acos", &[&y], &[], y.ty.clone())?;
    let half = b.mul_scalar(&theta, 0.5)?;
    let n_half = b.add_scalar(&nf, 0.5)?;
    let trig = match kind {
        't' => b.unary("cosine", &b.mul(&nf, &theta)?)?,
        'u' => {
            let s = b.unary("sine", &theta)?;
            let a = b.mul(&n_plus_1, &theta)?;
            let regular = b.div(&b.unary("sine", &a)?, &s)?;
            let limit = b.div(&b.mul(&n_plus_1, &b.unary("cosine", &a)?)?, &y)?;
            b.select(&o.cmp_f(&s, 0.0, "NE")?, &regular, &limit)?
        }
        'v' => {
            let regular = b.div(
                &b.unary("cosine", &b.mul(&n_half, &theta)?)?,
                &b.unary("cosine", &half)?,
            )?;
            let ok = o.cmp_f(&b.unary("sine", &half)?, 1.0, "NE")?;
            b.select(&ok, &regular, &o.parity(&n, &two_n_plus_1)?)?
        }
        _ => {
            let regular = b.div(
                &b.unary("sine", &b.mul(&n_half, &theta)?)?,
                &b.unary("sine", &half)?,
            )?;
            let ok = o.cmp_f(&b.unary("cosine", &half)?, 1.0, "NE")?;
            let end = if shifted {
                o.parity(&n, &one)?
            } else {
                b.select(&o.cmp_f(x, 0.0, "GT")?, &two_n_plus_1, &o.parity(&n, &one)?)?
            };
            b.select(&ok, &regular, &end)?
        }
    };
    let special = b.binary(
        "or",
        &b.binary("or", &at_top, &at_bottom)?,
        &b.binary("or", &trig_region, &o.cmp_i(&n, 1, "LE")?)?,
    )?;
    // The kernel's loop runs k = 2..=n: n - 1 steps.
    let iters = b.select(
        &special,
        &o.ci(0, &n)?,
        &b.binary("subtract", &n, &o.ci(1, &n)?)?,
    )?;
    let step: Step = |b, _k, y, p, q| b.sub(&b.mul(&b.add(y, y)?, q)?, p);
    let mut r = recurrence(b, &y, &iters, &one, &q0, step)?;
    r = b.select(&o.cmp_i(&n, 1, "EQ")?, &q0, &r)?;
    r = b.select(&o.cmp_i(&n, 0, "EQ")?, &one, &r)?;
    r = b.select(&trig_region, &trig, &r)?;
    r = b.select(&at_bottom, &bottom, &r)?;
    r = b.select(&at_top, &top, &r)?;
    b.select(&o.cmp_i(&n, 0, "LT")?, &o.c(0.0)?, &r)
}

/// Physicists' (H) and probabilists' (He) Hermite polynomials; NaN past the kernel's degree
/// limit (128 for float, 512 for double).
fn hermite<'a>(b: &Builder<'a>, x: &Val<'a>, deg: &Val<'a>, prob: bool) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let n = degree(b, deg)?;
    let limit = if x.dtype() == DType::F64 { 512 } else { 128 };
    let q0 = if prob { x.clone() } else { b.add(x, x)? };
    let one = o.c(1.0)?;
    let iters = b.select(
        &o.cmp_i(&n, limit, "GT")?,
        &o.ci(0, &n)?,
        &b.binary("subtract", &n, &o.ci(1, &n)?)?,
    )?;
    let step: Step = if prob {
        |b, k, x, p, q| b.sub(&b.mul(x, q)?, &b.mul(k, p)?)
    } else {
        |b, k, x, p, q| b.sub(&b.mul(&b.add(x, x)?, q)?, &b.mul(&b.add(k, k)?, p)?)
    };
    let mut r = recurrence(b, x, &iters, &one, &q0, step)?;
    r = b.select(&o.cmp_i(&n, limit, "GT")?, &o.c(f64::NAN)?, &r)?;
    r = b.select(&o.cmp_i(&n, 1, "EQ")?, &q0, &r)?;
    r = b.select(&o.cmp_i(&n, 0, "EQ")?, &one, &r)?;
    b.select(&o.cmp_i(&n, 0, "LT")?, &o.c(0.0)?, &r)
}

fn laguerre<'a>(b: &Builder<'a>, x: &Val<'a>, deg: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let n = degree(b, deg)?;
    let one = o.c(1.0)?;
    let q0 = b.sub(&one, x)?;
    let iters = b.binary("subtract", &n, &o.ci(1, &n)?)?;
    let step: Step = |b, k, x, p, q| {
        let one = b.full_like(Scalar::Float(1.0), x)?;
        let a = b.mul(&b.add(&b.add(k, k)?, &b.sub(&one, x)?)?, q)?;
        let k1 = b.add_scalar(k, 1.0)?;
        b.div(&b.sub(&a, &b.mul(k, p)?)?, &k1)
    };
    let mut r = recurrence(b, x, &iters, &one, &q0, step)?;
    r = b.select(&o.cmp_i(&n, 1, "EQ")?, &q0, &r)?;
    r = b.select(&o.cmp_i(&n, 0, "EQ")?, &one, &r)?;
    r = b.select(&o.cmp_f(x, 0.0, "EQ")?, &one, &r)?;
    b.select(&o.cmp_i(&n, 0, "LT")?, &o.c(0.0)?, &r)
}

fn legendre<'a>(b: &Builder<'a>, x: &Val<'a>, deg: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let n = degree(b, deg)?;
    let one = o.c(1.0)?;
    let iters = b.binary("subtract", &n, &o.ci(1, &n)?)?;
    let step: Step = |b, k, x, p, q| {
        let a = b.mul(&b.mul(&b.add_scalar(&b.add(k, k)?, 1.0)?, x)?, q)?;
        b.div(&b.sub(&a, &b.mul(k, p)?)?, &b.add_scalar(k, 1.0)?)
    };
    let mut r = recurrence(b, x, &iters, &one, x, step)?;
    r = b.select(&o.cmp_i(&n, 1, "EQ")?, x, &r)?;
    r = b.select(&o.cmp_i(&n, 0, "EQ")?, &one, &r)?;
    let ends = o.cmp_f(&b.unary("abs", x)?, 1.0, "EQ")?;
    let end = b.select(&o.cmp_f(x, 0.0, "GT")?, &one, &o.parity(&n, &one)?)?;
    r = b.select(&ends, &end, &r)?;
    b.select(&o.cmp_i(&n, 0, "LT")?, &o.c(0.0)?, &r)
}
