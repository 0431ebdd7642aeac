//! Integer scalars a graph uses only as numbers, passed to the executable as 0-d i64 inputs
//! instead of written into it as constants.
//!
//! Dynamo makes an integer that changes between calls symbolic: a sliding-window cache's count
//! of tokens seen, which positions and the window's mask offset are computed from. Written into
//! the graph, every value would be another executable (every decode step a compile, although no
//! shape changes). When no size depends on the scalar and every op that reads it takes a 0-d
//! tensor in place of a number, the executable reads it at run time instead, computing each
//! expression of it (`max(s - 11, 0)`) with ops on 0-d tensors: one executable serves every value.

use crate::ir::{Arg, DType, Graph, GraphWithSources, Input, InputKind, Node, SymExpr, SymSlot, SymbolicGraph, TensorType};
use crate::padding::{insert_inputs, reads_tensor_operands, shift_values};

/// A term of an expression being computed: known now, or a 0-d i64 value of the graph.
#[derive(Clone, Copy)]
enum Term {
    Known(i64),
    Value(u32),
}

impl Term {
    fn arg(self) -> Arg {
        match self {
            Term::Known(v) => Arg::Int(v),
            Term::Value(v) => Arg::Value(v),
        }
    }
}

/// Nodes computing expressions of run-time numbers, to go first in the graph (their values
/// numbered from `first`).
struct Emitter<'a> {
    /// Symbol -> the input holding it at run time.
    inputs: &'a [(u32, u32)],
    symbols: &'a [Option<i64>],
    first: u32,
    nodes: Vec<Node>,
}

impl Emitter<'_> {
    fn push(&mut self, op: &str, args: Vec<Arg>, kwargs: Vec<(String, Arg)>) -> Term {
        self.nodes.push(Node { op: op.into(), args, kwargs, outputs: vec![TensorType::new(DType::I64, vec![])] });
        Term::Value(self.first + self.nodes.len() as u32 - 1)
    }

    /// `a op b` where `a` or `b` is a value; `op_const` when `b` is known (or `a`, for the
    /// commutative ones, whose operands then swap).
    fn binary(&mut self, op: &str, op_const: &str, commutes: bool, a: Term, b: Term) -> Term {
        match (a, b) {
            (Term::Value(_), Term::Known(_)) => self.push(op_const, vec![a.arg(), b.arg()], vec![]),
            (Term::Known(_), Term::Value(_)) if commutes => self.push(op_const, vec![b.arg(), a.arg()], vec![]),
            _ => self.push(op, vec![a.arg(), b.arg()], vec![]),
        }
    }

    fn term(&mut self, e: &SymExpr) -> Result<Term, String> {
        if let Ok(v) = e.eval(self.symbols) {
            if !mentions(e, self.inputs) {
                return Ok(Term::Known(v));
            }
        }
        let fold = |this: &mut Self, xs: &[SymExpr], step: &dyn Fn(&mut Self, Term, Term) -> Term| {
            let mut terms = xs.iter().map(|x| this.term(x)).collect::<Result<Vec<_>, _>>()?.into_iter();
            let first = terms.next().ok_or_else(|| format!("empty {e:?}"))?;
            Ok(terms.fold(first, |acc, t| step(this, acc, t)))
        };
        match e {
            SymExpr::Sym(k) => self
                .inputs
                .iter()
                .find(|(s, _)| s == k)
                .map(|&(_, v)| Term::Value(v))
                .ok_or_else(|| format!("symbol s{k} is not bound")),
            SymExpr::Const(c) => Ok(Term::Known(*c)),
            SymExpr::Add(xs) => fold(self, xs, &|s, a, b| s.binary("aten.add.Tensor", "aten.add.Tensor", true, a, b)),
            SymExpr::Mul(xs) => fold(self, xs, &|s, a, b| s.binary("aten.mul.Tensor", "aten.mul.Tensor", true, a, b)),
            SymExpr::Max(xs) => fold(self, xs, &|s, a, b| s.binary("aten.maximum.default", "aten.clamp_min.default", true, a, b)),
            SymExpr::Min(xs) => fold(self, xs, &|s, a, b| s.binary("aten.minimum.default", "aten.clamp_max.default", true, a, b)),
            SymExpr::Pow(x, n) => {
                let x = self.term(x)?;
                let mut out = if *n == 0 { Term::Known(1) } else { x };
                for _ in 1..*n {
                    out = self.binary("aten.mul.Tensor", "aten.mul.Tensor", true, out, x);
                }
                Ok(out)
            }
            // Python's `//` and `%` round toward -inf, as these ops do.
            SymExpr::FloorDiv(a, b) => {
                let (a, b) = (self.term(a)?, self.term(b)?);
                let floor = vec![("rounding_mode".to_string(), Arg::Str("floor".into()))];
                Ok(self.push("aten.div.Tensor_mode", vec![a.arg(), b.arg()], floor))
            }
            SymExpr::Mod(a, b) => {
                let (a, b) = (self.term(a)?, self.term(b)?);
                Ok(self.binary("aten.remainder.Tensor", "aten.remainder.Scalar", false, a, b))
            }
        }
    }
}

/// Whether `e` mentions one of the run-time symbols.
fn mentions(e: &SymExpr, inputs: &[(u32, u32)]) -> bool {
    e.mentions(|k| inputs.iter().any(|&(s, _)| s == k))
}

impl SymbolicGraph {
    /// The scalar inputs (positions in `scalars`) the executable can read at run time: a bare
    /// symbol that no size and no other scalar depends on, used only as a number by ops whose
    /// lowering takes a 0-d tensor alike (`reads_tensor_operands`, positional arguments 0-1).
    pub fn number_scalars(&self) -> Vec<u32> {
        let mut out = vec![];
        for (i, e) in self.scalars.iter().enumerate() {
            let SymExpr::Sym(k) = *e else { continue };
            let mentions_k = |e: &SymExpr| e.mentions(|s| s == k);
            let elsewhere = self.scalars.iter().enumerate().any(|(j, e)| j != i && mentions_k(e));
            let only_numbers = self.sizes.iter().filter(|s| mentions_k(&s.expr)).all(|s| match &s.at {
                SymSlot::Arg { node, arg, path } => {
                    let node = &self.graph.graph.nodes[*node as usize];
                    path.is_empty() && *arg <= 1 && (*arg as usize) < node.args.len() && reads_tensor_operands(&node.op)
                }
                SymSlot::Dim { .. } => false,
            });
            if only_numbers && !elsewhere {
                out.push(i as u32);
            }
        }
        out
    }

    /// Makes `out` (this graph specialized under `symbols`) read the scalars `numbers` (from
    /// [`Self::number_scalars`]) at run time: one 0-d i64 input each, inserted before input `at`
    /// in this order, and every argument computed from them computed in the graph.
    pub fn read_numbers(&self, out: &mut GraphWithSources, numbers: &[u32], symbols: &[Option<i64>], at: u32) -> Result<(), String> {
        if numbers.is_empty() {
            return Ok(());
        }
        let g: &mut Graph = &mut out.graph;
        if at as usize > g.inputs.len() {
            return Err(format!("cannot insert inputs at {at}: the graph has {} inputs", g.inputs.len()));
        }
        let number = Input { ty: TensorType::new(DType::I64, vec![]), kind: InputKind::User };
        insert_inputs(g, at, std::iter::repeat_n(number, numbers.len()));
        let inputs: Vec<(u32, u32)> = numbers
            .iter()
            .enumerate()
            .map(|(n, &i)| match self.scalars.get(i as usize) {
                Some(SymExpr::Sym(k)) => Ok((*k, at + n as u32)),
                _ => Err(format!("scalar {i} is not a number the graph can read")),
            })
            .collect::<Result<_, String>>()?;
        let first = g.inputs.len() as u32;
        let mut emitter = Emitter { inputs: &inputs, symbols, first, nodes: vec![] };
        let mut reads = vec![];
        for s in &self.sizes {
            if let SymSlot::Arg { node, arg, .. } = &s.at {
                if mentions(&s.expr, &inputs) {
                    reads.push((*node as usize, *arg as usize, emitter.term(&s.expr)?));
                }
            }
        }
        let count = emitter.nodes.len();
        shift_values(g, first, count as u32);
        for (node, arg, term) in reads {
            *g.nodes[node].args.get_mut(arg).ok_or("a number's argument is missing")? = term.arg();
        }
        g.nodes.splice(0..0, emitter.nodes);
        if !out.sources.is_empty() {
            out.sources.splice(0..0, std::iter::repeat_n(None, count));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::SymSize;

    const S: SymExpr = SymExpr::Sym(0);

    /// `(x + max(n - 11, 0)) * n`, x: [4], n: the scalar; `op` in place of the add.
    fn window_offset(op: &str) -> SymbolicGraph {
        let node = |op: &str, args| Node { op: op.into(), args, kwargs: vec![], outputs: vec![TensorType::new(DType::F32, vec![4])] };
        let graph = Graph {
            inputs: vec![Input { ty: TensorType::new(DType::F32, vec![4]), kind: InputKind::User }],
            nodes: vec![
                node(op, vec![Arg::Value(0), Arg::Int(0)]),
                node("aten.mul.Tensor", vec![Arg::Value(1), Arg::Int(0)]),
            ],
            outputs: vec![2],
            aliases: vec![],
        };
        let offset = SymExpr::Max(vec![SymExpr::Add(vec![S, SymExpr::Const(-11)]), SymExpr::Const(0)]);
        let arg = |node| SymSlot::Arg { node, arg: 1, path: vec![] };
        SymbolicGraph {
            graph: GraphWithSources { graph, sources: vec![Some("a".into()), Some("b".into())] },
            sizes: vec![SymSize { at: arg(0), expr: offset }, SymSize { at: arg(1), expr: S }],
            scalars: vec![S],
        }
    }

    #[test]
    fn a_scalar_used_only_as_a_number_is_read_at_run_time() {
        let g = window_offset("aten.add.Tensor");
        assert_eq!(g.number_scalars(), vec![0]);
        let symbols = g.bind(&[vec![4]], &[0]).unwrap();
        let mut out = g.specialize(&[vec![4]], &[0]).unwrap();
        g.read_numbers(&mut out, &[0], &symbols, 1).unwrap();
        let c = &out.graph;
        assert_eq!(c.inputs.len(), 2);
        assert_eq!(c.inputs[1].ty, TensorType::new(DType::I64, vec![]));
        let ops: Vec<(&str, &[Arg])> = c.nodes.iter().map(|n| (n.op.as_str(), n.args.as_slice())).collect();
        assert_eq!(
            ops,
            vec![
                ("aten.add.Tensor", &[Arg::Value(1), Arg::Int(-11)][..]),
                ("aten.clamp_min.default", &[Arg::Value(2), Arg::Int(0)][..]),
                ("aten.add.Tensor", &[Arg::Value(0), Arg::Value(3)][..]),
                ("aten.mul.Tensor", &[Arg::Value(4), Arg::Value(1)][..]),
            ]
        );
        assert_eq!(c.outputs, vec![5]);
        assert_eq!(out.sources, vec![None, None, Some("a".into()), Some("b".into())]);
    }

    #[test]
    fn a_scalar_that_shapes_the_graph_or_feeds_other_ops_is_written_in() {
        // clamp's bounds are numbers only (no tensor operand in their place).
        assert!(window_offset("aten.clamp.default").number_scalars().is_empty());
        let mut sized = window_offset("aten.add.Tensor");
        sized.sizes.push(SymSize { at: SymSlot::Dim { value: 2, dim: 0 }, expr: S });
        assert!(sized.number_scalars().is_empty());
    }
}
