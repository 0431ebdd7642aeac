//! The packed layout of a tensor padded along one dimension (`crate::padding::packed_layout`):
//! a `[o.., n, i..]` tensor padded to `[o.., S, i..]` keeps its `O·n·I` true elements first, in
//! the true-size tensor's own order, then whatever fills the rest. Padded, each of the `O` outer
//! rows starts at a multiple of `S·I`; packed, at a multiple of `n·I`. `O` is small where this is
//! used (a cache's batch times heads), so each direction is `O` dynamic slices or updates.

use super::builder::{Scalar, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};
use crate::padding::{PACK, UNPACK};

pub fn register(r: &mut Registry) {
    r.add(&[UNPACK], unpack);
    r.add(&[PACK], pack);
}

/// `(O, S, I)` of `shape` around `dim`.
fn split(shape: &[i64], dim: usize) -> (i64, i64, i64) {
    (shape[..dim].iter().product(), shape[dim], shape[dim + 1..].iter().product())
}

/// Where outer row `j` starts in the packed layout of rows `rows` long: `j · rows`.
fn row_start<'a>(n: &NodeCtx<'a>, rows: &Val<'a>, j: i64) -> R<Val<'a>> {
    n.b.mul(rows, &n.b.scalar(Scalar::Int(j), DType::I64)?)
}

/// Packed → padded: outer row `j` is read from `j·n·I`; positions at or past `n` (whatever the
/// packed buffer held there) become zeros, as a zero-padded input's.
fn unpack(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let len = n.tensor(1, "length")?;
    let dim = n.int(2, "dim")? as usize;
    let (outer, padded, inner) = split(x.shape(), dim);
    let b = &n.b;
    let flat = b.reshape(&x, &[outer * padded * inner])?;
    let row = b.mul(&len, &b.scalar(Scalar::Int(inner), DType::I64)?)?;
    let rows = (0..outer)
        .map(|j| b.reshape(&b.dynamic_slice(&flat, &[&row_start(&n, &row, j)?], &[padded * inner])?, &[1, padded, inner]))
        .collect::<R<Vec<_>>>()?;
    let rows = b.concat(&rows.iter().collect::<Vec<_>>(), 0)?;
    let at = b.iota(&TensorType::new(DType::I64, vec![outer, padded, inner]), 1)?;
    let exact = b.compare(&at, &b.broadcast_to(&len, &[outer, padded, inner])?, "LT")?;
    let kept = b.select(&exact, &rows, &b.splat(Scalar::Int(0), &rows.ty)?)?;
    Ok(vec![b.reshape(&kept, x.shape())?])
}

/// Padded → packed: outer row `j` (its first `n + by` positions exact) is written at
/// `j·(n + by)·I`, in order, so each row overwrites the previous one's inexact tail.
fn pack(n: NodeCtx<'_>) -> Res<'_> {
    let y = n.tensor(0, "self")?;
    let len = n.tensor(1, "length")?;
    let dim = n.int(2, "dim")? as usize;
    let by = n.int(3, "by")?;
    let (outer, padded, inner) = split(y.shape(), dim);
    if outer == 1 {
        return Ok(vec![y]);
    }
    let b = &n.b;
    let exact = b.add(&len, &b.scalar(Scalar::Int(by), DType::I64)?)?;
    let row = b.mul(&exact, &b.scalar(Scalar::Int(inner), DType::I64)?)?;
    let rows = b.reshape(&y, &[outer, padded * inner])?;
    let mut flat = b.splat(Scalar::Int(0), &TensorType::new(y.dtype(), vec![outer * padded * inner]))?;
    for j in 0..outer {
        let r = b.reshape(&b.slice(&rows, &[j, 0], &[j + 1, padded * inner], &[1, 1])?, &[padded * inner])?;
        flat = b.dynamic_update_slice(&flat, &r, &[&row_start(&n, &row, j)?])?;
    }
    Ok(vec![b.reshape(&flat, y.shape())?])
}
