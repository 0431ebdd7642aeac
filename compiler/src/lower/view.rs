//! Shape and layout ops. A functional graph has no aliasing, so views become copies: reshape,
//! transpose, broadcast, slice, concatenate.

use super::builder::{norm_dim, norm_dims, Scalar, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::DType;
use crate::padding::APPEND_AT;

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.view.default",
            "aten.reshape.default",
            "aten._unsafe_view.default",
            "aten.view_copy.default",
        ],
        view,
    );
    r.add(
        &["aten.permute.default", "aten.permute_copy.default"],
        permute,
    );
    r.add(&["aten.transpose.int", "aten.t.default"], transpose);
    r.add(&["aten.expand.default", "aten.expand_copy.default"], expand);
    r.add(
        &["aten.unsqueeze.default", "aten.unsqueeze_copy.default"],
        unsqueeze,
    );
    r.add(
        &[
            "aten.squeeze.dims",
            "aten.squeeze.dim",
            "aten.squeeze.default",
        ],
        squeeze,
    );
    r.add(&["aten.slice.Tensor", "aten.slice_copy.Tensor"], slice);
    r.add(&["aten.select.int", "aten.select_copy.int"], select);
    r.add(&["aten.cat.default", "aten.concat.default"], cat);
    r.add(
        &[
            "aten.split_with_sizes.default",
            "aten.split.Tensor",
            "aten.unbind.int",
        ],
        split,
    );
    r.add(
        &[
            "aten.clone.default",
            "aten.alias.default",
            "aten.detach.default",
            "aten.contiguous.default",
            "aten.alias_copy.default",
        ],
        identity,
    );
    r.add(&["aten.repeat.default"], repeat);
    r.add(&["aten.constant_pad_nd.default"], constant_pad_nd);
    r.add(&["aten.flip.default"], flip);
    r.add(&["aten.view_as_complex.default"], view_as_complex);
    r.add(&["aten.view_as_real.default"], view_as_real);
}

/// `view_as_complex(x[..., 2])`: (real, imag) pairs of the last dim become one complex element.
fn view_as_complex(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let last = x
        .rank()
        .checked_sub(1)
        .ok_or("view_as_complex of a 0-d tensor")?;
    let shape = &x.shape()[..last];
    let part = |i| b.reshape(&b.slice_dim(&x, last, i, i + 1, 1)?, shape);
    let (re, im) = (part(0)?, part(1)?);
    Ok(vec![b.complex(&re, &im)?])
}

/// `view_as_real(z)`: complex elements as a trailing (real, imag) dim.
fn view_as_real(n: NodeCtx<'_>) -> Res<'_> {
    let z = n.tensor(0, "self")?;
    let b = &n.b;
    let mut shape = z.shape().to_vec();
    shape.push(1);
    let part = |name| b.reshape(&b.complex_part(name, &z)?, &shape);
    let (re, im) = (part("real")?, part("imag")?);
    Ok(vec![b.concat(&[&re, &im], z.rank())?])
}

fn identity(n: NodeCtx<'_>) -> Res<'_> {
    Ok(vec![n.tensor(0, "self")?])
}

/// Resolves a `-1` in a view's sizes.
fn infer_sizes(sizes: &[i64], numel: i64) -> R<Vec<i64>> {
    let known: i64 = sizes.iter().filter(|&&s| s != -1).product();
    match sizes.iter().filter(|&&s| s == -1).count() {
        0 => Ok(sizes.to_vec()),
        1 if known != 0 && numel % known == 0 => Ok(sizes
            .iter()
            .map(|&s| if s == -1 { numel / known } else { s })
            .collect()),
        _ => Err(format!("cannot infer sizes {sizes:?} for {numel} elements")),
    }
}

fn view(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let shape = infer_sizes(&n.ints(1, "size")?, x.ty.numel())?;
    Ok(vec![n.b.reshape(&x, &shape)?])
}

fn permute(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dims = n
        .ints(1, "dims")?
        .iter()
        .map(|&d| norm_dim(d, x.rank()))
        .collect::<R<Vec<_>>>()?;
    Ok(vec![n.b.transpose(&x, &dims)?])
}

fn transpose(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let mut perm: Vec<usize> = (0..x.rank()).collect();
    if x.rank() >= 2 {
        let (d0, d1) = if n.op == "aten.t.default" {
            (0, 1)
        } else {
            (
                norm_dim(n.int(1, "dim0")?, x.rank())?,
                norm_dim(n.int(2, "dim1")?, x.rank())?,
            )
        };
        perm.swap(d0, d1);
    }
    Ok(vec![n.b.transpose(&x, &perm)?])
}

/// `expand(x, sizes)`: new leading dims, `-1` keeps a dim.
fn expand(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let sizes = n.ints(1, "size")?;
    let off = sizes
        .len()
        .checked_sub(x.rank())
        .ok_or("expand to fewer dims")?;
    let shape: Vec<i64> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            if s == -1 && i >= off {
                x.shape()[i - off]
            } else {
                s
            }
        })
        .collect();
    Ok(vec![n.b.broadcast_to(&x, &shape)?])
}

fn unsqueeze(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let d = norm_dim(n.int(1, "dim")?, x.rank() + 1)?;
    let mut shape = x.shape().to_vec();
    shape.insert(d, 1);
    Ok(vec![n.b.reshape(&x, &shape)?])
}

/// Drops the given size-1 dims (all size-1 dims for `squeeze.default`); others are kept.
fn squeeze(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dims = match n.op.as_str() {
        "aten.squeeze.default" => (0..x.rank()).collect(),
        _ if x.rank() == 0 => vec![],
        // An empty dim list squeezes nothing (unlike a reduction's, which means every dim).
        _ => match n.ints(1, "dim")? {
            dims if dims.is_empty() => vec![],
            dims => norm_dims(&dims, x.rank())?,
        },
    };
    let shape: Vec<i64> = x
        .shape()
        .iter()
        .enumerate()
        .filter(|&(i, &s)| !(s == 1 && dims.contains(&i)))
        .map(|(_, &s)| s)
        .collect();
    Ok(vec![n.b.reshape(&x, &shape)?])
}

/// Python slice bounds clamped into `[0, size]`.
fn clamp_index(i: i64, size: i64) -> i64 {
    (if i < 0 { i + size } else { i }).clamp(0, size)
}

fn slice(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(n.int_or(1, "dim", 0)?, x.rank())?;
    let size = x.shape()[dim];
    let start = clamp_index(n.int_or(2, "start", 0)?, size);
    let end = clamp_index(n.int_or(3, "end", i64::MAX)?.min(size), size).max(start);
    let step = n.int_or(4, "step", 1)?;
    if step < 1 {
        return Err(format!("slice step must be positive, got {step}"));
    }
    Ok(vec![n.b.slice_dim(&x, dim, start, end, step)?])
}

fn select(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let size = x.shape()[dim];
    let i = n.int(2, "index")?;
    let i = if i < 0 { i + size } else { i };
    if !(0..size).contains(&i) {
        return Err(format!("index {i} out of range for size {size}"));
    }
    let part = n.b.slice_dim(&x, dim, i, i + 1, 1)?;
    let mut shape = x.shape().to_vec();
    shape.remove(dim);
    Ok(vec![n.b.reshape(&part, &shape)?])
}

/// `cat(tensors, dim)` in the promoted dtype; 1-d empty tensors are skipped as in ATen.
fn cat(n: NodeCtx<'_>) -> Res<'_> {
    let dtype: DType = n.out_dtype()?;
    let xs: Vec<_> = n
        .tensors(0, "tensors")?
        .into_iter()
        .filter(|t| !(t.rank() == 1 && t.shape()[0] == 0))
        .collect();
    let Some(first) = xs.first() else {
        // Only empty vectors: the result is empty too.
        return Ok(vec![n.b.splat(Scalar::Int(0), n.out(0)?)?]);
    };
    let dim = norm_dim(n.int_or(1, "dim", 0)?, first.rank())?;
    let xs = xs
        .iter()
        .map(|x| n.b.convert(x, dtype))
        .collect::<R<Vec<_>>>()?;
    match (n.opt_tensor(usize::MAX, APPEND_AT)?, xs.as_slice()) {
        // Padded (buckets): the first part is exact up to its true size, read at run time; the
        // rest go there, not after its padding.
        (Some(at), [head, rest @ ..]) if !rest.is_empty() => {
            let rest = n.b.concat(&rest.iter().collect::<Vec<_>>(), dim)?;
            let whole = n.b.concat(&[head, &rest], dim)?;
            let zero = n.b.scalar(Scalar::Int(0), at.dtype())?;
            let mut starts = vec![&zero; whole.rank()];
            starts[dim] = &at;
            Ok(vec![n.b.dynamic_update_slice(&whole, &rest, &starts)?])
        }
        _ => Ok(vec![n.b.concat(&xs.iter().collect::<Vec<_>>(), dim)?]),
    }
}

/// `split_with_sizes`, `split` (equal chunks, last smaller) and `unbind`.
fn split(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(
        n.int_or(if n.op == "aten.unbind.int" { 1 } else { 2 }, "dim", 0)?,
        x.rank(),
    )?;
    let size = x.shape()[dim];
    let sizes = match n.op.as_str() {
        "aten.split_with_sizes.default" => n.ints(1, "split_sizes")?,
        "aten.unbind.int" => vec![1; size as usize],
        _ => {
            let chunk = n.int(1, "split_size")?.max(1);
            (0..size)
                .step_by(chunk as usize)
                .map(|s| chunk.min(size - s))
                .collect()
        }
    };
    let mut start = 0;
    let mut parts = vec![];
    for s in sizes {
        let mut part = n.b.slice_dim(&x, dim, start, start + s, 1)?;
        if n.op == "aten.unbind.int" {
            let mut shape = x.shape().to_vec();
            shape.remove(dim);
            part = n.b.reshape(&part, &shape)?;
        }
        parts.push(part);
        start += s;
    }
    Ok(parts)
}

/// `repeat(x, reps)`: broadcast into an interleaved `[r0, s0, r1, s1, …]` shape, then merge.
fn repeat(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let reps = n.ints(1, "repeats")?;
    let off = reps
        .len()
        .checked_sub(x.rank())
        .ok_or("repeat with fewer dims than the tensor")?;
    let padded: Vec<i64> = (0..reps.len())
        .map(|i| if i < off { 1 } else { x.shape()[i - off] })
        .collect();
    let x = n.b.reshape(&x, &padded)?;
    let wide: Vec<i64> = reps
        .iter()
        .zip(&padded)
        .flat_map(|(&r, &s)| [r, s])
        .collect();
    let dims: Vec<usize> = (0..reps.len()).map(|i| 2 * i + 1).collect();
    let b = n.b.broadcast_in_dim(&x, &wide, &dims)?;
    let out: Vec<i64> = reps.iter().zip(&padded).map(|(r, s)| r * s).collect();
    Ok(vec![n.b.reshape(&b, &out)?])
}

/// `constant_pad_nd(x, pad, value)`: `pad` lists (low, high) pairs from the last dim backwards;
/// negative pads crop, which `stablehlo.pad` allows.
fn constant_pad_nd(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let pad = n.ints(1, "pad")?;
    let (mut low, mut high) = (vec![0; x.rank()], vec![0; x.rank()]);
    for (i, pair) in pad.chunks(2).enumerate() {
        let d = x.rank().checked_sub(i + 1).ok_or("more pads than dims")?;
        low[d] = pair[0];
        high[d] = *pair.get(1).unwrap_or(&0);
    }
    let fill =
        n.b.scalar(n.scalar_or(2, "value", Scalar::Int(0))?, x.dtype())?;
    Ok(vec![n.b.pad(&x, &fill, &low, &high, &vec![0; x.rank()])?])
}

fn flip(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dims = n.ints(1, "dims")?;
    if dims.is_empty() {
        return Ok(vec![x]);
    }
    Ok(vec![n.b.reverse(&x, &norm_dims(&dims, x.rank())?)?])
}
