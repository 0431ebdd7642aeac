//! Average pooling over the trailing 2 or 3 spatial dims, as `reduce_window` sums divided by
//! PyTorch's per-window divisor.

use super::builder::{opmath, Combiner, Scalar, R};
use super::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(
        &["aten.avg_pool2d.default", "aten.avg_pool3d.default"],
        avg_pool,
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
