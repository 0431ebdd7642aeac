//! Reductions (sum, mean, amax/amin, any/all), softmax / log_softmax, cumsum / cummax / cummin /
//! logcumsumexp, segment_reduce, histc, histogram / histogramdd.
//!
//! Half-precision inputs accumulate in f32 and round once, as PyTorch's CPU kernels do.

use super::builder::{
    inverse_perm, keep_dims_shape, norm_dim, norm_dims, opmath, type_str, Builder, Combiner,
    Scalar, Val, R,
};
use super::attention::hide_padded_keys;
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.sum.dim_IntList",
            "aten.sum.default",
            "aten.mean.dim",
            "aten.mean.default",
        ],
        sum_mean,
    );
    r.add(
        &[
            "aten.prod.default",
            "aten.prod.dim_int",
            "prims.prod.default",
        ],
        prod,
    );
    r.add(
        &[
            "aten.amax.default",
            "aten.amin.default",
            "aten.max.default",
            "aten.min.default",
        ],
        extremum,
    );
    r.add(
        &[
            "aten.any.dim",
            "aten.any.dims",
            "aten.any.default",
            "aten.all.dim",
            "aten.all.dims",
            "aten.all.default",
        ],
        any_all,
    );
    r.add(
        &[
            "aten._softmax.default",
            "aten._log_softmax.default",
            "aten.softmax.int",
            "aten.log_softmax.int",
            "aten._safe_softmax.default",
        ],
        softmax,
    );
    r.add(&["aten.cumsum.default"], cumsum);
    r.add(&["aten.logcumsumexp.default"], logcumsumexp);
    r.add(&["aten.cummax.default", "aten.cummin.default"], cumextremum);
    r.add(&["aten.histc.default"], histc);
    r.add(
        &[
            "aten.histogram.bin_ct",
            "aten.histogram.bins_tensor",
            "aten._histogramdd_bin_edges.default",
            "aten._histogramdd_from_bin_cts.default",
            "aten._histogramdd_from_bin_tensors.default",
        ],
        histogram,
    );
    r.add(&["aten.segment_reduce.default"], segment_reduce);
    r.add(&["aten.var.correction", "aten.var_mean.correction"], var);
}

/// The reduced dims and `keepdim` of a `(self, dim, keepdim)` reduction.
fn reduce_args(n: &NodeCtx<'_>, x: &Val<'_>) -> R<(Vec<usize>, bool)> {
    let every = (0..x.rank()).collect();
    Ok(match n.op.as_str() {
        "aten.sum.default" | "aten.mean.default" | "aten.prod.default" | "aten.max.default"
        | "aten.min.default" | "aten.any.default" | "aten.all.default" => (every, false),
        "aten.any.dim" | "aten.all.dim" | "aten.prod.dim_int" => (
            vec![norm_dim(n.int(1, "dim")?, x.rank())?],
            n.bool_or(2, "keepdim", false)?,
        ),
        _ => (
            norm_dims(&n.ints(1, "dim")?, x.rank())?,
            n.bool_or(2, "keepdim", false)?,
        ),
    })
}

/// Sum of `x` over `dims` in the compute type of `out`, converted to `out`.
pub fn sum_to<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    dims: &[usize],
    keepdim: bool,
    out: DType,
) -> R<Val<'a>> {
    let s = b.reduce(&b.convert(x, opmath(out))?, dims, Combiner::Add, keepdim)?;
    b.convert(&s, out)
}

/// Mean over `dims`, in the compute type (f32 for half types), not converted back.
pub fn mean_in<'a>(b: &Builder<'a>, x: &Val<'a>, dims: &[usize], keepdim: bool) -> R<Val<'a>> {
    let count: i64 = dims.iter().map(|&d| x.shape()[d]).product();
    let s = sum_to(b, x, dims, keepdim, opmath(x.dtype()))?;
    b.mul_scalar(&s, 1.0 / count as f64)
}

fn sum_mean(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let (dims, keepdim) = reduce_args(&n, &x)?;
    let default = if x.dtype().is_float() || x.dtype().is_complex() {
        x.dtype()
    } else {
        DType::I64
    };
    let out = n.opt_dtype(usize::MAX, "dtype")?.unwrap_or(default);
    let b = &n.b;
    if n.op.starts_with("aten.mean") {
        let m = mean_in(b, &b.convert(&x, out)?, &dims, keepdim)?;
        return Ok(vec![b.convert(&m, out)?]);
    }
    Ok(vec![sum_to(b, &x, &dims, keepdim, out)?])
}

/// `prod` over dims (`prims.prod(x, dims)` has no keepdim), in the compute type; integer and
/// bool inputs give i64 unless `dtype=` says otherwise.
fn prod(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let (dims, keepdim) = if n.op == "prims.prod.default" {
        (norm_dims(&n.ints(1, "dims")?, x.rank())?, false)
    } else {
        reduce_args(&n, &x)?
    };
    let out = n.out_dtype()?;
    let b = &n.b;
    let p = b.reduce(&b.convert(&x, opmath(out))?, &dims, Combiner::Mul, keepdim)?;
    Ok(vec![b.convert(&p, out)?])
}

fn extremum(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let (dims, keepdim) = reduce_args(&n, &x)?;
    let c = if n.op.contains("max") {
        Combiner::Max
    } else {
        Combiner::Min
    };
    let c = match (c, x.dtype()) {
        (Combiner::Max, DType::Bool) => Combiner::Or,
        (Combiner::Min, DType::Bool) => Combiner::And,
        (c, _) => c,
    };
    Ok(vec![n.b.reduce(&x, &dims, c, keepdim)?])
}

fn any_all(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let (dims, keepdim) = reduce_args(&n, &x)?;
    let c = if n.op.starts_with("aten.any") {
        Combiner::Or
    } else {
        Combiner::And
    };
    Ok(vec![n.b.reduce(
        &n.b.convert(&x, DType::Bool)?,
        &dims,
        c,
        keepdim,
    )?])
}

/// Numerically stable (log-)softmax along `dim`: shift by the row max first (`exponentials`).
/// `_safe_softmax` (what SDPA's math path calls) gives 0 on fully masked rows, which its
/// decomposition finds with a compare and an `any` over the whole scores tensor; here the row
/// sums say which rows they are.
fn softmax(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let out = match n.op.as_str() {
        "aten._softmax.default" | "aten._log_softmax.default"
            if n.bool_or(2, "half_to_float", false)? =>
        {
            DType::F32
        }
        "aten._softmax.default" | "aten._log_softmax.default" => x.dtype(),
        _ => n.opt_dtype(2, "dtype")?.unwrap_or(x.dtype()),
    };
    let safe = n.op == "aten._safe_softmax.default";
    let b = &n.b;
    let x = hide_padded_keys(&n, b.convert(&x, opmath(out))?, dim, f64::NEG_INFINITY)?;
    let rows = exponentials(b, &x, dim, safe)?;
    let y = if n.op.contains("log_softmax") {
        b.sub(&rows.shifted, &b.unary("log", &rows.total)?)?
    } else {
        b.div(&rows.e, &rows.total)?
    };
    let y = if safe {
        zero_masked_rows(b, &y, &rows.total)?
    } else {
        y
    };
    Ok(vec![b.convert(&y, out)?])
}

/// A softmax's pieces along one dim: `shifted = x - shift` with `shift` the row max (kept dim),
/// `e = exp(shifted)` and the row sums `total`.
pub struct Exponentials<'a> {
    pub shift: Val<'a>,
    pub shifted: Val<'a>,
    pub e: Val<'a>,
    pub total: Val<'a>,
}

/// The max needs no NaN pass of its own: a NaN in a row makes the row's sum, and so every
/// softmax output of the row, NaN, as in eager. With `masked_rows`, a row that is entirely -inf
/// (fully masked) shifts by 0 instead of its -inf max, so its exponentials sum to 0, which no
/// other row's do (the max element alone contributes 1; a NaN gives NaN): `zero_masked_rows`
/// reads them off `total`.
pub fn exponentials<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    dim: usize,
    masked_rows: bool,
) -> R<Exponentials<'a>> {
    let mut shift = b.reduce_as_backend(x, &[dim], Combiner::Max, true)?;
    if masked_rows {
        let neg_inf = b.full_like(Scalar::Float(f64::NEG_INFINITY), &shift)?;
        let masked = b.compare(&shift, &neg_inf, "EQ")?;
        shift = b.select(&masked, &b.full_like(Scalar::Float(0.0), &shift)?, &shift)?;
    }
    let shifted = b.sub(x, &shift)?;
    let e = b.unary("exponential", &shifted)?;
    let total = b.reduce(&e, &[dim], Combiner::Add, true)?;
    Ok(Exponentials {
        shift,
        shifted,
        e,
        total,
    })
}

/// `y` with 0 on the rows whose `total` (from `exponentials` with `masked_rows`) is 0.
pub fn zero_masked_rows<'a>(b: &Builder<'a>, y: &Val<'a>, total: &Val<'a>) -> R<Val<'a>> {
    zero_rows(b, &b.compare(total, &b.full_like(Scalar::Float(0.0), total)?, "EQ")?, y)
}

/// `y` with 0 on the rows `hidden` marks (a pred with the reduced dim kept, broadcast to `y`).
pub fn zero_rows<'a>(b: &Builder<'a>, hidden: &Val<'a>, y: &Val<'a>) -> R<Val<'a>> {
    let hidden = b.broadcast_to(hidden, y.shape())?;
    b.select(&hidden, &b.full_like(Scalar::Float(0.0), y)?, y)
}

/// Inclusive scan of `x` along `dim` with `combiner`: a `reduce_window` whose window covers
/// everything before each element. A 0-d tensor is its own scan.
pub fn scan<'a>(b: &Builder<'a>, x: &Val<'a>, dim: usize, combiner: Combiner) -> R<Val<'a>> {
    if x.rank() == 0 {
        return Ok(x.clone());
    }
    let len = x.shape()[dim];
    let mut window = vec![1; x.rank()];
    let mut pads = vec![(0, 0); x.rank()];
    window[dim] = len;
    pads[dim] = (len - 1, 0);
    b.reduce_window(x, combiner, &window, &vec![1; x.rank()], &pads)
}

fn cumsum(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let default = if x.dtype().is_float() {
        x.dtype()
    } else {
        DType::I64
    };
    let out = n.opt_dtype(2, "dtype")?.unwrap_or(default);
    let b = &n.b;
    let y = scan(b, &b.convert(&x, opmath(out))?, dim, Combiner::Add)?;
    Ok(vec![b.convert(&y, out)?])
}

/// `logcumsumexp(x, dim)`: `m + log(sum exp(x_k - m))` over each prefix, with `m` the prefix's
/// own max so no term underflows against a later, larger one; built over all (position,
/// earlier position) pairs. An infinite prefix max is the answer itself (avoids inf - inf).
fn logcumsumexp(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    if x.rank() == 0 {
        return Ok(vec![x]);
    }
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let mut perm: Vec<usize> = (0..x.rank()).filter(|&d| d != dim).collect();
    perm.push(dim);
    let xt = b.transpose(&b.convert(&x, opmath(x.dtype()))?, &perm)?;
    let r = xt.rank();
    let mut pair = xt.shape().to_vec();
    pair.push(xt.shape()[r - 1]);
    let mut dims: Vec<usize> = (0..r - 1).collect();
    dims.push(r);
    let xk = b.broadcast_in_dim(&xt, &pair, &dims)?;
    let (i, k) = (
        b.iota(&TensorType::new(DType::I64, pair.clone()), r - 1)?,
        b.iota(&TensorType::new(DType::I64, pair.clone()), r)?,
    );
    let prefix = b.compare(&k, &i, "LE")?;
    let neg_inf = b.full_like(Scalar::Float(f64::NEG_INFINITY), &xk)?;
    let m = b.reduce(
        &b.select(&prefix, &xk, &neg_inf)?,
        &[r],
        Combiner::Max,
        true,
    )?;
    let terms = b.unary("exponential", &b.sub(&xk, &m)?)?;
    let zero = b.full_like(Scalar::Int(0), &terms)?;
    let sum = b.reduce(
        &b.select(&prefix, &terms, &zero)?,
        &[r],
        Combiner::Add,
        false,
    )?;
    let m = b.reshape(&m, xt.shape())?;
    let y = b.add(&m, &b.unary("log", &sum)?)?;
    let inf = b.compare(
        &b.unary("abs", &m)?,
        &b.full_like(Scalar::Float(f64::INFINITY), &m)?,
        "EQ",
    )?;
    let y = b.select(&inf, &m, &y)?;
    Ok(vec![b.convert(
        &b.transpose(&y, &inverse_perm(&perm))?,
        x.dtype(),
    )?])
}

/// `cummax` / `cummin`: the running extremum (NaN sticks, as max/min propagate it) and the index
/// of its last occurrence so far. Each element that equals the running extremum at its own
/// position (or is NaN) resets the index, so the index is a running max of those positions.
fn cumextremum(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let b = &n.b;
    let combiner = if n.op == "aten.cummax.default" {
        Combiner::Max
    } else {
        Combiner::Min
    };
    if x.rank() == 0 {
        return Ok(vec![x, b.scalar(Scalar::Int(0), DType::I64)?]);
    }
    let values = scan(b, &x, dim, combiner)?;
    let reset = b.binary(
        "or",
        &b.compare(&x, &values, "EQ")?,
        &b.compare(&x, &x, "NE")?,
    )?;
    let pos = b.iota(&TensorType::new(DType::I64, x.shape().to_vec()), dim)?;
    let marks = b.select(&reset, &pos, &b.full_like(Scalar::Int(0), &pos)?)?;
    Ok(vec![values, scan(b, &marks, dim, Combiner::Max)?])
}

/// `var(x, dim, correction, keepdim)` (and `var_mean`), two-pass in the compute type.
fn var<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "self")?;
    let dims = norm_dims(&n.ints(1, "dim")?, x.rank())?;
    let correction = n.float_or(2, "correction", 1.0)?;
    let keepdim = n.bool_or(3, "keepdim", false)?;
    let b = &n.b;
    let (v, mean) = variance(b, &x, &dims, correction)?;
    let shape = if keepdim {
        keep_dims_shape(x.shape(), &dims)
    } else {
        x.shape()
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(i))
            .map(|(_, &s)| s)
            .collect()
    };
    let fin = |t: &Val<'a>| b.convert(&b.reshape(t, &shape)?, x.dtype());
    let mut outs = vec![fin(&v)?];
    if n.op == "aten.var_mean.correction" {
        outs.push(fin(&mean)?);
    }
    Ok(outs)
}

/// Variance (with `correction` subtracted from the count) and mean over `dims`, both in the
/// compute type with the reduced dims kept.
pub fn variance<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    dims: &[usize],
    correction: f64,
) -> R<(Val<'a>, Val<'a>)> {
    let xf = b.convert(x, opmath(x.dtype()))?;
    let mean = mean_in(b, &xf, dims, true)?;
    let centered = b.sub(&xf, &mean)?;
    let count: i64 = dims.iter().map(|&d| x.shape()[d]).product();
    let sq = sum_to(b, &b.mul(&centered, &centered)?, dims, true, xf.dtype())?;
    let v = b.mul_scalar(&sq, 1.0 / (count as f64 - correction).max(0.0))?;
    Ok((v, mean))
}

/// `histc(x, bins, min, max)`: bin `floor((v - min) * bins / (max - min))` (the top edge falls in
/// the last bin), values outside `[min, max]` and NaN ignored; `min == max` uses the data range
/// (widened by 1 each side when that is empty too), as PyTorch does.
fn histc(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let bins = n.int_or(1, "bins", 100)?;
    let (lo, hi) = (n.float_or(2, "min", 0.0)?, n.float_or(3, "max", 0.0)?);
    let b = &n.b;
    let flat = b.reshape(
        &b.convert(&x, opmath(x.dtype()))?,
        &[x.shape().iter().product()],
    )?;
    let d = flat.dtype();
    let (lo, hi) = if lo == hi {
        let (lo, hi) = (
            b.reduce(&flat, &[0], Combiner::Min, false)?,
            b.reduce(&flat, &[0], Combiner::Max, false)?,
        );
        let empty = b.compare(&lo, &hi, "EQ")?;
        (
            b.select(&empty, &b.add_scalar(&lo, -1.0)?, &lo)?,
            b.select(&empty, &b.add_scalar(&hi, 1.0)?, &hi)?,
        )
    } else {
        (
            b.scalar(Scalar::Float(lo), d)?,
            b.scalar(Scalar::Float(hi), d)?,
        )
    };
    let scaled = b.div(
        &b.mul_scalar(&b.sub(&flat, &lo)?, bins as f64)?,
        &b.sub(&hi, &lo)?,
    )?;
    let top = b.full_like(Scalar::Int(bins - 1), &scaled)?;
    let pos = b.binary("minimum", &b.unary("floor", &scaled)?, &top)?;
    let inside = b.binary(
        "and",
        &b.compare(&flat, &b.broadcast_to(&lo, flat.shape())?, "GE")?,
        &b.compare(&flat, &b.broadcast_to(&hi, flat.shape())?, "LE")?,
    )?;
    let len = flat.shape()[0];
    let bin = b.iota(&TensorType::new(d, vec![len, bins]), 1)?;
    let hit = b.binary(
        "and",
        &b.compare(&b.broadcast_in_dim(&pos, &[len, bins], &[0])?, &bin, "EQ")?,
        &b.broadcast_in_dim(&inside, &[len, bins], &[0])?,
    )?;
    Ok(vec![sum_to(
        b,
        &b.convert(&hit, d)?,
        &[0],
        false,
        x.dtype(),
    )?])
}

/// `histogram` (1-D, flattened input) and the `histogramdd` pieces (input `[..., D]`): bin
/// counts (or `weight` sums) and bin edges. Bin counts give `bins + 1` edges per dim spaced as
/// ATen's `linspace` between `range` or the data's min and max (widened by 0.5 when equal;
/// 0 and 1 for no data). An element falls in the last bin whose left edge is at most it, the
/// rightmost edge joining the last bin; elements outside the edges or NaN are left out.
/// `density` divides by the total and by each bin's widths.
fn histogram(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let x = n.tensor(0, "self")?;
    let dd = n.op.contains("histogramdd");
    let d = x.dtype();
    if !d.is_float() {
        return Err(format!("{} of {} is not lowered", n.op, type_str(&x.ty)));
    }
    let dims = if dd {
        *x.shape().last().ok_or("histogramdd of a 0-d tensor")?
    } else {
        1
    };
    let count = if dims == 0 { 0 } else { x.ty.numel() / dims };
    let x = b.reshape(&x, &[count, dims])?;
    let tensor_bins = n.op.ends_with("bins_tensor") || n.op.ends_with("bin_tensors.default");
    let edges: Vec<Val> = if tensor_bins && dd {
        n.tensors(1, "bins")?
    } else if tensor_bins {
        vec![n.tensor(1, "bins")?]
    } else {
        let bins = n.ints(1, "bins")?;
        let range = n.opt_floats(2, "range")?;
        if range.as_ref().is_some_and(|r| r.len() as i64 != 2 * dims) {
            return Err(format!("{}: range {range:?} needs 2 numbers per dim", n.op));
        }
        (0..dims as usize)
            .map(|k| {
                let bins = *bins.get(k).or(bins.first()).ok_or("histogram: no bins")?;
                let column =
                    b.reshape(&b.slice_dim(&x, 1, k as i64, k as i64 + 1, 1)?, &[count])?;
                let (lo, hi) = match &range {
                    Some(r) => (
                        b.scalar(Scalar::Float(r[2 * k]), d)?,
                        b.scalar(Scalar::Float(r[2 * k + 1]), d)?,
                    ),
                    None if count == 0 => {
                        (b.scalar(Scalar::Int(0), d)?, b.scalar(Scalar::Int(1), d)?)
                    }
                    None => (
                        b.reduce(&column, &[0], Combiner::Min, false)?,
                        b.reduce(&column, &[0], Combiner::Max, false)?,
                    ),
                };
                let same = b.compare(&lo, &hi, "EQ")?;
                let lo = b.select(&same, &b.add_scalar(&lo, -0.5)?, &lo)?;
                let hi = b.select(&same, &b.add_scalar(&hi, 0.5)?, &hi)?;
                linspace(b, &lo, &hi, bins + 1)
            })
            .collect::<R<Vec<_>>>()?
    };
    if n.op.ends_with("_bin_edges.default") {
        return Ok(edges);
    }
    let weight = n.opt_tensor(3, "weight")?;
    let density = n.bool_or(4, "density", false)?;
    let weight = match weight {
        Some(w) => b.reshape(&b.convert(&w, d)?, &[count])?,
        None => b.splat(Scalar::Int(1), &TensorType::new(d, vec![count]))?,
    };
    // Flat bin id over all dims (row-major) and whether every coordinate is inside.
    let total: i64 = edges.iter().map(|e| e.shape()[0] - 1).product();
    let mut flat = b.splat(Scalar::Int(0), &TensorType::new(DType::I64, vec![count]))?;
    let mut inside = b.splat(
        Scalar::Bool(true),
        &TensorType::new(DType::Bool, vec![count]),
    )?;
    for (k, e) in edges.iter().enumerate() {
        let e = b.convert(e, d)?;
        let len = e.shape()[0];
        let column = b.reshape(&b.slice_dim(&x, 1, k as i64, k as i64 + 1, 1)?, &[count])?;
        let pair = [count, len];
        let col = b.broadcast_in_dim(&column, &pair, &[0])?;
        let below = b.compare(&b.broadcast_in_dim(&e, &pair, &[1])?, &col, "LE")?;
        let passed = b.reduce(&b.convert(&below, DType::I64)?, &[1], Combiner::Add, false)?;
        let last = b.full_like(Scalar::Int(len - 1), &passed)?;
        let pos = b.sub(
            &b.binary("minimum", &passed, &last)?,
            &b.full_like(Scalar::Int(1), &passed)?,
        )?;
        let first = b.reshape(&b.slice_dim(&e, 0, 0, 1, 1)?, &[])?;
        let top = b.reshape(&b.slice_dim(&e, 0, len - 1, len, 1)?, &[])?;
        let ok = b.binary(
            "and",
            &b.compare(&column, &b.broadcast_to(&first, &[count])?, "GE")?,
            &b.compare(&column, &b.broadcast_to(&top, &[count])?, "LE")?,
        )?;
        inside = b.binary("and", &inside, &ok)?;
        flat = b.add(
            &b.mul(&flat, &b.full_like(Scalar::Int(len - 1), &flat)?)?,
            &pos,
        )?;
    }
    let pair = [count, total];
    let bin = b.iota(&TensorType::new(DType::I64, pair.to_vec()), 1)?;
    let hit = b.binary(
        "and",
        &b.compare(&b.broadcast_in_dim(&flat, &pair, &[0])?, &bin, "EQ")?,
        &b.broadcast_in_dim(&inside, &pair, &[0])?,
    )?;
    let zero = b.splat(Scalar::Int(0), &TensorType::new(d, pair.to_vec()))?;
    let terms = b.select(&hit, &b.broadcast_in_dim(&weight, &pair, &[0])?, &zero)?;
    let shape: Vec<i64> = edges.iter().map(|e| e.shape()[0] - 1).collect();
    let mut hist = b.reshape(&sum_to(b, &terms, &[0], false, d)?, &shape)?;
    if density {
        let sum = sum_to(b, &hist, &(0..shape.len()).collect::<Vec<_>>(), false, d)?;
        hist = b.div(&hist, &sum)?;
        for (k, e) in edges.iter().enumerate() {
            let e = b.convert(e, d)?;
            let len = e.shape()[0];
            let width = b.sub(
                &b.slice_dim(&e, 0, 1, len, 1)?,
                &b.slice_dim(&e, 0, 0, len - 1, 1)?,
            )?;
            hist = b.div(&hist, &b.broadcast_in_dim(&width, &shape, &[k])?)?;
        }
    }
    let mut outs = vec![hist];
    if !dd {
        outs.extend(edges);
    }
    Ok(outs)
}

/// `steps` points from `lo` to `hi` (0-d) as ATen's `linspace` computes them: the first half
/// counts up from `lo`, the second half down from `hi`.
fn linspace<'a>(b: &Builder<'a>, lo: &Val<'a>, hi: &Val<'a>, steps: i64) -> R<Val<'a>> {
    let d = lo.dtype();
    let ty = TensorType::new(d, vec![steps]);
    let step = b.div(
        &b.sub(hi, lo)?,
        &b.scalar(Scalar::Int((steps - 1).max(1)), d)?,
    )?;
    let i = b.iota(&ty, 0)?;
    let up = b.add(
        &b.broadcast_to(lo, &[steps])?,
        &b.mul(&b.broadcast_to(&step, &[steps])?, &i)?,
    )?;
    let back = b.sub(&b.full_like(Scalar::Int(steps - 1), &i)?, &i)?;
    let down = b.sub(
        &b.broadcast_to(hi, &[steps])?,
        &b.mul(&b.broadcast_to(&step, &[steps])?, &back)?,
    )?;
    let first_half = b.compare(&i, &b.full_like(Scalar::Int(steps / 2), &i)?, "LT")?;
    b.select(&first_half, &up, &down)
}

/// `segment_reduce(data, reduce, lengths|offsets, axis, initial)` with 1-D segment bounds:
/// segment `s` covers `offsets[s] <= k < offsets[s + 1]` along `axis` (lengths become offsets
/// by a prefix sum), so each segment is a masked reduction over the whole axis. As in PyTorch,
/// `initial` joins every segment's reduction; a `mean` divides by the length, an empty one
/// giving `initial` (NaN without it).
fn segment_reduce(n: NodeCtx<'_>) -> Res<'_> {
    let data = n.tensor(0, "data")?;
    let reduce = n.str_or(1, "reduce", "")?;
    let axis = norm_dim(n.int_or(5, "axis", 0)?, data.rank())?;
    let initial = n.opt_scalar(7, "initial")?;
    let b = &n.b;
    let d = data.dtype();
    let offsets = match (n.opt_tensor(2, "lengths")?, n.opt_tensor(4, "offsets")?) {
        (Some(lengths), _) if lengths.rank() == 1 => {
            let lengths = b.convert(&lengths, DType::I64)?;
            let zero = b.splat(Scalar::Int(0), &TensorType::new(DType::I64, vec![1]))?;
            b.concat(&[&zero, &scan(b, &lengths, 0, Combiner::Add)?], 0)?
        }
        (None, Some(offsets)) if offsets.rank() == 1 => b.convert(&offsets, DType::I64)?,
        _ => return Err("segment_reduce needs 1-D lengths or offsets".into()),
    };
    let segments = offsets.shape()[0] - 1;
    let len = data.shape()[axis];
    let combiner = match reduce.as_str() {
        "sum" | "mean" => Combiner::Add,
        "prod" => Combiner::Mul,
        "max" => Combiner::Max,
        "min" => Combiner::Min,
        other => return Err(format!("unknown segment reduction {other:?}")),
    };
    // [segments, ...data] with the mask over (segment, axis).
    let mut shape = vec![segments];
    shape.extend(data.shape());
    let bounds = |from: i64| {
        let o = b.slice(&offsets, &[from], &[from + segments], &[1])?;
        b.broadcast_in_dim(&o, &[segments, len], &[0])
    };
    let pos = b.iota(&TensorType::new(DType::I64, vec![segments, len]), 1)?;
    let inside = b.binary(
        "and",
        &b.compare(&pos, &bounds(0)?, "GE")?,
        &b.compare(&pos, &bounds(1)?, "LT")?,
    )?;
    let inside = b.broadcast_in_dim(&inside, &shape, &[0, axis + 1])?;
    let spread = b.broadcast_in_dim(&data, &shape, &(1..shape.len()).collect::<Vec<_>>())?;
    let identity = b.splat(combiner.identity(d), &TensorType::new(d, shape.clone()))?;
    let masked = b.select(&inside, &spread, &identity)?;
    let mut y = b.reduce(&masked, &[axis + 1], combiner, false)?;
    if let Some(init) = initial {
        y = b.combine(combiner, &y, &b.full_like(init, &y)?)?;
    }
    if reduce == "mean" {
        let counts = b.sub(
            &b.slice(&offsets, &[1], &[segments + 1], &[1])?,
            &b.slice(&offsets, &[0], &[segments], &[1])?,
        )?;
        let counts = b.broadcast_in_dim(&counts, y.shape(), &[0])?;
        let empty = b.compare(&counts, &b.full_like(Scalar::Int(0), &counts)?, "EQ")?;
        let fallback = b.full_like(initial.unwrap_or(Scalar::Float(f64::NAN)), &y)?;
        y = b.select(&empty, &fallback, &b.div(&y, &b.convert(&counts, d)?)?)?;
    }
    let perm: Vec<usize> = (1..=axis).chain([0]).chain(axis + 1..data.rank()).collect();
    Ok(vec![b.transpose(&y, &perm)?])
}
