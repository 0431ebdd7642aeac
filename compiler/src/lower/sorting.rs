//! Sorting and selection: sort, topk, kthvalue, median, max/min along a dim, argmax/argmin, all on one stable
//! `stablehlo.sort` of (values, indices). Stability gives PyTorch's tie order (the first
//! occurrence wins), and the comparator ranks NaN like PyTorch: above every number.
//! `searchsorted` / `bucketize` and `mode` need no sort: they count comparisons.

use super::builder::{norm_dim, result_type, type_str, Builder, Combiner, Operand, Scalar, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(&["aten.sort.default", "aten.sort.stable"], sort);
    r.add(&["aten.topk.default"], topk);
    r.add(&["aten.kthvalue.default"], kthvalue);
    r.add(
        &[
            "aten.median.default",
            "aten.median.dim",
            "aten.nanmedian.default",
            "aten.nanmedian.dim",
        ],
        median,
    );
    r.add(
        &[
            "aten.max.dim",
            "aten.min.dim",
            "aten.argmax.default",
            "aten.argmin.default",
        ],
        extremum_dim,
    );
    r.add(
        &[
            "aten.searchsorted.Tensor",
            "aten.searchsorted.Scalar",
            "aten.bucketize.Tensor",
            "aten.bucketize.Scalar",
        ],
        searchsorted,
    );
    r.add(&["aten.mode.default"], mode);
}

/// Sorts `x` along `dim`, returning values and i64 source indices. `descending` puts NaN
/// first (PyTorch sorts NaN as the largest value); `nan_first` forces NaN first when ascending,
/// so that min picks NaN as PyTorch's min propagates it.
pub fn sort_dim<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    dim: usize,
    descending: bool,
    nan_first: bool,
) -> R<(Val<'a>, Val<'a>)> {
    let d = x.dtype();
    let idx = b.iota(&TensorType::new(DType::I64, x.shape().to_vec()), dim)?;
    let region = b.region(&[d, d, DType::I64, DType::I64], |b, a| {
        // Booleans compare as integers.
        let (p, q) = if d == DType::Bool {
            (b.convert(&a[0], DType::I32)?, b.convert(&a[1], DType::I32)?)
        } else {
            (a[0].clone(), a[1].clone())
        };
        let before = b.compare(&p, &q, if descending { "GT" } else { "LT" })?;
        if !d.is_float() {
            return Ok(vec![before]);
        }
        let (nan_p, nan_q) = (b.compare(&p, &p, "NE")?, b.compare(&q, &q, "NE")?);
        let (first, second) = if descending || nan_first {
            (nan_p, nan_q)
        } else {
            (nan_q, nan_p)
        };
        let nan_order = b.binary("and", &first, &b.unary("not", &second)?)?;
        Ok(vec![b.binary("or", &before, &nan_order)?])
    })?;
    let mut out = b.op_regions(
        "stablehlo.sort",
        &[x, &idx],
        &[
            ("dimension", format!("{dim} : i64")),
            ("is_stable", "true".into()),
        ],
        vec![region],
        vec![x.ty.clone(), idx.ty.clone()],
    )?;
    let i = out.pop().ok_or("sort produced no indices")?;
    Ok((out.remove(0), i))
}

fn sort(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    // `sort.stable(self, *, stable, dim, descending)` has keyword-only dim/descending.
    let (dim, descending) = if n.op == "aten.sort.stable" {
        (
            n.int_or(usize::MAX, "dim", -1)?,
            n.bool_or(usize::MAX, "descending", false)?,
        )
    } else {
        (n.int_or(1, "dim", -1)?, n.bool_or(2, "descending", false)?)
    };
    if x.rank() == 0 {
        let zero = n.b.scalar(Scalar::Int(0), DType::I64)?;
        return Ok(vec![x, zero]);
    }
    let (v, i) = sort_dim(&n.b, &x, norm_dim(dim, x.rank())?, descending, false)?;
    Ok(vec![v, i])
}

fn topk(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let k = n.int(1, "k")?;
    let largest = n.bool_or(3, "largest", true)?;
    if x.rank() == 0 {
        let zero = n.b.scalar(Scalar::Int(0), DType::I64)?;
        return Ok(vec![x, zero]);
    }
    let dim = norm_dim(n.int_or(2, "dim", -1)?, x.rank())?;
    let (v, i) = sort_dim(&n.b, &x, dim, largest, false)?;
    Ok(vec![
        n.b.slice_dim(&v, dim, 0, k, 1)?,
        n.b.slice_dim(&i, dim, 0, k, 1)?,
    ])
}

/// `max.dim`/`min.dim` (values and indices) and `argmax`/`argmin` (indices; no dim flattens).
/// The recorded output shape already says whether `keepdim` kept the reduced dim.
fn extremum_dim(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let largest = n.op.contains("max");
    let arg = n.op.starts_with("aten.arg");
    let (x, dim) = match n.arg(1, "dim") {
        Some(_) => (x.clone(), norm_dim(n.int(1, "dim")?, x.rank())?),
        None => (b.reshape(&x, &[x.shape().iter().product()])?, 0),
    };
    let (v, i) = if x.rank() == 0 {
        (x.clone(), b.scalar(Scalar::Int(0), DType::I64)?)
    } else {
        let (v, i) = sort_dim(b, &x, dim, largest, true)?;
        (
            b.slice_dim(&v, dim, 0, 1, 1)?,
            b.slice_dim(&i, dim, 0, 1, 1)?,
        )
    };
    let shape = &n.out(if arg { 0 } else { 1 })?.shape;
    let i = b.reshape(&i, shape)?;
    if arg {
        return Ok(vec![i]);
    }
    Ok(vec![b.reshape(&v, shape)?, i])
}

/// `kthvalue(x, k, dim, keepdim)`: the k-th smallest (1-based) and its index, NaN ranking last.
fn kthvalue<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "self")?;
    let k = n.int(1, "k")?;
    let b = &n.b;
    let shape = &n.out(0)?.shape;
    if x.rank() == 0 {
        return Ok(vec![x, b.scalar(Scalar::Int(0), DType::I64)?]);
    }
    let dim = norm_dim(n.int_or(2, "dim", -1)?, x.rank())?;
    let (v, i) = sort_dim(b, &x, dim, false, false)?;
    let pick = |t: &Val<'a>| b.reshape(&b.slice_dim(t, dim, k - 1, k, 1)?, shape);
    Ok(vec![pick(&v)?, pick(&i)?])
}

/// `median` / `nanmedian`, flattened (value only) or along `dim` (value and index): the lower
/// middle of the sorted values. `median` propagates NaN (its first NaN, sorted to the front);
/// `nanmedian` takes the middle of the non-NaN values, sorted first. The position differs per
/// row, so it is picked with a one-hot mask and a sum rather than a gather.
fn median<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let b = &n.b;
    let x = n.tensor(0, "self")?;
    let ignore_nan = n.op.starts_with("aten.nanmedian");
    let by_dim = n.op.ends_with(".dim");
    let (x, dim) = if by_dim && x.rank() > 0 {
        (x.clone(), norm_dim(n.int(1, "dim")?, x.rank())?)
    } else {
        (b.reshape(&x, &[x.shape().iter().product()])?, 0)
    };
    let (v, i) = sort_dim(b, &x, dim, false, !ignore_nan)?;
    let nan = b.convert(&b.compare(&x, &x, "NE")?, DType::I64)?;
    let nans = b.reduce(&nan, &[dim], Combiner::Add, true)?;
    let len = b.full_like(Scalar::Int(x.shape()[dim]), &nans)?;
    let (zero, one, two) = (
        b.full_like(Scalar::Int(0), &nans)?,
        b.full_like(Scalar::Int(1), &nans)?,
        b.full_like(Scalar::Int(2), &nans)?,
    );
    let k = if ignore_nan {
        let last = b.binary("maximum", &b.sub(&b.sub(&len, &nans)?, &one)?, &zero)?;
        b.div(&last, &two)?
    } else {
        let middle = b.div(&b.sub(&len, &one)?, &two)?;
        b.select(&b.compare(&nans, &zero, "GT")?, &zero, &middle)?
    };
    let pos = b.iota(&TensorType::new(DType::I64, x.shape().to_vec()), dim)?;
    let hit = b.compare(&pos, &b.broadcast_to(&k, x.shape())?, "EQ")?;
    let pick = |t: &Val<'a>, shape: &[i64]| {
        let masked = b.select(&hit, t, &b.full_like(Scalar::Int(0), t)?)?;
        b.reshape(&b.reduce(&masked, &[dim], Combiner::Add, false)?, shape)
    };
    let mut outs = vec![pick(&v, &n.out(0)?.shape)?];
    if by_dim {
        outs.push(pick(&i, &n.out(1)?.shape)?);
    }
    Ok(outs)
}

/// `searchsorted(sorted_sequence, self, out_int32, right, side, sorter)` and
/// `bucketize(self, boundaries, out_int32, right)`: for each value, how many boundaries its
/// binary search passes, i.e. the count of boundaries b with `!(b >= v)` (left) or `!(b > v)`
/// (right), ATen's own predicates (a NaN value lands after every boundary). A count does not
/// depend on the order, so `sorter` needs no gather. A 1-D sequence serves every value; an N-D
/// one pairs its leading dims with the values' leading dims.
fn searchsorted(n: NodeCtx<'_>) -> Res<'_> {
    let bucketize = n.op.starts_with("aten.bucketize");
    let (seq_pos, val_pos) = if bucketize { (1, 0) } else { (0, 1) };
    let seq = n.tensor(
        seq_pos,
        if bucketize {
            "boundaries"
        } else {
            "sorted_sequence"
        },
    )?;
    let values = n.operand(val_pos, "self")?;
    let right =
        n.bool_or(usize::MAX, "right", false)? || n.str_or(usize::MAX, "side", "left")? == "right";
    let b = &n.b;
    let dtype = result_type(&[&Operand::Tensor(seq.clone()), &values]);
    let (seq, v) = (b.convert(&seq, dtype)?, b.materialize(&values, dtype)?);
    let m = *seq
        .shape()
        .last()
        .ok_or("searchsorted: 0-d sorted_sequence")?;
    let vshape = v.shape().to_vec();
    let seq_row = if seq.rank() == 1 {
        seq.clone()
    } else {
        let lead = &seq.shape()[..seq.rank() - 1];
        if vshape.len() != seq.rank() || &vshape[..lead.len()] != lead {
            return Err(format!(
                "searchsorted: leading dims of {} and values {vshape:?} differ",
                type_str(&seq.ty)
            ));
        }
        b.reshape(&seq, &[lead, &[1, m]].concat())?
    };
    let shape = [&vshape[..], &[m]].concat();
    let v_col = b.reshape(&v, &[&vshape[..], &[1]].concat())?;
    let (seq_b, v_b) = (
        b.broadcast_to(&seq_row, &shape)?,
        b.broadcast_to(&v_col, &shape)?,
    );
    let passed = b.unary(
        "not",
        &b.compare(&seq_b, &v_b, if right { "GT" } else { "GE" })?,
    )?;
    let out = n.out_dtype()?;
    let count = b.reduce(
        &b.convert(&passed, out)?,
        &[vshape.len()],
        Combiner::Add,
        false,
    )?;
    Ok(vec![count])
}

/// `mode(x, dim, keepdim)`: the most frequent value along `dim` (the smallest among equally
/// frequent ones, as ATen scans its sorted values with a strict `>`) and the highest index
/// holding it. That index is ATen's for rows of up to 16 (its sort keeps equal values in order
/// there); for a longer row whose mode repeats, ATen's unstable sort picks some index of it,
/// which is not reproduced. Counts
/// come from an all-pairs equality, so NaN (equal to nothing) never wins over a number.
fn mode<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    if x.rank() == 0 {
        return Ok(vec![x, b.scalar(Scalar::Int(0), DType::I64)?]);
    }
    let dim = norm_dim(n.int_or(1, "dim", -1)?, x.rank())?;
    let len = x.shape()[dim];
    let mut perm: Vec<usize> = (0..x.rank()).filter(|&d| d != dim).collect();
    perm.push(dim);
    let xt = b.transpose(&x, &perm)?;
    let r = xt.rank();
    let mut pair = xt.shape().to_vec();
    pair.push(len);
    let rows: Vec<usize> = (0..r - 1).collect();
    let xi = b.broadcast_in_dim(&xt, &pair, &[&rows[..], &[r - 1]].concat())?;
    let xj = b.broadcast_in_dim(&xt, &pair, &[&rows[..], &[r]].concat())?;
    let freq = b.reduce(
        &b.convert(&b.compare(&xi, &xj, "EQ")?, DType::I64)?,
        &[r],
        Combiner::Add,
        false,
    )?;
    let top = b.reduce(&freq, &[r - 1], Combiner::Max, true)?;
    let candidate = b.compare(&freq, &b.broadcast_to(&top, freq.shape())?, "EQ")?;
    let highest = b.full_like(Combiner::Min.identity(x.dtype()), &xt)?;
    let value = b.reduce(
        &b.select(&candidate, &xt, &highest)?,
        &[r - 1],
        Combiner::Min,
        true,
    )?;
    let pos = b.iota(&TensorType::new(DType::I64, xt.shape().to_vec()), r - 1)?;
    let at = b.compare(&xt, &b.broadcast_to(&value, xt.shape())?, "EQ")?;
    let index = b.reduce(
        &b.select(&at, &pos, &b.full_like(Scalar::Int(-1), &pos)?)?,
        &[r - 1],
        Combiner::Max,
        true,
    )?;
    // Reduced in the transposed layout with the dim last and kept; the outputs say keepdim.
    Ok(vec![
        b.reshape(&value, &n.out(0)?.shape)?,
        b.reshape(&index, &n.out(1)?.shape)?,
    ])
}
