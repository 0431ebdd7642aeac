//! What the passes that find a composite among a graph's ATen ops (RMSNorm, a product's GELU)
//! ask of the graph: which node defines a value, which nodes read it, its type.

use super::builder::norm_dim;
use crate::ir::{Arg, DType, Graph, Node, TensorType, ValueId};
use std::collections::HashMap;

/// A graph's values by the nodes that define and read them.
pub struct Uses<'g> {
    pub graph: &'g Graph,
    pub types: Vec<&'g TensorType>,
    defined_by: Vec<Option<usize>>,
    first_output: Vec<ValueId>,
    readers: HashMap<ValueId, Vec<usize>>,
}

impl<'g> Uses<'g> {
    pub fn new(graph: &'g Graph) -> Self {
        let mut defined_by = vec![None; graph.inputs.len()];
        let mut first_output = Vec::with_capacity(graph.nodes.len());
        let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for (i, node) in graph.nodes.iter().enumerate() {
            first_output.push(defined_by.len() as ValueId);
            defined_by.extend(std::iter::repeat_n(Some(i), node.outputs.len()));
            let mut args: Vec<&Arg> = node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a)).collect();
            while let Some(arg) = args.pop() {
                match arg {
                    Arg::Value(v) => readers.entry(*v).or_default().push(i),
                    Arg::List(items) => args.extend(items),
                    _ => {}
                }
            }
        }
        Uses { graph, types: graph.value_types(), defined_by, first_output, readers }
    }

    /// The node defining `v`, where it is an `op`.
    pub fn node_of(&self, v: ValueId, op: &str) -> Option<usize> {
        self.defined_by.get(v as usize).copied().flatten().filter(|&i| self.graph.nodes[i].op == op)
    }

    /// Where `v` is a bf16 value converted to f32 (`to` f32) or an f32 one converted to bf16
    /// (`to` bf16), its shape kept (`_to_copy`, or `convert_element_type`): that value, and the
    /// converting node.
    pub fn converted(&self, v: ValueId, to: DType) -> Option<(ValueId, usize)> {
        let node = self.node_of(v, "aten._to_copy.default").or_else(|| self.node_of(v, "prims.convert_element_type.default"))?;
        let from = value(self.graph.nodes[node].args.first()?)?;
        let (from_ty, ty) = (self.types.get(from as usize)?, self.types.get(v as usize)?);
        let other = match to {
            DType::F32 => DType::Bf16,
            DType::Bf16 => DType::F32,
            _ => return None,
        };
        (ty.dtype == to && from_ty.dtype == other && from_ty.shape == ty.shape).then_some((from, node))
    }

    /// Node `i`'s first value.
    pub fn output(&self, i: usize) -> ValueId {
        self.first_output[i]
    }

    /// The nodes reading `v` (once per argument that names it).
    pub fn readers(&self, v: ValueId) -> &[usize] {
        self.readers.get(&v).map_or(&[], Vec::as_slice)
    }

    /// Whether only products read `v`, directly or through (up to four) views of it.
    pub fn only_products(&self, v: ValueId) -> bool {
        const PRODUCTS: [&str; 3] = ["aten.mm.default", "aten.addmm.default", "aten.bmm.default"];
        const VIEWS: [&str; 4] = ["aten.view.default", "aten._unsafe_view.default", "aten.alias.default", "aten.slice.Tensor"];
        self.only_read_by(v, &|node: &Node| VIEWS.contains(&node.op.as_str()), &|node: &Node| PRODUCTS.contains(&node.op.as_str()))
    }

    /// Whether only nodes `reads` accepts read `v`, directly or through (up to four) nodes
    /// `through` accepts (views of it), and it is not a graph output.
    pub fn only_read_by(&self, v: ValueId, through: &dyn Fn(&Node) -> bool, reads: &dyn Fn(&Node) -> bool) -> bool {
        self.only_read_within(v, through, reads, 0)
    }

    fn only_read_within(&self, v: ValueId, through: &dyn Fn(&Node) -> bool, reads: &dyn Fn(&Node) -> bool, depth: usize) -> bool {
        let nodes = self.readers(v);
        depth < 4
            && !nodes.is_empty()
            && !self.graph.outputs.contains(&v)
            && nodes.iter().all(|&i| {
                let node = &self.graph.nodes[i];
                reads(node) || (through(node) && self.only_read_within(self.output(i), through, reads, depth + 1))
            })
    }

    /// Where `v` permutes another value's dims (`permute` or `transpose`): that value, and the
    /// permutation (`v`'s dim `d` is its dim `perm[d]`).
    pub fn permuted(&self, v: ValueId) -> Option<(ValueId, Vec<usize>)> {
        let nodes = &self.graph.nodes;
        let (node, swap) = match self.node_of(v, "aten.transpose.int") {
            Some(node) => (node, true),
            None => (self.node_of(v, "aten.permute.default")?, false),
        };
        let source = value(nodes[node].args.first()?)?;
        let rank = self.types.get(source as usize)?.rank();
        let dim = |a: &Arg| norm_dim(number(a)? as i64, rank).ok();
        let perm: Vec<usize> = if swap {
            let mut perm: Vec<usize> = (0..rank).collect();
            perm.swap(dim(nodes[node].args.get(1)?)?, dim(nodes[node].args.get(2)?)?);
            perm
        } else {
            let Some(Arg::List(dims)) = nodes[node].args.get(1) else { return None };
            dims.iter().map(dim).collect::<Option<_>>()?
        };
        (rank > 0 && perm.len() == rank).then_some((source, perm))
    }

    /// Where `v` is a view (`view` or `_unsafe_view`): the node, and the value it views.
    pub fn viewed(&self, v: ValueId) -> Option<(usize, ValueId)> {
        let view = self.node_of(v, "aten.view.default").or_else(|| self.node_of(v, "aten._unsafe_view.default"))?;
        Some((view, value(self.graph.nodes[view].args.first()?)?))
    }
}

/// The value an argument names.
pub fn value(a: &Arg) -> Option<ValueId> {
    match a {
        Arg::Value(v) => Some(*v),
        _ => None,
    }
}

/// The number an argument is.
pub fn number(a: &Arg) -> Option<f64> {
    match a {
        Arg::Int(i) => Some(*i as f64),
        Arg::Float(f) => Some(f.value()),
        _ => None,
    }
}
