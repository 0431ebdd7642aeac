//! Layer, group and (inference) batch normalization, computed in f32 for half types with
//! biased variance, returning PyTorch's saved mean / rstd as extra outputs; RMSNorm, which
//! reaches us as the ops it is written in, found among them (`rms_norms`); and a diffusion
//! transformer's modulated LayerNorm, found likewise (`modulated_norms`).

use super::builder::{lowering_target, opmath, Builder, Scalar, Val, R};
use crate::ir::{Arg, DType, Node, TensorType, ValueId};
use std::collections::HashMap;
use super::patterns::{number, value, Uses};
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
    let width: i64 = x.shape()[axis..].iter().product();
    let Some(target) = layer_norm_target(x.dtype()).filter(|_| width > 0 && x.ty.numel() > 0) else { return Ok(None) };
    let b = &n.b;
    let (weight, bias) = (n.opt_tensor(2, "weight")?, n.opt_tensor(3, "bias")?);
    let outs = layer_norm_call(b, target, (x, width), (weight.as_ref(), bias.as_ref()), eps, None)?;
    let shaped = |v: &Val<'a>, i| -> R<Val<'a>> { b.reshape(&b.convert(v, n.out(i)?.dtype)?, &n.out(i)?.shape) };
    Ok(Some(vec![shaped(&outs[0], 0)?, shaped(&outs[1], 1)?, shaped(&outs[2], 2)?]))
}

/// Our LayerNorm kernel for rows of `dtype`, where the plugin has it.
fn layer_norm_target(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => lowering_target().host_layer_norm,
        // bf16 rows computed in f32 and rounded once, as eager's (XLA's way: 3.4x eager's time
        // on SD3.5 Medium's `[2, 589, 1536]`).
        DType::Bf16 => lowering_target().host_bf16_layer_norm,
        _ => None,
    }
}

/// The LayerNorm kernel's call on `x`'s rows of `width` (its weight and bias as f32 `[width]`, 1
/// and 0 where absent), modulated by a factor and shift `[batches, 1, width]` where given: the
/// rows `[rows, width]` as `x`'s dtype, and their mean and rstd `[rows]`.
fn layer_norm_call<'a>(
    b: &Builder<'a>,
    target: &str,
    (x, width): (&Val<'a>, i64),
    (weight, bias): (Option<&Val<'a>>, Option<&Val<'a>>),
    eps: f64,
    modulation: Option<(&Val<'a>, &Val<'a>)>,
) -> R<Vec<Val<'a>>> {
    let rows = x.ty.numel() / width;
    let param = |p: Option<&Val<'a>>, default| -> R<Val<'a>> {
        match p {
            Some(p) => b.reshape(&b.convert(p, DType::F32)?, &[width]),
            None => b.splat(Scalar::Float(default), &TensorType::new(DType::F32, vec![width])),
        }
    };
    let (weight, bias) = (param(weight, 1.0)?, param(bias, 0.0)?);
    let eps = b.scalar(Scalar::Float(eps), DType::F32)?;
    let mut operands = vec![b.reshape(x, &[rows, width])?, weight, bias, eps];
    if let Some((factor, shift)) = modulation {
        for per_batch in [factor, shift] {
            operands.push(b.reshape(&b.convert(per_batch, DType::F32)?, &[per_batch.ty.numel() / width, width])?);
        }
    }
    let results = vec![TensorType::new(x.dtype(), vec![rows, width]), TensorType::new(DType::F32, vec![rows]), TensorType::new(DType::F32, vec![rows])];
    b.host_call(target, &operands.iter().collect::<Vec<_>>(), results)
}

/// A LayerNorm over the last dim whose rows a diffusion transformer modulates, `norm(x) ·
/// factor + shift` with a `factor` and `shift` `[B, 1, N]` for `x` `[B, T, N]`: AdaLN's
/// `norm(x) * (1 + scale[:, None]) + shift[:, None]` in SD3's, SD3.5's and Flux's blocks. XLA ran the
/// modulation as a loop of its own over the norm's result, read back from memory (SD3.5
/// Medium's bf16 `[2, 589, 1536]`: 343 µs for the norm, 341 more for the modulation). Only
/// from `LARGE_NORM` values on: XLA computes the factor (`1 + scale`) and the shift each as a
/// loop of its own for the kernel, where it had fused them into the modulation's, and a small
/// model's call is mostly such loops (a tiny SD3's execute 653-678 → 728-748 µs).
#[derive(Clone, Copy, Debug, PartialEq)]
struct ModulatedNorm {
    x: ValueId,
    weight: Option<ValueId>,
    bias: Option<ValueId>,
    eps: f64,
    factor: ValueId,
    shift: ValueId,
}

/// The modulated norms of a graph lowered as our kernel, by the node holding each one's result
/// (the shift's sum); the norm and product before it are left to XLA, which drops them.
pub struct ModulatedNorms {
    by_node: HashMap<usize, ModulatedNorm>,
}

impl ModulatedNorms {
    /// The modulated norms of `uses`' graph where the plugin has our kernel for their rows.
    pub fn of(uses: &Uses) -> Self {
        let mut by_node = modulated_norms(uses);
        by_node.retain(|_, norm| layer_norm_target(uses.types[norm.x as usize].dtype).is_some());
        ModulatedNorms { by_node }
    }

    /// Node `i`'s value (of type `out`) as our kernel's, where it is a modulated norm's result;
    /// `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, b: &Builder<'a>, values: &[Option<Val<'a>>], out: &TensorType) -> Option<R<Vec<Val<'a>>>> {
        let norm = self.by_node.get(&i)?;
        let operand = |v: ValueId| values.get(v as usize).cloned().flatten().ok_or_else(|| format!("%{v} is not a value"));
        let lowered = || -> R<Vec<Val<'a>>> {
            let x = operand(norm.x)?;
            let target = layer_norm_target(x.dtype()).ok_or("no LayerNorm kernel for these rows")?;
            let (weight, bias) = (norm.weight.map(operand).transpose()?, norm.bias.map(operand).transpose()?);
            let modulation = (&operand(norm.factor)?, &operand(norm.shift)?);
            let width = *x.shape().last().ok_or("a LayerNorm of a 0-d tensor")?;
            let outs = layer_norm_call(b, target, (&x, width), (weight.as_ref(), bias.as_ref()), norm.eps, Some(modulation))?;
            Ok(vec![b.reshape(&outs[0], &out.shape)?])
        };
        Some(lowered())
    }
}

/// The modulated norms of `uses`' graph (`ModulatedNorm`) whose norm and product nothing else
/// reads, by their last node.
fn modulated_norms(uses: &Uses) -> HashMap<usize, ModulatedNorm> {
    let (graph, nodes, types) = (uses.graph, &uses.graph.nodes, &uses.types);
    // The two values of `op(a, b)`, in both orders.
    let operands = |i: usize, op: &str| -> Option<[(ValueId, ValueId); 2]> {
        match nodes[i].args[..] {
            [Arg::Value(a), Arg::Value(b)] if nodes[i].op == op && nodes[i].kwargs.is_empty() => Some([(a, b), (b, a)]),
            _ => None,
        }
    };
    // Read by node `reader` alone, and not a graph output.
    let sealed = |v: ValueId, reader: usize| uses.readers(v) == [reader] && !graph.outputs.contains(&v);
    let mut found = HashMap::new();
    for last in 0..nodes.len() {
        let Some(pairs) = operands(last, "aten.add.Tensor") else { continue };
        let modulated = pairs.into_iter().find_map(|(product, shift)| {
            let times = uses.node_of(product, "aten.mul.Tensor")?;
            operands(times, "aten.mul.Tensor")?.into_iter().find_map(|(normalized, factor)| {
                let norm = uses.node_of(normalized, "aten.native_layer_norm.default")?;
                let node = &nodes[norm];
                let ty = types[normalized as usize];
                let (&[batches, _, width], Some(Arg::List(dims))) = (ty.shape.as_slice(), node.args.get(1)) else { return None };
                let per_batch = TensorType::new(ty.dtype, vec![batches, 1, width]);
                let fits = uses.output(norm) == normalized && dims.len() == 1 && nodes[last].outputs.first() == Some(ty) && nodes[times].outputs.first() == Some(ty);
                let large = ty.numel() >= LARGE_NORM;
                let sealed = sealed(normalized, times) && sealed(product, last);
                let x = value(node.args.first()?)?;
                (fits && large && sealed && types[factor as usize] == &per_batch && types[shift as usize] == &per_batch).then_some(ModulatedNorm {
                    x,
                    weight: node.args.get(2).and_then(value),
                    bias: node.args.get(3).and_then(value),
                    eps: node.args.get(4).and_then(number).unwrap_or(1e-5),
                    factor,
                    shift,
                })
            })
        });
        if let Some(norm) = modulated {
            found.insert(last, norm);
        }
    }
    found
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

/// An RMSNorm over the last dim as transformers and diffusers write it: `x · rsqrt(mean(x², -1,
/// keepdim) + eps)`, times a `weight` `[N]` or not. No ATen op of its own reaches the backend (nor
/// does `F.rms_norm`'s, which decomposes into the same ops), so the norm is recognized by them.
#[derive(Clone, Debug, PartialEq)]
struct RmsNorm {
    x: ValueId,
    weight: Option<ValueId>,
    eps: f64,
    /// `x` is bf16, converted to f32 for the norm and its result back before the weight.
    bf16: bool,
    /// `x` as a permutation of another value's dims that keeps the last one last (diffusers'
    /// queries and keys, heads moved before tokens), the value and the permutation: the norm of
    /// its rows, permuted after, is the norm of `x`'s, without XLA copying `x` into rows first
    /// (SD3.5 Medium: nine copies of 1.5-2 MB).
    permuted: Option<(ValueId, Vec<usize>)>,
}

impl RmsNorm {
    /// Our kernel for it, where the plugin has one.
    fn target(&self) -> Option<&'static str> {
        let target = lowering_target();
        if self.bf16 { target.host_bf16_rms_norm } else { target.host_rms_norm }
    }
}

/// The RMSNorms of a graph lowered as our kernel, by the node holding each one's result.
pub struct RmsNorms {
    by_node: HashMap<usize, RmsNorm>,
}

impl RmsNorms {
    /// The norms of `uses`' graph where the plugin runs our kernel (none elsewhere).
    pub fn of(uses: &Uses) -> Self {
        let mut by_node = rms_norms(uses);
        by_node.retain(|_, norm| norm.target().is_some());
        RmsNorms { by_node }
    }

    /// Node `i`'s value as our kernel's, where it is a norm's result; `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, b: &Builder<'a>, values: &[Option<Val<'a>>]) -> Option<R<Vec<Val<'a>>>> {
        let norm = self.by_node.get(&i)?;
        let target = norm.target()?;
        let operand = |v: ValueId| values.get(v as usize).cloned().flatten().ok_or_else(|| format!("%{v} is not a value"));
        let lowered = || -> R<Vec<Val<'a>>> {
            let weight = norm.weight.map(operand).transpose()?;
            let rows = norm.permuted.as_ref().map_or(norm.x, |(source, _)| *source);
            let normalized = host_rms_norm(b, target, &operand(rows)?, weight.as_ref(), norm.eps)?;
            Ok(vec![match &norm.permuted {
                Some((_, perm)) => b.transpose(&normalized, perm)?,
                None => normalized,
            }])
        };
        Some(lowered())
    }
}

/// Values from which an RMSNorm is our kernel whatever reads it: SD3.5 Medium's query and key
/// norms (`[2, 24, 256, 64]` and `[2, 24, 333, 64]`, then concatenated for the attention) as
/// XLA's fusions took 6 % more of its bf16 execute (146.3 against 138.1 ms), 2 % in f32.
const LARGE_NORM: i64 = 1 << 16;

/// The RMSNorms of `graph` whose result only products read (through views), or of `LARGE_NORM`
/// values or more, by the node whose value is that result (the weight's product, or the scaling
/// where no weight follows): of f32 rows, or of bf16 rows as transformers' `LlamaRMSNorm` and
/// diffusers' `RMSNorm` compute them (converted to f32, the scaling converted back to bf16
/// before a bf16 weight).
///
/// That node is then lowered as our kernel over `x`; the ops before it are left to XLA, which
/// drops those nothing else reads. A product is a thunk of its own, where XLA ran the norm as
/// four (a batch-8 tiny Llama's call 2.82 → 2.61-2.70 ms); a small norm read by elementwise
/// work (diffusers' queries and keys, then rotated) stays XLA's, which fuses it into that work
/// (our kernel there: a tiny Flux's call 1.20-1.24 → 1.27-1.38 ms).
fn rms_norms(uses: &Uses) -> HashMap<usize, RmsNorm> {
    let (nodes, types) = (&uses.graph.nodes, &uses.types);
    // `x` and `eps` of an `rsqrt(mean(x², -1) + eps)` over an f32 `x`.
    let inverse_rms = |rsqrt: usize| -> Option<(ValueId, f64)> {
        let sum = value(nodes[rsqrt].args.first()?)?;
        let add = &nodes[uses.node_of(sum, "aten.add.Tensor").or_else(|| uses.node_of(sum, "aten.add.Scalar"))?];
        let eps = number(add.args.get(1)?)?;
        let mean = &nodes[uses.node_of(value(add.args.first()?)?, "aten.mean.dim")?];
        let pow = &nodes[uses.node_of(value(mean.args.first()?)?, "aten.pow.Tensor_Scalar")?];
        let x = value(pow.args.first()?)?;
        let ty = types.get(x as usize)?;
        let last = ty.rank().checked_sub(1)? as i64;
        let over_last = matches!(mean.args.get(1), Some(Arg::List(d)) if matches!(d[..], [Arg::Int(d)] if d == -1 || d == last));
        let plain = add.kwargs.is_empty() && mean.kwargs.iter().all(|(_, a)| *a == Arg::None);
        (ty.dtype == DType::F32 && ty.numel() > 0 && over_last && matches!(mean.args.get(2), Some(Arg::Bool(true))) && plain && number(pow.args.get(1)?) == Some(2.0))
            .then_some((x, eps))
    };
    // The other operand of a two-value `mul`, where one of them is `v`.
    let times = |node: &Node, v: ValueId| -> Option<ValueId> {
        match node.args[..] {
            [Arg::Value(a), Arg::Value(b)] if node.op == "aten.mul.Tensor" && a == v => Some(b),
            [Arg::Value(a), Arg::Value(b)] if node.op == "aten.mul.Tensor" && b == v => Some(a),
            _ => None,
        }
    };
    let mut norms = HashMap::new();
    for (r, node) in nodes.iter().enumerate() {
        let Some((x, eps)) = (node.op == "aten.rsqrt.default").then(|| inverse_rms(r)).flatten() else { continue };
        let x_ty = types[x as usize];
        // `mul(x, rsqrt)` of `x`'s type, then `mul(that, weight)` of it with a weight `[N]`.
        let product_of = |v: ValueId, ty: &TensorType, with: &dyn Fn(ValueId) -> bool| {
            uses.readers(v).iter().copied().find_map(|i| times(&nodes[i], v).filter(|&o| with(o) && nodes[i].outputs.first() == Some(ty)).map(|o| (i, o)))
        };
        // bf16 rows: `x` converted from them, the scaling (of `x` or of them, promoted to f32 as
        // diffusers' is) converted back to their type.
        let source = uses.converted(x, DType::F32).map(|(rows, _)| rows);
        let Some((scaling, _)) = product_of(uses.output(r), x_ty, &|o| o == x || Some(o) == source) else { continue };
        let bf16 = source.and_then(|rows| {
            let narrowing = uses.readers(uses.output(scaling)).iter().copied().find(|&i| uses.converted(uses.output(i), DType::Bf16).is_some())?;
            Some((rows, narrowing))
        });
        let (x, scaled, ty) = match bf16 {
            Some((rows, narrowing)) => (rows, narrowing, types[rows as usize]),
            None => (x, scaling, x_ty),
        };
        let width = TensorType::new(ty.dtype, vec![*ty.shape.last().unwrap_or(&1)]);
        let norm = |weight| RmsNorm { x, weight, eps, bf16: bf16.is_some(), permuted: uses.permuted(x).filter(|(_, perm)| perm.last() == Some(&(perm.len() - 1))) };
        let (node, norm) = match product_of(uses.output(scaled), ty, &|o| types[o as usize] == &width) {
            Some((weighting, weight)) => (weighting, norm(Some(weight))),
            None => (scaled, norm(None)),
        };
        if uses.only_products(uses.output(node)) || types[x as usize].numel() >= LARGE_NORM {
            norms.insert(node, norm);
        }
    }
    norms
}

/// An RMSNorm's result, `[..., N]` like `x`, from our host kernel.
fn host_rms_norm<'a>(b: &Builder<'a>, target: &str, x: &Val<'a>, weight: Option<&Val<'a>>, eps: f64) -> R<Val<'a>> {
    let width = *x.shape().last().ok_or("an RMSNorm of a 0-d tensor")?;
    let weight = match weight {
        // A bf16 weight's values, exact in f32.
        Some(w) => b.reshape(&b.convert(w, DType::F32)?, &[width])?,
        None => b.splat(Scalar::Float(1.0), &TensorType::new(DType::F32, vec![width]))?,
    };
    let eps = b.scalar(Scalar::Float(eps), DType::F32)?;
    let rows = [x.ty.numel() / width.max(1), width];
    let y = b.host_call(target, &[&b.reshape(x, &rows)?, &weight, &eps], vec![TensorType::new(x.dtype(), rows.to_vec())])?;
    b.reshape(&y[0], x.shape())
}
