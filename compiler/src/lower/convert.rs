//! dtype conversions, copies, and ops that are identities in an inference graph.

use std::cmp::Ordering;

use super::builder::Scalar;
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten._to_copy.default",
            "prims.convert_element_type.default",
            "aten.to.dtype",
        ],
        to_dtype,
    );
    r.add(&["aten.view.dtype"], view_dtype);
    r.add(&["aten.copy.default", "aten.copy_.default"], copy);
    r.add(&["aten.native_dropout.default"], dropout);
    r.add(
        &["aten._assert_async.msg", "aten._assert_async.default"],
        no_op,
    );
}

/// `_to_copy(x, dtype=…)` and friends: only the dtype matters to a functional graph (device and
/// memory format do not exist here).
fn to_dtype(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dtype = n.opt_dtype(1, "dtype")?.unwrap_or(x.dtype());
    Ok(vec![n.b.convert(&x, dtype)?])
}

/// `x.view(dtype)`: the same bytes read as another dtype (little-endian, as PyTorch's CPU and CUDA
/// tensors lay them out). A narrower dtype splits each element of the last dim into several, a
/// wider one joins them.
fn view_dtype(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let to = n.out_dtype()?;
    let b = &n.b;
    let (from_size, to_size) = (x.dtype().size(), to.size());
    if [x.dtype(), to].iter().any(|d| matches!(d, DType::Bool | DType::C64)) {
        return Err(format!("view as {} of {}: bool and complex bits are not lowered", to.name(), x.dtype().name()));
    }
    let shape = x.shape();
    let last = *shape.last().ok_or("view of a 0-d tensor as a dtype of another size")?;
    let lead = &shape[..shape.len() - 1];
    let y = match from_size.cmp(&to_size) {
        Ordering::Equal => b.bitcast(&x, to)?,
        Ordering::Greater => {
            let ratio = (from_size / to_size) as i64;
            let parts = b.op(
                "stablehlo.bitcast_convert",
                &[&x],
                &[],
                TensorType::new(to, [shape, &[ratio]].concat()),
            )?;
            b.reshape(&parts, &[lead, &[last * ratio]].concat())?
        }
        Ordering::Less => {
            let ratio = (to_size / from_size) as i64;
            let grouped = b.reshape(&x, &[lead, &[last / ratio, ratio]].concat())?;
            b.op("stablehlo.bitcast_convert", &[&grouped], &[], n.out(0)?.clone())?
        }
    };
    Ok(vec![y])
}

/// `copy(dst, src)`: the value of `src` in `dst`'s type (broadcast and cast).
fn copy(n: NodeCtx<'_>) -> Res<'_> {
    let dst = n.tensor(0, "self")?;
    let src = n.b.convert(&n.tensor(1, "src")?, dst.dtype())?;
    Ok(vec![n.b.broadcast_to(&src, dst.shape())?])
}

/// `native_dropout(x, p, train)` in eval (or with p = 0): `x` and an all-true keep mask. Training
/// dropout would need PyTorch's RNG stream to match eager, so it is rejected.
fn dropout(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "input")?;
    let train = n.bool_or(2, "train", true)?;
    if train && n.float_or(1, "p", 0.0)? != 0.0 {
        return Err("training-mode dropout (p > 0) is not supported".into());
    }
    let mask = n.b.splat(Scalar::Bool(true), n.out(1)?)?;
    Ok(vec![x, mask])
}

/// `_assert_async`: a runtime check with no outputs; the graph keeps it only for its effect.
fn no_op(_: NodeCtx<'_>) -> Res<'_> {
    Ok(vec![])
}
