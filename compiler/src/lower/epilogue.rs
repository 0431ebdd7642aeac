//! Products whose bias and tanh GELU our product kernel applies to its rows while they are in
//! cache, where XLA ran the GELU as a loop of its own over the result read back from memory
//! (GPT-2's MLP, diffusers' `FeedForward` with `gelu-approximate`).
//!
//! The GELU arrives as `aten.gelu(v, approximate="tanh")` or, from transformers' `gelu_new`, as
//! the ops it is written in; `v` is an `addmm(bias, x, w)`, viewed or not. The node holding
//! the GELU's result is lowered as the kernel over `x`, `w` and the bias; the ops before it are
//! left to XLA, which drops those nothing else reads.

use super::builder::{lowering_target, Builder, HostProduct, Val, R};
use super::patterns::{number, value, Uses};
use crate::ir::{Arg, DType, Graph, Node, TensorType, ValueId};
use std::collections::{HashMap, HashSet};

/// An `addmm(bias, x, w)` whose result only a tanh GELU reads.
#[derive(Clone, Copy, Debug, PartialEq)]
struct GeluProduct {
    bias: ValueId,
    x: ValueId,
    w: ValueId,
}

/// The products of a graph lowered with their GELU, by the node holding each GELU's result.
pub struct GeluProducts {
    kernels: Option<HostProduct>,
    by_node: HashMap<usize, GeluProduct>,
}

impl GeluProducts {
    /// `graph`'s GELU products where the plugin has our kernel (none elsewhere).
    pub fn of(graph: &Graph) -> Self {
        let kernels = lowering_target().host_gemm_bias_gelu_tanh;
        GeluProducts { kernels, by_node: kernels.map(|_| gelu_products(graph)).unwrap_or_default() }
    }

    /// Node `i`'s value as our kernel's, where it is a GELU product's result that our kernel
    /// takes (a product `dot_general` gives it); `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, b: &Builder<'a>, values: &[Option<Val<'a>>], out: &TensorType) -> Option<R<Vec<Val<'a>>>> {
        let product = self.by_node.get(&i)?;
        let operand = |v: ValueId| values.get(v as usize).cloned().flatten();
        let (bias, x, w) = (operand(product.bias)?, operand(product.x)?, operand(product.w)?);
        match b.host_product_then(self.kernels, &x, &w, &bias) {
            Ok(Some(y)) => Some(b.reshape(&y, &out.shape).map(|y| vec![y])),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// √(2/π), the GELU's scale inside its tanh.
const BETA: f64 = 0.797_884_560_802_865_4;

fn gelu_products(graph: &Graph) -> HashMap<usize, GeluProduct> {
    let uses = Uses::new(graph);
    let nodes = &graph.nodes;
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
    let mut found = HashMap::new();
    for last in 0..nodes.len() {
        let Some((v, mut chain)) = aten_gelu(last).or_else(|| written_out(last)) else { continue };
        // `v`: the product, or a view of it.
        let view = defined(v, "aten.view.default").or_else(|| defined(v, "aten._unsafe_view.default"));
        let viewed = match view {
            Some(view) => nodes[view].args.first().and_then(value),
            None => Some(v),
        };
        let Some(product) = viewed.and_then(|p| defined(p, "aten.addmm.default")) else { continue };
        let addmm = &nodes[product];
        let plain = addmm.args.len() == 3 && addmm.kwargs.iter().all(|(k, a)| matches!((k.as_str(), number(a)), ("alpha" | "beta", Some(1.0))));
        let [Some(bias), Some(x), Some(w)] = [0, 1, 2].map(|i| addmm.args.get(i).and_then(value)) else { continue };
        if !plain || uses.types[uses.output(product) as usize].dtype != DType::F32 {
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
            found.insert(last, GeluProduct { bias, x, w });
        }
    }
    found
}
