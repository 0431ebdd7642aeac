//! Resampling: `grid_sampler_3d` (PyTorch decomposes the 2-D one) and antialiased
//! bilinear/bicubic upsampling, all following ATen's CPU kernels' formulas.

use super::builder::{type_str, Builder, IndexMap, Scalar, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(&["aten.grid_sampler_3d.default"], grid_sampler_3d);
    r.add(
        &[
            "aten._upsample_bilinear2d_aa.default",
            "aten._upsample_bicubic2d_aa.default",
        ],
        upsample_aa,
    );
}

/// ATen's antialiasing filters: the triangle (bilinear) and Keys' cubic with a = -0.5.
fn aa_filter(cubic: bool, x: f32) -> f32 {
    let x = x.abs();
    if !cubic {
        return if x < 1.0 { 1.0 - x } else { 0.0 };
    }
    let a = -0.5f32;
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    } else {
        0.0
    }
}

/// The `[out, in]` resampling matrix of one dim, row i holding output i's normalized filter
/// weights, computed with the f32/f64 mix of ATen's `_compute_weights_aa` so the weights agree
/// bit for bit: the filter widens by the scale when downsampling.
fn aa_weights(input: i64, output: i64, align: bool, scale: Option<f64>, cubic: bool) -> Vec<f32> {
    let scale: f32 = if align {
        if output > 1 {
            (input - 1) as f32 / (output - 1) as f32
        } else {
            0.0
        }
    } else {
        match scale {
            Some(s) if s > 0.0 => (1.0 / s) as f32,
            _ => input as f32 / output as f32,
        }
    };
    let half = if cubic { 2.0f32 } else { 1.0 };
    let support = if scale >= 1.0 { half * scale } else { half };
    let invscale: f32 = if scale >= 1.0 { (1.0 / scale as f64) as f32 } else { 1.0 };
    let mut m = vec![0f32; (output * input) as usize];
    for i in 0..output {
        let center = (scale as f64 * (i as f64 + 0.5)) as f32;
        let xmin = (((center - support) as f64 + 0.5) as i64).max(0);
        let xsize = (((center + support) as f64 + 0.5) as i64).min(input) - xmin;
        let w: Vec<f32> = (0..xsize.max(0))
            .map(|j| {
                let x = ((j + xmin) as f32 - center) as f64 + 0.5;
                aa_filter(cubic, (x * invscale as f64) as f32)
            })
            .collect();
        let total: f32 = w.iter().sum();
        for (j, wj) in w.iter().enumerate() {
            let v = if total != 0.0 { wj / total } else { *wj };
            m[(i * input + xmin) as usize + j] = v;
        }
    }
    m
}

/// `_upsample_{bilinear,bicubic}2d_aa(x [N, C, H, W], output_size, align_corners, scales_h,
/// scales_w)`: separable resampling, width first then height as ATen does, each a product with
/// a constant weight matrix (a dim whose size is unchanged is left alone, as in ATen).
fn upsample_aa<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let b = &n.b;
    let x = n.tensor(0, "self")?;
    let size = n.ints(1, "output_size")?;
    let align = n.bool_or(2, "align_corners", false)?;
    let scales = [
        n.opt_scalar(3, "scales_h")?.map(Scalar::as_f64),
        n.opt_scalar(4, "scales_w")?.map(Scalar::as_f64),
    ];
    let cubic = n.op.contains("bicubic");
    if x.rank() != 4 || size.len() != 2 || x.dtype() != DType::F32 {
        return Err(format!(
            "{} of {} to {size:?} is not lowered (needs f32 [N, C, H, W])",
            n.op,
            type_str(&x.ty)
        ));
    }
    let mut y = x.clone();
    for (k, dim) in [(1usize, 3usize), (0, 2)] {
        let (input, output) = (x.shape()[dim], size[k]);
        if input == output {
            continue;
        }
        let w = aa_weights(input, output, align, scales[k], cubic);
        let w = b.constant_f32(&w, &[output, input])?;
        let z = b.dot_general(&y, &w, (&[], &[]), (&[dim as i64], &[1]), DType::F32)?;
        // The new dim comes last; put it back in place.
        let perm: Vec<usize> = (0..dim).chain([3]).chain(dim..3).collect();
        y = b.transpose(&z, &perm)?;
    }
    Ok(vec![y])
}

/// One grid coordinate in [-1, 1] mapped to input pixels and then by the padding mode, as
/// ATen's `grid_sampler_compute_source_index` does (border clips, reflection reflects then
/// clips; NaN/inf become -100, out of bounds).
fn source_index<'a>(
    b: &Builder<'a>,
    coord: &Val<'a>,
    size: i64,
    padding: i64,
    align: bool,
) -> R<Val<'a>> {
    let size_f = size as f64;
    let c = if align {
        b.mul_scalar(&b.mul_scalar(&b.add_scalar(coord, 1.0)?, 0.5)?, size_f - 1.0)?
    } else {
        b.mul_scalar(&b.add_scalar(&b.mul_scalar(&b.add_scalar(coord, 1.0)?, size_f)?, -1.0)?, 0.5)?
    };
    let clip = |c: &Val<'a>| -> R<Val<'a>> {
        let lo = b.full_like(Scalar::Int(0), c)?;
        let hi = b.full_like(Scalar::Int(size - 1), c)?;
        b.binary("minimum", &hi, &b.binary("maximum", c, &lo)?)
    };
    let c = match padding {
        0 => c,
        1 => clip(&c)?,
        2 => {
            let (twice_low, twice_high) = if align {
                (0.0, 2.0 * (size_f - 1.0))
            } else {
                (-1.0, 2.0 * size_f - 1.0)
            };
            let reflected = if twice_low == twice_high {
                b.full_like(Scalar::Int(0), &c)?
            } else {
                let (min, span) = (twice_low / 2.0, (twice_high - twice_low) / 2.0);
                let dist = b.unary("abs", &b.add_scalar(&c, -min)?)?;
                let span_v = b.full_like(Scalar::Float(span), &dist)?;
                let extra = b.binary("remainder", &dist, &span_v)?;
                let flips = b.unary("floor", &b.div(&dist, &span_v)?)?;
                let two = b.full_like(Scalar::Int(2), &flips)?;
                let even = b.compare(
                    &b.binary("remainder", &flips, &two)?,
                    &b.full_like(Scalar::Int(0), &flips)?,
                    "EQ",
                )?;
                let up = b.add_scalar(&extra, min)?;
                let down = b.add_scalar(&b.sub(&span_v, &extra)?, min)?;
                b.select(&even, &up, &down)?
            };
            clip(&reflected)?
        }
        _ => return Err(format!("grid_sampler: unknown padding mode {padding}")),
    };
    let safe = b.compare(
        &b.unary("abs", &c)?,
        &b.full_like(Scalar::Float(2147483647.0), &c)?,
        "LT",
    )?;
    b.select(&safe, &c, &b.full_like(Scalar::Float(-100.0), &c)?)
}

/// `grid_sampler_3d(input [N, C, D, H, W], grid [N, D', H', W', 3], interpolation, padding,
/// align_corners)`: trilinear (0) or nearest (1, ties to even) samples at the grid's (x, y, z);
/// corners outside the input contribute nothing.
fn grid_sampler_3d<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let b = &n.b;
    let (input, grid) = (n.tensor(0, "input")?, n.tensor(1, "grid")?);
    let (mode, padding) = (n.int(2, "interpolation_mode")?, n.int(3, "padding_mode")?);
    let align = n.bool_or(4, "align_corners", false)?;
    if input.rank() != 5 || grid.rank() != 5 || grid.shape()[4] != 3 || mode > 1 {
        return Err(format!(
            "grid_sampler_3d of {} with grid {} and interpolation mode {mode} is not lowered",
            type_str(&input.ty),
            type_str(&grid.ty)
        ));
    }
    let out_ty = n.out(0)?.clone();
    if out_ty.numel() == 0 || input.ty.numel() == 0 {
        return Ok(vec![b.splat(Scalar::Int(0), &out_ty)?]);
    }
    // ATen's kernel computes in the input dtype itself, half types included.
    let d = input.dtype();
    let ch = input.shape()[1];
    let sizes = [input.shape()[4], input.shape()[3], input.shape()[2]]; // W, H, D for x, y, z
    let pts: Vec<i64> = grid.shape()[..4].to_vec();
    let grid = b.convert(&grid, d)?;
    let coords = (0..3)
        .map(|k| {
            let g = b.reshape(&b.slice_dim(&grid, 4, k, k + 1, 1)?, &pts)?;
            source_index(b, &g, sizes[k as usize], padding, align)
        })
        .collect::<R<Vec<_>>>()?;
    let xt = b.transpose(&b.convert(&input, d)?, &[0, 2, 3, 4, 1])?;
    let batch = b.iota(&TensorType::new(DType::I64, pts.clone()), 0)?;
    let mut col_shape = pts.clone();
    col_shape.push(1);
    let mut val_shape = pts.clone();
    val_shape.push(ch);
    let map = IndexMap {
        window_dims: vec![4],
        collapsed: vec![0, 1, 2, 3],
        index_to_operand: vec![0, 1, 2, 3],
        index_vector_dim: 4,
    };
    // The input value at integer-valued float corner (x, y, z), scaled by `weight`; zero when
    // the corner is outside the input.
    let corner = |c: [&Val<'a>; 3], weight: &Val<'a>| -> R<Val<'a>> {
        let mut valid: Option<Val<'a>> = None;
        let mut columns = vec![b.reshape(&batch, &col_shape)?];
        for k in [2, 1, 0] {
            let inside = b.binary(
                "and",
                &b.compare(c[k], &b.full_like(Scalar::Int(0), c[k])?, "GE")?,
                &b.compare(c[k], &b.full_like(Scalar::Int(sizes[k] - 1), c[k])?, "LE")?,
            )?;
            valid = Some(match valid {
                None => inside,
                Some(v) => b.binary("and", &v, &inside)?,
            });
            let i = b.convert(c[k], DType::I64)?;
            let i = b.binary("maximum", &i, &b.full_like(Scalar::Int(0), &i)?)?;
            let i = b.binary("minimum", &i, &b.full_like(Scalar::Int(sizes[k] - 1), &i)?)?;
            columns.push(b.reshape(&i, &col_shape)?);
        }
        let idx = b.concat(&columns.iter().collect::<Vec<_>>(), 4)?;
        let v = b.gather(&xt, &idx, &map, &[1, 1, 1, 1, ch], val_shape.clone())?;
        let w = b.broadcast_in_dim(weight, &val_shape, &[0, 1, 2, 3])?;
        let valid = b.broadcast_in_dim(&valid.ok_or("no coordinates")?, &val_shape, &[0, 1, 2, 3])?;
        b.select(&valid, &b.mul(&v, &w)?, &b.full_like(Scalar::Int(0), &v)?)
    };
    let sum = if mode == 1 {
        let r: Vec<Val> = coords
            .iter()
            .map(|c| b.unary("round_nearest_even", c))
            .collect::<R<_>>()?;
        corner([&r[0], &r[1], &r[2]], &b.full_like(Scalar::Int(1), &r[0])?)?
    } else {
        let lo: Vec<Val> = coords.iter().map(|c| b.unary("floor", c)).collect::<R<_>>()?;
        let hi: Vec<Val> = lo.iter().map(|l| b.add_scalar(l, 1.0)).collect::<R<_>>()?;
        // Distances to the far corner (weight of the near one) and from the near one.
        let near: Vec<Val> = (0..3).map(|k| b.sub(&hi[k], &coords[k])).collect::<R<_>>()?;
        let far: Vec<Val> = (0..3).map(|k| b.sub(&coords[k], &lo[k])).collect::<R<_>>()?;
        let mut acc: Option<Val> = None;
        // ATen's order: tnw, tne, tsw, tse, bnw, bne, bsw, bse (z outer, then y, then x).
        for bits in 0..8 {
            let pick = |k: usize| (bits >> (2 - k)) & 1 == 1; // k: 0 = z, 1 = y, 2 = x
            let (z, y, x) = (2, 1, 0);
            let w = b.mul(
                &b.mul(
                    if pick(2) { &far[x] } else { &near[x] },
                    if pick(1) { &far[y] } else { &near[y] },
                )?,
                if pick(0) { &far[z] } else { &near[z] },
            )?;
            let c = [
                if pick(2) { &hi[x] } else { &lo[x] },
                if pick(1) { &hi[y] } else { &lo[y] },
                if pick(0) { &hi[z] } else { &lo[z] },
            ];
            let v = corner(c, &w)?;
            acc = Some(match acc {
                None => v,
                Some(a) => b.add(&a, &v)?,
            });
        }
        acc.ok_or("no corners")?
    };
    let y = b.transpose(&sum, &[0, 4, 1, 2, 3])?;
    Ok(vec![b.convert(&y, out_ty.dtype)?])
}

#[cfg(test)]
mod tests {
    use super::aa_weights;

    #[test]
    fn aa_weight_rows_are_normalized_and_same_size_is_identity() {
        for cubic in [false, true] {
            for (input, output) in [(10, 3), (10, 17), (7, 7)] {
                let w = aa_weights(input, output, false, None, cubic);
                for row in w.chunks(input as usize) {
                    assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
                }
                if input == output {
                    for (i, row) in w.chunks(input as usize).enumerate() {
                        assert_eq!(row[i], 1.0);
                    }
                }
            }
        }
    }
}
