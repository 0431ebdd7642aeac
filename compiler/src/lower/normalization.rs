//! Layer, group and (inference) batch normalization, computed in f32 for half types with
//! biased variance, returning PyTorch's saved mean / rstd as extra outputs.

use super::builder::{lowering_target, opmath, Builder, Scalar, Val, R};
use crate::ir::{DType, TensorType};
use super::reduction::variance;
use super::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.native_layer_norm.default"], layer_norm);
    r.add(&["aten.native_group_norm.default"], group_norm);
    r.add(
        &["aten._native_batch_norm_legit_no_training.default"],
        batch_norm_inference,
    );
}

/// Applies the optional per-element `weight` and `bias`, mapped onto `y`'s shape by `bcast`.
fn affine<'a>(
    b: &Builder<'a>,
    y: Val<'a>,
    params: [Option<Val<'a>>; 2],
    bcast: impl Fn(&Val<'a>) -> R<Val<'a>>,
) -> R<Val<'a>> {
    let [weight, bias] = params;
    let mut y = y;
    if let Some(w) = weight {
        y = b.binary("multiply", &y, &bcast(&b.convert(&w, y.dtype())?)?)?;
    }
    if let Some(bias) = bias {
        y = b.binary("add", &y, &bcast(&b.convert(&bias, y.dtype())?)?)?;
    }
    Ok(y)
}

fn rsqrt_eps<'a>(b: &Builder<'a>, var: &Val<'a>, eps: f64) -> R<Val<'a>> {
    b.unary("rsqrt", &b.add_scalar(var, eps)?)
}

fn layer_norm(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "input")?;
    let norm_rank = n.ints(1, "normalized_shape")?.len();
    let axis = x
        .rank()
        .checked_sub(norm_rank)
        .ok_or("normalized_shape longer than the input")?;
    let eps = n.float_or(4, "eps", 1e-5)?;
    let b = &n.b;
    if let Some(outs) = host_layer_norm(&n, &x, axis, eps)? {
        return Ok(outs);
    }
    let dims: Vec<usize> = (axis..x.rank()).collect();
    let (var, mean) = variance(b, &x, &dims, 0.0)?;
    let rstd = rsqrt_eps(b, &var, eps)?;
    let xf = b.convert(&x, opmath(x.dtype()))?;
    let y = b.mul(&b.sub(&xf, &mean)?, &rstd)?;
    let y = affine(
        b,
        y,
        [n.opt_tensor(2, "weight")?, n.opt_tensor(3, "bias")?],
        |p| b.broadcast_to(p, x.shape()),
    )?;
    Ok(vec![
        b.convert(&y, n.out(0)?.dtype)?,
        b.convert(&mean, n.out(1)?.dtype)?,
        b.convert(&rstd, n.out(2)?.dtype)?,
    ])
}

/// `layer_norm`'s outputs from our host kernel (`tpu_dynamo_runtime::host_kernels`) where the
/// plugin has it: f32 rows of the normalized dims (XLA:CPU ran five ops, each on its own thread
/// hand-off, where the arithmetic of a small model's rows takes less than one).
fn host_layer_norm<'a>(n: &NodeCtx<'a>, x: &Val<'a>, axis: usize, eps: f64) -> R<Option<Vec<Val<'a>>>> {
    let Some(target) = lowering_target().host_layer_norm else { return Ok(None) };
    let width: i64 = x.shape()[axis..].iter().product();
    if x.dtype() != DType::F32 || width == 0 || x.ty.numel() == 0 {
        return Ok(None);
    }
    let b = &n.b;
    let rows = x.ty.numel() / width;
    let param = |i, name, default| -> R<Val<'a>> {
        match n.opt_tensor(i, name)? {
            Some(p) => b.reshape(&b.convert(&p, DType::F32)?, &[width]),
            None => b.splat(Scalar::Float(default), &TensorType::new(DType::F32, vec![width])),
        }
    };
    let (weight, bias) = (param(2, "weight", 1.0)?, param(3, "bias", 0.0)?);
    let eps = b.scalar(Scalar::Float(eps), DType::F32)?;
    let results = vec![TensorType::new(DType::F32, vec![rows, width]), TensorType::new(DType::F32, vec![rows]), TensorType::new(DType::F32, vec![rows])];
    let outs = b.host_call(target, &[&b.reshape(x, &[rows, width])?, &weight, &bias, &eps], results)?;
    let shaped = |v: &Val<'a>, i| -> R<Val<'a>> { b.reshape(v, &n.out(i)?.shape) };
    Ok(Some(vec![shaped(&outs[0], 0)?, shaped(&outs[1], 1)?, shaped(&outs[2], 2)?]))
}

/// `native_group_norm(x, weight, bias, N, C, HxW, group, eps)`: statistics over each group of
/// channels (and all spatial positions); mean / rstd have shape `[N, group]`. The output is
/// `x · scale + shift` with per-(sample, channel) `scale = rstd · weight` and `shift = bias −
/// mean · scale`, as ATen's CPU kernel computes it: reading `x` alone, the output needs no
/// `x − mean` kept from the variance's pass (XLA wrote that out in full, 2.6-2.9x eager's time).
fn group_norm<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "input")?;
    let (batch, groups) = (n.int(3, "N")?, n.int(6, "group")?);
    let channels = *x.shape().get(1).ok_or("group_norm of an input without channels")?;
    let eps = n.float_or(7, "eps", 1e-5)?;
    let b = &n.b;
    let xf = b.convert(&x, opmath(x.dtype()))?;
    let grouped = b.reshape(&xf, &[batch, groups, x.ty.numel() / (batch * groups)])?;
    let (var, mean) = variance(b, &grouped, &[2], 0.0)?;
    let rstd = rsqrt_eps(b, &var, eps)?;
    // [N, G, 1] -> [N, C]: channel c belongs to group c / (C / G).
    let per_channel = |v: &Val<'a>| {
        let spread = b.broadcast_in_dim(&b.reshape(v, &[batch, groups])?, &[batch, groups, channels / groups], &[0, 1])?;
        b.reshape(&spread, &[batch, channels])
    };
    let channel_param = |p: &Val<'a>| b.broadcast_in_dim(&b.convert(p, xf.dtype())?, &[batch, channels], &[1]);
    let mut scale = per_channel(&rstd)?;
    if let Some(w) = n.opt_tensor(1, "weight")? {
        scale = b.mul(&scale, &channel_param(&w)?)?;
    }
    let mut shift = b.unary("negate", &b.mul(&per_channel(&mean)?, &scale)?)?;
    if let Some(bias) = n.opt_tensor(2, "bias")? {
        shift = b.add(&shift, &channel_param(&bias)?)?;
    }
    let spread = |v: &Val<'a>| b.broadcast_in_dim(v, x.shape(), &[0, 1]);
    let y = b.add(&b.mul(&xf, &spread(&scale)?)?, &spread(&shift)?)?;
    let stat = |v: &Val<'a>, i| b.convert(&b.reshape(v, &[batch, groups])?, n.out(i)?.dtype);
    Ok(vec![
        b.convert(&y, n.out(0)?.dtype)?,
        stat(&mean, 1)?,
        stat(&rstd, 2)?,
    ])
}

/// Eval-mode batch norm with running statistics; the saved-statistics outputs are empty.
fn batch_norm_inference<'a>(n: NodeCtx<'a>) -> Res<'a> {
    let x = n.tensor(0, "input")?;
    let (mean, var) = (n.tensor(3, "running_mean")?, n.tensor(4, "running_var")?);
    let eps = n.float_or(6, "eps", 1e-5)?;
    let b = &n.b;
    let f = opmath(x.dtype());
    let chan = |v: &Val<'a>| b.broadcast_in_dim(&b.convert(v, f)?, x.shape(), &[1]);
    let rstd = rsqrt_eps(b, &b.convert(&var, f)?, eps)?;
    let y = b.mul(&b.sub(&b.convert(&x, f)?, &chan(&mean)?)?, &chan(&rstd)?)?;
    let y = affine(
        b,
        y,
        [n.opt_tensor(1, "weight")?, n.opt_tensor(2, "bias")?],
        |p| b.broadcast_in_dim(p, x.shape(), &[1]),
    )?;
    Ok(vec![
        b.convert(&y, x.dtype())?,
        b.splat(Scalar::Int(0), n.out(1)?)?,
        b.splat(Scalar::Int(0), n.out(2)?)?,
    ])
}
