//! Elementwise math: binary arithmetic (tensor or number operands), unary functions, pow,
//! activations, `where`.
//!
//! Like PyTorch's CPU kernels, half-precision results are computed in f32 ("opmath") and rounded
//! once at the end; operands are promoted to the dtype FX recorded for the result.

use super::builder::{lowering_target, opmath, type_str, Builder, Operand, Scalar, Val, R};
use super::trig::{sin_cos, Trig, VECTOR_TRIG_MIN_ELEMENTS};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

/// Unary functions, each registered as `aten.<name>.default` and (the ones PyTorch has as a
/// primitive, reached through its reference decompositions) `prims.<name>.default`.
const UNARY: &[&str] = &[
    "neg",
    "abs",
    "exp",
    "log",
    "log1p",
    "expm1",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sigmoid",
    "floor",
    "ceil",
    "round",
    "sign",
    "reciprocal",
    "relu",
    "erf",
    "gelu",
    "silu",
    "exp2",
    "log2",
    "trunc",
    "acos",
    "asin",
    "atan",
    "acosh",
    "asinh",
    "atanh",
    "sinh",
    "cosh",
    "erfc",
    "erfinv",
    "lgamma",
    "log10",
    "sgn",
    "frac",
];
/// Unary functions without a `prims` counterpart.
const UNARY_ATEN_ONLY: &[&str] = &["relu", "gelu", "silu", "sigmoid", "sgn", "frac", "erfinv"];

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.add.Tensor",
            "aten.add.Scalar",
            "aten.sub.Tensor",
            "aten.sub.Scalar",
            "aten.rsub.Tensor",
            "aten.rsub.Scalar",
            "prims.add.default",
            "prims.sub.default",
        ],
        add_sub,
    );
    r.add(
        &[
            "aten.mul.Tensor",
            "aten.mul.Scalar",
            "prims.mul.default",
            "aten.div.Tensor",
            "aten.div.Scalar",
            "aten.true_divide.Tensor",
        ],
        mul_div,
    );
    r.add(
        &[
            "aten.div.Tensor_mode",
            "aten.div.Scalar_mode",
            "aten.floor_divide.default",
        ],
        div_mode,
    );
    r.add(
        &[
            "aten.remainder.Tensor",
            "aten.remainder.Scalar",
            "aten.fmod.Tensor",
            "aten.fmod.Scalar",
        ],
        remainder,
    );
    r.add(
        &[
            "aten.maximum.default",
            "aten.minimum.default",
            "aten.atan2.default",
            "aten.fmax.default",
            "aten.fmin.default",
            "prims.fmax.default",
            "prims.fmin.default",
        ],
        binary_plain,
    );
    r.add(
        &[
            "aten.pow.Tensor_Scalar",
            "aten.pow.Tensor_Tensor",
            "aten.pow.Scalar",
        ],
        pow,
    );
    for name in UNARY {
        let aten: &'static str = Box::leak(format!("aten.{name}.default").into_boxed_str());
        r.add(&[aten], unary);
        if !UNARY_ATEN_ONLY.contains(name) {
            let prim: &'static str = Box::leak(format!("prims.{name}.default").into_boxed_str());
            r.add(&[prim], unary);
        }
    }
    r.add(&["prims.signbit.default", "aten.signbit.default"], signbit);
    r.add(&["aten.angle.default"], angle);
    r.add(
        &[
            "prims.nextafter.default",
            "aten.nextafter.default",
            "prims.hypot.default",
            "aten.hypot.default",
        ],
        special_binary,
    );
    r.add(
        &[
            "aten.clamp.default",
            "aten.clamp.Tensor",
            "aten.clamp_min.default",
            "aten.clamp_max.default",
            "aten.hardtanh.default",
        ],
        clamp,
    );
    r.add(
        &[
            "aten.where.self",
            "aten.where.ScalarSelf",
            "aten.where.ScalarOther",
            "aten.where.Scalar",
            "prims.where.default",
        ],
        where_,
    );
    r.add(
        &["aten.masked_fill.Scalar", "aten.masked_fill.Tensor"],
        masked_fill,
    );
}

/// Promotes both operands to the compute type of the recorded result, applies `f`, and rounds
/// back to the result dtype.
fn arith<'a>(
    n: &NodeCtx<'a>,
    a: &Operand<'a>,
    b: &Operand<'a>,
    f: impl FnOnce(&Builder<'a>, &Val<'a>, &Val<'a>) -> R<Val<'a>>,
) -> R<Val<'a>> {
    let out = n.out_dtype()?;
    let v = n.b.coerce(&[a, b], opmath(out))?;
    n.b.convert(&f(&n.b, &v[0], &v[1])?, out)
}

/// `self ± alpha * other`; `rsub` is `other - alpha * self`.
fn add_sub(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let alpha = n.scalar_or(2, "alpha", Scalar::Int(1))?;
    let rsub = n.op.starts_with("aten.rsub");
    let name = if n.op.contains(".add.") {
        "add"
    } else {
        "subtract"
    };
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        let (first, second) = if rsub { (q, p) } else { (p, q) };
        if first.dtype() == DType::Bool {
            return b.binary("or", first, second);
        }
        let second = match alpha.as_f64() {
            1.0 => second.clone(),
            _ => b.binary("multiply", second, &b.full_like(alpha, second)?)?,
        };
        b.binary(name, first, &second)
    })?])
}

fn mul_div(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let name = if n.op.contains(".mul.") {
        "multiply"
    } else {
        "divide"
    };
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        if p.dtype() == DType::Bool {
            b.binary("and", p, q)
        } else {
            b.binary(name, p, q)
        }
    })?])
}

/// `trunc(x)` for floats, which StableHLO lacks: floor toward zero.
fn trunc<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let neg = b.compare(x, &b.full_like(Scalar::Int(0), x)?, "LT")?;
    b.select(&neg, &b.unary("ceil", x)?, &b.unary("floor", x)?)
}

/// Division with `rounding_mode` "trunc" or "floor" (None is true division).
fn div_mode(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let mode = if n.op == "aten.floor_divide.default" {
        "floor".to_string()
    } else {
        n.str_or(2, "rounding_mode", "true")?
    };
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        let quot = b.binary("divide", p, q)?;
        match (mode.as_str(), p.dtype().is_float()) {
            ("true", _) => Ok(quot),
            ("trunc", true) => trunc(b, &quot),
            (_, true) => b.unary("floor", &quot),
            (_, false) if mode == "trunc" => Ok(quot),
            // Integer division truncates; step down when the signs differ and it was inexact.
            (_, false) => {
                let zero = b.full_like(Scalar::Int(0), p)?;
                let inexact = b.compare(&b.binary("remainder", p, q)?, &zero, "NE")?;
                let signs = b.binary(
                    "xor",
                    &b.compare(p, &zero, "LT")?,
                    &b.compare(q, &zero, "LT")?,
                )?;
                let fix = b.binary("and", &inexact, &signs)?;
                b.select(
                    &fix,
                    &b.binary("subtract", &quot, &b.full_like(Scalar::Int(1), &quot)?)?,
                    &quot,
                )
            }
        }
    })?])
}

/// `remainder` takes the divisor's sign (Python `%`); `fmod` the dividend's (C `fmod`).
fn remainder(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let python = n.op.starts_with("aten.remainder");
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        let r = b.binary("remainder", p, q)?;
        if !python {
            return Ok(r);
        }
        let zero = b.full_like(Scalar::Int(0), p)?;
        let nonzero = b.compare(&r, &zero, "NE")?;
        let signs = b.compare(
            &b.compare(&r, &zero, "LT")?,
            &b.compare(q, &zero, "LT")?,
            "NE",
        )?;
        b.select(
            &b.binary("and", &nonzero, &signs)?,
            &b.binary("add", &r, q)?,
            &r,
        )
    })?])
}

fn binary_plain(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let op =
        n.op.trim_start_matches("aten.")
            .trim_start_matches("prims.");
    let name = match op {
        "maximum.default" | "fmax.default" => "maximum",
        "minimum.default" | "fmin.default" => "minimum",
        _ => "atan2",
    };
    // fmax/fmin ignore a NaN operand (NaN only when both are); maximum/minimum propagate it.
    let ignore_nan = op.starts_with("fm");
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        if p.dtype() == DType::Bool {
            return b.binary(if name == "maximum" { "or" } else { "and" }, p, q);
        }
        let m = b.binary(name, p, q)?;
        if !(ignore_nan && p.dtype().is_float()) {
            return Ok(m);
        }
        let m = b.select(&b.compare(q, q, "NE")?, p, &m)?;
        b.select(&b.compare(p, p, "NE")?, q, &m)
    })?])
}

/// `x ** e` for a number `e`: small integer and ±0.5 exponents become multiplies / sqrt as in
/// PyTorch's kernel (exact for negative bases), the rest `stablehlo.power`.
fn pow_scalar<'a>(b: &Builder<'a>, x: &Val<'a>, e: f64) -> R<Val<'a>> {
    let float = x.dtype().is_float();
    match e {
        0.5 if float => b.unary("sqrt", x),
        -0.5 if float => b.unary("rsqrt", x),
        e if e.fract() == 0.0 && e.abs() <= 4.0 && (e >= 0.0 || float) => {
            let mut acc = b.full_like(Scalar::Int(1), x)?;
            for _ in 0..e.abs() as i64 {
                acc = b.binary("multiply", &acc, x)?;
            }
            if e < 0.0 {
                acc = b.binary("divide", &b.full_like(Scalar::Int(1), x)?, &acc)?;
            }
            Ok(acc)
        }
        e => b.binary("power", x, &b.full_like(Scalar::Float(e), x)?),
    }
}

fn pow(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "exponent")?);
    let exp = match &y {
        Operand::Scalar(s) => Some(s.as_f64()),
        Operand::Tensor(_) => None,
    };
    Ok(vec![arith(&n, &x, &y, |b, p, q| match exp {
        Some(e) => pow_scalar(b, p, e),
        None => b.binary("power", p, q),
    })?])
}

/// erf by the rational approximation XLA and Eigen use for f32 (|error| < 1 ulp-ish on f32).
fn erf<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    const ALPHA: [f64; 7] = [
        -2.72614225801306e-10,
        2.77068142495902e-08,
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    ];
    const BETA: [f64; 5] = [
        -1.45660718464996e-05,
        -2.13374055278905e-04,
        -1.68282697438203e-03,
        -7.37332916720468e-03,
        -1.42647390514189e-02,
    ];
    let x = b.op(
        "stablehlo.clamp",
        &[
            &b.full_like(Scalar::Float(-4.0), x)?,
            x,
            &b.full_like(Scalar::Float(4.0), x)?,
        ],
        &[],
        x.ty.clone(),
    )?;
    let x2 = b.binary("multiply", &x, &x)?;
    let horner = |coefs: &[f64]| -> R<Val<'a>> {
        let mut acc = b.full_like(Scalar::Float(coefs[0]), &x2)?;
        for &c in &coefs[1..] {
            acc = b.add_scalar(&b.binary("multiply", &acc, &x2)?, c)?;
        }
        Ok(acc)
    };
    let p = b.binary("multiply", &x, &horner(&ALPHA)?)?;
    b.binary("divide", &p, &horner(&BETA)?)
}

/// GELU, exact (`0.5 x (1 + erf(x/√2))`) or with `approximate="tanh"`.
fn gelu<'a>(b: &Builder<'a>, x: &Val<'a>, approximate: &str) -> R<Val<'a>> {
    let inner = if approximate == "tanh" {
        let cube = b.binary("multiply", &b.binary("multiply", x, x)?, x)?;
        let poly = b.binary("add", x, &b.mul_scalar(&cube, 0.044715)?)?;
        b.unary(
            "tanh",
            &b.mul_scalar(&poly, (2.0 / std::f64::consts::PI).sqrt())?,
        )?
    } else {
        erf(b, &b.mul_scalar(x, std::f64::consts::FRAC_1_SQRT_2)?)?
    };
    let half_x = b.mul_scalar(x, 0.5)?;
    b.binary("multiply", &half_x, &b.add_scalar(&inner, 1.0)?)
}

/// Unary functions; integer inputs of float functions are promoted (the recorded dtype says so).
fn unary(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let b = &n.b;
    let x = n.tensor(0, "self")?;
    let name =
        n.op.trim_start_matches("aten.")
            .trim_start_matches("prims.")
            .trim_end_matches(".default");
    if x.dtype() == DType::C64 && out != DType::C64 {
        // `abs` of a complex tensor is its real magnitude (converting first would keep only
        // the real part); other complex-to-real unary ops are not lowered here.
        if name != "abs" {
            return Err(format!("{} of {} is not lowered", n.op, type_str(&x.ty)));
        }
        let ty = TensorType::new(DType::F32, x.shape().to_vec());
        return Ok(vec![b.convert(&b.op("stablehlo.abs", &[&x], &[], ty)?, out)?]);
    }
    let x = b.convert(&x, opmath(out))?;
    if matches!(name, "sin" | "cos")
        && x.dtype() == DType::F32
        && x.ty.numel() >= VECTOR_TRIG_MIN_ELEMENTS
        && lowering_target().cpu
    {
        let f = if name == "sin" { Trig::Sin } else { Trig::Cos };
        return Ok(vec![b.convert(&sin_cos(b, &x, f)?, out)?]);
    }
    let one = || b.full_like(Scalar::Int(1), &x);
    let simple = match name {
        "neg" => Some("negate"),
        "abs" | "log" | "sqrt" | "rsqrt" | "tan" | "tanh" | "floor" | "ceil" | "sign" => Some(name),
        "exp" => Some("exponential"),
        "log1p" => Some("log_plus_one"),
        "expm1" => Some("exponential_minus_one"),
        "sin" => Some("sine"),
        "cos" => Some("cosine"),
        "sigmoid" => Some("logistic"),
        "round" => Some("round_nearest_even"),
        "sgn" => Some("sign"),
        _ => None,
    };
    // Functions StableHLO lacks; XLA expands these CHLO ops with accurate approximations.
    let chlo = match name {
        "acos" | "asin" | "atan" | "acosh" | "asinh" | "atanh" | "sinh" | "cosh" | "erfc"
        | "lgamma" => Some(name),
        "erfinv" => Some("erf_inv"),
        _ => None,
    };
    if let Some(op) = chlo {
        return Ok(vec![b.convert(
            &b.op(&format!("chlo.{op}"), &[&x], &[], x.ty.clone())?,
            out,
        )?]);
    }
    let y = match (simple, name) {
        (Some("abs"), _) if x.dtype() == DType::Bool => x.clone(),
        (Some(op), _) => b.unary(op, &x)?,
        (_, "reciprocal") => b.binary("divide", &one()?, &x)?,
        (_, "relu") => b.binary("maximum", &x, &b.full_like(Scalar::Int(0), &x)?)?,
        (_, "erf") => erf(b, &x)?,
        (_, "gelu") => gelu(b, &x, &n.str_or(1, "approximate", "none")?)?,
        (_, "silu") => b.binary("multiply", &x, &b.unary("logistic", &x)?)?,
        (_, "exp2") => b.binary("power", &b.full_like(Scalar::Int(2), &x)?, &x)?,
        (_, "log2") => b.mul_scalar(&b.unary("log", &x)?, std::f64::consts::LOG2_E)?,
        (_, "trunc") if x.dtype().is_float() => trunc(b, &x)?,
        (_, "trunc") => x.clone(),
        (_, "log10") => b.mul_scalar(&b.unary("log", &x)?, std::f64::consts::LOG10_E)?,
        (_, "frac") => b.sub(&x, &trunc(b, &x)?)?,
        _ => return Err(format!("no unary rule for {}", n.op)),
    };
    Ok(vec![b.convert(&y, out)?])
}

/// `clamp(x, min, max)`; maximum/minimum propagate NaN like PyTorch.
fn clamp(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let b = &n.b;
    let x = b.convert(&n.tensor(0, "self")?, opmath(out))?;
    let (lo, hi) = match n.op.as_str() {
        "aten.clamp_min.default" => (Some(n.operand(1, "min")?), None),
        "aten.clamp_max.default" => (None, Some(n.operand(1, "max")?)),
        "aten.hardtanh.default" => (
            Some(Operand::Scalar(Scalar::Float(
                n.float_or(1, "min_val", -1.0)?,
            ))),
            Some(Operand::Scalar(Scalar::Float(
                n.float_or(2, "max_val", 1.0)?,
            ))),
        ),
        _ => (n.opt_operand(1, "min")?, n.opt_operand(2, "max")?),
    };
    let mut y = x;
    for (bound, op) in [(lo, "maximum"), (hi, "minimum")] {
        if let Some(bound) = bound {
            y = b.binary_bcast(op, &y, &b.materialize(&bound, y.dtype())?)?;
        }
    }
    Ok(vec![b.convert(&y, out)?])
}

fn where_(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let cond = n.b.convert(&n.tensor(0, "condition")?, DType::Bool)?;
    let v =
        n.b.coerce(&[&n.operand(1, "self")?, &n.operand(2, "other")?], out)?;
    Ok(vec![n.b.select(&cond, &v[0], &v[1])?])
}

fn masked_fill(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let mask = n.b.convert(&n.tensor(1, "mask")?, DType::Bool)?;
    let value = n.b.materialize(&n.operand(2, "value")?, x.dtype())?;
    let value = n.b.broadcast_to(&value, x.shape())?;
    let mask = n.b.broadcast_to(&mask, x.shape())?;
    Ok(vec![n.b.select(&mask, &value, &x)?])
}

/// `signbit(x)`: the sign bit of the float's bits (true for -0.0 and negative NaNs too), in the
/// recorded dtype (bool for ATen's op, the input's for the prim).
fn signbit(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let bits = match x.dtype().size() {
        _ if !x.dtype().is_float() => x.clone(),
        2 => b.bitcast(&x, DType::I16)?,
        4 => b.bitcast(&x, DType::I32)?,
        _ => b.bitcast(&x, DType::I64)?,
    };
    let neg = b.compare(&bits, &b.full_like(Scalar::Int(0), &bits)?, "LT")?;
    Ok(vec![b.convert(&neg, n.out_dtype()?)?])
}

/// `angle(x)`: `atan2(imag, real)` of a complex tensor; of a real one, pi for negative values,
/// NaN kept, else 0 (so -0.0 gives 0, as in PyTorch, where `atan2(0, x)` would give pi).
fn angle(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    if x.dtype() == DType::C64 {
        let (re, im) = (b.complex_part("real", &x)?, b.complex_part("imag", &x)?);
        return Ok(vec![b.convert(&b.binary("atan2", &im, &re)?, out)?]);
    }
    let x = b.convert(&x, out)?;
    let zero = b.full_like(Scalar::Int(0), &x)?;
    let pi = b.full_like(Scalar::Float(std::f64::consts::PI), &x)?;
    let y = b.select(&b.compare(&x, &zero, "LT")?, &pi, &zero)?;
    Ok(vec![b.select(&b.compare(&x, &x, "NE")?, &x, &y)?])
}

/// Two-operand functions: nextafter(x, y) as the CHLO op XLA expands, hypot as sqrt(a² + b²).
fn special_binary(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let op = n.op.clone();
    Ok(vec![arith(&n, &x, &y, |b, p, q| {
        let chlo = |name: &str| b.op(&format!("chlo.{name}"), &[p, q], &[], p.ty.clone());
        match op.as_str() {
            "prims.nextafter.default" | "aten.nextafter.default" => chlo("next_after"),
            _ => b.unary("sqrt", &b.add(&b.mul(p, p)?, &b.mul(q, q)?)?),
        }
    })?])
}
