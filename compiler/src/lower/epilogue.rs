//! Products whose rows our product kernel finishes while they are in cache, where XLA ran what
//! follows as a loop of its own over the result read back from memory:
//! - an `addmm(bias, x, w)`, viewed or not, then a tanh GELU (GPT-2's MLP, diffusers'
//!   `FeedForward` with `gelu-approximate`): the GELU arrives as `aten.gelu(v,
//!   approximate="tanh")` or, from transformers' `gelu_new`, as the ops it is written in; in
//!   bf16 only the first, which eager computes in f32 from the rounded product and rounds once
//!   (each op written out rounds to bf16, which the kernel would not);
//! - an `mm(x, w)`, viewed or not, then SiLU (`v · sigmoid(v)`, or `aten.silu`) times another
//!   value of its shape (Llama's gated MLP: `silu(gate_proj(x)) * up_proj(x)`); in bf16 SiLU as
//!   one op, or as its decomposition computes it, in f32 between two converts (rounded once);
//! - an `mm(x, w)` or `addmm(bias, x, w)`, viewed or not, plus a residual of its shape (a
//!   transformer block's `residual + o_proj(h)`, GPT-2's `attn_output + residual`), in f32: a
//!   `[1024, 64]` sum cost XLA:CPU 16-30 µs as a loop of its own after the product.
//!
//! A bf16 kernel rounds where eager's ops do: the product, the GELU or SiLU, their product by
//! the factor.
//!
//! The node holding the result is lowered as the kernel over `x`, `w` and the bias or the
//! factor; the ops before it are left to XLA, which drops those nothing else reads.

use super::builder::{lowering_target, Builder, HostProduct, Val, R};
use super::patterns::{number, value, Uses};
use crate::ir::{Arg, DType, Node, TensorType, ValueId};
use std::collections::{HashMap, HashSet};

/// What the kernel applies after the product.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Finish {
    /// The bias, then the tanh GELU.
    BiasGeluTanh,
    /// SiLU, then times the factor.
    SiluTimes,
    /// The residual added.
    Plus,
    /// The bias, then the residual added.
    BiasPlus,
}

/// A product `x @ w` finished by the kernel, with its other operands: the bias `[N]`, and the
/// factor or the residual, shaped as the result.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Finished {
    x: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
    shaped: Option<ValueId>,
    finish: Finish,
    dtype: DType,
}

impl Finished {
    /// The kernels that finish it, where the plugin has them.
    fn kernels(&self) -> Option<HostProduct> {
        let target = lowering_target();
        match (self.finish, self.dtype) {
            (Finish::BiasGeluTanh, DType::F32) => target.host_gemm_bias_gelu_tanh,
            (Finish::BiasGeluTanh, DType::Bf16) => target.host_bf16_gemm_bias_gelu_tanh,
            (Finish::SiluTimes, DType::F32) => target.host_gemm_silu_times,
            (Finish::SiluTimes, DType::Bf16) => target.host_bf16_gemm_silu_times,
            (Finish::Plus, DType::F32) => target.host_gemm_plus,
            (Finish::BiasPlus, DType::F32) => target.host_gemm_bias_plus,
            _ => None,
        }
    }
}

/// The finished products of a graph, by the node holding each one's result.
pub struct FinishedProducts {
    by_node: HashMap<usize, Finished>,
}

impl FinishedProducts {
    /// The finished products of `uses`' graph where the plugin has our kernels (none elsewhere).
    pub fn of(uses: &Uses) -> Self {
        let mut by_node = finished_products(uses);
        by_node.retain(|_, product| product.kernels().is_some());
        FinishedProducts { by_node }
    }

    /// Node `i`'s value (of type `out`) as our kernel's, where it is a finished product's result
    /// and `dot_general` would give the product to our kernel; `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, b: &Builder<'a>, values: &[Option<Val<'a>>], out: &TensorType) -> Option<R<Vec<Val<'a>>>> {
        let product = self.by_node.get(&i)?;
        let operand = |v: ValueId| values.get(v as usize).cloned().flatten();
        // An operand the product may not have: `None` where it has one not lowered.
        let optional = |v: Option<ValueId>| v.map_or(Some(None), |v| operand(v).map(Some));
        let (x, w) = (operand(product.x)?, operand(product.w)?);
        let (bias, shaped) = (optional(product.bias)?, optional(product.shaped)?);
        let lowered = || -> R<Option<Val<'a>>> {
            let rows = x.shape().first().copied().unwrap_or(1);
            let shaped = shaped.as_ref().map(|t| b.reshape(t, &[rows, out.numel() / rows.max(1)])).transpose()?;
            let extra: Vec<&Val<'a>> = bias.iter().chain(shaped.as_ref()).collect();
            b.host_product_then(product.kernels(), &x, &w, &extra)?.map(|y| b.reshape(&y, &out.shape)).transpose()
        };
        lowered().transpose().map(|y| y.map(|y| vec![y]))
    }
}

/// √(2/π), the GELU's scale inside its tanh.
const BETA: f64 = 0.797_884_560_802_865_4;

fn finished_products(uses: &Uses) -> HashMap<usize, Finished> {
    let (graph, nodes) = (uses.graph, &uses.graph.nodes);
    // The tensor operand of `op(t, c)` or `op(c, t)` for the number `c`.
    let with_number = |node: &Node, op: &str, c: f64| -> Option<ValueId> {
        let close = |a: &Arg| number(a).is_some_and(|n| (n - c).abs() <= 1e-12 * c.abs());
        match &node.args[..] {
            [Arg::Value(t), n] | [n, Arg::Value(t)] if node.op == op && node.kwargs.is_empty() && close(n) => Some(*t),
            _ => None,
        }
    };
    let defined = |v: ValueId, op: &str| uses.node_of(v, op);
    // `v` and the chain's nodes, where node `last` is `0.5·v · (tanh(β·(v + κ·v³)) + 1)`.
    let written_out = |last: usize| -> Option<(ValueId, Vec<usize>)> {
        let [Arg::Value(p), Arg::Value(q)] = nodes[last].args[..] else { return None };
        if nodes[last].op != "aten.mul.Tensor" {
            return None;
        }
        let (half, plus_one) = [(p, q), (q, p)].into_iter().find_map(|(h, o)| {
            let half = defined(h, "aten.mul.Tensor").filter(|&i| with_number(&nodes[i], "aten.mul.Tensor", 0.5).is_some())?;
            Some((half, defined(o, "aten.add.Tensor")?))
        })?;
        let v = with_number(&nodes[half], "aten.mul.Tensor", 0.5)?;
        let tanh = defined(with_number(&nodes[plus_one], "aten.add.Tensor", 1.0)?, "aten.tanh.default")?;
        let scaled = defined(value(nodes[tanh].args.first()?)?, "aten.mul.Tensor")?;
        let sum = defined(with_number(&nodes[scaled], "aten.mul.Tensor", BETA)?, "aten.add.Tensor")?;
        let [Arg::Value(s1), Arg::Value(s2)] = nodes[sum].args[..] else { return None };
        if !nodes[sum].kwargs.is_empty() {
            return None;
        }
        let cubed_term = if s1 == v { s2 } else if s2 == v { s1 } else { return None };
        let kappa = defined(cubed_term, "aten.mul.Tensor")?;
        let pow = defined(with_number(&nodes[kappa], "aten.mul.Tensor", 0.044715)?, "aten.pow.Tensor_Scalar")?;
        (value(nodes[pow].args.first()?)? == v && nodes[pow].args.get(1).and_then(number) == Some(3.0))
            .then(|| (v, vec![half, plus_one, tanh, scaled, sum, kappa, pow]))
    };
    let aten_gelu = |last: usize| -> Option<(ValueId, Vec<usize>)> {
        let node = &nodes[last];
        let approximate = node.args.get(1).or_else(|| node.kwargs.iter().find(|(k, _)| k == "approximate").map(|(_, a)| a));
        if node.op != "aten.gelu.default" || !matches!(approximate, Some(Arg::Str(s)) if s == "tanh") {
            return None;
        }
        Some((value(node.args.first()?)?, vec![]))
    };
    // `v` and the chain's nodes, where `s` is `silu(v)`, and whether the chain is one op (which
    // rounds once).
    let silu = |s: ValueId| -> Option<(ValueId, Vec<usize>, bool)> {
        if let Some(silu) = defined(s, "aten.silu.default") {
            return Some((value(nodes[silu].args.first()?)?, vec![silu], true));
        }
        let times = defined(s, "aten.mul.Tensor")?;
        let [Arg::Value(a), Arg::Value(c)] = nodes[times].args[..] else { return None };
        [(a, c), (c, a)].into_iter().find_map(|(v, sig)| {
            let sigmoid = defined(sig, "aten.sigmoid.default")?;
            (value(nodes[sigmoid].args.first()?)? == v).then(|| (v, vec![times, sigmoid], false))
        })
    };
    // `v`, the factor and the chain's nodes, where node `last` is `silu(v) · factor`, and
    // whether SiLU rounds once: one op, or a bf16 `v` converted to f32 for it and back after
    // (`aten.silu`'s decomposition in bf16).
    let silu_times = |last: usize| -> Option<(ValueId, ValueId, Vec<usize>, bool)> {
        let [Arg::Value(p), Arg::Value(q)] = nodes[last].args[..] else { return None };
        if nodes[last].op != "aten.mul.Tensor" {
            return None;
        }
        [(p, q), (q, p)].into_iter().find_map(|(s, factor)| {
            if let Some((v, chain, rounds_once)) = silu(s) {
                return Some((v, factor, chain, rounds_once));
            }
            let (narrowed, narrow) = uses.converted(s, DType::Bf16)?;
            let (wide, mut chain, _) = silu(narrowed)?;
            let (v, widen) = uses.converted(wide, DType::F32)?;
            chain.extend([narrow, widen]);
            Some((v, factor, chain, true))
        })
    };
    // The view node `v` is, if any, and the value it views (`v` itself where none).
    let viewed = |v: ValueId| -> (Option<usize>, ValueId) { uses.viewed(v).map_or((None, v), |(view, of)| (Some(view), of)) };
    // `v` and the residual, where node `last` is `v + residual` (either order, `alpha` 1), all
    // three of one type, and `v` is a product or a view of one.
    let residual_add = |last: usize| -> Option<(ValueId, ValueId)> {
        let node = &nodes[last];
        let [Arg::Value(p), Arg::Value(q)] = node.args[..] else { return None };
        let unscaled = node.kwargs.iter().all(|(k, a)| k == "alpha" && number(a) == Some(1.0));
        if node.op != "aten.add.Tensor" || !unscaled {
            return None;
        }
        let sum = uses.types[uses.output(last) as usize];
        let product = |v: ValueId| {
            let p = viewed(v).1;
            defined(p, "aten.mm.default").or_else(|| defined(p, "aten.addmm.default"))
        };
        [(p, q), (q, p)].into_iter().find(|&(v, r)| uses.types[v as usize] == sum && uses.types[r as usize] == sum && product(v).is_some())
    };
    let mut found = HashMap::new();
    for last in 0..nodes.len() {
        // `rounds_once`: the finish rounds once, as one op of ATen's (a bf16 kernel's does too).
        // `shaped`: the factor or the residual.
        let (v, mut chain, finish, shaped, rounds_once) = match (aten_gelu(last), written_out(last)) {
            (Some((v, chain)), _) => (v, chain, Finish::BiasGeluTanh, None, true),
            (_, Some((v, chain))) => (v, chain, Finish::BiasGeluTanh, None, false),
            _ => match (silu_times(last), residual_add(last)) {
                (Some((v, factor, chain, rounds_once)), _) => (v, chain, Finish::SiluTimes, Some(factor), rounds_once),
                // An f32 sum only (its kernels are), the bias told by the product below.
                (_, Some((v, residual))) => (v, vec![], Finish::Plus, Some(residual), false),
                _ => continue,
            },
        };
        // `v`: the product, or a view of it.
        let (view, viewed) = viewed(v);
        let (product, finish) = match finish {
            Finish::SiluTimes => (defined(viewed, "aten.mm.default"), finish),
            Finish::Plus => match defined(viewed, "aten.addmm.default") {
                Some(addmm) => (Some(addmm), Finish::BiasPlus),
                None => (defined(viewed, "aten.mm.default"), Finish::Plus),
            },
            _ => (defined(viewed, "aten.addmm.default"), finish),
        };
        let Some(product) = product else { continue };
        let node = &nodes[product];
        let plain = node.kwargs.iter().all(|(k, a)| matches!((k.as_str(), number(a)), ("alpha" | "beta", Some(1.0))));
        let operands: Vec<Option<ValueId>> = node.args.iter().map(value).collect();
        let (x, w, bias) = match (finish, &operands[..]) {
            (Finish::BiasGeluTanh | Finish::BiasPlus, &[Some(bias), Some(x), Some(w)]) => (x, w, Some(bias)),
            (Finish::SiluTimes | Finish::Plus, &[Some(x), Some(w)]) => (x, w, None),
            _ => continue,
        };
        // The factor as `v` is (the other product, viewed alike).
        if finish == Finish::SiluTimes && !shaped.is_some_and(|factor| uses.types[factor as usize] == uses.types[v as usize]) {
            continue;
        }
        let dtype = uses.types[uses.output(product) as usize].dtype;
        if !plain || !(dtype == DType::F32 || dtype == DType::Bf16 && rounds_once) {
            continue;
        }
        // Nothing outside the chain may read its values (they are not computed apart).
        chain.push(product);
        chain.extend(view);
        let inside: HashSet<usize> = chain.iter().copied().chain([last]).collect();
        let sealed = chain.iter().all(|&i| {
            let out = uses.output(i);
            !graph.outputs.contains(&out) && uses.readers(out).iter().all(|r| inside.contains(r))
        });
        if sealed {
            found.insert(last, Finished { x, w, bias, shaped, finish, dtype });
        }
    }
    found
}
