//! Gathers and scatters: embedding, advanced indexing (`index`, `index_put`, `index_select`),
//! `gather` / `scatter`, the slice/select/as_strided scatters, `take` / `put`,
//! `masked_scatter` and `embedding_bag`.

use super::builder::{
    broadcast_shapes, inverse_perm, norm_dim, type_str, Builder, Combiner, IndexMap, Operand,
    Scalar, Val, R,
};
use super::reduction::scan;
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(&["aten.embedding.default"], embedding);
    r.add(&["aten.embedding_renorm.default"], embedding_renorm);
    r.add(&["aten._embedding_bag_forward_only.default"], embedding_bag);
    r.add(&["aten.index.Tensor", "aten.index_select.default"], index);
    r.add(&["aten.index_put.default"], index_put);
    r.add(&["aten.take.default"], take);
    r.add(&["aten.put.default"], put);
    r.add(&["aten.masked_scatter.default"], masked_scatter);
    r.add(
        &[
            "aten.as_strided_scatter.default",
            "prims.as_strided_scatter.default",
        ],
        as_strided_scatter,
    );
    r.add(&["aten.gather.default"], gather);
    r.add(
        &[
            "aten.scatter.value",
            "aten.scatter.src",
            "aten.scatter.reduce",
            "aten.scatter.value_reduce",
            "aten.scatter_add.default",
            "aten.scatter_reduce.two",
        ],
        scatter,
    );
    r.add(&["aten.index_reduce.default"], index_reduce);
    r.add(&["aten.nonzero_static.default"], nonzero_static);
    r.add(
        &["aten.slice_scatter.default", "aten.select_scatter.default"],
        slice_scatter,
    );
    r.add(&["aten.diagonal_scatter.default"], diagonal_scatter);
    r.add(
        &["aten.as_strided.default", "aten.as_strided_copy.default"],
        as_strided,
    );
}

/// Flat storage positions of an `as_strided(size, stride, offset)` view of a contiguous tensor,
/// `offset + sum(i_k * stride_k)`, as `size + [1]` coordinates, with the map that gathers or
/// scatters one element of the flattened tensor per position.
fn strided_positions<'a>(
    b: &Builder<'a>,
    size: &[i64],
    stride: &[i64],
    offset: i64,
) -> R<(Val<'a>, IndexMap)> {
    let ty = TensorType::new(DType::I64, size.to_vec());
    let mut idx = b.splat(Scalar::Int(offset), &ty)?;
    for (k, &st) in stride.iter().enumerate() {
        let term = b.binary(
            "multiply",
            &b.iota(&ty, k)?,
            &b.splat(Scalar::Int(st), &ty)?,
        )?;
        idx = b.binary("add", &idx, &term)?;
    }
    let mut shape = size.to_vec();
    shape.push(1);
    let map = IndexMap {
        window_dims: vec![],
        collapsed: vec![0],
        index_to_operand: vec![0],
        index_vector_dim: size.len(),
    };
    Ok((b.reshape(&idx, &shape)?, map))
}

/// `as_strided(x, size, stride, offset)` over `x`'s contiguous storage (a functional graph's
/// values are contiguous): element `i` reads `flat[offset + sum(i_k * stride_k)]`, one gather.
fn as_strided(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let (size, stride) = (n.ints(1, "size")?, n.ints(2, "stride")?);
    let offset = n.int_or(3, "storage_offset", 0)?;
    let b = &n.b;
    let out = n.out(0)?.clone();
    let numel: i64 = x.shape().iter().product();
    if numel == 0 || size.iter().product::<i64>() == 0 {
        return Ok(vec![b.splat(Scalar::Int(0), &out)?]);
    }
    let flat = b.reshape(&x, &[numel])?;
    let (idx, map) = strided_positions(b, &size, &stride, offset)?;
    Ok(vec![b.gather(&flat, &idx, &map, &[1], size)?])
}

/// `as_strided_scatter(x, src, size, stride, offset)`: `x` with its `as_strided` view replaced
/// by `src`, one scatter into the flattened storage.
fn as_strided_scatter(n: NodeCtx<'_>) -> Res<'_> {
    let (x, src) = (n.tensor(0, "self")?, n.tensor(1, "src")?);
    let (size, stride) = (n.ints(2, "size")?, n.ints(3, "stride")?);
    let offset = n.int_or(4, "storage_offset", 0)?;
    let b = &n.b;
    if x.ty.numel() == 0 || size.iter().product::<i64>() == 0 {
        return Ok(vec![x]);
    }
    let flat = b.reshape(&x, &[x.ty.numel()])?;
    let (idx, map) = strided_positions(b, &size, &stride, offset)?;
    let y = b.scatter(&flat, &idx, &b.reshape(&src, &size)?, &map, None)?;
    Ok(vec![b.reshape(&y, x.shape())?])
}

fn range(from: usize, to: usize) -> Vec<i64> {
    (from as i64..to as i64).collect()
}

/// Integer indices as i64, with negative ones counted from the end of a dim of `size`.
fn wrap_index<'a>(b: &Builder<'a>, idx: &Val<'a>, size: i64) -> R<Val<'a>> {
    if idx.dtype() == DType::Bool || !idx.dtype().is_integer() {
        return Err(format!(
            "index tensors must be integers here, got {}",
            type_str(&idx.ty)
        ));
    }
    let idx = b.convert(idx, DType::I64)?;
    let neg = b.compare(&idx, &b.full_like(Scalar::Int(0), &idx)?, "LT")?;
    b.select(
        &neg,
        &b.binary("add", &idx, &b.full_like(Scalar::Int(size), &idx)?)?,
        &idx,
    )
}

/// `embedding(weight, indices)`: rows of `weight`, shape `indices.shape + [dim]`.
fn embedding(n: NodeCtx<'_>) -> Res<'_> {
    let (w, idx) = (n.tensor(0, "weight")?, n.tensor(1, "indices")?);
    let r = idx.rank();
    let map = IndexMap {
        window_dims: vec![r as i64],
        collapsed: vec![0],
        index_to_operand: vec![0],
        index_vector_dim: r,
    };
    let mut shape = idx.shape().to_vec();
    shape.push(w.shape()[1]);
    Ok(vec![n.b.gather(
        &w,
        &idx,
        &map,
        &[1, w.shape()[1]],
        shape,
    )?])
}

/// `embedding_renorm(weight, indices, max_norm, norm_type)` (`embedding`'s `max_norm`): each
/// row that `indices` names, once, is scaled by `max_norm / (norm + 1e-7)` when its p-norm
/// exceeds `max_norm`; the scale is formed in f64 as ATen does and applied in the row's dtype.
fn embedding_renorm(n: NodeCtx<'_>) -> Res<'_> {
    let (w, idx) = (n.tensor(0, "self")?, n.tensor(1, "indices")?);
    let (max_norm, p) = (n.float_or(2, "max_norm", 0.0)?, n.float_or(3, "norm_type", 2.0)?);
    let b = &n.b;
    if w.rank() != 2 || !w.dtype().is_float() {
        return Err(format!("embedding_renorm of {} is not lowered", type_str(&w.ty)));
    }
    let rows = w.shape()[0];
    let k = idx.ty.numel();
    let pair = [rows, k];
    let r = b.iota(&TensorType::new(DType::I64, pair.to_vec()), 0)?;
    let named = b.broadcast_in_dim(&b.reshape(&b.convert(&idx, DType::I64)?, &[k])?, &pair, &[1])?;
    let used = b.reduce(&b.compare(&r, &named, "EQ")?, &[1], Combiner::Or, false)?;
    let a = b.unary("abs", &w)?;
    let norm = if p == f64::INFINITY {
        b.reduce(&a, &[1], Combiner::Max, false)?
    } else if p == 1.0 {
        b.reduce(&a, &[1], Combiner::Add, false)?
    } else if p == 2.0 {
        let squares = b.binary("multiply", &a, &a)?;
        b.unary("sqrt", &b.reduce(&squares, &[1], Combiner::Add, false)?)?
    } else {
        let powered = b.binary("power", &a, &b.full_like(Scalar::Float(p), &a)?)?;
        let sum = b.reduce(&powered, &[1], Combiner::Add, false)?;
        b.binary("power", &sum, &b.full_like(Scalar::Float(1.0 / p), &sum)?)?
    };
    let norm = b.convert(&norm, DType::F64)?;
    let limit = b.full_like(Scalar::Float(max_norm), &norm)?;
    let scale = b.div(&limit, &b.add_scalar(&norm, 1e-7)?)?;
    let shrink = b.binary("and", &used, &b.compare(&norm, &limit, "GT")?)?;
    let one = b.full_like(Scalar::Int(1), &scale)?;
    let scale = b.convert(&b.select(&shrink, &scale, &one)?, w.dtype())?;
    Ok(vec![b.mul(&w, &b.broadcast_in_dim(&scale, w.shape(), &[0])?)?])
}

/// `_embedding_bag_forward_only(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
/// per_sample_weights, include_last_offset, padding_idx)` with 1-D indices. Bag b holds the
/// indices `offsets[b] <= j < offsets[b + 1]` (the last bag runs to the end unless
/// `include_last_offset`, whose final offset must then be the index count, as documented;
/// ATen's kernels disagree among themselves otherwise), rows equal to `padding_idx` left out.
/// The outputs are what ATen's CPU kernel gives without grad: the bag sum (rows scaled by `per_sample_weights`), mean or max,
/// 0 for an empty bag; each index's bag (when the recorded offset2bag is not empty); bag sizes
/// (non-padding counts for mean/max, zeros for sum); max_indices (max: each feature's weight row
/// of the bag's first maximum; mean: the bag sizes; sum: zeros). Recorded shapes longer than
/// the bag count (ATen's meta sizes bag_size like offsets) are padded with zeros.
fn embedding_bag<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let b = &n.b;
    let w = n.tensor(0, "weight")?;
    let (idx, offsets) = (n.tensor(1, "indices")?, n.tensor(2, "offsets")?);
    let mode = n.int_or(4, "mode", 0)?;
    let weights = n.opt_tensor(6, "per_sample_weights")?;
    let include_last = n.bool_or(7, "include_last_offset", false)?;
    let padding = n.int_or(8, "padding_idx", -1)?;
    if idx.rank() != 1 || offsets.rank() != 1 || w.rank() != 2 || !(0..=2).contains(&mode) {
        return Err(format!(
            "embedding_bag of indices {} offsets {} weight {} mode {mode} is not lowered",
            type_str(&idx.ty),
            type_str(&offsets.ty),
            type_str(&w.ty)
        ));
    }
    let (len, dim, bags) = (idx.shape()[0], w.shape()[1], n.out(0)?.shape[0]);
    let d = w.dtype();
    let idx = b.convert(&idx, DType::I64)?;
    let offsets = b.convert(&offsets, DType::I64)?;
    let starts = b.slice_dim(&offsets, 0, 0, bags, 1)?;
    let ends = if include_last {
        b.slice_dim(&offsets, 0, 1, bags + 1, 1)?
    } else {
        let end = b.splat(Scalar::Int(len), &TensorType::new(DType::I64, vec![1]))?;
        b.concat(&[&b.slice_dim(&offsets, 0, 1, bags, 1)?, &end], 0)?
    };
    let pair = [bags, len];
    let j = b.iota(&TensorType::new(DType::I64, pair.to_vec()), 1)?;
    let starts_b = b.broadcast_in_dim(&starts, &pair, &[0])?;
    let in_bag = b.binary(
        "and",
        &b.compare(&j, &starts_b, "GE")?,
        &b.compare(&j, &b.broadcast_in_dim(&ends, &pair, &[0])?, "LT")?,
    )?;
    let member = if padding >= 0 {
        let kept = b.compare(&idx, &b.full_like(Scalar::Int(padding), &idx)?, "NE")?;
        b.binary("and", &in_bag, &b.broadcast_in_dim(&kept, &pair, &[1])?)?
    } else {
        in_bag
    };
    let counts = b.reduce(&b.convert(&member, DType::I64)?, &[1], Combiner::Add, false)?;
    let cube = [bags, len, dim];
    let rows = if len == 0 {
        b.splat(Scalar::Int(0), &TensorType::new(d, vec![len, dim]))?
    } else {
        let map = IndexMap {
            window_dims: vec![1],
            collapsed: vec![0],
            index_to_operand: vec![0],
            index_vector_dim: 1,
        };
        b.gather(&w, &b.reshape(&idx, &[len, 1])?, &map, &[1, dim], vec![len, dim])?
    };
    let rows = match &weights {
        Some(s) => b.mul(&rows, &b.broadcast_in_dim(&b.convert(s, d)?, &[len, dim], &[0])?)?,
        None => rows,
    };
    let rows = b.broadcast_in_dim(&rows, &cube, &[1, 2])?;
    let member3 = b.broadcast_in_dim(&member, &cube, &[0, 1])?;
    let zero = b.splat(Scalar::Int(0), &TensorType::new(d, vec![bags, dim]))?;
    let counts_f = b.broadcast_in_dim(&b.convert(&counts, d)?, &[bags, dim], &[0])?;
    let empty = b.compare(&counts_f, &zero, "EQ")?;
    let mut max_index = None;
    let out = if mode == 2 {
        let lowest = b.full_like(Scalar::Float(f64::NEG_INFINITY), &rows)?;
        let masked = b.select(&member3, &rows, &lowest)?;
        let max = b.reduce(&masked, &[1], Combiner::Max, false)?;
        let at_max = b.binary(
            "and",
            &member3,
            &b.compare(&masked, &b.broadcast_in_dim(&max, &cube, &[0, 2])?, "EQ")?,
        )?;
        let j3 = b.iota(&TensorType::new(DType::I64, cube.to_vec()), 1)?;
        let first = b.reduce(
            &b.select(&at_max, &j3, &b.full_like(Scalar::Int(len), &j3)?)?,
            &[1],
            Combiner::Min,
            false,
        )?;
        let pick = b.compare(&j3, &b.broadcast_in_dim(&first, &cube, &[0, 2])?, "EQ")?;
        let idx3 = b.broadcast_in_dim(&idx, &cube, &[1])?;
        let row = b.reduce(
            &b.select(&pick, &idx3, &b.full_like(Scalar::Int(0), &idx3)?)?,
            &[1],
            Combiner::Add,
            false,
        )?;
        max_index = Some(row);
        b.select(&empty, &zero, &max)?
    } else {
        let sum = b.reduce(
            &b.select(&member3, &rows, &b.full_like(Scalar::Int(0), &rows)?)?,
            &[1],
            Combiner::Add,
            false,
        )?;
        if mode == 1 {
            let one = b.full_like(Scalar::Int(1), &counts_f)?;
            b.div(&sum, &b.select(&empty, &one, &counts_f)?)?
        } else {
            sum
        }
    };
    // Bag-sized i64 vectors padded (or cut) to a recorded shape and dtype.
    let fit = |v: &Val<'a>, k: usize| -> R<Val<'a>> {
        let ty = n.out(k)?;
        if ty.rank() != 1 {
            return Err(format!("embedding_bag output {k}: expected 1-D, got {}", type_str(ty)));
        }
        let fill = b.scalar(Scalar::Int(0), DType::I64)?;
        let v = b.pad(v, &fill, &[0], &[ty.shape[0] - v.shape()[0]], &[0])?;
        b.convert(&v, ty.dtype)
    };
    let zeros = b.splat(Scalar::Int(0), &TensorType::new(DType::I64, vec![bags]))?;
    let offset2bag = if n.out(1)?.numel() == 0 {
        b.splat(Scalar::Int(0), n.out(1)?)?
    } else {
        let opened = b.convert(&b.compare(&starts_b, &j, "LE")?, DType::I64)?;
        let bag = b.reduce(&opened, &[0], Combiner::Add, false)?;
        fit(&b.sub(&bag, &b.full_like(Scalar::Int(1), &bag)?)?, 1)?
    };
    let sizes = if mode == 0 { zeros.clone() } else { counts };
    let max_indices = match max_index {
        Some(m) => b.convert(&m, n.out(3)?.dtype)?,
        None if mode == 1 => fit(&sizes, 3)?,
        None => fit(&zeros, 3)?,
    };
    Ok(vec![out, offset2bag, fit(&sizes, 2)?, max_indices])
}

/// Advanced indexing as one gather/scatter over the indexed dims moved to the front.
struct Advanced<'a> {
    /// `x` transposed to indexed dims first, then the rest in order.
    xt: Val<'a>,
    /// The broadcast index tensors stacked on a trailing dim: `B + [k]`.
    indices: Val<'a>,
    map: IndexMap,
    /// Result shape in the transposed layout: `B + rest`.
    shape: Vec<i64>,
    /// Permutation from the transposed result layout to PyTorch's (identity unless the indexed
    /// dims are adjacent and not leading, where PyTorch keeps `B` in their place).
    result_perm: Vec<usize>,
    /// Permutation that brought `x` into `xt`.
    x_perm: Vec<usize>,
}

fn advanced<'a>(b: &Builder<'a>, x: &Val<'a>, indices: &[Option<Val<'a>>]) -> R<Advanced<'a>> {
    let positions: Vec<usize> = (0..indices.len())
        .filter(|&i| indices[i].is_some())
        .collect();
    let k = positions.len();
    if k == 0 {
        return Err("index with no index tensors".into());
    }
    let mut bshape = vec![];
    for &p in &positions {
        bshape = broadcast_shapes(&bshape, indices[p].as_ref().map_or(&[][..], |t| t.shape()))?;
    }
    let nb = bshape.len();
    let mut column_shape = bshape.clone();
    column_shape.push(1);
    let columns = positions
        .iter()
        .map(|&p| {
            let idx = wrap_index(b, indices[p].as_ref().ok_or("index")?, x.shape()[p])?;
            b.reshape(&b.broadcast_to(&idx, &bshape)?, &column_shape)
        })
        .collect::<R<Vec<_>>>()?;
    let stacked = b.concat(&columns.iter().collect::<Vec<_>>(), nb)?;
    let rest: Vec<usize> = (0..x.rank()).filter(|d| !positions.contains(d)).collect();
    let x_perm: Vec<usize> = positions.iter().chain(&rest).copied().collect();
    let xt = b.transpose(x, &x_perm)?;
    let mut shape = bshape.clone();
    shape.extend(rest.iter().map(|&d| x.shape()[d]));
    let adjacent = positions.windows(2).all(|w| w[1] == w[0] + 1);
    let lead = if adjacent { positions[0] } else { 0 };
    // Transposed layout is [B, pre, post]; PyTorch's is [pre, B, post] with |pre| = lead.
    let result_perm: Vec<usize> = (nb..nb + lead)
        .chain(0..nb)
        .chain(nb + lead..shape.len())
        .collect();
    let map = IndexMap {
        window_dims: range(nb, shape.len()),
        collapsed: range(0, k),
        index_to_operand: range(0, k),
        index_vector_dim: nb,
    };
    Ok(Advanced {
        xt,
        indices: stacked,
        map,
        shape,
        result_perm,
        x_perm,
    })
}

/// `x[indices]` (`index.Tensor`, with None for full dims) and `index_select(x, dim, index)`.
fn index(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let out = n.out(0)?;
    if out.numel() == 0 {
        return Ok(vec![b.splat(Scalar::Int(0), out)?]);
    }
    // `index_select` accepts a 0-d `self` (dim 0 or -1) as one element.
    let x = at_least_1d(b, &n.tensor(0, "self")?)?;
    let indices = if n.op == "aten.index_select.default" {
        let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
        let mut v = vec![None; dim];
        v.push(Some(n.tensor(2, "index")?));
        v
    } else {
        n.opt_tensors(1, "indices")?
    };
    let a = advanced(b, &x, &indices)?;
    let mut slice_sizes = vec![1; a.map.collapsed.len()];
    slice_sizes.extend(&a.xt.shape()[a.map.collapsed.len()..]);
    let g = b.gather(&a.xt, &a.indices, &a.map, &slice_sizes, a.shape.clone())?;
    Ok(vec![
        b.reshape(&b.transpose(&g, &a.result_perm)?, &out.shape)?
    ])
}

/// `x` flattened and `index` (wrapped) as the `[k, 1]` coordinates of a pointwise gather or
/// scatter on it.
fn flat_coordinates<'a>(b: &Builder<'a>, x: &Val<'a>, index: &Val<'a>) -> R<(Val<'a>, Val<'a>)> {
    let numel = x.ty.numel();
    let k = index.ty.numel();
    let flat = b.reshape(x, &[numel])?;
    let idx = b.reshape(&wrap_index(b, index, numel)?, &[k, 1])?;
    Ok((flat, idx))
}

/// `take(x, index)`: elements of the flattened `x` at `index` (negative wraps), shaped like
/// `index`.
fn take(n: NodeCtx<'_>) -> Res<'_> {
    let (x, index) = (n.tensor(0, "self")?, n.tensor(1, "index")?);
    let b = &n.b;
    let out = n.out(0)?;
    if out.numel() == 0 {
        return Ok(vec![b.splat(Scalar::Int(0), out)?]);
    }
    let (flat, idx) = flat_coordinates(b, &x, &index)?;
    let g = b.gather(&flat, &idx, &pointwise_map(1), &[1], vec![index.ty.numel()])?;
    Ok(vec![b.reshape(&g, &out.shape)?])
}

/// `put(x, index, source, accumulate)`: `source`'s elements written (or added) into the
/// flattened `x` at `index`.
fn put(n: NodeCtx<'_>) -> Res<'_> {
    let (x, index, source) = (
        n.tensor(0, "self")?,
        n.tensor(1, "index")?,
        n.tensor(2, "source")?,
    );
    let b = &n.b;
    if index.ty.numel() == 0 {
        return Ok(vec![x]);
    }
    let (flat, idx) = flat_coordinates(b, &x, &index)?;
    let src = b.reshape(&source, &[index.ty.numel()])?;
    let accumulate = n.bool_or(3, "accumulate", false)?;
    let y = b.scatter(
        &flat,
        &idx,
        &src,
        &pointwise_map(1),
        accumulate.then_some(Combiner::Add),
    )?;
    Ok(vec![b.reshape(&y, x.shape())?])
}

/// For each position of a 1-D bool `mask`, how many true positions precede it (which source
/// element a true one takes), capped at `available - 1` so false positions still index safely.
fn true_ranks<'a>(b: &Builder<'a>, mask: &Val<'a>, available: i64) -> R<Val<'a>> {
    let taken = b.convert(mask, DType::I64)?;
    let rank = b.sub(&scan(b, &taken, 0, Combiner::Add)?, &taken)?;
    b.binary("minimum", &rank, &b.full_like(Scalar::Int(available - 1), &rank)?)
}

/// `masked_scatter(x, mask, source)`: the positions where `mask` (broadcast) is true take
/// `source`'s elements in row-major order; each one's source element is its exclusive prefix
/// count of true positions.
fn masked_scatter(n: NodeCtx<'_>) -> Res<'_> {
    let (x, mask, source) = (
        n.tensor(0, "self")?,
        n.tensor(1, "mask")?,
        n.tensor(2, "source")?,
    );
    let b = &n.b;
    let shape = n.out(0)?.shape.clone();
    let x = b.broadcast_to(&x, &shape)?;
    let mask = b.broadcast_to(&b.convert(&mask, DType::Bool)?, &shape)?;
    let (numel, available) = (x.ty.numel(), source.ty.numel());
    if numel == 0 || available == 0 {
        // ATen requires as many source elements as true positions: none are taken here.
        return Ok(vec![x]);
    }
    let rank = true_ranks(b, &b.reshape(&mask, &[numel])?, available)?;
    let src = b.reshape(&source, &[available])?;
    let g = b.gather(
        &src,
        &b.reshape(&rank, &[numel, 1])?,
        &pointwise_map(1),
        &[1],
        vec![numel],
    )?;
    let g = b.convert(&b.reshape(&g, &shape)?, x.dtype())?;
    Ok(vec![b.select(&mask, &g, &x)?])
}

/// `index_put(x, indices, values, accumulate)`: the scatter form of [`index`].
fn index_put(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let indices = n.opt_tensors(1, "indices")?;
    let values = n.tensor(2, "values")?;
    let accumulate = n.bool_or(3, "accumulate", false)?;
    if let [Some(mask)] = &indices[..] {
        if mask.dtype() == DType::Bool {
            return Ok(vec![index_put_mask(b, &x, mask, &values, accumulate)?]);
        }
    }
    let a = advanced(b, &x, &indices)?;
    let torch_shape: Vec<i64> = a.result_perm.iter().map(|&p| a.shape[p]).collect();
    let updates = b.transpose(
        &b.broadcast_to(&values, &torch_shape)?,
        &inverse_perm(&a.result_perm),
    )?;
    let y = b.scatter(
        &a.xt,
        &a.indices,
        &updates,
        &a.map,
        accumulate.then_some(Combiner::Add),
    )?;
    Ok(vec![b.transpose(&y, &inverse_perm(&a.x_perm))?])
}

/// `x[mask] = values` (or `+=`) with one bool `mask` over `x`'s leading dims: the selected rows
/// keep a static place in `x`, so this is a select. `values` is one row broadcast to all, or one
/// row per selected position in row-major order (each row's exclusive prefix count of `mask`
/// picks it, as `masked_scatter` does).
fn index_put_mask<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    mask: &Val<'a>,
    values: &Val<'a>,
    accumulate: bool,
) -> R<Val<'a>> {
    let m = mask.rank();
    if m > x.rank() || mask.shape() != &x.shape()[..m] {
        return Err(format!(
            "index_put: bool mask {} must match the leading dims of {}",
            type_str(&mask.ty),
            type_str(&x.ty)
        ));
    }
    let rows = mask.ty.numel();
    let post = &x.shape()[m..];
    let row_shape: Vec<i64> = [&[rows][..], post].concat();
    let values = b.convert(values, x.dtype())?;
    let per_row = values.rank() == post.len() + 1 && values.shape()[0] != 1;
    let values = if per_row && rows > 0 {
        let available = values.shape()[0];
        let rank = true_ranks(b, &b.reshape(mask, &[rows])?, available)?;
        let map = IndexMap {
            window_dims: range(1, post.len() + 1),
            collapsed: vec![0],
            index_to_operand: vec![0],
            index_vector_dim: 1,
        };
        let slice: Vec<i64> = [&[1][..], post].concat();
        b.gather(
            &values,
            &b.reshape(&rank, &[rows, 1])?,
            &map,
            &slice,
            row_shape.clone(),
        )?
    } else {
        let values = if values.rank() == post.len() + 1 {
            b.reshape(&values, &values.shape()[1..])?
        } else {
            values
        };
        b.broadcast_to(&values, &row_shape)?
    };
    let xr = b.reshape(x, &row_shape)?;
    let new = if accumulate {
        b.add(&xr, &values)?
    } else {
        values
    };
    let pick = b.broadcast_in_dim(&b.reshape(mask, &[rows])?, &row_shape, &[0])?;
    b.reshape(&b.select(&pick, &new, &xr)?, x.shape())
}

/// Full coordinates for `gather`/`scatter` along `dim`: `index` there, the position elsewhere;
/// shape `index.shape + [rank]`.
fn coordinates<'a>(b: &Builder<'a>, x: &Val<'a>, dim: usize, index: &Val<'a>) -> R<Val<'a>> {
    let mut column = index.shape().to_vec();
    column.push(1);
    let cols = (0..x.rank())
        .map(|d| {
            let c = if d == dim {
                wrap_index(b, index, x.shape()[d])?
            } else {
                b.iota(&TensorType::new(DType::I64, index.shape().to_vec()), d)?
            };
            b.reshape(&c, &column)
        })
        .collect::<R<Vec<_>>>()?;
    b.concat(&cols.iter().collect::<Vec<_>>(), index.rank())
}

fn pointwise_map(rank: usize) -> IndexMap {
    IndexMap {
        window_dims: vec![],
        collapsed: range(0, rank),
        index_to_operand: range(0, rank),
        index_vector_dim: rank,
    }
}

/// 0-d tensors as 1-element vectors: the scatter/gather coordinate maps need a dim to index.
fn at_least_1d<'a>(b: &Builder<'a>, x: &Val<'a>) -> R<Val<'a>> {
    if x.rank() == 0 {
        b.reshape(x, &[1])
    } else {
        Ok(x.clone())
    }
}

/// `gather(x, dim, index)`: `out[i][j] = x[index[i][j]][j]` (for dim 0), shape of `index`.
fn gather(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let x = at_least_1d(b, &n.tensor(0, "self")?)?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let index = at_least_1d(b, &n.tensor(2, "index")?)?;
    let out = n.out(0)?;
    if out.shape.contains(&0) {
        // An empty index may have any rank; nothing to read.
        return Ok(vec![b.splat(Scalar::Int(0), out)?]);
    }
    let coords = coordinates(b, &x, dim, &index)?;
    let g = b.gather(
        &x,
        &coords,
        &pointwise_map(x.rank()),
        &vec![1; x.rank()],
        index.shape().to_vec(),
    )?;
    Ok(vec![b.reshape(&g, &out.shape)?])
}

/// `diagonal_scatter(x, src, offset, dim1, dim2)`: `x` with its `offset` diagonal over (`dim1`,
/// `dim2`) replaced by `src` (diagonal last): a select between `x` and `src` gathered at each
/// element's position along the diagonal. (PyTorch's decomposition writes into a view, which
/// AOTAutograd rejects after functionalization.)
fn diagonal_scatter(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let (x, src) = (n.tensor(0, "self")?, n.tensor(1, "src")?);
    let offset = n.int_or(2, "offset", 0)?;
    let rank = x.rank();
    let (d1, d2) = (norm_dim(n.int_or(3, "dim1", 0)?, rank)?, norm_dim(n.int_or(4, "dim2", 1)?, rank)?);
    let len = src.shape().last().copied().unwrap_or(0);
    if rank < 2 || d1 == d2 || src.rank() != rank - 1 || src.dtype() != x.dtype() {
        return Err(format!("diagonal_scatter of {} into {}", type_str(&src.ty), type_str(&x.ty)));
    }
    if len == 0 || x.shape().contains(&0) {
        return Ok(vec![x]);
    }
    let mut perm: Vec<usize> = (0..rank).filter(|&d| d != d1 && d != d2).collect();
    perm.extend([d1, d2]);
    let xt = b.transpose(&x, &perm)?;
    let (n1, n2) = (xt.shape()[rank - 2], xt.shape()[rank - 1]);
    let plane = TensorType::new(DType::I64, vec![n1, n2]);
    let (i, j) = (b.iota(&plane, 0)?, b.iota(&plane, 1)?);
    let on_diagonal = b.compare(&b.sub(&j, &i)?, &b.full_like(Scalar::Int(offset), &i)?, "EQ")?;
    // Position along the diagonal: the row for a diagonal above the main one, else the column.
    let k = if offset >= 0 { i } else { j };
    let k = b.binary("minimum", &k, &b.full_like(Scalar::Int(len - 1), &k)?)?;
    let rest = &xt.shape()[..rank - 2];
    let index_shape: Vec<i64> = rest.iter().copied().chain([n1 * n2]).collect();
    let index = b.broadcast_in_dim(&b.reshape(&k, &[n1 * n2])?, &index_shape, &[rank - 2])?;
    let coords = coordinates(b, &src, rank - 2, &index)?;
    let picked = b.gather(&src, &coords, &pointwise_map(src.rank()), &vec![1; src.rank()], index_shape)?;
    let picked = b.reshape(&picked, xt.shape())?;
    let mask = b.broadcast_in_dim(&on_diagonal, xt.shape(), &[rank - 2, rank - 1])?;
    let y = b.select(&mask, &picked, &xt)?;
    Ok(vec![b.transpose(&y, &inverse_perm(&perm))?])
}

/// `scatter(x, dim, index, src|value[, reduce])`, `scatter_add` and `scatter_reduce`: the
/// inverse of [`gather`], only the `index`-shaped corner of `src` taking part.
fn scatter(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let x = at_least_1d(b, &n.tensor(0, "self")?)?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let index = at_least_1d(b, &n.tensor(2, "index")?)?;
    let updates = match n.operand(3, "src")? {
        Operand::Tensor(src) => {
            let src = at_least_1d(b, &src)?;
            let limit: Vec<i64> = index.shape().to_vec();
            b.slice(&src, &vec![0; src.rank()], &limit, &vec![1; src.rank()])?
        }
        Operand::Scalar(v) => b.splat(v, &TensorType::new(x.dtype(), index.shape().to_vec()))?,
    };
    let reduce = match n.op.as_str() {
        "aten.scatter_add.default" => Some("sum".to_string()),
        "aten.scatter.reduce" | "aten.scatter.value_reduce" | "aten.scatter_reduce.two" => {
            Some(n.str_or(4, "reduce", "")?)
        }
        _ => None,
    };
    let include_self = n.bool_or(5, "include_self", true)?;
    let coords = coordinates(b, &x, dim, &index)?;
    let y = scatter_reduced(b, &x, &coords, &updates, reduce.as_deref(), include_self)?;
    Ok(vec![b.reshape(&y, &n.out(0)?.shape)?])
}

/// `index_reduce(x, dim, index, source, reduce, include_self)`: slice `i` of `source` along
/// `dim` folds into slice `index[i]` of `x`, a scatter whose coordinates are `index` broadcast
/// over `source`.
fn index_reduce(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let x = at_least_1d(b, &n.tensor(0, "self")?)?;
    let dim = norm_dim(n.int(1, "dim")?, x.rank())?;
    let source = at_least_1d(b, &n.tensor(3, "source")?)?;
    let index = b.broadcast_in_dim(&n.tensor(2, "index")?, source.shape(), &[dim])?;
    let coords = coordinates(b, &x, dim, &index)?;
    let reduce = n.str_or(4, "reduce", "")?;
    let include_self = n.bool_or(5, "include_self", true)?;
    let y = scatter_reduced(b, &x, &coords, &source, Some(&reduce), include_self)?;
    Ok(vec![b.reshape(&y, &n.out(0)?.shape)?])
}

/// Pointwise scatter of `src` into `x` at full `coords`, replacing (`reduce` None) or folding
/// with PyTorch's reduction `reduce`. Without `include_self`, targets hit at least once start
/// from the reduction's identity instead of `x`; `mean` divides the sum by the number of
/// contributions (counting `x` when included), untouched slots keeping `x`.
fn scatter_reduced<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    coords: &Val<'a>,
    src: &Val<'a>,
    reduce: Option<&str>,
    include_self: bool,
) -> R<Val<'a>> {
    let map = pointwise_map(x.rank());
    let Some(reduce) = reduce else {
        return b.scatter(x, coords, src, &map, None);
    };
    let combine = match reduce {
        "sum" | "add" | "mean" => Combiner::Add,
        "prod" | "multiply" => Combiner::Mul,
        "amax" => Combiner::Max,
        "amin" => Combiner::Min,
        other => return Err(format!("unknown scatter reduction {other:?}")),
    };
    let d = x.dtype();
    let base = if include_self {
        x.clone()
    } else {
        let bools = |shape: &[i64], v| {
            b.splat(
                Scalar::Bool(v),
                &TensorType::new(DType::Bool, shape.to_vec()),
            )
        };
        let hit = b.scatter(
            &bools(x.shape(), false)?,
            coords,
            &bools(src.shape(), true)?,
            &map,
            None,
        )?;
        b.select(&hit, &b.full_like(combine.identity(d), x)?, x)?
    };
    let y = b.scatter(&base, coords, src, &map, Some(combine))?;
    if reduce != "mean" {
        return Ok(y);
    }
    if !d.is_float() {
        // PyTorch floor-divides integer means; not lowered.
        return Err(format!("integer scatter mean ({})", type_str(&x.ty)));
    }
    let ones = b.splat(Scalar::Int(1), &TensorType::new(d, src.shape().to_vec()))?;
    let count = b.scatter(
        &b.full_like(Scalar::Int(include_self as i64), x)?,
        coords,
        &ones,
        &map,
        Some(Combiner::Add),
    )?;
    b.div(
        &y,
        &b.binary("maximum", &count, &b.full_like(Scalar::Int(1), &count)?)?,
    )
}

/// `slice_scatter(x, src, dim, start, end, step)` / `select_scatter(x, src, dim, index)`: pad
/// `src` (and a mask) out to `x`'s shape with the step as interior padding, then select.
fn slice_scatter(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let src = n.tensor(1, "src")?;
    let dim = norm_dim(n.int(2, "dim")?, x.rank())?;
    let size = x.shape()[dim];
    let b = &n.b;
    let (src, start, step) = if n.op == "aten.select_scatter.default" {
        let i = n.int(3, "index")?;
        let mut shape = src.shape().to_vec();
        shape.insert(dim, 1);
        (
            b.reshape(&src, &shape)?,
            if i < 0 { i + size } else { i },
            1,
        )
    } else {
        let s = n.int_or(3, "start", 0)?;
        (
            src,
            if s < 0 {
                (s + size).max(0)
            } else {
                s.min(size)
            },
            n.int_or(5, "step", 1)?,
        )
    };
    let src = b.convert(&src, x.dtype())?;
    let count = src.shape()[dim];
    let (mut low, mut high, mut interior) =
        (vec![0; x.rank()], vec![0; x.rank()], vec![0; x.rank()]);
    low[dim] = start;
    interior[dim] = step - 1;
    high[dim] = size - start - ((count - 1).max(0) * step + 1).min(size);
    let fill = b.scalar(Scalar::Int(0), x.dtype())?;
    let placed = b.pad(&src, &fill, &low, &high, &interior)?;
    let ones = b.splat(
        Scalar::Bool(true),
        &TensorType::new(DType::Bool, src.shape().to_vec()),
    )?;
    let mask = b.pad(
        &ones,
        &b.scalar(Scalar::Bool(false), DType::Bool)?,
        &low,
        &high,
        &interior,
    )?;
    Ok(vec![b.select(&mask, &placed, &x)?])
}

/// `nonzero_static(x, size, fill_value)`: the coordinates of the first `size` nonzero elements
/// (row-major), rows past the count filled with `fill_value`. Each nonzero element's rank among
/// them (an exclusive prefix count) is its output row; a scatter places its flat index there,
/// the zeros aimed past the end so that the scatter drops them.
fn nonzero_static(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let size = n.int(1, "size")?;
    let fill = n.int_or(2, "fill_value", -1)?;
    let b = &n.b;
    let out = n.out(0)?.clone();
    let numel: i64 = x.shape().iter().product();
    if out.shape.contains(&0) || numel == 0 {
        return Ok(vec![b.splat(Scalar::Int(fill), &out)?]);
    }
    let flat_ty = TensorType::new(DType::I64, vec![numel]);
    let nz = b.convert(
        &b.convert(&b.reshape(&x, &[numel])?, DType::Bool)?,
        DType::I64,
    )?;
    let row = b.sub(&scan(b, &nz, 0, Combiner::Add)?, &nz)?;
    let target = b.select(
        &b.convert(&nz, DType::Bool)?,
        &row,
        &b.splat(Scalar::Int(size), &flat_ty)?,
    )?;
    let rows_ty = TensorType::new(DType::I64, vec![size]);
    let flat = b.scatter(
        &b.splat(Scalar::Int(-1), &rows_ty)?,
        &b.reshape(&target, &[numel, 1])?,
        &b.iota(&flat_ty, 0)?,
        &pointwise_map(1),
        None,
    )?;
    let unused = b.compare(&flat, &b.splat(Scalar::Int(0), &rows_ty)?, "LT")?;
    let mut stride = numel;
    let cols = x
        .shape()
        .iter()
        .map(|&dim_size| {
            stride /= dim_size;
            let c = b.binary(
                "remainder",
                &b.div(&flat, &b.splat(Scalar::Int(stride), &rows_ty)?)?,
                &b.splat(Scalar::Int(dim_size), &rows_ty)?,
            )?;
            let c = b.select(&unused, &b.splat(Scalar::Int(fill), &rows_ty)?, &c)?;
            b.reshape(&c, &[size, 1])
        })
        .collect::<R<Vec<_>>>()?;
    Ok(vec![b.concat(&cols.iter().collect::<Vec<_>>(), 1)?])
}
