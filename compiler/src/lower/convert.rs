//! dtype conversions and copies.

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
