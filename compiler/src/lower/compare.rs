//! Comparisons, logical and bitwise ops.

use super::builder::{result_type, Scalar};
use super::{NodeCtx, Registry, Res};
use crate::ir::DType;

pub fn register(r: &mut Registry) {
    let mut cmp = vec![];
    for op in ["eq", "ne", "lt", "le", "gt", "ge"] {
        for overload in ["Scalar", "Tensor"] {
            cmp.push(&*Box::leak(
                format!("aten.{op}.{overload}").into_boxed_str(),
            ));
        }
    }
    r.add(&cmp, compare);
    r.add(
        &[
            "aten.logical_and.default",
            "aten.logical_or.default",
            "aten.logical_xor.default",
            "aten.logical_not.default",
        ],
        logical,
    );
    r.add(
        &[
            "aten.bitwise_and.Tensor",
            "aten.bitwise_and.Scalar",
            "aten.bitwise_or.Tensor",
            "aten.bitwise_or.Scalar",
            "aten.bitwise_xor.Tensor",
            "aten.bitwise_xor.Scalar",
            "aten.bitwise_not.default",
        ],
        bitwise,
    );
    let mut shifts = vec![];
    for op in ["bitwise_left_shift", "bitwise_right_shift"] {
        for overload in ["Tensor", "Tensor_Scalar", "Scalar_Tensor"] {
            shifts.push(&*Box::leak(format!("aten.{op}.{overload}").into_boxed_str()));
        }
    }
    for op in ["__lshift__", "__rshift__"] {
        for overload in ["Tensor", "Scalar"] {
            shifts.push(&*Box::leak(format!("aten.{op}.{overload}").into_boxed_str()));
        }
    }
    r.add(&shifts, shift);
    r.add(&["aten.isnan.default", "aten.isinf.default"], classify);
}

/// Compares in the promoted dtype of both operands (`torch.result_type`), as ATen does.
fn compare(n: NodeCtx<'_>) -> Res<'_> {
    let (x, y) = (n.operand(0, "self")?, n.operand(1, "other")?);
    let dir = match &n.op[5..7] {
        "eq" => "EQ",
        "ne" => "NE",
        "lt" => "LT",
        "le" => "LE",
        "gt" => "GT",
        _ => "GE",
    };
    let v = n.b.coerce(&[&x, &y], result_type(&[&x, &y]))?;
    Ok(vec![n.b.compare(&v[0], &v[1], dir)?])
}

/// Logical ops see `x != 0` and return bool.
fn logical(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let x = b.convert(&n.tensor(0, "self")?, DType::Bool)?;
    let name = &n.op["aten.logical_".len()..n.op.len() - ".default".len()];
    if name == "not" {
        return Ok(vec![b.unary("not", &x)?]);
    }
    let y = b.convert(&n.tensor(1, "other")?, DType::Bool)?;
    Ok(vec![b.binary_bcast(name, &x, &y)?])
}

fn bitwise(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    let name = n.op["aten.bitwise_".len()..]
        .split('.')
        .next()
        .unwrap_or_default();
    if name == "not" {
        return Ok(vec![n.b.unary("not", &n.tensor(0, "self")?)?]);
    }
    let v =
        n.b.coerce(&[&n.operand(0, "self")?, &n.operand(1, "other")?], out)?;
    Ok(vec![n.b.binary(name, &v[0], &v[1])?])
}

/// `x << y`, `x >> y` in the result dtype: a right shift is arithmetic for signed integers and
/// logical for `uint8`, as in ATen. StableHLO's shifts give what ATen gives for a count out of
/// range (negative, or the width or more): 0, or the sign for an arithmetic right shift.
fn shift(n: NodeCtx<'_>) -> Res<'_> {
    let out = n.out_dtype()?;
    if !out.is_integer() {
        return Err(format!("{} of {}: shifts need integers", n.op, out.name()));
    }
    let v = n.b.coerce(&[&n.operand(0, "self")?, &n.operand(1, "other")?], out)?;
    let op = match (n.op.contains("left") || n.op.contains("lshift"), out.is_signed_integer()) {
        (true, _) => "shift_left",
        (false, true) => "shift_right_arithmetic",
        (false, false) => "shift_right_logical",
    };
    Ok(vec![n.b.binary(op, &v[0], &v[1])?])
}

fn classify(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    if !x.dtype().is_float() {
        return Ok(vec![n
            .b
            .splat(Scalar::Bool(false), &n.b.convert(&x, DType::Bool)?.ty)?]);
    }
    if n.op == "aten.isnan.default" {
        return Ok(vec![n.b.compare(&x, &x, "NE")?]);
    }
    let inf = n.b.full_like(Scalar::Float(f64::INFINITY), &x)?;
    Ok(vec![n.b.compare(&n.b.unary("abs", &x)?, &inf, "EQ")?])
}
