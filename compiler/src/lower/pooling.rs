//! Pooling over the trailing spatial dims: average pooling as `reduce_window` sums divided by
//! PyTorch's per-window divisor; adaptive pooling as masked reductions.

use super::builder::{opmath, Builder, Combiner, Scalar, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &["aten.avg_pool2d.default", "aten.avg_pool3d.default"],
        avg_pool,
    );
    r.add(
        &[
            "aten._adaptive_avg_pool3d.default",
            "aten.adaptive_max_pool2d.default",
            "aten.adaptive_max_pool3d.default",
        ],
        adaptive_pool,
    );
}

/// Output length of one pooled dim and the extra high padding `ceil_mode` needs; a window that
/// would start in the right padding is dropped, as in PyTorch.
fn pooled_len(len: i64, k: i64, s: i64, p: i64, ceil: bool) -> (i64, i64) {
    let span = len + 2 * p - k;
    let mut out = if ceil { (span + s - 1) / s } else { span / s } + 1;
    if ceil && (out - 1) * s >= len + p {
        out -= 1;
    }
    (out, ((out - 1) * s + k - (len + 2 * p)).max(0))
}

/// `avg_pool{2,3}d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)`.
/// The divisor counts the window's elements inside the zero-padded input (`count_include_pad`)
/// or inside the input itself; `ceil_mode`'s extra padding never counts.
fn avg_pool(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let spatial = if n.op.contains("3d") { 3 } else { 2 };
    let lead = x
        .rank()
        .checked_sub(spatial)
        .ok_or("avg_pool: input rank too small")?;
    let per_dim = |pos: usize, name: &str, default: &[i64]| -> R<Vec<i64>> {
        let v = n.ints(pos, name)?;
        Ok(match v.len() {
            0 => default.to_vec(),
            1 => vec![v[0]; spatial],
            _ => v,
        })
    };
    let kernel = per_dim(1, "kernel_size", &[])?;
    let stride = per_dim(2, "stride", &kernel)?;
    let padding = per_dim(3, "padding", &vec![0; spatial])?;
    let ceil = n.bool_or(4, "ceil_mode", false)?;
    let include_pad = n.bool_or(5, "count_include_pad", true)?;
    let divisor = n
        .arg(6, "divisor_override")
        .map(|_| n.int(6, "divisor_override"))
        .transpose()?;
    let out = n.out_dtype()?;
    let b = &n.b;
    let xf = b.convert(&x, opmath(out))?;
    let (mut window, mut strides, mut pads) = (vec![1; lead], vec![1; lead], vec![(0, 0); lead]);
    let mut extra = vec![0; lead];
    for i in 0..spatial {
        let (_, e) = pooled_len(x.shape()[lead + i], kernel[i], stride[i], padding[i], ceil);
        window.push(kernel[i]);
        strides.push(stride[i]);
        pads.push((padding[i], padding[i] + e));
        extra.push(e);
    }
    let sum = b.reduce_window(&xf, Combiner::Add, &window, &strides, &pads)?;
    let count = if let Some(d) = divisor {
        b.full_like(Scalar::Int(d), &sum)?
    } else {
        // Ones over the counted region (the padded input, or the input alone), zeros beyond it.
        let ones = b.full_like(Scalar::Int(1), &xf)?;
        let (counted, rest) = if include_pad {
            let low: Vec<i64> = pads.iter().map(|p| p.0).collect();
            let one = b.scalar(Scalar::Int(1), xf.dtype())?;
            let zeros = vec![0; x.rank()];
            let padded = b.pad(&ones, &one, &low, &low, &zeros)?;
            (padded, extra.iter().map(|&e| (0, e)).collect())
        } else {
            (ones, pads.clone())
        };
        b.reduce_window(&counted, Combiner::Add, &window, &strides, &rest)?
    };
    Ok(vec![b.convert(&b.div(&sum, &count)?, out)?])
}

/// Adaptive pooling over the trailing `out.len()` dims: output cell `i` of a dim of length `len`
/// covers `[floor(i * len / o), ceil((i + 1) * len / o))`. Windows differ in size, so `x` is
/// spread to `[lead.., out.., spatial..]` and each cell reduces its masked window: the mean, or
/// the max with its flat spatial index (the first maximum, or the last NaN, as PyTorch's CPU
/// kernel picks).
fn adaptive_pool<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "self")?;
    let out = n.ints(1, "output_size")?;
    let b = &n.b;
    let k = out.len();
    let lead = x
        .rank()
        .checked_sub(k)
        .ok_or("adaptive pool: input rank too small")?;
    let spatial = &x.shape()[lead..];
    let mut shape = x.shape()[..lead].to_vec();
    shape.extend(&out);
    shape.extend(spatial);
    let windows: Vec<usize> = (lead + k..lead + 2 * k).collect();
    let x_dims: Vec<usize> = (0..lead).chain(windows.iter().copied()).collect();
    let xs = b.broadcast_in_dim(&x, &shape, &x_dims)?;
    let mut inside: Option<Val<'a>> = None;
    for d in 0..k {
        let m = window_mask(b, out[d], spatial[d])?;
        let m = b.broadcast_in_dim(&m, &shape, &[lead + d, lead + k + d])?;
        inside = Some(match inside {
            Some(acc) => b.binary("and", &acc, &m)?,
            None => m,
        });
    }
    let inside = inside.ok_or("adaptive pool: no output size")?;
    // `v` where `mask` holds, `fill` elsewhere, reduced over the windows.
    let masked = |mask: &Val<'a>, v: &Val<'a>, fill: Scalar, c: Combiner| {
        let other = b.splat(fill, &v.ty)?;
        b.reduce(&b.select(mask, v, &other)?, &windows, c, false)
    };
    if n.op.contains("avg") {
        let xf = b.convert(&xs, opmath(x.dtype()))?;
        let sum = masked(&inside, &xf, Scalar::Int(0), Combiner::Add)?;
        let ones = b.full_like(Scalar::Int(1), &xf)?;
        let count = masked(&inside, &ones, Scalar::Int(0), Combiner::Add)?;
        return Ok(vec![b.convert(&b.div(&sum, &count)?, x.dtype())?]);
    }
    let nan_in = b.binary("and", &b.compare(&xs, &xs, "NE")?, &inside)?;
    let any_nan = b.reduce(&nan_in, &windows, Combiner::Or, false)?;
    let values = masked(
        &inside,
        &xs,
        Combiner::Max.identity(x.dtype()),
        Combiner::Max,
    )?;
    let full = b.broadcast_in_dim(&values, &shape, &(0..lead + k).collect::<Vec<_>>())?;
    let idx_ty = TensorType::new(DType::I64, shape.clone());
    let mut flat = b.splat(Scalar::Int(0), &idx_ty)?;
    let mut stride = 1;
    for d in (0..k).rev() {
        let term = b.mul(
            &b.iota(&idx_ty, lead + k + d)?,
            &b.splat(Scalar::Int(stride), &idx_ty)?,
        )?;
        flat = b.add(&flat, &term)?;
        stride *= spatial[d];
    }
    let at_max = b.binary("and", &b.compare(&xs, &full, "EQ")?, &inside)?;
    let (last, first) = (Combiner::Max, Combiner::Min);
    let indices = b.select(
        &any_nan,
        &masked(&nan_in, &flat, last.identity(DType::I64), last)?,
        &masked(&at_max, &flat, first.identity(DType::I64), first)?,
    )?;
    Ok(vec![values, indices])
}

/// `[o, len]` mask of adaptive window `i` (row) covering position `p` (column).
fn window_mask<'a>(b: &Builder<'a>, o: i64, len: i64) -> R<Val<'a>> {
    let ty = TensorType::new(DType::I64, vec![o, len]);
    let c = |v| b.splat(Scalar::Int(v), &ty);
    let (i, p) = (b.iota(&ty, 0)?, b.iota(&ty, 1)?);
    let start = b.div(&b.mul(&i, &c(len)?)?, &c(o)?)?;
    let end_num = b.add(&b.mul(&b.add(&i, &c(1)?)?, &c(len)?)?, &c(o - 1)?)?;
    let end = b.div(&end_num, &c(o)?)?;
    b.binary(
        "and",
        &b.compare(&p, &start, "GE")?,
        &b.compare(&p, &end, "LT")?,
    )
}
