//! LAPACK-style factorizations and solvers, written as StableHLO loops (`stablehlo.while` over
//! the pivot/column index) on matrices batched to `[B, m, n]`. Each step works on the whole
//! matrix with index masks instead of dynamic slices, so one loop body serves every batch.

mod eigen;
mod ldl;
mod lu;
mod matfun;
mod qr;
mod triangular;

use super::builder::{broadcast_shapes, Builder, Combiner, Scalar, Val, R};
use super::Registry;
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    eigen::register(r);
    ldl::register(r);
    lu::register(r);
    matfun::register(r);
    qr::register(r);
    triangular::register(r);
}

/// Only f32/f64 matrices: PyTorch's CPU LAPACK has no half or integer kernels.
fn check_float(op: &str, x: &Val) -> R<()> {
    if matches!(x.dtype(), DType::F32 | DType::F64) {
        return Ok(());
    }
    Err(format!(
        "{op}: only f32/f64 matrices are lowered, got {}",
        super::builder::type_str(&x.ty)
    ))
}

/// The leading (batch) dims of a matrix or stack of matrices.
fn batch_of(x: &Val) -> R<Vec<i64>> {
    let r = x.rank();
    if r < 2 {
        return Err(format!(
            "expected a matrix, got {}",
            super::builder::type_str(&x.ty)
        ));
    }
    Ok(x.shape()[..r - 2].to_vec())
}

/// `x[..., m, n]` flattened to `[B, m, n]`.
fn flat<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let r = x.rank();
    let batch: i64 = x.shape()[..r - 2].iter().product();
    b.reshape(x, &[batch, x.shape()[r - 2], x.shape()[r - 1]])
}

/// `x` (batch flattened to its first dim) back to `batch` + its trailing dims.
fn unflat<'a>(b: &Builder<'a>, x: &Val<'a>, batch: &[i64]) -> R<Val<'a>> {
    let mut shape = batch.to_vec();
    shape.extend_from_slice(&x.shape()[1..]);
    b.reshape(x, &shape)
}

/// Per-matrix vectors `v[..., k]` broadcast to the batch dims `batch` and flattened to `[B, k]`.
fn flat_rows<'a>(b: &Builder<'a>, v: &Val<'a>, batch: &[i64]) -> R<Val<'a>> {
    let k = v.shape()[v.rank() - 1];
    let mut shape = batch.to_vec();
    shape.push(k);
    b.reshape(&b.broadcast_to(v, &shape)?, &[batch.iter().product(), k])
}

/// Two stacks of matrices broadcast to their common batch dims.
fn broadcast_batch<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    y: &Val<'a>,
) -> R<(Val<'a>, Val<'a>, Vec<i64>)> {
    let batch = broadcast_shapes(&batch_of(x)?, &batch_of(y)?)?;
    let to = |v: &Val<'a>| {
        let mut s = batch.clone();
        s.extend_from_slice(&v.shape()[v.rank() - 2..]);
        b.broadcast_to(v, &s)
    };
    Ok((to(x)?, to(y)?, batch))
}

/// Swaps the last two dims.
fn mt<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    let r = x.rank();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    b.transpose(x, &perm)
}

/// Batched matrix product of `[B, m, k]` and `[B, k, n]`.
fn bmm<'a>(b: &Builder<'a>, x: &Val<'a>, y: &Val<'a>) -> R<Val<'a>> {
    b.dot_general(x, y, (&[0], &[0]), (&[2], &[1]), x.dtype())
}

/// An i64 iota of `shape` along `dim`.
fn iota<'a>(b: &Builder<'a>, shape: &[i64], dim: usize) -> R<Val<'a>> {
    b.iota(&TensorType::new(DType::I64, shape.to_vec()), dim)
}

/// `iota <dir> idx` where `idx` is 0-d or per batch (`[B]`, broadcast along dim 0).
fn cmp_idx<'a>(b: &Builder<'a>, iota: &Val<'a>, idx: &Val<'a>, dir: &str) -> R<Val<'a>> {
    let dims: &[usize] = if idx.rank() == 0 { &[] } else { &[0] };
    b.compare(iota, &b.broadcast_in_dim(idx, iota.shape(), dims)?, dir)
}

/// Entries of `x` where `mask` holds, zero elsewhere.
fn keep<'a>(b: &Builder<'a>, mask: &Val<'a>, x: &Val<'a>) -> R<Val<'a>> {
    b.select(mask, x, &b.full_like(Scalar::Int(0), x)?)
}

/// `sum over dim` of the masked entries: picks one row/column/element when the mask has one
/// hit along `dim`.
fn pick<'a>(b: &Builder<'a>, mask: &Val<'a>, x: &Val<'a>, dim: usize) -> R<Val<'a>> {
    b.reduce(&keep(b, mask, x)?, &[dim], Combiner::Add, false)
}

/// Column `k` (0-d or per batch) of `a[B, m, n]`: `[B, m]`.
fn column<'a>(b: &Builder<'a>, a: &Val<'a>, k: &Val<'a>) -> R<Val<'a>> {
    pick(b, &cmp_idx(b, &iota(b, a.shape(), 2)?, k, "EQ")?, a, 2)
}

/// Row `k` (0-d or per batch) of `a[B, m, n]`: `[B, n]`.
fn row<'a>(b: &Builder<'a>, a: &Val<'a>, k: &Val<'a>) -> R<Val<'a>> {
    pick(b, &cmp_idx(b, &iota(b, a.shape(), 1)?, k, "EQ")?, a, 1)
}

/// Entry `k` (0-d or per batch) of `v[B, n]`: `[B]`.
fn entry<'a>(b: &Builder<'a>, v: &Val<'a>, k: &Val<'a>) -> R<Val<'a>> {
    pick(b, &cmp_idx(b, &iota(b, v.shape(), 1)?, k, "EQ")?, v, 1)
}

/// `u[B, m] ⊗ v[B, n]`: `[B, m, n]`.
fn outer<'a>(b: &Builder<'a>, u: &Val<'a>, v: &Val<'a>) -> R<Val<'a>> {
    let shape = [u.shape()[0], u.shape()[1], v.shape()[1]];
    b.mul(
        &b.broadcast_in_dim(u, &shape, &[0, 1])?,
        &b.broadcast_in_dim(v, &shape, &[0, 2])?,
    )
}

/// `[B, m]` broadcast along a new dim `dim` (1: as rows, 2: as columns) of `shape`.
fn spread<'a>(b: &Builder<'a>, v: &Val<'a>, shape: &[i64], dim: usize) -> R<Val<'a>> {
    let dims = if dim == 1 { [0, 2] } else { [0, 1] };
    b.broadcast_in_dim(v, shape, &dims)
}

/// The diagonal of `a[B, m, n]`: `[B, min(m, n)]`.
fn diagonal<'a>(b: &Builder<'a>, a: &Val<'a>) -> R<Val<'a>> {
    let k = a.shape()[1].min(a.shape()[2]);
    let sq = b.slice(a, &[0, 0, 0], &[a.shape()[0], k, k], &[1, 1, 1])?;
    let eye = b.compare(&iota(b, sq.shape(), 1)?, &iota(b, sq.shape(), 2)?, "EQ")?;
    pick(b, &eye, &sq, 2)
}

/// The identity `[B, n, n]` of `dtype`.
fn eye<'a>(b: &Builder<'a>, batch: i64, n: i64, dtype: DType) -> R<Val<'a>> {
    let shape = [batch, n, n];
    let e = b.compare(&iota(b, &shape, 1)?, &iota(b, &shape, 2)?, "EQ")?;
    b.convert(&e, dtype)
}

/// The symmetric matrix whose lower triangle is `a`'s (what LAPACK reads with `uplo = 'L'`).
fn symmetric_from_lower<'a>(b: &Builder<'a>, a: &Val<'a>) -> R<Val<'a>> {
    b.add(&triangle(b, a, true, 0)?, &mt(b, &triangle(b, a, true, -1)?)?)
}

/// Lower (`diag` = 0: with the diagonal, -1: strictly) or upper (`diag` = 0/1) triangle.
fn triangle<'a>(b: &Builder<'a>, a: &Val<'a>, lower: bool, diag: i64) -> R<Val<'a>> {
    let (i, j) = (iota(b, a.shape(), 1)?, iota(b, a.shape(), 2)?);
    let off = b.sub(&j, &i)?;
    let bound = b.splat(Scalar::Int(diag), &off.ty)?;
    let mask = b.compare(&off, &bound, if lower { "LE" } else { "GE" })?;
    keep(b, &mask, a)
}
