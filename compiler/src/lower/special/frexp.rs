//! `frexp(x)`: mantissa in [0.5, 1) with x's sign and an int32 exponent, read off the float's
//! bits as C's `frexp` does (subnormals first scaled into the normal range; ±0, ±inf and NaN
//! give themselves and exponent 0).

use super::super::builder::{Builder, Scalar, Val, R};
use super::super::{NodeCtx, Registry, Res};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    r.add(&["prims.frexp.default", "aten.frexp.Tensor"], frexp_rule);
}

fn frexp_rule(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    if !x.dtype().is_float() {
        return Err(format!(
            "frexp: needs a float tensor, got {}",
            x.dtype().name()
        ));
    }
    let (m, e) = frexp(b, &b.convert(&x, wide_enough(x.dtype()))?)?;
    Ok(vec![
        b.convert(&m, n.out(0)?.dtype)?,
        b.convert(&e, n.out(1)?.dtype)?,
    ])
}

/// Half types are decomposed in f32, which holds their mantissas exactly.
fn wide_enough(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// All on the integer bits: XLA's CPU code flushes subnormal floats to zero in arithmetic.
fn frexp<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<(Val<'a>, Val<'a>)> {
    // (int type, width, mantissa bits, exponent bias - 1)
    let (it, width, mbits, bias) = if x.dtype() == DType::F64 {
        (DType::I64, 64, 52, 1022)
    } else {
        (DType::I32, 32, 23, 126)
    };
    let bits = b.bitcast(x, it)?;
    let ci = |v: i64| b.full_like(Scalar::Int(v), &bits);
    let int = |name: &str, a: &Val<'a>, v: i64| b.binary(name, a, &ci(v)?);
    let emask = (1i64 << (width - mbits - 1)) - 1;
    let frac_mask = (1i64 << mbits) - 1;
    let sign = int("and", &bits, 1i64 << (width - 1))?;
    let field = int("and", &int("shift_right_logical", &bits, mbits)?, emask)?;
    let frac = int("and", &bits, frac_mask)?;
    // A subnormal's leading bit p = width - 1 - clz(frac) moves to the implicit position.
    let clz = b.unary("count_leading_zeros", &frac)?;
    let p = b.binary("subtract", &ci(width - 1)?, &clz)?;
    let shifted = b.binary("shift_left", &frac, &b.binary("subtract", &ci(mbits)?, &p)?)?;
    let sub_frac = int("and", &shifted, frac_mask)?;
    let sub_exp = b.binary("subtract", &p, &ci(mbits + bias - 1)?)?;
    let subnormal = b.compare(&field, &ci(0)?, "EQ")?;
    let frac = b.select(&subnormal, &sub_frac, &frac)?;
    let exp = b.select(&subnormal, &sub_exp, &int("subtract", &field, bias)?)?;
    let mant = b.binary("or", &b.binary("or", &sign, &frac)?, &ci(bias << mbits)?)?;
    let mant = b.bitcast(&mant, x.dtype())?;
    // ±0, ±inf, NaN: x itself, exponent 0.
    let zero = b.binary(
        "and",
        &subnormal,
        &b.compare(&int("and", &bits, frac_mask)?, &ci(0)?, "EQ")?,
    )?;
    let special = b.binary("or", &zero, &b.compare(&field, &ci(emask)?, "EQ")?)?;
    let mant = b.select(&special, x, &mant)?;
    let exp = b.select(&special, &ci(0)?, &exp)?;
    Ok((mant, b.convert(&exp, DType::I32)?))
}
