//! Symbolic graph -> concrete graph for one call: bind the symbols from the call's input shapes
//! and integer scalars, evaluate every [`SymExpr`], and write the values into a copy of the
//! graph. Lets a graph Dynamo traced with symbolic sizes be converted once and compiled per shape
//! without going back through Python's conversion.

use std::fmt;

use crate::ir::{Arg, Graph, GraphWithSources, Node, SymExpr, SymSize, SymSlot, SymbolicGraph, TensorType};

/// Why a symbolic graph cannot be specialized (or, from [`SymbolicGraph::check`], ever).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecializeError(pub String);

impl fmt::Display for SpecializeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tpu_dynamo: cannot specialize the symbolic graph: {}",
            self.0
        )
    }
}

impl std::error::Error for SpecializeError {}

type R<T> = Result<T, SpecializeError>;

fn err<T>(msg: String) -> R<T> {
    Err(SpecializeError(msg))
}

/// Python's `a // b` (rounds toward -inf).
fn floor_div(a: i64, b: i64) -> Option<i64> {
    let q = a.checked_div(b)?;
    Some(if a % b != 0 && (a < 0) != (b < 0) {
        q - 1
    } else {
        q
    })
}

impl SymExpr {
    /// The value under `symbols` (symbol k's value at index k, `None` while unbound).
    pub fn eval(&self, symbols: &[Option<i64>]) -> R<i64> {
        let fold = |xs: &[SymExpr], f: fn(i64, i64) -> Option<i64>| -> R<i64> {
            let (first, rest) = xs
                .split_first()
                .ok_or_else(|| SpecializeError(format!("empty {self:?}")))?;
            rest.iter().try_fold(first.eval(symbols)?, |acc, x| {
                f(acc, x.eval(symbols)?)
                    .ok_or_else(|| SpecializeError(format!("overflow in {self:?}")))
            })
        };
        let binary = |a: &SymExpr, b: &SymExpr, f: fn(i64, i64) -> Option<i64>| -> R<i64> {
            let (a, b) = (a.eval(symbols)?, b.eval(symbols)?);
            f(a, b).ok_or_else(|| {
                SpecializeError(format!(
                    "{self:?} overflows or divides by zero at ({a}, {b})"
                ))
            })
        };
        match self {
            SymExpr::Sym(k) => match symbols.get(*k as usize) {
                Some(Some(v)) => Ok(*v),
                _ => err(format!(
                    "symbol s{k} is not bound by any input size or scalar"
                )),
            },
            SymExpr::Const(c) => Ok(*c),
            SymExpr::Add(xs) => fold(xs, i64::checked_add),
            SymExpr::Mul(xs) => fold(xs, i64::checked_mul),
            SymExpr::Max(xs) => fold(xs, |a, b| Some(a.max(b))),
            SymExpr::Min(xs) => fold(xs, |a, b| Some(a.min(b))),
            SymExpr::FloorDiv(a, b) => binary(a, b, floor_div),
            SymExpr::Mod(a, b) => {
                binary(a, b, |a, b| a.checked_sub(b.checked_mul(floor_div(a, b)?)?))
            }
            SymExpr::Pow(base, e) => {
                let b = base.eval(symbols)?;
                b.checked_pow(*e)
                    .ok_or_else(|| SpecializeError(format!("overflow in {self:?} at {b}")))
            }
        }
    }

    /// The expression with the symbols that `values` binds replaced by their values.
    fn substitute(&self, values: &[Option<i64>]) -> SymExpr {
        let all = |xs: &[SymExpr]| xs.iter().map(|x| x.substitute(values)).collect();
        match self {
            SymExpr::Sym(k) => match values.get(*k as usize) {
                Some(Some(v)) => SymExpr::Const(*v),
                _ => SymExpr::Sym(*k),
            },
            SymExpr::Const(c) => SymExpr::Const(*c),
            SymExpr::Add(xs) => SymExpr::Add(all(xs)),
            SymExpr::Mul(xs) => SymExpr::Mul(all(xs)),
            SymExpr::Max(xs) => SymExpr::Max(all(xs)),
            SymExpr::Min(xs) => SymExpr::Min(all(xs)),
            SymExpr::FloorDiv(a, b) => SymExpr::FloorDiv(Box::new(a.substitute(values)), Box::new(b.substitute(values))),
            SymExpr::Mod(a, b) => SymExpr::Mod(Box::new(a.substitute(values)), Box::new(b.substitute(values))),
            SymExpr::Pow(a, e) => SymExpr::Pow(Box::new(a.substitute(values)), *e),
        }
    }

    /// Whether the expression mentions a symbol `which` picks.
    pub(crate) fn mentions(&self, which: impl Fn(u32) -> bool) -> bool {
        let mut syms = vec![];
        self.symbols(&mut syms);
        syms.into_iter().any(which)
    }

    /// Every symbol the expression mentions.
    pub(crate) fn symbols(&self, out: &mut Vec<u32>) {
        match self {
            SymExpr::Sym(k) => out.push(*k),
            SymExpr::Const(_) => {}
            SymExpr::Add(xs) | SymExpr::Mul(xs) | SymExpr::Max(xs) | SymExpr::Min(xs) => {
                xs.iter().for_each(|x| x.symbols(out))
            }
            SymExpr::FloorDiv(a, b) | SymExpr::Mod(a, b) => {
                a.symbols(out);
                b.symbols(out);
            }
            SymExpr::Pow(a, _) => a.symbols(out),
        }
    }
}

/// The `arg`-th argument of `node` (positional, then keyword values), then down `path`.
pub(crate) fn arg_mut<'a>(node: &'a mut Node, arg: u32, path: &[u32]) -> Option<&'a mut Arg> {
    let top = node
        .args
        .iter_mut()
        .chain(node.kwargs.iter_mut().map(|(_, a)| a))
        .nth(arg as usize)?;
    path.iter().try_fold(top, |a, &i| match a {
        Arg::List(items) => items.get_mut(i as usize),
        _ => None,
    })
}

/// Every value's type, inputs first, then node outputs (the `ValueId` order).
fn types_mut(g: &mut Graph) -> Vec<&mut TensorType> {
    g.inputs
        .iter_mut()
        .map(|i| &mut i.ty)
        .chain(g.nodes.iter_mut().flat_map(|n| n.outputs.iter_mut()))
        .collect()
}

/// Writes `values[i]` at `sizes[i]`'s slot in `g`.
fn write(g: &mut Graph, sizes: &[SymSize], values: &[i64]) -> R<()> {
    let missing =
        |slot: &SymSlot| SpecializeError(format!("{slot:?} is not an integer in the graph"));
    let mut types = types_mut(g);
    for (s, &v) in sizes.iter().zip(values) {
        if let SymSlot::Dim { value, dim } = s.at {
            let d = types
                .get_mut(value as usize)
                .and_then(|t| t.shape.get_mut(dim as usize));
            *d.ok_or_else(|| missing(&s.at))? = v;
        }
    }
    for (s, &v) in sizes.iter().zip(values) {
        if let SymSlot::Arg { node, arg, path } = &s.at {
            match g
                .nodes
                .get_mut(*node as usize)
                .and_then(|n| arg_mut(n, *arg, path))
            {
                Some(Arg::Int(i)) => *i = v,
                _ => return Err(missing(&s.at)),
            }
        }
    }
    Ok(())
}

impl SymbolicGraph {
    /// Checks once, at conversion, that every slot exists and every symbol can be bound by a
    /// call (appears bare in an input dimension or a scalar), so `specialize` fails only on a
    /// call whose inputs contradict the graph.
    pub fn check(&self) -> R<()> {
        write(&mut self.graph.graph.clone(), &self.sizes, &vec![0; self.sizes.len()])?;
        let n_inputs = self.graph.graph.inputs.len();
        let mut bindable = vec![];
        for s in &self.sizes {
            if let (SymSlot::Dim { value, .. }, SymExpr::Sym(k)) = (&s.at, &s.expr) {
                if (*value as usize) < n_inputs {
                    bindable.push(*k);
                }
            }
        }
        bindable.extend(self.scalars.iter().filter_map(|e| match e {
            SymExpr::Sym(k) => Some(*k),
            _ => None,
        }));
        let mut used = vec![];
        self.sizes.iter().for_each(|s| s.expr.symbols(&mut used));
        self.scalars.iter().for_each(|e| e.symbols(&mut used));
        match used.into_iter().find(|k| !bindable.contains(k)) {
            Some(k) => err(format!("symbol s{k} is not an input size or scalar (data-dependent sizes are not supported)")),
            None => Ok(()),
        }
    }

    /// Each symbol's value for a call with these input shapes (one per graph input) and scalars.
    pub fn bind(&self, shapes: &[Vec<i64>], scalars: &[i64]) -> R<Vec<Option<i64>>> {
        let inputs = &self.graph.graph.inputs;
        if shapes.len() != inputs.len() || scalars.len() != self.scalars.len() {
            return err(format!(
                "expected {} input shapes and {} scalars, got {} and {}",
                inputs.len(),
                self.scalars.len(),
                shapes.len(),
                scalars.len()
            ));
        }
        for (i, (input, shape)) in inputs.iter().zip(shapes).enumerate() {
            if input.ty.rank() != shape.len() {
                return err(format!(
                    "input {i} should have rank {}, got shape {shape:?}",
                    input.ty.rank()
                ));
            }
        }
        // Input dimensions and scalars, each with its actual value: the graph's expectations.
        let mut expected: Vec<(&SymExpr, i64, String)> = vec![];
        for s in &self.sizes {
            if let SymSlot::Dim { value, dim } = s.at {
                if let Some(&v) = shapes
                    .get(value as usize)
                    .and_then(|shape| shape.get(dim as usize))
                {
                    expected.push((&s.expr, v, format!("input {value} dimension {dim}")));
                }
            }
        }
        for (i, (e, &v)) in self.scalars.iter().zip(scalars).enumerate() {
            expected.push((e, v, format!("scalar {i}")));
        }
        let mut symbols = vec![];
        for (e, v, _) in &expected {
            if let SymExpr::Sym(k) = e {
                let k = *k as usize;
                if symbols.len() <= k {
                    symbols.resize(k + 1, None);
                }
                symbols[k].get_or_insert(*v);
            }
        }
        for (e, v, what) in &expected {
            let want = e.eval(&symbols)?;
            if want != *v {
                return err(format!(
                    "{what} is {v}, but the graph has {want} there ({e:?})"
                ));
            }
        }
        Ok(symbols)
    }

    /// This graph with the symbols `values` binds (`(symbol, value)`) fixed: every size that
    /// then mentions no other symbol written in as a static one. Lets padding leave some sizes
    /// exact (a cache that stopped growing) while it pads the others.
    pub fn fix(&self, values: &[(u32, i64)]) -> R<SymbolicGraph> {
        let mut bound = vec![];
        for &(k, v) in values {
            if bound.len() <= k as usize {
                bound.resize(k as usize + 1, None);
            }
            bound[k as usize] = Some(v);
        }
        let (mut fixed, mut kept) = (vec![], vec![]);
        for s in &self.sizes {
            let expr = s.expr.substitute(&bound);
            if expr.mentions(|_| true) {
                kept.push(SymSize { at: s.at.clone(), expr });
            } else {
                fixed.push((s.clone(), expr.eval(&bound)?));
            }
        }
        let mut graph = self.graph.clone();
        let (sizes, values): (Vec<SymSize>, Vec<i64>) = fixed.into_iter().unzip();
        write(&mut graph.graph, &sizes, &values)?;
        let scalars = self.scalars.iter().map(|e| e.substitute(&bound)).collect();
        Ok(SymbolicGraph { graph, sizes: kept, scalars })
    }

    /// The concrete graph for a call with these input shapes and scalars. Static input
    /// dimensions must match too; the graph was traced for them.
    pub fn specialize(&self, shapes: &[Vec<i64>], scalars: &[i64]) -> R<GraphWithSources> {
        let symbols = self.bind(shapes, scalars)?;
        let values = self
            .sizes
            .iter()
            .map(|s| s.expr.eval(&symbols))
            .collect::<R<Vec<_>>>()?;
        let mut out = self.graph.clone();
        write(&mut out.graph, &self.sizes, &values)?;
        for (i, (input, shape)) in out.graph.inputs.iter().zip(shapes).enumerate() {
            if &input.ty.shape != shape {
                return err(format!(
                    "input {i} should have shape {:?}, got {shape:?}",
                    input.ty.shape
                ));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Input, InputKind, SymSize};

    fn sym(k: u32) -> SymExpr {
        SymExpr::Sym(k)
    }
    fn c(v: i64) -> SymExpr {
        SymExpr::Const(v)
    }
    fn b(e: SymExpr) -> Box<SymExpr> {
        Box::new(e)
    }
    fn dim(value: u32, dim: u32, expr: SymExpr) -> SymSize {
        SymSize {
            at: SymSlot::Dim { value, dim },
            expr,
        }
    }

    #[test]
    fn expressions_evaluate_like_python() {
        let s = [Some(7), Some(-7)];
        let cases = [
            (SymExpr::Add(vec![sym(0), c(1)]), 8),
            (SymExpr::Mul(vec![c(-1), sym(0)]), -7),
            (SymExpr::FloorDiv(b(sym(0)), b(c(2))), 3),
            (SymExpr::FloorDiv(b(sym(1)), b(c(2))), -4),
            (SymExpr::Mod(b(sym(1)), b(c(3))), 2),
            (SymExpr::Mod(b(sym(0)), b(c(-3))), -2),
            (SymExpr::Pow(b(sym(0)), 2), 49),
            (SymExpr::Max(vec![sym(0), sym(1), c(3)]), 7),
            (SymExpr::Min(vec![sym(0), sym(1)]), -7),
        ];
        for (e, want) in cases {
            assert_eq!(e.eval(&s), Ok(want), "{e:?}");
        }
        assert!(SymExpr::FloorDiv(b(sym(0)), b(c(0))).eval(&s).is_err());
        assert!(SymExpr::Mul(vec![c(i64::MAX), c(2)]).eval(&s).is_err());
        assert!(sym(2).eval(&s).unwrap_err().0.contains("s2 is not bound"));
    }

    /// x: f32[2, s0]; view(x, [s0, 2]) -> f32[s0, 2]; arange(s0 + 1) -> i64[s0 + 1].
    fn example() -> SymbolicGraph {
        let node = |op: &str, args, shape| Node {
            op: op.into(),
            args,
            kwargs: vec![],
            outputs: vec![TensorType::new(DType::F32, shape)],
        };
        let graph = Graph {
            inputs: vec![Input {
                ty: TensorType::new(DType::F32, vec![2, 0]),
                kind: InputKind::User,
            }],
            nodes: vec![
                node(
                    "aten.view.default",
                    vec![Arg::Value(0), Arg::List(vec![Arg::Int(0), Arg::Int(2)])],
                    vec![0, 2],
                ),
                node("aten.arange.default", vec![Arg::Int(0)], vec![0]),
            ],
            outputs: vec![1, 2],
            aliases: vec![],
        };
        let s1 = SymExpr::Add(vec![sym(0), c(1)]);
        SymbolicGraph {
            graph: GraphWithSources {
                graph,
                sources: vec![None, None],
            },
            sizes: vec![
                dim(0, 1, sym(0)),
                dim(1, 0, sym(0)),
                SymSize {
                    at: SymSlot::Arg {
                        node: 0,
                        arg: 1,
                        path: vec![0],
                    },
                    expr: sym(0),
                },
                dim(2, 0, s1.clone()),
                SymSize {
                    at: SymSlot::Arg {
                        node: 1,
                        arg: 0,
                        path: vec![],
                    },
                    expr: s1,
                },
            ],
            scalars: vec![sym(0)],
        }
    }

    #[test]
    fn substitutes_shapes_and_int_args() {
        let g = example();
        g.check().unwrap();
        let out = g.specialize(&[vec![2, 5]], &[5]).unwrap().graph;
        assert_eq!(out.inputs[0].ty.shape, vec![2, 5]);
        assert_eq!(out.nodes[0].outputs[0].shape, vec![5, 2]);
        assert_eq!(
            out.nodes[0].args[1],
            Arg::List(vec![Arg::Int(5), Arg::Int(2)])
        );
        assert_eq!(out.nodes[1].outputs[0].shape, vec![6]);
        assert_eq!(out.nodes[1].args[0], Arg::Int(6));
        // Same shapes, same bytes: the concrete graph is what the cache keys on.
        let again = g.specialize(&[vec![2, 5]], &[5]).unwrap().graph;
        assert_eq!(out.canonical_bytes(), again.canonical_bytes());
        assert_ne!(
            out.hash(),
            g.specialize(&[vec![2, 6]], &[6]).unwrap().graph.hash()
        );
    }

    #[test]
    fn fixing_a_symbol_writes_its_sizes_in() {
        let fixed = example().fix(&[(0, 5)]).unwrap();
        assert!(fixed.sizes.is_empty());
        assert_eq!(fixed.scalars, vec![c(5)]);
        let g = &fixed.graph.graph;
        assert_eq!(g.inputs[0].ty.shape, vec![2, 5]);
        assert_eq!(g.nodes[1].args[0], Arg::Int(6));
        // Specialized, it is the graph those sizes make; another value is a contradiction.
        assert_eq!(fixed.specialize(&[vec![2, 5]], &[5]).unwrap().graph, example().specialize(&[vec![2, 5]], &[5]).unwrap().graph);
        assert!(fixed.specialize(&[vec![2, 6]], &[6]).is_err());
        // Sizes that mention a symbol still free keep it, with the fixed ones as constants.
        let mut two = example();
        two.sizes.push(dim(2, 0, SymExpr::Add(vec![sym(0), sym(1)])));
        two.scalars.push(sym(1));
        let partly = two.fix(&[(1, 3)]).unwrap();
        assert_eq!(partly.sizes.last().unwrap().expr, SymExpr::Add(vec![sym(0), c(3)]));
        assert_eq!(partly.scalars, vec![sym(0), c(3)]);
    }

    #[test]
    fn rejects_calls_that_contradict_the_graph() {
        let g = example();
        let msg =
            |shapes: &[Vec<i64>], scalars: &[i64]| g.specialize(shapes, scalars).unwrap_err().0;
        assert!(msg(&[vec![3, 5]], &[5]).contains("should have shape [2, 5]"));
        assert!(msg(&[vec![2, 5]], &[4]).contains("scalar 0 is 4, but the graph has 5"));
        assert!(msg(&[vec![2, 5, 1]], &[5]).contains("rank 2"));
        assert!(msg(&[], &[5]).contains("expected 1 input shapes"));
    }

    #[test]
    fn check_rejects_unbindable_symbols_and_bad_slots() {
        let mut g = example();
        g.sizes.push(dim(1, 1, SymExpr::Mul(vec![sym(1), c(2)])));
        assert!(g
            .check()
            .unwrap_err()
            .0
            .contains("symbol s1 is not an input size"));
        let mut g = example();
        g.sizes.push(SymSize {
            at: SymSlot::Arg {
                node: 0,
                arg: 0,
                path: vec![],
            },
            expr: sym(0),
        });
        assert!(g.check().unwrap_err().0.contains("is not an integer"));
        let mut g = example();
        g.sizes.push(dim(9, 0, sym(0)));
        assert!(g.check().is_err());
    }
}
