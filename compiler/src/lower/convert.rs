//! dtype conversions, copies, and ops that are identities in an inference graph.

use super::builder::Scalar;
use super::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten._to_copy.default",
            "prims.convert_element_type.default",
            "aten.to.dtype",
        ],
        to_dtype,
    );
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
