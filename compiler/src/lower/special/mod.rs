//! Special functions computed as PyTorch's own CPU kernels compute them (ATen/native/Math.h):
//! same branches, same Cephes coefficient tables, same working precision, so results agree with
//! eager to float ulps rather than to an approximation's accuracy.

// Coefficients are written digit for digit as their sources publish them, so they can be checked
// against those sources; the f64 they round to is the same.
#![allow(clippy::excessive_precision)]

mod bessel;
// Tables keep several coefficients a line.
#[rustfmt::skip]
mod cephes;
mod erfcx_table;
mod error;
mod frexp;
mod gamma;
mod igamma;
mod polynomial;

pub(super) use bessel::i0;

use super::builder::{opmath, Builder, Combiner, Scalar, Val, R};
use super::{NodeCtx, Registry};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    bessel::register(r);
    error::register(r);
    frexp::register(r);
    gamma::register(r);
    igamma::register(r);
    polynomial::register(r);
}

/// The result dtype of a rule that only computes in floating point.
pub(super) fn float_out(n: &NodeCtx<'_>) -> R<DType> {
    let out = n.out_dtype()?;
    if !opmath(out).is_float() {
        return Err(format!(
            "{}: needs a float result, got {}",
            n.op,
            out.name()
        ));
    }
    Ok(out)
}


/// Small helpers over one shape and dtype.
pub struct Ops<'b, 'a> {
    pub b: &'b Builder<'a>,
    pub like: Val<'a>,
}

impl<'a> Ops<'_, 'a> {
    pub fn c(&self, v: f64) -> R<Val<'a>> {
        self.b.full_like(Scalar::Float(v), &self.like)
    }
    pub fn ci(&self, v: i64, n: &Val<'a>) -> R<Val<'a>> {
        self.b.full_like(Scalar::Int(v), n)
    }
    pub fn cmp_i(&self, n: &Val<'a>, v: i64, dir: &str) -> R<Val<'a>> {
        self.b.compare(n, &self.ci(v, n)?, dir)
    }
    pub fn cmp_f(&self, x: &Val<'a>, v: f64, dir: &str) -> R<Val<'a>> {
        self.b.compare(x, &self.c(v)?, dir)
    }
    /// An i64 expression in n, then converted (the kernels' int arithmetic before the cast).
    pub fn f(&self, n: &Val<'a>) -> R<Val<'a>> {
        self.b.convert(n, self.like.dtype())
    }
    /// `n * a + c` computed in i64, as a float.
    pub fn lin(&self, n: &Val<'a>, a: i64, c: i64) -> R<Val<'a>> {
        let b = self.b;
        let m = b.binary("multiply", n, &self.ci(a, n)?)?;
        self.f(&b.binary("add", &m, &self.ci(c, n)?)?)
    }
    /// `v` for even n, `-v` for odd n (n ≥ 0).
    pub fn parity(&self, n: &Val<'a>, v: &Val<'a>) -> R<Val<'a>> {
        let b = self.b;
        let odd = self.cmp_i(&b.binary("remainder", n, &self.ci(2, n)?)?, 0, "NE")?;
        b.select(&odd, &b.unary("negate", v)?, v)
    }
}

/// Cephes' `polevl`: Horner's rule over `coefs`, highest power first, constants rounded to x's
/// dtype as the kernels' `static const T` tables are.
pub fn polevl<'a>(b: &Builder<'a>, x: &Val<'a>, coefs: &[f64]) -> R<Val<'a>> {
    let mut acc = b.full_like(Scalar::Float(coefs[0]), x)?;
    for &c in &coefs[1..] {
        acc = b.add_scalar(&b.mul(&acc, x)?, c)?;
    }
    Ok(acc)
}

/// Cephes' `chbevl`: the Chebyshev series `coefs` (highest order first) at `x`, by Clenshaw's
/// recurrence.
pub fn chbevl<'a>(b: &Builder<'a>, x: &Val<'a>, coefs: &[f64]) -> R<Val<'a>> {
    let mut b0 = b.full_like(Scalar::Float(coefs[0]), x)?;
    let mut b1 = b.full_like(Scalar::Float(0.0), x)?;
    let mut b2 = b1.clone();
    for &c in &coefs[1..] {
        b2 = b1;
        b1 = b0;
        b0 = b.add_scalar(&b.sub(&b.mul(x, &b1)?, &b2)?, c)?;
    }
    b.mul_scalar(&b.sub(&b0, &b2)?, 0.5)
}

/// Runs `step` per element as a kernel's `for (i = 0; i < max_iter; i++) { ...; if (..) break; }`
/// would: `step` maps the state (same types out, constants passed through) to the next state
/// and where to stop after this step; elements start finished where `done` is set, and each
/// stops at its own break. Returns the final state.
pub fn iterate<'a, F>(
    b: &Builder<'a>,
    state: &[Val<'a>],
    done: &Val<'a>,
    max_iter: i64,
    step: F,
) -> R<Vec<Val<'a>>>
where
    F: for<'x> FnOnce(&Builder<'x>, &[Val<'x>]) -> R<(Vec<Val<'x>>, Val<'x>)>,
{
    let dims: Vec<usize> = (0..done.rank()).collect();
    let i0 = b.scalar(Scalar::Int(0), crate::ir::DType::I64)?;
    let mut init = vec![&i0, done];
    init.extend(state.iter());
    let out = b.while_loop(
        &init,
        |b, s| {
            let more = b.reduce(&b.unary("not", &s[1])?, &dims, Combiner::Or, false)?;
            let below = b.compare(&s[0], &b.full_like(Scalar::Int(max_iter), &s[0])?, "LT")?;
            b.binary("and", &more, &below)
        },
        |b, s| {
            let (i, done) = (&s[0], &s[1]);
            let (next, stop) = step(&b, &s[2..])?;
            let mut out = vec![
                b.binary("add", i, &b.full_like(Scalar::Int(1), i)?)?,
                b.binary("or", done, &stop)?,
            ];
            for (n, o) in next.iter().zip(&s[2..]) {
                out.push(b.select(done, o, n)?);
            }
            Ok(out)
        },
    )?;
    Ok(out[2..].to_vec())
}
