//! Regularized incomplete gamma functions `igamma(a, x)` (lower, P) and `igammac(a, x)`
//! (upper, Q) as PyTorch's `calc_igamma`/`calc_igammac` (after SciPy/Cephes): a uniform
//! asymptotic expansion where a is large and x ≈ a, else the power series of P or of Q, or the
//! continued fraction of Q, each a loop to machine epsilon. Where the kernel mixes in double
//! literals the same sub-expressions are evaluated in double here.

use super::super::builder::{opmath, Builder, IndexMap, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use super::cephes::{IGAM_D, LANCZOS_DENOM, LANCZOS_NUM};
use super::{float_out, iterate, polevl, Ops};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "prims.igamma.default",
            "aten.igamma.default",
            "prims.igammac.default",
            "aten.igammac.default",
        ],
        rule,
    );
}

fn rule(n: NodeCtx<'_>) -> Res<'_> {
    let out = float_out(&n)?;
    let b = &n.b;
    let v = b.coerce(
        &[&n.operand(0, "self")?, &n.operand(1, "other")?],
        opmath(out),
    )?;
    let y = incomplete_gamma(b, &v[0], &v[1], n.op.contains("igammac"))?;
    Ok(vec![b.convert(&y, out)?])
}

/// Per-dtype constants of the kernels: (MACHEP, MAXLOG, BIG, BIGINV).
fn limits(d: DType) -> (f64, f64, f64, f64) {
    if d == DType::F64 {
        (
            1.11022302462515654042E-16,
            7.09782712893383996843E2,
            4.503599627370496e15,
            2.22044604925031308085e-16,
        )
    } else {
        (
            5.9604644775390625E-8,
            88.72283905206835f32 as f64,
            16777216.,
            5.9604644775390625E-8,
        )
    }
}

const LANCZOS_G: f64 = 6.024680040776729583740234375;

fn wide<'a>(b: &Builder<'a>, v: &Val<'a>) -> R<Val<'a>> {
    b.convert(v, DType::F64)
}

fn incomplete_gamma<'a>(b: &Builder<'a>, a: &Val<'a>, x: &Val<'a>, upper: bool) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let and = |p: &Val<'a>, q: &Val<'a>| b.binary("and", p, q);
    let not = |p: &Val<'a>| b.unary("not", p);
    let finite = |v: &Val<'a>| o.cmp_f(&b.unary("abs", v)?, f64::INFINITY, "LT");
    let inf = |v: &Val<'a>| o.cmp_f(&b.unary("abs", v)?, f64::INFINITY, "EQ");
    let regular = and(
        &and(&o.cmp_f(a, 0.0, "GT")?, &o.cmp_f(x, 0.0, "GT")?)?,
        &and(&finite(a)?, &finite(x)?)?,
    )?;
    let absxma = b.div(&b.unary("abs", &b.sub(x, a)?)?, a)?;
    let mid = and(
        &and(&o.cmp_f(a, 20.0, "GT")?, &o.cmp_f(a, 200.0, "LT")?)?,
        &o.cmp_f(&absxma, 0.3, "LT")?,
    )?;
    let large = and(
        &o.cmp_f(a, 200.0, "GT")?,
        &b.compare(&absxma, &b.div(&o.c(4.5)?, &b.unary("sqrt", a)?)?, "LT")?,
    )?;
    let asym_region = and(&regular, &b.binary("or", &mid, &large)?)?;
    let rest = and(&regular, &not(&asym_region)?)?;
    // Q's branches on the rest (x > 1.1 etc. compare with double literals).
    let (xd, ad) = (wide(b, x)?, wide(b, a)?);
    let dconst = |v: f64| b.full_like(Scalar::Float(v), &xd);
    let above = b.compare(&xd, &dconst(1.1)?, "GT")?;
    let low = o.cmp_f(x, 0.5, "LE")?;
    let log_ratio = b.div(&dconst(-0.4)?, &wide(b, &b.unary("log", x)?)?)?;
    let p_series_low = b.compare(&log_ratio, &ad, "LT")?;
    let p_series_mid = b.compare(&b.mul(&xd, &dconst(1.1)?)?, &ad, "LT")?;
    let q_p_series = b.select(
        &above,
        &b.compare(x, a, "LT")?,
        &b.select(&low, &p_series_low, &p_series_mid)?,
    )?;
    let q_fraction = and(&above, &not(&b.compare(x, a, "LT")?)?)?;
    let q_q_series = and(&not(&above)?, &not(&q_p_series)?)?;
    // P takes 1 - Q where x > 1 and x > a, Q's branch there being the fraction or Q's series.
    let p_from_q = and(&o.cmp_f(x, 1.0, "GT")?, &b.compare(x, a, "GT")?)?;
    let (use_p, use_fraction, use_q) = if upper {
        (q_p_series, q_fraction, q_q_series)
    } else {
        (
            not(&p_from_q)?,
            and(&p_from_q, &q_fraction)?,
            and(&p_from_q, &not(&q_fraction)?)?,
        )
    };
    let one = o.c(1.0)?;
    let ax = prefactor(b, a, x)?;
    let p = p_series(b, a, x, &ax, &not(&and(&rest, &use_p)?)?)?;
    let cf = q_fraction_eval(b, a, x, &ax, &not(&and(&rest, &use_fraction)?)?)?;
    let qs = q_series(b, a, x, &not(&and(&rest, &use_q)?)?)?;
    let asym = asymptotic(b, a, x, !upper, &not(&asym_region)?)?;
    // Each branch gives its own function or the complement.
    let (p, cf, qs) = if upper {
        (b.sub(&one, &p)?, cf, qs)
    } else {
        (p, b.sub(&one, &cf)?, b.sub(&one, &qs)?)
    };
    let mut r = b.select(&use_p, &p, &b.select(&use_fraction, &cf, &qs)?)?;
    r = b.select(&asym_region, &asym, &r)?;
    let nan = o.c(f64::NAN)?;
    let any_nan = b.binary("or", &b.compare(a, a, "NE")?, &b.compare(x, x, "NE")?)?;
    r = b.select(&any_nan, &nan, &r)?;
    // Boundaries, lowest precedence first: x = inf, a = inf, x = 0, a = 0, negatives.
    let (at_x_inf, at_x_zero) = if upper { (0.0, 1.0) } else { (1.0, 0.0) };
    r = b.select(&inf(x)?, &o.c(at_x_inf)?, &r)?;
    let a_inf = b.select(&inf(x)?, &nan, &o.c(at_x_zero)?)?;
    r = b.select(&inf(a)?, &a_inf, &r)?;
    r = b.select(&o.cmp_f(x, 0.0, "EQ")?, &o.c(at_x_zero)?, &r)?;
    let a_zero = b.select(&o.cmp_f(x, 0.0, "GT")?, &o.c(at_x_inf)?, &nan)?;
    r = b.select(&o.cmp_f(a, 0.0, "EQ")?, &a_zero, &r)?;
    let negative = b.binary("or", &o.cmp_f(x, 0.0, "LT")?, &o.cmp_f(a, 0.0, "LT")?)?;
    b.select(&negative, &nan, &r)
}

/// `ratevl` of the scaled Lanczos sum: the rational function in a, or in 1/a (coefficients
/// reversed) for |a| > 1.
fn lanczos_sum<'a>(o: &Ops<'_, 'a>, a: &Val<'a>) -> R<Val<'a>> {
    let b = o.b;
    let forward = b.div(&polevl(b, a, &LANCZOS_NUM)?, &polevl(b, a, &LANCZOS_DENOM)?)?;
    let rev = |t: &[f64]| t.iter().rev().copied().collect::<Vec<_>>();
    let inv = b.div(&o.c(1.0)?, a)?;
    let backward = b.div(
        &polevl(b, &inv, &rev(&LANCZOS_NUM))?,
        &polevl(b, &inv, &rev(&LANCZOS_DENOM))?,
    )?;
    b.select(
        &o.cmp_f(&b.unary("abs", a)?, 1.0, "GT")?,
        &backward,
        &forward,
    )
}

/// `_igam_helper_fac`: x^a e^-x / Γ(a), directly when x is far from a, else through Lanczos.
fn prefactor<'a>(b: &Builder<'a>, a: &Val<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let (_, maxlog, _, _) = limits(a.dtype());
    let far = b.compare(
        &wide(b, &b.unary("abs", &b.sub(a, x)?)?)?,
        &b.mul_scalar(&wide(b, &b.unary("abs", a)?)?, 0.4)?,
        "GT",
    )?;
    let lgam = b.op("chlo.lgamma", &[a], &[], a.ty.clone())?;
    let ax = b.sub(&b.sub(&b.mul(a, &b.unary("log", x)?)?, x)?, &lgam)?;
    let direct = b.select(
        &o.cmp_f(&ax, -maxlog, "LT")?,
        &o.c(0.0)?,
        &b.unary("exponential", &ax)?,
    )?;
    let fac = b.add_scalar(&b.add_scalar(a, LANCZOS_G)?, -0.5)?;
    let res = b.div(
        &b.unary("sqrt", &b.div(&fac, &o.c(std::f64::consts::E)?)?)?,
        &lanczos_sum(&o, a)?,
    )?;
    let near = b.mul(
        &b.unary("exponential", &b.sub(a, x)?)?,
        &b.binary("power", &b.div(x, &fac)?, a)?,
    )?;
    let small = b.mul(&res, &near)?;
    let num = b.add_scalar(&b.add_scalar(&b.sub(x, a)?, -LANCZOS_G)?, 0.5)?;
    let numfac = b.div(&num, &fac)?;
    let t1 = b.mul(a, &b.sub(&b.unary("log_plus_one", &numfac)?, &numfac)?)?;
    let g = o.c(LANCZOS_G)?;
    let half_minus_g = b.sub(
        &b.full_like(Scalar::Float(0.5), &wide(b, &g)?)?,
        &wide(b, &g)?,
    )?;
    let t2 = b.div(&b.mul(&wide(b, x)?, &half_minus_g)?, &wide(b, &fac)?)?;
    let e = b.unary("exponential", &b.add(&wide(b, &t1)?, &t2)?)?;
    let big = b.convert(&b.mul(&wide(b, &res)?, &e)?, a.dtype())?;
    let both_small = b.binary("and", &o.cmp_f(a, 200.0, "LT")?, &o.cmp_f(x, 200.0, "LT")?)?;
    b.select(&far, &direct, &b.select(&both_small, &small, &big)?)
}

/// `_igam_helper_series`: P(a, x) by its power series.
/// `ax` is `prefactor(a, x)`.
fn p_series<'a>(
    b: &Builder<'a>,
    a: &Val<'a>,
    x: &Val<'a>,
    ax: &Val<'a>,
    skip: &Val<'a>,
) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let zero = o.cmp_f(ax, 0.0, "EQ")?;
    let one = o.c(1.0)?;
    let s = iterate(
        b,
        &[a.clone(), x.clone(), a.clone(), one.clone(), one],
        &b.binary("or", skip, &zero)?,
        2000,
        |b, s| {
            let (a, x, r, c, ans) = (&s[0], &s[1], &s[2], &s[3], &s[4]);
            let r = b.add_scalar(r, 1.0)?;
            let c = b.mul(c, &b.div(x, &r)?)?;
            let ans = b.add(ans, &c)?;
            let (machep, ..) = limits(a.dtype());
            let stop = b.compare(&c, &b.mul_scalar(&ans, machep)?, "LE")?;
            Ok((vec![a.clone(), x.clone(), r, c, ans], stop))
        },
    )?;
    let p = b.div(&b.mul(&s[4], ax)?, a)?;
    b.select(&zero, &o.c(0.0)?, &p)
}

/// `_igamc_helper_series`: Q(a, x) for small x by the series of γ*.
fn q_series<'a>(b: &Builder<'a>, a: &Val<'a>, x: &Val<'a>, skip: &Val<'a>) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let s = iterate(
        b,
        &[a.clone(), x.clone(), o.c(0.0)?, o.c(1.0)?, o.c(0.0)?],
        skip,
        1999,
        |b, s| {
            let (a, x, n, fac, sum) = (&s[0], &s[1], &s[2], &s[3], &s[4]);
            let n = b.add_scalar(n, 1.0)?;
            let fac = b.mul(fac, &b.div(&b.unary("negate", x)?, &n)?)?;
            let term = b.div(&fac, &b.add(a, &n)?)?;
            let sum = b.add(sum, &term)?;
            let (machep, ..) = limits(a.dtype());
            let limit = b.mul_scalar(&b.unary("abs", &sum)?, machep)?;
            let stop = b.compare(&b.unary("abs", &term)?, &limit, "LE")?;
            Ok((vec![a.clone(), x.clone(), n, fac, sum], stop))
        },
    )?;
    let lgam = |v: &Val<'a>| b.op("chlo.lgamma", &[v], &[], v.ty.clone());
    let alogx = b.mul(a, &b.unary("log", x)?)?;
    let head = b.unary(
        "negate",
        &b.unary(
            "exponential_minus_one",
            &b.sub(&alogx, &lgam(&b.add_scalar(a, 1.0)?)?)?,
        )?,
    )?;
    let scale = b.unary("exponential", &b.sub(&alogx, &lgam(a)?)?)?;
    b.sub(&head, &b.mul(&scale, &s[4])?)
}

/// `_igamc_helper_continued_fraction`: Q(a, x) for x > a by Legendre's continued fraction,
/// rescaling the convergents when they grow past BIG.
fn q_fraction_eval<'a>(
    b: &Builder<'a>,
    a: &Val<'a>,
    x: &Val<'a>,
    ax: &Val<'a>,
    skip: &Val<'a>,
) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let zero = o.cmp_f(ax, 0.0, "EQ")?;
    let y = b.sub(&o.c(1.0)?, a)?;
    let z = b.add_scalar(&b.add(x, &y)?, 1.0)?;
    let pkm1 = b.add_scalar(x, 1.0)?;
    let qkm1 = b.mul(&z, x)?;
    let ans = b.div(&pkm1, &qkm1)?;
    let state = [o.c(0.0)?, y, z, pkm1, o.c(1.0)?, qkm1, x.clone(), ans];
    let s = iterate(b, &state, &b.binary("or", skip, &zero)?, 2000, |b, s| {
        let (machep, _, big, biginv) = limits(s[0].dtype());
        let c = b.add_scalar(&s[0], 1.0)?;
        let y = b.add_scalar(&s[1], 1.0)?;
        let z = b.add_scalar(&s[2], 2.0)?;
        let (pkm1, pkm2, qkm1, qkm2, ans) = (&s[3], &s[4], &s[5], &s[6], &s[7]);
        let yc = b.mul(&y, &c)?;
        let pk = b.sub(&b.mul(pkm1, &z)?, &b.mul(pkm2, &yc)?)?;
        let qk = b.sub(&b.mul(qkm1, &z)?, &b.mul(qkm2, &yc)?)?;
        let zero = b.full_like(Scalar::Float(0.0), &qk)?;
        let nonzero = b.compare(&qk, &zero, "NE")?;
        let r = b.div(&pk, &qk)?;
        let t = b.unary("abs", &b.div(&b.sub(ans, &r)?, &r)?)?;
        let t = b.select(&nonzero, &t, &b.full_like(Scalar::Float(1.0), &t)?)?;
        let ans = b.select(&nonzero, &r, ans)?;
        let grown = b.compare(
            &b.unary("abs", &pk)?,
            &b.full_like(Scalar::Float(big), &pk)?,
            "GT",
        )?;
        let mut next = vec![c, y, z];
        for v in [&pk, pkm1, &qk, qkm1] {
            next.push(b.select(&grown, &b.mul_scalar(v, biginv)?, v)?);
        }
        next.push(ans);
        let stop = b.compare(&t, &b.full_like(Scalar::Float(machep), &t)?, "LE")?;
        Ok((next, stop))
    })?;
    b.select(&zero, &o.c(0.0)?, &b.mul(&s[7], ax)?)
}

/// `_igam_helper_asymptotic_series` (DLMF 8.12.3/8.12.4): erfc of the scaled η plus the
/// series Σ c_k(η) a^-k, each c_k a truncated power series in η. The 25 c_k are evaluated side
/// by side along a trailing axis.
fn asymptotic<'a>(
    b: &Builder<'a>,
    a: &Val<'a>,
    x: &Val<'a>,
    lower: bool,
    skip: &Val<'a>,
) -> R<Val<'a>> {
    let o = Ops { b, like: a.clone() };
    let (machep, ..) = limits(a.dtype());
    let dt = a.dtype();
    let lambda = b.div(x, a)?;
    let sigma = b.div(&b.sub(x, a)?, a)?;
    let root = b.unary(
        "sqrt",
        &b.mul_scalar(&b.sub(&b.unary("log_plus_one", &sigma)?, &sigma)?, -2.0)?,
    )?;
    let mut eta = b.select(
        &o.cmp_f(&lambda, 1.0, "LT")?,
        &b.unary("negate", &root)?,
        &o.c(0.0)?,
    )?;
    eta = b.select(&o.cmp_f(&lambda, 1.0, "GT")?, &root, &eta)?;
    // Elements outside the region get a harmless η = 0.
    eta = b.select(skip, &o.c(0.0)?, &eta)?;
    let sgn = if lower { -1.0 } else { 1.0 };
    let arg = b.mul(
        &b.mul_scalar(&eta, sgn)?,
        &b.unary("sqrt", &b.div(a, &o.c(2.0)?)?)?,
    )?;
    let res = b.mul_scalar(&b.op("chlo.erfc", &[&arg], &[], arg.ty.clone())?, 0.5)?;
    // c_k for all k at once along a trailing axis of 25, one power of η per loop step.
    let rank = a.rank();
    let mut wide_shape = a.shape().to_vec();
    wide_shape.push(25);
    let lead: Vec<usize> = (0..rank).collect();
    let eta_w = b.broadcast_in_dim(&eta, &wide_shape, &lead)?;
    // Column n of the table (c_k's η^n coefficient for every k) is row n of its transpose.
    let transposed: Vec<f64> = (0..25)
        .flat_map(|n| IGAM_D.iter().map(move |row| row[n]))
        .collect();
    let zero_i = b.scalar(Scalar::Int(0), DType::I64)?;
    let ck0 = igam_column(b, &zero_i, &transposed, dt, &wide_shape)?;
    let open = b.compare(&ck0, &ck0, "EQ")?;
    let one_i = b.scalar(Scalar::Int(1), DType::I64)?;
    let inner = b.while_loop(
        &[&one_i, &eta_w, &eta_w, &ck0, &open],
        |b, s| b.compare(&s[0], &b.full_like(Scalar::Int(25), &s[0])?, "LT"),
        |b, s| {
            let (n, eta, pow, ck, open) = (&s[0], &s[1], &s[2], &s[3], &s[4]);
            let term = b.mul(&igam_column(&b, n, &transposed, dt, &wide_shape)?, pow)?;
            let next = b.add(ck, &term)?;
            let tiny = b.compare(
                &b.unary("abs", &term)?,
                &b.mul_scalar(&b.unary("abs", &next)?, machep)?,
                "LT",
            )?;
            Ok(vec![
                b.binary("add", n, &b.full_like(Scalar::Int(1), n)?)?,
                eta.clone(),
                b.mul(eta, pow)?,
                b.select(open, &next, ck)?,
                b.binary("and", open, &b.unary("not", &tiny)?)?,
            ])
        },
    )?;
    // Σ c_k a^-k, stopping when a term grows or becomes negligible.
    let live = b.unary("not", skip)?;
    let outer = b.while_loop(
        &[
            &zero_i,
            &inner[3],
            a,
            &o.c(0.0)?,
            &o.c(1.0)?,
            &o.c(f64::INFINITY)?,
            &live,
        ],
        |b, s| b.compare(&s[0], &b.full_like(Scalar::Int(25), &s[0])?, "LT"),
        |b, s| {
            let (k, ck, a, sum, afac, old, live) =
                (&s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6]);
            let mut slice = a.shape().to_vec();
            slice.push(1);
            let map = IndexMap {
                window_dims: (0..rank as i64).collect(),
                collapsed: vec![rank as i64],
                index_to_operand: vec![rank as i64],
                index_vector_dim: 0,
            };
            let c = b.gather(ck, &b.reshape(k, &[1])?, &map, &slice, a.shape().to_vec())?;
            let term = b.mul(&c, afac)?;
            let abs = b.unary("abs", &term)?;
            let grew = b.compare(&abs, old, "GT")?;
            let live = b.binary("and", live, &b.unary("not", &grew)?)?;
            let next = b.add(sum, &term)?;
            let sum = b.select(&live, &next, sum)?;
            let tiny = b.compare(&abs, &b.mul_scalar(&b.unary("abs", &next)?, machep)?, "LT")?;
            Ok(vec![
                b.binary("add", k, &b.full_like(Scalar::Int(1), k)?)?,
                ck.clone(),
                a.clone(),
                sum,
                b.div(afac, a)?,
                abs,
                b.binary("and", &live, &b.unary("not", &tiny)?)?,
            ])
        },
    )?;
    let sum = outer[3].clone();
    // res + sgn exp(-a η²/2) sum / sqrt(2π a), in double as the kernel's literals make it.
    let two_pi = (2.0f32 * std::f32::consts::PI) as f64;
    let (ad, ed) = (wide(b, a)?, wide(b, &eta)?);
    let e = b.unary(
        "exponential",
        &b.mul(&b.mul(&b.mul_scalar(&ad, -0.5)?, &ed)?, &ed)?,
    )?;
    let num = b.mul(&b.mul_scalar(&e, sgn)?, &wide(b, &sum)?)?;
    let den = wide(b, &b.unary("sqrt", &b.mul_scalar(a, two_pi)?)?)?;
    b.convert(&b.add(&wide(b, &res)?, &b.div(&num, &den)?)?, dt)
}

/// Row `n` of the transposed table (the η^n coefficient of every c_k), spread over `shape`
/// along its last axis.
fn igam_column<'x>(
    b: &Builder<'x>,
    n: &Val<'x>,
    transposed: &[f64],
    dt: DType,
    shape: &[i64],
) -> R<Val<'x>> {
    let start = b.mul(n, &b.full_like(Scalar::Int(25), n)?)?;
    let map = IndexMap {
        window_dims: vec![0],
        collapsed: vec![],
        index_to_operand: vec![0],
        index_vector_dim: 0,
    };
    let row = b.gather(
        &b.table(transposed, dt)?,
        &b.reshape(&start, &[1])?,
        &map,
        &[25],
        vec![25],
    )?;
    b.broadcast_in_dim(&row, shape, &[shape.len() - 1])
}
