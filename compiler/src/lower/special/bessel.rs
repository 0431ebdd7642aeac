//! Bessel and Airy functions (`torch.i0`, `torch.special.{i0e, i1, i1e, bessel_*,
//! modified_bessel_*, scaled_modified_bessel_*, spherical_bessel_j0, airy_ai}`): Cephes'
//! rational and Chebyshev approximations, branch by branch as PyTorch's kernels evaluate them.

use super::super::builder::{opmath, Builder, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use super::cephes::*;
use super::{float_out, chbevl, iterate, polevl, Ops};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "prims.bessel_i0.default",
            "aten.i0.default",
            "prims.bessel_i0e.default",
            "aten.special_i0e.default",
            "prims.bessel_i1.default",
            "aten.special_i1.default",
            "prims.bessel_i1e.default",
            "aten.special_i1e.default",
            "prims.bessel_j0.default",
            "aten.special_bessel_j0.default",
            "prims.bessel_j1.default",
            "aten.special_bessel_j1.default",
            "aten.special_bessel_y0.default",
            "aten.special_bessel_y1.default",
            "aten.special_modified_bessel_i0.default",
            "aten.special_modified_bessel_i1.default",
            "aten.special_modified_bessel_k0.default",
            "aten.special_modified_bessel_k1.default",
            "aten.special_scaled_modified_bessel_k0.default",
            "aten.special_scaled_modified_bessel_k1.default",
            "prims.spherical_bessel_j0.default",
            "aten.special_spherical_bessel_j0.default",
            "aten.special_airy_ai.default",
        ],
        bessel,
    );
}

fn bessel(n: NodeCtx<'_>) -> Res<'_> {
    let out = float_out(&n)?;
    let b = &n.b;
    let x = n.tensor(0, "self")?;
    let x = b.convert(&x, opmath(out))?;
    let name =
        n.op.trim_start_matches("aten.")
            .trim_start_matches("prims.");
    let name = name
        .trim_start_matches("special_")
        .trim_end_matches(".default");
    let y = match name {
        "bessel_i0" | "i0" | "modified_bessel_i0" => i0(b, &x, true)?,
        "bessel_i0e" | "i0e" => i0(b, &x, false)?,
        "bessel_i1" | "i1" => i1_cephes(b, &x, true)?,
        "bessel_i1e" | "i1e" => i1_cephes(b, &x, false)?,
        "modified_bessel_i1" => modified_i1(b, &x)?,
        "bessel_j0" => j0(b, &x)?,
        "bessel_j1" => j1(b, &x)?,
        "bessel_y0" => y0(b, &x)?,
        "bessel_y1" => y1(b, &x)?,
        "modified_bessel_k0" => k0(b, &x, false)?,
        "modified_bessel_k1" => k1(b, &x, false)?,
        "scaled_modified_bessel_k0" => k0(b, &x, true)?,
        "scaled_modified_bessel_k1" => k1(b, &x, true)?,
        "spherical_bessel_j0" => spherical_j0(b, &x)?,
        "airy_ai" => airy_ai(b, &x)?,
        _ => return Err(format!("no Bessel rule for {}", n.op)),
    };
    Ok(vec![b.convert(&y, out)?])
}

/// `T(a) / T(c)` as the kernels write constants: both rounded to x's dtype, divided there.
fn ratio(x: &Val<'_>, a: f64, c: f64) -> f64 {
    if x.dtype() == DType::F64 {
        a / c
    } else {
        (a as f32 / c as f32) as f64
    }
}

/// The Chebyshev argument of the [0, 8] tables, `|x| / 2 - 2`, and of the [8, inf) ones,
/// `32 / |x| - 2`, with the mask of the first range.
fn i_args<'a>(o: &Ops<'_, 'a>, ax: &Val<'a>) -> R<(Val<'a>, Val<'a>, Val<'a>)> {
    let b = o.b;
    let near = o.cmp_f(ax, 8.0, "LE")?;
    let small = b.add_scalar(&b.div(ax, &o.c(2.0)?)?, -2.0)?;
    let large = b.add_scalar(&b.div(&o.c(32.0)?, ax)?, -2.0)?;
    Ok((near, small, large))
}

/// I0 (`scaled`: times exp(|x|), as `i0`/`modified_bessel_i0`; else `i0e`).
pub(in crate::lower) fn i0<'a>(b: &Builder<'a>, x: &Val<'a>, unscaled: bool) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let ax = b.unary("abs", x)?;
    let (near, ys, yl) = i_args(&o, &ax)?;
    let e = b.unary("exponential", &ax)?;
    let (small, large) = (chbevl(b, &ys, &I0_A)?, chbevl(b, &yl, &I0_B)?);
    let (small, large) = if unscaled {
        (b.mul(&e, &small)?, b.mul(&e, &large)?)
    } else {
        (small, large)
    };
    b.select(&near, &small, &b.div(&large, &b.unary("sqrt", &ax)?)?)
}

/// `calc_i1` / `calc_i1e`: the float kernels use only the tables' leading terms.
fn i1_cephes<'a>(b: &Builder<'a>, x: &Val<'a>, unscaled: bool) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let f32_tables = x.dtype() != DType::F64;
    let (ta, tb): (&[f64], &[f64]) = if f32_tables {
        (&I1_A[12..], &I1_B[18..])
    } else {
        (&I1_A, &I1_B)
    };
    let ax = b.unary("abs", x)?;
    let (near, ys, yl) = i_args(&o, &ax)?;
    let (ca, cb) = (chbevl(b, &ys, ta)?, chbevl(b, &yl, tb)?);
    let e = b.unary("exponential", &ax)?;
    let (small, large) = if unscaled {
        (b.mul(&b.mul(&e, &ax)?, &ca)?, b.mul(&e, &cb)?)
    } else {
        (b.mul(&ca, &ax)?, cb)
    };
    let y = b.select(&near, &small, &b.div(&large, &b.unary("sqrt", &ax)?)?)?;
    b.select(&o.cmp_f(x, 0.0, "LT")?, &b.unary("negate", &y)?, &y)
}

/// `modified_bessel_i1`: the full tables, multiplied in the kernel's order.
fn modified_i1<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let ax = b.unary("abs", x)?;
    let (near, ys, yl) = i_args(&o, &ax)?;
    let e = b.unary("exponential", &ax)?;
    let small = b.mul(&b.mul(&chbevl(b, &ys, &I1_A)?, &ax)?, &e)?;
    let large = b.div(&b.mul(&e, &chbevl(b, &yl, &I1_B)?)?, &b.unary("sqrt", &ax)?)?;
    let y = b.select(&near, &small, &large)?;
    b.select(&o.cmp_f(x, 0.0, "LT")?, &b.unary("negate", &y)?, &y)
}

/// The large-argument form of j0/j1/y0/y1: `(P cos(x - phase) ∓ 5/x Q sin(x - phase)) sqrt(2/π) /
/// sqrt(x)` (sine and cosine swapped and + for y), with `w` the kernel's 25/x² spelling.
fn asymptotic<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    order: u8,
    second_kind: bool,
) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let (pp, pq, qp, qq): (&[f64], &[f64], &[f64], &[f64]) = if order == 0 {
        (&PP0, &PQ0, &QP0, &QQ0)
    } else {
        (&PP1, &PQ1, &QP1, &QQ1)
    };
    let p = b.div(&polevl(b, w, pp)?, &polevl(b, w, pq)?)?;
    let q = b.mul(
        &b.div(&o.c(5.0)?, x)?,
        &b.div(&polevl(b, w, qp)?, &polevl(b, w, qq)?)?,
    )?;
    let phase = if order == 0 { std::f64::consts::FRAC_PI_4 } else { 3.0 * std::f64::consts::FRAC_PI_4 };
    let shifted = b.add_scalar(x, -phase)?;
    let (s, c) = (b.unary("sine", &shifted)?, b.unary("cosine", &shifted)?);
    let sum = if second_kind {
        b.add(&b.mul(&p, &s)?, &b.mul(&q, &c)?)?
    } else {
        b.sub(&b.mul(&p, &c)?, &b.mul(&q, &s)?)?
    };
    b.div(
        &b.mul_scalar(&sum, 0.797884560802865355879892119868763737)?,
        &b.unary("sqrt", x)?,
    )
}

/// 25/(x·x) (order 0) or (5/x)(5/x) (order 1), the two spellings the kernels use.
fn inv_square<'a>(o: &Ops<'_, 'a>, x: &Val<'a>, order: u8) -> R<Val<'a>> {
    let b = o.b;
    if order == 0 {
        b.div(&o.c(25.0)?, &b.mul(x, x)?)
    } else {
        let f = b.div(&o.c(5.0)?, x)?;
        b.mul(&f, &f)
    }
}

fn j0<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let ax = b.unary("abs", x)?;
    let z = b.mul(&ax, &ax)?;
    let tiny = b.sub(&o.c(1.0)?, &b.div(&z, &o.c(4.0)?)?)?;
    let roots = b.mul(
        &b.add_scalar(&z, -5.78318596294678452118e+00)?,
        &b.add_scalar(&z, -3.04712623436620863991e+01)?,
    )?;
    let small = b.div(
        &b.mul(&roots, &polevl(b, &z, &J0_RP)?)?,
        &polevl(b, &z, &J0_RQ)?,
    )?;
    let small = b.select(&o.cmp_f(&ax, 0.00001, "LT")?, &tiny, &small)?;
    let large = asymptotic(b, &ax, &inv_square(&o, &ax, 0)?, 0, false)?;
    b.select(&o.cmp_f(&ax, 5.0, "LE")?, &small, &large)
}

fn j1<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let ax = b.unary("abs", x)?;
    let z = b.mul(&ax, &ax)?;
    let small = b.mul(
        &b.div(&polevl(b, &z, &J1_RP)?, &polevl(b, &z, &J1_RQ)?)?,
        &ax,
    )?;
    let small = b.mul(
        &b.mul(&small, &b.add_scalar(&z, -1.46819706421238932572e+01)?)?,
        &b.add_scalar(&z, -4.92184563216946036703e+01)?,
    )?;
    let large = asymptotic(b, &ax, &inv_square(&o, &ax, 1)?, 1, false)?;
    let y = b.select(&o.cmp_f(&ax, 5.0, "LE")?, &small, &large)?;
    b.select(&o.cmp_f(x, 0.0, "LT")?, &b.unary("negate", &y)?, &y)
}

const TWO_OVER_PI: f64 = std::f64::consts::FRAC_2_PI;

/// y0/y1 below 5 are -inf at 0 and NaN for negative x.
fn y_domain<'a>(o: &Ops<'_, 'a>, x: &Val<'a>, y: &Val<'a>) -> R<Val<'a>> {
    let b = o.b;
    let y = b.select(&o.cmp_f(x, 0.0, "LT")?, &o.c(f64::NAN)?, y)?;
    b.select(&o.cmp_f(x, 0.0, "EQ")?, &o.c(f64::NEG_INFINITY)?, &y)
}

fn y0<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let z = b.mul(x, x)?;
    let rational = b.div(&polevl(b, &z, &Y0_YP)?, &polevl(b, &z, &Y0_YQ)?)?;
    let log_term = b.mul(&b.mul_scalar(&b.unary("log", x)?, TWO_OVER_PI)?, &j0(b, x)?)?;
    let small = y_domain(&o, x, &b.add(&rational, &log_term)?)?;
    let large = asymptotic(b, x, &inv_square(&o, x, 0)?, 0, true)?;
    b.select(&o.cmp_f(x, 5.0, "LE")?, &small, &large)
}

fn y1<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let z = b.mul(x, x)?;
    let rational = b.mul(x, &b.div(&polevl(b, &z, &Y1_YP)?, &polevl(b, &z, &Y1_YQ)?)?)?;
    let inner = b.sub(
        &b.mul(&j1(b, x)?, &b.unary("log", x)?)?,
        &b.div(&o.c(1.0)?, x)?,
    )?;
    let small = y_domain(
        &o,
        x,
        &b.add(&rational, &b.mul_scalar(&inner, TWO_OVER_PI)?)?,
    )?;
    let large = asymptotic(b, x, &inv_square(&o, x, 1)?, 1, true)?;
    b.select(&o.cmp_f(x, 5.0, "LE")?, &small, &large)
}

/// K0 (or exp(x) K0 when `scaled`); +inf at 0, NaN below.
fn k0<'a>(b: &Builder<'a>, x: &Val<'a>, scaled: bool) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let near = chbevl(b, &b.add_scalar(&b.mul(x, x)?, -2.0)?, &K0_A)?;
    let i0x = i0(b, x, true)?;
    let small = if scaled {
        let log = b.unary("log", &b.mul_scalar(x, 0.5)?)?;
        b.mul(
            &b.sub(&near, &b.mul(&log, &i0x)?)?,
            &b.unary("exponential", x)?,
        )?
    } else {
        // The kernel writes `log(0.5 * x)` with a double 0.5: this term is evaluated in double.
        let wide = |v: &Val<'a>| b.convert(v, DType::F64);
        let log = b.unary("log", &b.mul_scalar(&wide(x)?, 0.5)?)?;
        let d = b.sub(&wide(&near)?, &b.mul(&log, &wide(&i0x)?)?)?;
        b.convert(&d, x.dtype())?
    };
    let far = chbevl(b, &b.add_scalar(&b.div(&o.c(8.0)?, x)?, -2.0)?, &K0_B)?;
    let large = if scaled {
        b.div(&far, &b.unary("sqrt", x)?)?
    } else {
        let e = b.unary("exponential", &b.unary("negate", x)?)?;
        b.div(&b.mul(&e, &far)?, &b.unary("sqrt", x)?)?
    };
    k_domain(&o, x, &b.select(&o.cmp_f(x, 2.0, "LE")?, &small, &large)?)
}

fn k1<'a>(b: &Builder<'a>, x: &Val<'a>, scaled: bool) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let near = chbevl(b, &b.add_scalar(&b.mul(x, x)?, -2.0)?, &K1_A)?;
    let log = b.unary("log", &b.mul_scalar(x, 0.5)?)?;
    let small = b.add(&b.mul(&log, &modified_i1(b, x)?)?, &b.div(&near, x)?)?;
    let far = chbevl(b, &b.add_scalar(&b.div(&o.c(8.0)?, x)?, -2.0)?, &K1_B)?;
    let (small, large) = if scaled {
        (
            b.mul(&small, &b.unary("exponential", x)?)?,
            b.div(&far, &b.unary("sqrt", x)?)?,
        )
    } else {
        let e = b.unary("exponential", &b.unary("negate", x)?)?;
        (small, b.div(&b.mul(&e, &far)?, &b.unary("sqrt", x)?)?)
    };
    k_domain(&o, x, &b.select(&o.cmp_f(x, 2.0, "LE")?, &small, &large)?)
}

fn k_domain<'a>(o: &Ops<'_, 'a>, x: &Val<'a>, y: &Val<'a>) -> R<Val<'a>> {
    let b = o.b;
    let y = b.select(&o.cmp_f(x, 0.0, "LT")?, &o.c(f64::NAN)?, y)?;
    b.select(&o.cmp_f(x, 0.0, "EQ")?, &o.c(f64::INFINITY)?, &y)
}

/// sin(x)/x, by its Taylor polynomial below 1/2 and 0 at ±inf.
fn spherical_j0<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: x.clone() };
    let z = b.mul(x, x)?;
    let terms = [
        (-1.0, 6.0),
        (1.0, 120.0),
        (-1.0, 5040.0),
        (1.0, 362880.0),
        (-1.0, 39916800.0),
        (1.0, 6227020800.0),
    ];
    let (a, c) = terms[5];
    let mut acc = o.c(ratio(x, a, c))?;
    for &(a, c) in terms[..5].iter().rev() {
        acc = b.add_scalar(&b.mul(&z, &acc)?, ratio(x, a, c))?;
    }
    let taylor = b.add_scalar(&b.mul(&z, &acc)?, 1.0)?;
    let y = b.select(
        &o.cmp_f(&b.unary("abs", x)?, 0.5, "LT")?,
        &taylor,
        &b.div(&b.unary("sine", x)?, x)?,
    )?;
    let inf = o.cmp_f(&b.unary("abs", x)?, f64::INFINITY, "EQ")?;
    b.select(&inf, &o.c(0.0)?, &y)
}

/// Ai(x): asymptotic forms beyond ±2.09, the Maclaurin series (a while loop to machine
/// epsilon) between.
fn airy_ai<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    const C: f64 = 5.64189583547756286948e-01;
    let o = Ops { b, like: x.clone() };
    let f64_ = x.dtype() == DType::F64;
    let third = |v: &Val<'a>| b.div(v, &o.c(3.0)?);
    // x < -2.09
    let nx = b.unary("negate", x)?;
    let zeta_neg = third(&b.mul(&b.mul_scalar(x, -2.0)?, &b.unary("sqrt", &nx)?)?)?;
    let z = b.div(&o.c(1.0)?, &zeta_neg)?;
    let zz = b.mul(&z, &z)?;
    let quarter_pi = if f64_ {
        0.25 * std::f64::consts::PI
    } else {
        (0.25f32 * std::f32::consts::PI) as f64
    };
    let t = b.add_scalar(&zeta_neg, quarter_pi)?;
    let f = b.div(
        &b.mul(&zz, &polevl(b, &zz, &AIRY_AFN)?)?,
        &polevl(b, &zz, &AIRY_AFD)?,
    )?;
    let g = b.div(
        &b.mul(&z, &polevl(b, &zz, &AIRY_AGN)?)?,
        &polevl(b, &zz, &AIRY_AGD)?,
    )?;
    let osc = b.sub(
        &b.mul(&b.unary("sine", &t)?, &b.add_scalar(&f, 1.0)?)?,
        &b.mul(&b.unary("cosine", &t)?, &g)?,
    )?;
    let negative = b.mul(
        &b.div(&o.c(C)?, &b.unary("sqrt", &b.unary("sqrt", &nx)?)?)?,
        &osc,
    )?;
    // x >= 2.09
    let zeta = third(&b.mul(&b.mul_scalar(x, 2.0)?, &b.unary("sqrt", x)?)?)?;
    let w = b.div(&o.c(1.0)?, &zeta)?;
    let ratio_an = b.div(&polevl(b, &w, &AIRY_AN)?, &polevl(b, &w, &AIRY_AD)?)?;
    let denom = b.mul(
        &b.mul_scalar(&b.unary("sqrt", &b.unary("sqrt", x)?)?, 2.0)?,
        &b.unary("exponential", &zeta)?,
    )?;
    let positive = b.div(&b.mul_scalar(&ratio_an, C)?, &denom)?;
    // |x| < 2.09
    let series_region = b.binary("and", &o.cmp_f(x, -2.09, "GE")?, &o.cmp_f(x, 2.09, "LT")?)?;
    let series = airy_series(&o, x, &series_region)?;
    let mut y = b.select(&o.cmp_f(x, 2.09, "GE")?, &positive, &series)?;
    y = b.select(&o.cmp_f(x, -2.09, "LT")?, &negative, &y)?;
    y = b.select(&o.cmp_f(x, 103.892, "GT")?, &o.c(0.0)?, &y)?;
    let inf = o.cmp_f(&b.unary("abs", x)?, f64::INFINITY, "EQ")?;
    b.select(&inf, &o.c(f64::NAN)?, &y)
}

/// `c1 f(x) - c2 g(x)` with the Maclaurin series f, g summed until a term of f is below
/// epsilon relative to f; only `region` elements iterate.
fn airy_series<'a>(o: &Ops<'_, 'a>, x: &Val<'a>, region: &Val<'a>) -> R<Val<'a>> {
    let b = o.b;
    let eps = if x.dtype() == DType::F64 {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    };
    let z = b.mul(&b.mul(x, x)?, x)?;
    let one = o.c(1.0)?;
    let init = [
        z,
        one.clone(),
        one.clone(),
        x.clone(),
        one.clone(),
        x.clone(),
        one,
    ];
    let state = iterate(b, &init, &b.unary("not", region)?, i64::MAX, |b, s| {
        let (z, k, m, n, f, g) = (&s[0], &s[1], &s[2], &s[3], &s[4], &s[5]);
        let k1 = b.add_scalar(k, 1.0)?;
        let m1 = b.div(&b.mul(m, z)?, &k1)?;
        let k2 = b.add_scalar(&k1, 1.0)?;
        let n1 = b.div(&b.mul(n, z)?, &k2)?;
        let m1 = b.div(&m1, &k2)?;
        let f1 = b.add(f, &m1)?;
        let k3 = b.add_scalar(&k2, 1.0)?;
        let n1 = b.div(&n1, &k3)?;
        let g1 = b.add(g, &n1)?;
        let t1 = b.unary("abs", &b.div(&m1, &f1)?)?;
        let more = b.compare(&t1, &b.full_like(Scalar::Float(eps), &t1)?, "GT")?;
        Ok((
            vec![z.clone(), k3, m1, n1, f1, g1, t1],
            b.unary("not", &more)?,
        ))
    })?;
    b.sub(
        &b.mul_scalar(&state[4], 0.355028053887817239260)?,
        &b.mul_scalar(&state[5], 0.258819403792806798405)?,
    )
}
