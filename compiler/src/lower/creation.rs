//! Tensors made from numbers: full/zeros/ones(-like), scalar_tensor, arange, empty_*.

use super::builder::{opmath, Scalar};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.full.default",
            "aten.zeros.default",
            "aten.ones.default",
            "aten.empty.memory_format",
            "aten.empty_permuted.default",
            "aten.empty_strided.default",
            "aten.scalar_tensor.default",
        ],
        full,
    );
    r.add(
        &[
            "aten.full_like.default",
            "aten.zeros_like.default",
            "aten.ones_like.default",
            "aten.empty_like.default",
            "aten.new_full.default",
            "aten.new_zeros.default",
            "aten.new_ones.default",
            "aten.new_empty.default",
        ],
        full_like,
    );
    r.add(
        &[
            "aten.arange.start_step",
            "aten.arange.start",
            "aten.arange.default",
        ],
        arange,
    );
    r.add(
        &["aten.lift_fresh_copy.default", "aten.lift_fresh.default"],
        lift_fresh_copy,
    );
}

/// The fill value an op implies: explicit for `full*`, 1 for `ones*`, 0 otherwise (uninitialized
/// memory may hold anything, so `empty*` gives zeros).
fn fill_value(n: &NodeCtx<'_>, pos: usize) -> Result<Scalar, String> {
    let op = n.op.as_str();
    if op.contains("full") || op.contains("scalar_tensor") {
        n.scalar(pos, "fill_value").or_else(|_| n.scalar(pos, "s"))
    } else if op.contains("ones") {
        Ok(Scalar::Int(1))
    } else {
        Ok(Scalar::Int(0))
    }
}

/// `full(size, value)`, `zeros(size)`, `scalar_tensor(value)`…: dtype from `dtype=` or inferred
/// from the value as `torch.full` does.
fn full(n: NodeCtx<'_>) -> Res<'_> {
    let scalar = n.op == "aten.scalar_tensor.default";
    let shape = if scalar { vec![] } else { n.ints(0, "size")? };
    let value = fill_value(&n, if scalar { 0 } else { 1 })?;
    let default = if n.op.contains("full") {
        value.dtype()
    } else {
        DType::F32
    };
    let dtype = n.opt_dtype(usize::MAX, "dtype")?.unwrap_or(default);
    Ok(vec![n.b.splat(value, &TensorType::new(dtype, shape))?])
}

/// `full_like(x, value)`, `new_full(x, size, value)`…: shape and dtype from `x` unless given.
fn full_like(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let new = n.op.starts_with("aten.new_");
    let shape = if new {
        n.ints(1, "size")?
    } else {
        x.shape().to_vec()
    };
    let value = fill_value(&n, if new { 2 } else { 1 })?;
    let dtype = n.opt_dtype(usize::MAX, "dtype")?.unwrap_or(x.dtype());
    Ok(vec![n.b.splat(value, &TensorType::new(dtype, shape))?])
}

/// `arange(start, end, step)`: `start + i * step`, computed in i64 for integer results and in
/// the float compute type otherwise.
fn arange(n: NodeCtx<'_>) -> Res<'_> {
    let (start, end, step) = match n.op.as_str() {
        "aten.arange.default" => (Scalar::Int(0), n.scalar(0, "end")?, Scalar::Int(1)),
        "aten.arange.start" => (n.scalar(0, "start")?, n.scalar(1, "end")?, Scalar::Int(1)),
        _ => (
            n.scalar(0, "start")?,
            n.scalar(1, "end")?,
            n.scalar_or(2, "step", Scalar::Int(1))?,
        ),
    };
    let all_int = [start, end, step]
        .iter()
        .all(|s| matches!(s, Scalar::Int(_)));
    let dtype =
        n.opt_dtype(usize::MAX, "dtype")?
            .unwrap_or(if all_int { DType::I64 } else { DType::F32 });
    let len = ((end.as_f64() - start.as_f64()) / step.as_f64())
        .ceil()
        .max(0.0) as i64;
    let compute = if dtype.is_float() {
        opmath(dtype)
    } else {
        DType::I64
    };
    let b = &n.b;
    let ty = TensorType::new(compute, vec![len]);
    let i = b.iota(&ty, 0)?;
    let y = b.binary(
        "add",
        &b.binary("multiply", &i, &b.splat(step, &ty)?)?,
        &b.splat(start, &ty)?,
    )?;
    Ok(vec![b.convert(&y, dtype)?])
}

fn lift_fresh_copy(n: NodeCtx<'_>) -> Res<'_> {
    Ok(vec![n.tensor(0, "self")?])
}
