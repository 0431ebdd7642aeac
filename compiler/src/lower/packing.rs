//! The packed layout of a tensor padded along one dimension (`crate::padding::packed_layout`):
//! a `[o.., n, i..]` tensor padded to `[o.., S, i..]` keeps its `O·n·I` true elements first, in
//! the true-size tensor's own order, then whatever fills the rest. Padded, outer row `j`'s
//! positions start at row `j·S` of the `[O·S, I]` rows; packed, at row `j·n`. Each direction is
//! one gather of whole `I`-element rows, so the op count does not grow with `O` (batch × heads).

use super::builder::{IndexMap, Scalar, Val, R};
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

/// Rows `index` (any shape, i64) of `table` (`[rows, I]`): shape `index.shape + [I]`. An index
/// past the last row reads the last row (gather clamps).
fn rows<'a>(n: &NodeCtx<'a>, table: &Val<'a>, index: &Val<'a>) -> R<Val<'a>> {
    let inner = table.shape()[1];
    let count = index.ty.numel();
    let map = IndexMap { window_dims: vec![1], collapsed: vec![0], index_to_operand: vec![0], index_vector_dim: 1 };
    let got = n.b.gather(table, &n.b.reshape(index, &[count, 1])?, &map, &[1, inner], vec![count, inner])?;
    let mut shape = index.shape().to_vec();
    shape.push(inner);
    n.b.reshape(&got, &shape)
}

/// `[a, b]` i64 iota along `dim`.
fn iota<'a>(n: &NodeCtx<'a>, shape: &[i64], dim: usize) -> R<Val<'a>> {
    n.b.iota(&TensorType::new(DType::I64, shape.to_vec()), dim)
}

/// Packed → padded: position `r` of outer row `j` is packed row `j·n + r`; positions at or
/// past `n` (whatever the packed buffer held there) become zeros, as a zero-padded input's.
fn unpack(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let len = n.tensor(1, "length")?;
    let dim = n.int(2, "dim")? as usize;
    let (outer, padded, inner) = split(x.shape(), dim);
    let b = &n.b;
    let shape = [outer, padded];
    let r = iota(&n, &shape, 1)?;
    let len_each = b.broadcast_to(&len, &shape)?;
    let got = if outer == 1 {
        // One outer row: packed is padded already.
        b.reshape(&x, &[outer, padded, inner])?
    } else {
        let index = b.add(&b.mul(&iota(&n, &shape, 0)?, &len_each)?, &r)?;
        rows(&n, &b.reshape(&x, &[outer * padded, inner])?, &index)?
    };
    let exact = b.broadcast_in_dim(&b.compare(&r, &len_each, "LT")?, &[outer, padded, inner], &[0, 1])?;
    let kept = b.select(&exact, &got, &b.splat(Scalar::Int(0), &got.ty)?)?;
    Ok(vec![b.reshape(&kept, x.shape())?])
}

/// Padded → packed: packed row `q` is position `q mod m` of outer row `q div m`, `m = n + by`
/// the exact positions per outer row; rows past `O·m` are left to whatever the gather reads.
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
    let i64 = |v| b.scalar(Scalar::Int(v), DType::I64);
    // At least 1, so that the division below is defined for any length.
    let exact = b.binary("maximum", &b.add(&len, &i64(by)?)?, &i64(1)?)?;
    let q = iota(&n, &[outer * padded], 0)?;
    let each = b.broadcast_to(&exact, &[outer * padded])?;
    let (j, r) = (b.div(&q, &each)?, b.binary("remainder", &q, &each)?);
    let index = b.add(&b.mul(&j, &b.broadcast_to(&i64(padded)?, &[outer * padded])?)?, &r)?;
    let got = rows(&n, &b.reshape(&y, &[outer * padded, inner])?, &index)?;
    Ok(vec![b.reshape(&got, y.shape())?])
}
