//! FFTs: ATen's `_fft_r2c` / `_fft_c2c` / `_fft_c2r` as `stablehlo.fft`, and the complex ops
//! that come with spectra: conjugation and `polar`.
//!
//! `stablehlo.fft` transforms the trailing (at most 3) dims, so the requested dims are moved to
//! the end and back. XLA's inverse transforms divide by the signal size; ATen's do not and apply
//! their `normalization` argument instead (0: none, 1: 1/sqrt(n), 2: 1/n), so the rules undo
//! XLA's factor and apply ATen's in one multiply.

use super::builder::{i64_array, inverse_perm, norm_dim, type_str, Builder, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(&["aten._fft_c2c.default"], fft_c2c);
    r.add(&["aten._fft_r2c.default"], fft_r2c);
    r.add(&["aten._fft_c2r.default"], fft_c2r);
    r.add(
        &[
            "aten._conj.default",
            "aten.conj_physical.default",
            "aten._conj_physical.default",
        ],
        conj,
    );
    r.add(&["aten.polar.default"], polar);
    r.add(&["aten.complex.default"], complex);
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Fft,
    Ifft,
    Rfft,
    Irfft,
}

/// Most dims one `stablehlo.fft` transforms.
const MAX_FFT_DIMS: usize = 3;

/// `stablehlo.fft` of `kind` over `dims` (in order, at most 3); `irfft_len` is the real output
/// length of the last dim for IRFFT.
fn fft_over<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    dims: &[usize],
    kind: Kind,
    irfft_len: i64,
) -> R<Val<'a>> {
    let rank = x.rank();
    let mut perm: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    perm.extend_from_slice(dims);
    let xt = b.transpose(x, &perm)?;
    let k = dims.len();
    let mut lengths = xt.shape()[rank - k..].to_vec();
    let mut shape = xt.shape().to_vec();
    let (name, dtype) = match kind {
        Kind::Fft => ("FFT", DType::C64),
        Kind::Ifft => ("IFFT", DType::C64),
        Kind::Rfft => {
            shape[rank - 1] = lengths[k - 1] / 2 + 1;
            ("RFFT", DType::C64)
        }
        Kind::Irfft => {
            lengths[k - 1] = irfft_len;
            shape[rank - 1] = irfft_len;
            ("IRFFT", DType::F32)
        }
    };
    let attrs = [
        ("fft_type", format!("#stablehlo<fft_type {name}>")),
        ("fft_length", i64_array(&lengths)),
    ];
    let y = b.op(
        "stablehlo.fft",
        &[&xt],
        &attrs,
        TensorType::new(dtype, shape),
    )?;
    b.transpose(&y, &inverse_perm(&perm))
}

/// Complex-to-complex FFT (or IFFT) over any number of dims, in chunks of at most 3 (the
/// multi-dim DFT is separable).
fn c2c_over<'a>(b: &Builder<'a>, x: &Val<'a>, dims: &[usize], kind: Kind) -> R<Val<'a>> {
    dims.chunks(MAX_FFT_DIMS)
        .try_fold(x.clone(), |y, chunk| fft_over(b, &y, chunk, kind, 0))
}

/// Multiplies by ATen's normalization of a transform of `n` points, after undoing XLA's 1/n
/// for inverse transforms.
fn normalize<'a>(b: &Builder<'a>, y: &Val<'a>, n: i64, norm: i64, inverse: bool) -> R<Val<'a>> {
    let n = n as f64;
    let aten = match norm {
        0 => 1.0,
        1 => 1.0 / n.sqrt(),
        2 => 1.0 / n,
        _ => return Err(format!("unknown FFT normalization {norm}")),
    };
    let scale = if inverse { n * aten } else { aten };
    if scale == 1.0 {
        return Ok(y.clone());
    }
    if y.dtype() != DType::C64 {
        return b.mul_scalar(y, scale);
    }
    // Part by part: a complex product with (scale, 0) would turn an infinite part into NaN.
    let re = b.mul_scalar(&b.complex_part("real", y)?, scale)?;
    let im = b.mul_scalar(&b.complex_part("imag", y)?, scale)?;
    b.complex(&re, &im)
}

/// The transform dims, in the order given; every rule needs at least one.
fn fft_dims(n: &NodeCtx<'_>, x: &Val<'_>, want: DType) -> R<Vec<usize>> {
    if x.dtype() != want {
        return Err(format!(
            "{} of {} is not lowered (needs {})",
            n.op,
            type_str(&x.ty),
            want.name()
        ));
    }
    let dims = n
        .ints(1, "dim")?
        .iter()
        .map(|&d| norm_dim(d, x.rank()))
        .collect::<R<Vec<_>>>()?;
    if dims.is_empty() || x.rank() == 0 {
        return Err(format!("{} needs at least one dim, got {dims:?}", n.op));
    }
    Ok(dims)
}

fn points(x: &Val<'_>, dims: &[usize]) -> i64 {
    dims.iter().map(|&d| x.shape()[d]).product()
}

/// `_fft_c2c(x, dim, normalization, forward)`.
fn fft_c2c(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let dims = fft_dims(&n, &x, DType::C64)?;
    let norm = n.int(2, "normalization")?;
    let forward = n.bool_or(3, "forward", true)?;
    let kind = if forward { Kind::Fft } else { Kind::Ifft };
    let y = c2c_over(&n.b, &x, &dims, kind)?;
    Ok(vec![normalize(
        &n.b,
        &y,
        points(&x, &dims),
        norm,
        !forward,
    )?])
}

/// `_fft_r2c(x, dim, normalization, onesided)`: a forward transform; `onesided` keeps only the
/// first n/2+1 outputs of the last dim (the rest are their conjugate mirror).
fn fft_r2c(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let dims = fft_dims(&n, &x, DType::F32)?;
    let norm = n.int(2, "normalization")?;
    let y = if n.bool_or(3, "onesided", true)? {
        let split = dims.len().saturating_sub(MAX_FFT_DIMS);
        let half = fft_over(b, &x, &dims[split..], Kind::Rfft, 0)?;
        c2c_over(b, &half, &dims[..split], Kind::Fft)?
    } else {
        c2c_over(b, &b.convert(&x, DType::C64)?, &dims, Kind::Fft)?
    };
    Ok(vec![normalize(b, &y, points(&x, &dims), norm, false)?])
}

/// `_fft_c2r(x, dim, normalization, last_dim_size)`: an inverse transform to real values of
/// length `last_dim_size` along the last dim, which reads the first last_dim_size/2+1 inputs
/// there. As in ATen, the other dims get a complex inverse transform first and the last dim a
/// one-dimensional c2r, which matters for inputs that are not Hermitian-symmetric.
fn fft_c2r(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    let dims = fft_dims(&n, &x, DType::C64)?;
    let norm = n.int(2, "normalization")?;
    let len = n.int(3, "last_dim_size")?;
    let (last, rest) = dims.split_last().ok_or("no dims")?;
    let need = len / 2 + 1;
    if len < 1 || x.shape()[*last] < need {
        return Err(format!(
            "{}: last_dim_size {len} needs {need} inputs along dim {last} of {}",
            n.op,
            type_str(&x.ty)
        ));
    }
    let x = b.slice_dim(&x, *last, 0, need, 1)?;
    let y = c2c_over(b, &x, rest, Kind::Ifft)?;
    let y = fft_over(b, &y, &[*last], Kind::Irfft, len)?;
    Ok(vec![normalize(b, &y, points(&x, rest) * len, norm, true)?])
}

/// Complex conjugate; real tensors are their own conjugate.
fn conj(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let b = &n.b;
    if x.dtype() != DType::C64 {
        return Ok(vec![x]);
    }
    let re = b.complex_part("real", &x)?;
    let im = b.unary("negate", &b.complex_part("imag", &x)?)?;
    Ok(vec![b.complex(&re, &im)?])
}

/// `polar(abs, angle)`: `abs * cos(angle) + i * abs * sin(angle)` (PyTorch's decomposition
/// writes into a view in place, which a functional graph cannot hold).
/// The two f32 operands of `polar`/`complex`, broadcast to the result's shape.
fn f32_pair<'a>(n: &NodeCtx<'a>, names: [&str; 2]) -> R<(Val<'a>, Val<'a>)> {
    let (a, b) = (n.tensor(0, names[0])?, n.tensor(1, names[1])?);
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return Err(format!(
            "{} of {} and {} is not lowered (needs f32)",
            n.op,
            type_str(&a.ty),
            type_str(&b.ty)
        ));
    }
    let shape = n.out(0)?.shape.clone();
    Ok((n.b.broadcast_to(&a, &shape)?, n.b.broadcast_to(&b, &shape)?))
}

fn polar(n: NodeCtx<'_>) -> Res<'_> {
    let (r, theta) = f32_pair(&n, ["abs", "angle"])?;
    let b = &n.b;
    let re = b.mul(&r, &b.unary("cosine", &theta)?)?;
    let im = b.mul(&r, &b.unary("sine", &theta)?)?;
    Ok(vec![b.complex(&re, &im)?])
}

/// `torch.complex(real, imag)`; PyTorch's decomposition writes into a view, which AOTAutograd
/// rejects after functionalization, so the op is lowered as itself.
fn complex(n: NodeCtx<'_>) -> Res<'_> {
    let (re, im) = f32_pair(&n, ["real", "imag"])?;
    Ok(vec![n.b.complex(&re, &im)?])
}
