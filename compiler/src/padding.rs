//! Buckets: whether a symbolic graph may run on inputs padded along its symbolic dimensions, so
//! that many sizes share one executable (TorchTPU's `bucket_size` / `num_dynamic_buckets`).
//!
//! Padding is safe when every output's elements at positions below the true size are exactly
//! what the unpadded graph computes; the caller then cuts the outputs back. That is proven op by
//! op. Each dimension of each value is static or *padded*: its size is `outer·S·inner` for a
//! padded symbol S, the position along S being one digit of the index. An op keeps the proof if
//! positions below n along S depend only on positions below n: elementwise ops, reductions and
//! contractions over static dimensions, reshapes that keep the S digit whole, prefix slices,
//! cumulative ops, gathers from unpadded tables, causal attention whose queries and keys are
//! padded alike. Anything else refuses, naming the op: a reduction over padded positions, a
//! scatter at padded indices, a size used as a value other than by arithmetic or a comparison, an
//! in-place update of a padded input. The caller then compiles exact shapes.
//!
//! Some ops keep the proof only if the executable reads a symbol's true size at run time (an
//! extra 0-d input per such symbol; see [`PaddingPlan::runtime`]): a `cat` that appends to a
//! padded dimension (a dynamic cache's `past ++ new` along the sequence) writes the new entries
//! at the true size instead of after the padding, attention over padded keys hides the keys
//! at or past their true count (written out: a softmax hides them as -inf, a product over them
//! zeroes both operands there), and a size that arithmetic or a comparison uses as a number
//! reads the true size. A cat's result is *grown*: `S + k` long, its first `s + k` positions
//! exact. That is what lets one executable serve every step of a dynamic-cache decode.
//!
//! A batched decode's mask also gathers the attention mask (padded along its own symbol) at the
//! key positions: safe when the gathered positions count along an exact prefix, which the plan
//! then assumes the table covers ([`PaddingPlan::at_least`], checked per call). A sliding-window
//! cache keeps a suffix of its grown cache, which is every exact position while the true length
//! fits the window ([`PaddingPlan::at_most`], checked per call).
//!
//! An input or output padded along one dimension only is passed *packed* (its true elements
//! first, in the true-size tensor's order; [`SymbolicGraph::pack_padded`]): the caller then
//! neither pads nor cuts it, so a decode step's cache goes from one step to the next in place.

use std::collections::HashMap;

use crate::ir::{Arg, DType, Graph, GraphWithSources, Input, InputKind, Node, SymExpr, SymSlot, SymbolicGraph, TensorType};
use crate::lower::is_pointwise;
use crate::specialize::arg_mut;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dim {
    Static(i64),
    /// Size `outer * S * inner`, S the padded size of symbol `sym`.
    Padded { sym: u32, outer: i64, inner: i64 },
    /// Size `S + by`, exact at the first `s + by` positions (s the true size of `sym`).
    Grown { sym: u32, by: i64 },
}

use Dim::{Grown, Padded, Static};

impl Dim {
    fn bare(sym: u32) -> Dim {
        Padded { sym, outer: 1, inner: 1 }
    }
    fn is_padded(self) -> bool {
        !matches!(self, Static(_))
    }
    /// The symbol and the count of exact positions beyond its true size, if padded plainly or grown.
    fn valid(self) -> Option<(u32, i64)> {
        match self {
            Padded { sym, outer: 1, inner: 1 } => Some((sym, 0)),
            Grown { sym, by } => Some((sym, by)),
            _ => None,
        }
    }
}

/// How to pad a symbolic graph's inputs and cut its outputs back.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PaddingPlan {
    /// Per graph input: its padded `(dimension, symbol)` pairs.
    pub inputs: Vec<Vec<(u32, u32)>>,
    /// Per graph output: `(dimension, symbol, by)` to cut back to the symbol's true size + `by`.
    pub outputs: Vec<Vec<(u32, u32, i64)>>,
    /// Per integer scalar input: the symbol it carries (then passed padded too), if any.
    pub scalars: Vec<Option<u32>>,
    /// `(symbol, limit)`: the padded size may not exceed `limit` (a prefix slice of a static
    /// dimension that long).
    pub limits: Vec<(u32, i64)>,
    /// The symbols whose true sizes the executable reads at run time, one 0-d i64 input each
    /// (inserted by [`SymbolicGraph::specialize_padded`]), in this order.
    pub runtime: Vec<u32>,
    /// The nodes that read them, and how.
    pub rewrites: Vec<Rewrite>,
    /// Symbol pairs the plan assumes equal (keys and values of one cache); a call where they
    /// differ runs exact shapes.
    pub equal: Vec<(u32, u32)>,
    /// `(a, b, plus)`: the plan assumes `a`'s true size is at least `b`'s + `plus` (a gather
    /// along `a` at positions counted along `b`); a call where it is not runs exact shapes.
    pub at_least: Vec<(u32, u32, i64)>,
    /// `(symbol, limit)`: the plan assumes the symbol's true size is at most `limit` (a suffix
    /// slice that then keeps every exact position); a call where it is not runs exact shapes.
    pub at_most: Vec<(u32, i64)>,
}

impl PaddingPlan {
    /// The inputs passed *packed*: padded along one dimension only, their true elements lie
    /// first, in the order of the true-size tensor, the rest of the padded size after them
    /// (see [`SymbolicGraph::pack_padded`]).
    pub fn packed_inputs(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.inputs.len()).filter(|&i| self.inputs[i].len() == 1)
    }

    /// The outputs returned packed: cut along one dimension only.
    pub fn packed_outputs(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.outputs.len()).filter(|&o| self.outputs[o].len() == 1)
    }
}

/// A node that runs differently on padded inputs, reading a true size at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// A `cat` whose first part is padded along the cat dimension: the other parts are written
    /// at the first part's true size.
    AppendAt { node: u32, sym: u32 },
    /// Attention whose keys are padded: keys at or past the true size + `by` are hidden. Also
    /// eager attention's parts: a softmax over padded keys (hidden as -inf) and a product that
    /// contracts over them (both operands zeroed there).
    HideKeys { node: u32, sym: u32, by: i64 },
    /// A size used as a value by a pointwise op (argument `arg`, positional then keyword): the
    /// op reads the true size instead of the padded one.
    TrueSize { node: u32, arg: u32, sym: u32 },
    /// A suffix slice along dimension `dim` at least as long as the exact positions (see
    /// [`PaddingPlan::at_most`]): it keeps the whole padded dimension.
    KeepAll { node: u32, dim: u32 },
}

impl Rewrite {
    /// The symbol whose true size the rewritten node reads at run time, if any.
    fn reads(self) -> Option<u32> {
        match self {
            Rewrite::AppendAt { sym, .. } | Rewrite::HideKeys { sym, .. } | Rewrite::TrueSize { sym, .. } => Some(sym),
            Rewrite::KeepAll { .. } => None,
        }
    }
}

type R<T> = Result<T, String>;

/// A size as the trace recorded it: `m·s_k`, or something else that mentions a symbol.
#[derive(Clone, Debug, PartialEq)]
enum Recorded {
    Scaled { sym: u32, by: i64 },
    /// `s_k + by`.
    Shifted { sym: u32, by: i64 },
    Other(SymExpr),
}

fn recorded(e: &SymExpr) -> Recorded {
    match e {
        SymExpr::Sym(k) => Recorded::Scaled { sym: *k, by: 1 },
        SymExpr::Mul(xs) => match xs.as_slice() {
            [SymExpr::Const(m), SymExpr::Sym(k)] | [SymExpr::Sym(k), SymExpr::Const(m)] if *m > 0 => {
                Recorded::Scaled { sym: *k, by: *m }
            }
            _ => Recorded::Other(e.clone()),
        },
        SymExpr::Add(xs) => match xs.as_slice() {
            [SymExpr::Const(c), SymExpr::Sym(k)] | [SymExpr::Sym(k), SymExpr::Const(c)] if *c > 0 => {
                Recorded::Shifted { sym: *k, by: *c }
            }
            _ => Recorded::Other(e.clone()),
        },
        _ => Recorded::Other(e.clone()),
    }
}

/// Symbolic argument slots of one node: `(argument index, path) -> expression`.
type ArgSyms<'a> = HashMap<(u32, &'a [u32]), &'a SymExpr>;

/// The analysis state: every value's dimensions, plus the limits found.
struct Walk<'a> {
    types: Vec<&'a TensorType>,
    dims: Vec<Vec<Dim>>,
    recorded: HashMap<(u32, u32), Recorded>,
    /// The symbols padded (every one an input's dimension); any other is passed exactly.
    padded: Vec<u32>,
    /// Integer values whose every element is its position along one dimension plus a constant
    /// (`arange` and what keeps it): `value -> (dimension, offset)`. Lets a gather along a padded
    /// dimension at such positions be bounded.
    iota: HashMap<u32, (usize, i64)>,
    limits: Vec<(u32, i64)>,
    equal: Vec<(u32, u32)>,
    at_least: Vec<(u32, u32, i64)>,
    at_most: Vec<(u32, i64)>,
    rewrites: Vec<Rewrite>,
}

/// Positional argument `i`, else keyword `name`.
fn arg<'n>(node: &'n Node, i: usize, name: &str) -> Option<&'n Arg> {
    node.args.get(i).or_else(|| node.kwargs.iter().find(|(k, _)| k == name).map(|(_, a)| a))
}

fn int_list(a: Option<&Arg>) -> Option<Vec<i64>> {
    match a? {
        Arg::Int(i) => Some(vec![*i]),
        Arg::List(xs) => xs.iter().map(|x| if let Arg::Int(i) = x { Some(*i) } else { None }).collect(),
        _ => None,
    }
}

fn flag(node: &Node, i: usize, name: &str) -> bool {
    matches!(arg(node, i, name), Some(Arg::Bool(true)))
}

fn norm(d: i64, rank: usize) -> R<usize> {
    let r = rank as i64;
    let d = if d < 0 { d + r } else { d };
    if (0..r.max(1)).contains(&d) { Ok(d as usize) } else { Err(format!("dimension {d} out of range for rank {rank}")) }
}

/// Whether the op's lowering takes its `self` and `other` as a tensor or a number alike, so a
/// size used there may become the 0-d tensor of its true size.
pub(crate) fn reads_tensor_operands(op: &str) -> bool {
    let Some((name, overload)) = op.strip_prefix("aten.").and_then(|o| o.split_once('.')) else {
        return false;
    };
    matches!(overload, "Tensor" | "Scalar")
        && matches!(name, "add" | "sub" | "rsub" | "mul" | "div" | "eq" | "ne" | "lt" | "le" | "gt" | "ge")
}

/// Broadcasting `parts` to `rank` dimensions: a padded dimension comes from parts padded alike.
fn broadcast(parts: &[&[Dim]], rank: usize) -> R<Vec<Dim>> {
    let mut out = vec![None::<Dim>; rank];
    for op in parts {
        let skip = rank.checked_sub(op.len()).ok_or("an operand has a higher rank than the result")?;
        for (d, &dim) in op.iter().enumerate() {
            let slot = &mut out[skip + d];
            match (dim, *slot) {
                (Static(1), _) => {}
                (_, None) | (_, Some(Static(1))) => *slot = Some(dim),
                (a, Some(b)) if a == b => {}
                (a, Some(b)) if a.is_padded() || b.is_padded() => {
                    return Err(format!("operands broadcast {a:?} against {b:?}"))
                }
                _ => {}
            }
        }
    }
    Ok(out.into_iter().map(|d| d.unwrap_or(Static(1))).collect())
}

impl<'a> Walk<'a> {
    fn value(&self, a: Option<&Arg>) -> R<&[Dim]> {
        match a {
            Some(Arg::Value(v)) => Ok(&self.dims[*v as usize]),
            _ => Err("expected a tensor argument".into()),
        }
    }

    /// Every tensor operand of `node` (nested lists included).
    fn operands(&self, node: &Node) -> Vec<&[Dim]> {
        fn walk<'x>(a: &Arg, dims: &'x [Vec<Dim>], out: &mut Vec<&'x [Dim]>) {
            match a {
                Arg::Value(v) => out.push(&dims[*v as usize]),
                Arg::List(xs) => xs.iter().for_each(|x| walk(x, dims, out)),
                _ => {}
            }
        }
        let mut out = vec![];
        node.args.iter().chain(node.kwargs.iter().map(|(_, a)| a)).for_each(|a| walk(a, &self.dims, &mut out));
        out
    }

    /// The dimensions the trace recorded for `value`, every symbolic one read as `by·S` split
    /// as `outer = by`, `inner = 1` (a rule that knows better, like reshape, corrects the split).
    fn recorded_dims(&self, value: u32) -> R<Vec<Dim>> {
        let ty = self.types[value as usize];
        (0..ty.rank() as u32)
            .map(|d| match self.recorded.get(&(value, d)) {
                None => Ok(Static(ty.shape[d as usize])),
                Some(Recorded::Scaled { sym, by }) => Ok(Padded { sym: *sym, outer: *by, inner: 1 }),
                Some(Recorded::Shifted { sym, by }) => Ok(Grown { sym: *sym, by: *by }),
                Some(Recorded::Other(e)) => Err(format!("dimension {d} has size {e:?}, not a multiple of one size")),
            })
            .collect()
    }

    /// Pointwise with broadcasting: a padded output dimension comes from operands padded alike.
    fn broadcast(&self, node: &Node, rank: usize) -> R<Vec<Dim>> {
        broadcast(&self.operands(node), rank)
    }

    /// Output dimensions of `node`, one list per output; `Err` names why padding is unsafe.
    fn rule(&mut self, j: u32, node: &Node, first: u32, syms: &ArgSyms) -> R<Vec<Vec<Dim>>> {
        let op = node.op.as_str();
        let n_out = node.outputs.len();
        let out_rank = |o: usize| node.outputs[o].rank();
        // Argument slots that may hold a padded size (a size role); any other symbolic argument
        // is a size used as a value, which padding would change.
        let size_roles: &[u32] = match op {
            "aten.view.default" | "aten.reshape.default" | "aten._unsafe_view.default" | "aten.view_copy.default"
            | "aten.expand.default" | "aten.expand_copy.default" | "aten.new_full.default"
            | "aten.new_zeros.default" | "aten.new_ones.default" | "aten.new_empty.default" => &[1],
            "aten.full.default" | "aten.zeros.default" | "aten.ones.default" | "aten.empty.memory_format"
            | "aten.arange.default" => &[0],
            "aten.arange.start" | "aten.arange.start_step" => &[1],
            "aten.slice.Tensor" | "aten.slice_copy.Tensor" => &[3],
            _ => &[],
        };
        let mut values: Vec<_> = syms.iter().filter(|((i, _), _)| !size_roles.contains(i)).collect();
        values.sort_by_key(|((i, _), _)| *i);
        for (&(i, path), e) in values {
            match recorded(e) {
                // A number no padded size depends on is passed as it is.
                _ if !e.mentions(|k| self.padded.contains(&k)) => {}
                Recorded::Scaled { sym, by: 1 } if i <= 1 && path.is_empty() && reads_tensor_operands(op) => {
                    self.rewrites.push(Rewrite::TrueSize { node: j, arg: i, sym })
                }
                _ => return Err(format!("argument {i} is the size {e:?}, used as a value")),
            }
        }
        let x = || self.value(arg(node, 0, "self"));
        let same = |x: &[Dim]| Ok(vec![x.to_vec(); n_out]);
        if is_pointwise(op) {
            return (0..n_out).map(|o| self.broadcast(node, out_rank(o))).collect();
        }
        match op {
            "aten.clone.default" | "aten.alias.default" | "aten.detach.default" | "aten.contiguous.default"
            | "aten.alias_copy.default" | "aten.lift_fresh_copy.default" | "aten.lift_fresh.default" => same(x()?),
            // Fills and ranges: the value at a position below n does not depend on the length.
            "aten.full.default" | "aten.zeros.default" | "aten.ones.default" | "aten.empty.memory_format"
            | "aten.scalar_tensor.default" | "aten.full_like.default" | "aten.zeros_like.default"
            | "aten.ones_like.default" | "aten.empty_like.default" | "aten.new_full.default"
            | "aten.new_zeros.default" | "aten.new_ones.default" | "aten.new_empty.default"
            | "aten.arange.default" | "aten.arange.start" | "aten.arange.start_step" => {
                let dims = self.recorded_dims(first)?;
                if dims.iter().any(|d| matches!(d, Padded { outer, .. } if *outer != 1)) {
                    return Err("creates a dimension of a multiple of a padded size".into());
                }
                Ok(vec![dims])
            }
            "aten.view.default" | "aten.reshape.default" | "aten._unsafe_view.default" | "aten.view_copy.default" => {
                Ok(vec![self.reshape(x()?, first)?])
            }
            "aten.permute.default" | "aten.permute_copy.default" => {
                let x = x()?;
                let perm = int_list(arg(node, 1, "dims")).ok_or("permutation")?;
                Ok(vec![perm.iter().map(|&p| norm(p, x.len()).map(|p| x[p])).collect::<R<_>>()?])
            }
            "aten.transpose.int" | "aten.t.default" => {
                let mut x = x()?.to_vec();
                let (a, b) = match int_list(arg(node, 1, "dim0")).zip(int_list(arg(node, 2, "dim1"))) {
                    Some((a, b)) => (norm(a[0], x.len())?, norm(b[0], x.len())?),
                    None => (0, x.len().saturating_sub(1)),
                };
                x.swap(a, b);
                Ok(vec![x])
            }
            "aten.unsqueeze.default" | "aten.unsqueeze_copy.default" => {
                let mut x = x()?.to_vec();
                let d = int_list(arg(node, 1, "dim")).ok_or("dim")?[0];
                x.insert(norm(d, x.len() + 1)?, Static(1));
                Ok(vec![x])
            }
            "aten.squeeze.dims" | "aten.squeeze.dim" | "aten.squeeze.default" => {
                let x = x()?;
                let dims = match int_list(arg(node, 1, "dim")) {
                    Some(ds) => ds.iter().map(|&d| norm(d, x.len())).collect::<R<Vec<_>>>()?,
                    None => (0..x.len()).collect(),
                };
                let kept = x.iter().enumerate().filter(|(i, d)| !(dims.contains(i) && **d == Static(1)));
                let out: Vec<Dim> = kept.map(|(_, d)| *d).collect();
                (out.len() == out_rank(0)).then(|| vec![out]).ok_or_else(|| "squeezes a padded dimension".into())
            }
            "aten.expand.default" | "aten.expand_copy.default" => {
                let x = x()?;
                let mut out = self.recorded_dims(first)?;
                let skip = out.len() - x.len();
                for (d, &dim) in x.iter().enumerate() {
                    if dim != Static(1) {
                        out[skip + d] = dim;
                    }
                }
                Ok(vec![out])
            }
            "aten.slice.Tensor" | "aten.slice_copy.Tensor" => {
                let x = x()?.to_vec();
                let d = norm(int_list(arg(node, 1, "dim")).map_or(0, |v| v[0]), x.len())?;
                let start = int_list(arg(node, 2, "start")).map_or(0, |v| v[0]);
                let step = int_list(arg(node, 4, "step")).map_or(1, |v| v[0]);
                let to_the_end = int_list(arg(node, 3, "end")).is_none_or(|v| v[0] == i64::MAX);
                let mut out = x.to_vec();
                let end_sym = syms.get(&(3, &[][..])).map(|e| recorded(e));
                match (x[d], end_sym) {
                    (_, None) if !x[d].is_padded() => out[d] = self.recorded_dims(first)?[d],
                    // A prefix of a static dimension, as long as the padded size: the positions
                    // below n are the same elements; the padded size may not exceed the dimension.
                    (Static(len), Some(Recorded::Scaled { sym, by: 1 })) if start == 0 && step == 1 => {
                        self.limits.push((sym, len));
                        out[d] = Dim::bare(sym);
                    }
                    // The whole of a padded dimension.
                    (Padded { sym, .. }, Some(Recorded::Scaled { sym: s, by: 1 })) if start == 0 && step == 1 && sym == s => {}
                    (Padded { .. } | Grown { .. }, None) if start == 0 && step == 1 && self.recorded_dims(first)?[d] == x[d] => {}
                    // The last k positions, while there are at most k exact ones (a sliding-window
                    // cache keeping its last entries before the window fills): all of them, so the
                    // slice keeps the whole padded dimension, assuming that many (checked per call).
                    (dim, None) if start < 0 && step == 1 && to_the_end && let Some((sym, by)) = dim.valid() => {
                        self.at_most.push((sym, -start - by));
                        self.rewrites.push(Rewrite::KeepAll { node: j, dim: d as u32 });
                        let kept = if by == 0 { Recorded::Scaled { sym, by: 1 } } else { Recorded::Shifted { sym, by } };
                        self.recorded.insert((first, d as u32), kept);
                    }
                    _ => return Err("slices a padded dimension other than as a prefix of the padded size".into()),
                }
                Ok(vec![out])
            }
            "aten.select.int" | "aten.select_copy.int" => {
                let mut x = x()?.to_vec();
                let d = norm(int_list(arg(node, 1, "dim")).ok_or("dim")?[0], x.len())?;
                if x[d].is_padded() {
                    return Err("selects along a padded dimension".into());
                }
                x.remove(d);
                Ok(vec![x])
            }
            "aten.cat.default" | "aten.concat.default" => {
                let parts = self.operands(node);
                let rank = out_rank(0);
                let d = norm(int_list(arg(node, 1, "dim")).map_or(0, |v| v[0]), rank)?;
                let mut out = self.broadcast_except(&parts, rank, d)?;
                // Empty parts (a dynamic cache's first update) add nothing.
                let parts: Vec<&[Dim]> = parts.into_iter().filter(|p| p.len() == rank && p[d] != Static(0)).collect();
                let appended: Option<i64> = parts.iter().skip(1).map(|p| if let Static(k) = p[d] { Some(k) } else { None }).sum();
                match (parts.as_slice(), appended) {
                    ([only], _) => out[d] = only[d],
                    // Appending to a padded dimension: the rest go at the first part's true size.
                    ([head, ..], Some(by)) if let Padded { sym, outer: 1, inner: 1 } = head[d] => {
                        self.rewrites.push(Rewrite::AppendAt { node: j, sym });
                        out[d] = Grown { sym, by };
                    }
                    _ if parts.iter().any(|p| p[d].is_padded()) => {
                        return Err("concatenates along a padded dimension other than by appending to one padded part".into())
                    }
                    _ => out[d] = Static(node.outputs[0].shape[d]),
                }
                Ok(vec![out])
            }
            "aten.split_with_sizes.default" | "aten.split.Tensor" | "aten.unbind.int" => {
                let x = x()?;
                let d = norm(int_list(arg(node, if op == "aten.unbind.int" { 1 } else { 2 }, "dim")).map_or(0, |v| v[0]), x.len())?;
                if x[d].is_padded() {
                    return Err("splits along a padded dimension".into());
                }
                (0..n_out)
                    .map(|o| {
                        let mut y = x.to_vec();
                        if op == "aten.unbind.int" {
                            y.remove(d);
                        } else {
                            y[d] = Static(node.outputs[o].shape[d]);
                        }
                        Ok(y)
                    })
                    .collect()
            }
            // Reductions and normalizations over static dimensions; cumulative ops along any
            // dimension (position i depends on positions up to i only).
            "aten.sum.dim_IntList" | "aten.mean.dim" | "aten.amax.default" | "aten.amin.default" | "aten.any.dims"
            | "aten.all.dims" | "aten.any.dim" | "aten.all.dim" | "aten.prod.dim_int" | "aten.var.correction"
            | "aten.var_mean.correction" => {
                let x = x()?;
                let dims = match int_list(arg(node, 1, "dim")) {
                    Some(ds) if !ds.is_empty() => ds.iter().map(|&d| norm(d, x.len())).collect::<R<Vec<_>>>()?,
                    _ => (0..x.len()).collect(),
                };
                if dims.iter().any(|&d| x[d].is_padded()) {
                    return Err("reduces over a padded dimension".into());
                }
                let keep = flag(node, 2, "keepdim") || flag(node, 3, "keepdim");
                let out: Vec<Dim> = x
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &d)| match (dims.contains(&i), keep) {
                        (false, _) => Some(d),
                        (true, true) => Some(Static(1)),
                        (true, false) => None,
                    })
                    .collect();
                Ok(vec![out; n_out])
            }
            "aten._softmax.default"
            | "aten._log_softmax.default"
            | "aten.softmax.int"
            | "aten.log_softmax.int"
            | "aten._safe_softmax.default" => {
                let x = x()?.to_vec();
                let d = norm(int_list(arg(node, 1, "dim")).ok_or("dim")?[0], x.len())?;
                if x[d].is_padded() {
                    // Eager attention's softmax over padded keys: positions past the true count
                    // are hidden (-inf, so their probabilities are 0), as attention hides them.
                    match x[d].valid() {
                        Some((sym, by)) if !op.contains("log_softmax") => self.rewrites.push(Rewrite::HideKeys { node: j, sym, by }),
                        _ => return Err("normalizes over a padded dimension".into()),
                    }
                }
                Ok(vec![x; n_out])
            }
            "aten.cumsum.default" | "aten.cummax.default" | "aten.cummin.default" => same(x()?),
            "aten.native_layer_norm.default" => {
                let x = x()?;
                let n = int_list(arg(node, 1, "normalized_shape")).ok_or("normalized_shape")?.len();
                let lead = x.len() - n;
                if x[lead..].iter().any(|d| d.is_padded()) {
                    return Err("normalizes over a padded dimension".into());
                }
                let stats: Vec<Dim> = x[..lead].iter().copied().chain((0..n).map(|_| Static(1))).collect();
                Ok(vec![x.to_vec(), stats.clone(), stats])
            }
            "aten.mm.default" | "aten.addmm.default" | "aten.bmm.default" | "aten.baddbmm.default" => {
                let (ai, bi) = if op.contains("add") { (1, 2) } else { (0, 1) };
                let a = self.value(node.args.get(ai))?.to_vec();
                let b = self.value(node.args.get(bi))?.to_vec();
                let r = a.len();
                if a[r - 1].is_padded() || b[r - 2].is_padded() {
                    // Eager attention's probabilities times values over padded keys: both
                    // operands are zeroed past the true count, so padding adds nothing.
                    match (a[r - 1].valid(), b[r - 2].valid()) {
                        (Some((sa, by)), Some((sb, by_b))) if by == by_b && !op.contains("add") => {
                            if sa != sb {
                                self.equal.push((sa, sb));
                            }
                            self.rewrites.push(Rewrite::HideKeys { node: j, sym: sa, by });
                        }
                        _ => return Err("contracts over a padded dimension".into()),
                    }
                }
                if r == 3 && a[0] != b[0] && (a[0].is_padded() || b[0].is_padded()) {
                    return Err("batch dimensions are padded differently".into());
                }
                let mut out: Vec<Dim> = a[..r - 1].to_vec();
                out.push(b[r - 1]);
                if op.contains("add") {
                    let bias = self.value(node.args.first())?;
                    let skip = r - bias.len();
                    if bias.iter().enumerate().any(|(i, &d)| d.is_padded() && d != out[skip + i]) {
                        return Err("bias is padded unlike the product".into());
                    }
                }
                Ok(vec![out])
            }
            // Each query row attends to the keys alone, so padded queries are harmless. Padded
            // keys are too where the causal mask hides them from every true query (queries and
            // keys padded alike); otherwise they are hidden at run time past their true count.
            "aten._scaled_dot_product_flash_attention_for_cpu.default" => {
                let (q, k, v) = (x()?.to_vec(), self.value(arg(node, 1, "key"))?.to_vec(), self.value(arg(node, 2, "value"))?.to_vec());
                if q.len() != 4 || k.len() != 4 || v.len() != 4 {
                    return Err("query, key and value must be 4-d".into());
                }
                if [q[0], q[1], q[3], k[0], k[1], k[3], v[0], v[1], v[3]].iter().any(|d| d.is_padded()) {
                    return Err("pads a batch, head or feature dimension of attention".into());
                }
                if k[2] != v[2] {
                    // A dynamic cache's keys and values: separate symbols, equal at every call.
                    match (k[2].valid(), v[2].valid()) {
                        (Some((a, by)), Some((b, by_v))) if by == by_v => self.equal.push((a, b)),
                        _ => return Err("keys and values are padded differently".into()),
                    }
                }
                let mask = match arg(node, 5, "attn_mask") {
                    None | Some(Arg::None) => None,
                    m => Some(self.value(m)?),
                };
                // A mask padded along the keys holds anything there: its keys are hidden too.
                let mut mask_pads_keys = false;
                if let Some(m) = mask {
                    let rank = m.len();
                    for (i, d) in m.iter().enumerate().filter(|(_, d)| d.is_padded()) {
                        match rank - i {
                            2 if *d == q[2] => {}
                            1 if *d == k[2] => mask_pads_keys = true,
                            _ => return Err("pads a mask unlike its queries and keys".into()),
                        }
                    }
                }
                if k[2].is_padded() && (mask_pads_keys || !(flag(node, 4, "is_causal") && k[2] == q[2])) {
                    let (sym, by) = k[2].valid().ok_or("pads the keys by a multiple of a size")?;
                    self.rewrites.push(Rewrite::HideKeys { node: j, sym, by });
                }
                Ok(vec![vec![q[0], q[1], q[2], v[3]], q[..3].to_vec()])
            }
            // Row gathers from a table with no padded dimension: each output position reads the
            // table at its own index.
            "aten.embedding.default" => {
                let table = x()?;
                let ids = self.value(arg(node, 1, "indices"))?;
                if table.iter().any(|d| d.is_padded()) {
                    return Err("gathers from a padded table".into());
                }
                Ok(vec![ids.iter().copied().chain(std::iter::once(table[table.len() - 1])).collect()])
            }
            "aten.index.Tensor" => {
                let x = x()?.to_vec();
                let Some(Arg::List(items)) = arg(node, 1, "indices") else { return Err("indices".into()) };
                let mut indexed = vec![];
                for (d, item) in items.iter().enumerate() {
                    match item {
                        Arg::None => {}
                        Arg::Value(v) => indexed.push((d, *v)),
                        _ => return Err("indices".into()),
                    }
                }
                for &(d, v) in &indexed {
                    if x[d].is_padded() {
                        self.bound_gather(x[d], v)?;
                    }
                }
                let parts: Vec<&[Dim]> = indexed.iter().map(|&(_, v)| self.dims[v as usize].as_slice()).collect();
                let rank = parts.iter().map(|p| p.len()).max().unwrap_or(0);
                let gathered = broadcast(&parts, rank)?;
                let rest = |ds: std::ops::Range<usize>| ds.filter(|d| !indexed.iter().any(|&(i, _)| i == *d)).map(|d| x[d]);
                // Adjacent index tensors put their result where they stand, others put it first.
                let (lo, hi) = (indexed.first().map_or(0, |i| i.0), indexed.last().map_or(0, |i| i.0));
                let out: Vec<Dim> = if hi + 1 - lo == indexed.len() {
                    rest(0..lo).chain(gathered).chain(rest(hi + 1..x.len())).collect()
                } else {
                    gathered.into_iter().chain(rest(0..x.len())).collect()
                };
                Ok(vec![out])
            }
            _ => Err("has no padding rule".into()),
        }
    }

    /// A gather along `along` (a padded dimension) at `index`'s values keeps the proof when they
    /// count positions along a dimension of `index` padded plainly or grown: at its exact
    /// positions they stay below the symbol's true size, which the plan then assumes covers the
    /// gathered dimension (past it, the gather clamps and only padding reads the clamped values).
    fn bound_gather(&mut self, along: Dim, index: u32) -> R<()> {
        let refuse = || Err("gathers along a padded dimension at indices not bounded by its true size".to_string());
        let (Padded { sym: a, outer: 1, inner: 1 }, Some(&(d, offset))) = (along, self.iota.get(&index)) else {
            return refuse();
        };
        match self.dims[index as usize][d].valid() {
            Some((b, by)) if offset >= 0 => {
                self.at_least.push((a, b, by + offset));
                Ok(())
            }
            _ => refuse(),
        }
    }

    /// Records `value`, the only output of `node`, as positions along one of its dimensions plus
    /// a constant where the node keeps that (see `iota`).
    fn track_iota(&mut self, node: &Node, value: u32, syms: &ArgSyms) {
        let ty = self.types[value as usize];
        if node.outputs.len() != 1 || !ty.dtype.is_integer() {
            return;
        }
        let constant = |i: u32| match node.args.get(i as usize) {
            Some(Arg::Int(c)) if !syms.contains_key(&(i, &[][..])) => Some(*c),
            _ => None,
        };
        let of = |i: usize| match node.args.get(i) {
            Some(Arg::Value(v)) => self.iota.get(v).copied(),
            _ => None,
        };
        let op = node.op.as_str();
        let iota = match op {
            "aten.arange.default" => Some((0, 0)),
            "aten.arange.start" | "aten.arange.start_step" => {
                let step = if op.ends_with("step") { int_list(arg(node, 2, "step")).map_or(Some(1), |s| Some(s[0])) } else { Some(1) };
                constant(0).filter(|_| step == Some(1)).map(|start| (0, start))
            }
            "aten.add.Tensor" | "aten.add.Scalar" if arg(node, 2, "alpha").is_none() => {
                of(0).zip(constant(1)).or_else(|| of(1).zip(constant(0))).map(|((d, c), k)| (d, c + k))
            }
            "aten.unsqueeze.default" => of(0).zip(int_list(arg(node, 1, "dim"))).and_then(|((d, c), at)| {
                let at = norm(at[0], ty.rank()).ok()?;
                Some((if at <= d { d + 1 } else { d }, c))
            }),
            "aten.expand.default" => {
                let grown = ty.rank() - self.types[match node.args.first() { Some(Arg::Value(v)) => *v as usize, _ => return }].rank();
                of(0).map(|(d, c)| (d + grown, c))
            }
            "aten.slice.Tensor" => {
                let start = int_list(arg(node, 2, "start")).map_or(0, |v| v[0]);
                let step = int_list(arg(node, 4, "step")).map_or(1, |v| v[0]);
                of(0).filter(|_| start == 0 && step == 1)
            }
            "aten.clone.default" | "aten.alias.default" | "aten.detach.default" | "aten._to_copy.default"
            | "aten.lift_fresh_copy.default" => of(0),
            _ => None,
        };
        if let Some(iota) = iota {
            self.iota.insert(value, iota);
        }
    }

    /// `cat`'s operands broadcast over every dimension but `skip`.
    fn broadcast_except(&self, parts: &[&[Dim]], rank: usize, skip: usize) -> R<Vec<Dim>> {
        let mut out = vec![Static(1); rank];
        for p in parts.iter().filter(|p| p.len() == rank) {
            for (d, &dim) in p.iter().enumerate() {
                if d != skip && out[d] == Static(1) {
                    out[d] = dim;
                } else if d != skip && out[d] != dim {
                    return Err(format!("operands disagree in dimension {d}"));
                }
            }
        }
        Ok(out)
    }

    /// A reshape keeps the proof when each S digit survives whole: the input's only padded
    /// dimension and the output's have the same stride under S (`inner` times the static
    /// dimensions after it); with several, the dimensions from the first padded one on are kept.
    fn reshape(&self, x: &[Dim], first: u32) -> R<Vec<Dim>> {
        let mut out = self.recorded_dims(first)?;
        let has_grown = |ds: &[Dim]| ds.iter().any(|d| matches!(d, Grown { .. }));
        if has_grown(x) || has_grown(&out) {
            // A grown dimension survives only with it and every dimension after it unchanged.
            fn tail(ds: &[Dim]) -> &[Dim] {
                &ds[ds.iter().position(|d| d.is_padded()).unwrap_or(ds.len())..]
            }
            return if tail(x) == tail(&out) { Ok(out) } else { Err("reshape moves a grown padded dimension".into()) };
        }
        let padded = |ds: &[Dim]| ds.iter().enumerate().filter(|(_, d)| d.is_padded()).map(|(i, _)| i).collect::<Vec<_>>();
        let (pi, po) = (padded(x), padded(&out));
        let after = |ds: &[Dim], i: usize| ds[i + 1..].iter().map(|d| if let Static(v) = d { *v } else { 0 }).product::<i64>();
        match (pi.as_slice(), po.as_slice()) {
            ([], []) => Ok(out),
            ([i], [o]) => {
                let (Padded { sym, inner, .. }, Padded { sym: s2, outer: by, .. }) = (x[*i], out[*o]) else { unreachable!() };
                let stride = inner * after(x, *i);
                let tail = after(&out, *o);
                if sym != s2 || tail == 0 || stride % tail != 0 || by % (stride / tail) != 0 {
                    return Err("reshape splits the padded dimension's positions".into());
                }
                let inner = stride / tail;
                out[*o] = Padded { sym, outer: by / inner, inner };
                Ok(out)
            }
            // Several padded dimensions: only static dimensions before the first one may change.
            ([i, ..], [o, ..]) if x.len() - i == out.len() - o => {
                let scaled = |d: &Dim| match *d {
                    Padded { sym, outer, inner } => Padded { sym, outer: outer * inner, inner: 1 },
                    s => s,
                };
                if x[*i..].iter().map(scaled).ne(out[*o..].iter().map(scaled)) {
                    return Err("reshape moves several padded dimensions".into());
                }
                out[*o..].copy_from_slice(&x[*i..]);
                Ok(out)
            }
            _ => Err("reshape moves several padded dimensions".into()),
        }
    }
}

impl SymbolicGraph {
    /// The padding plan if padding every symbolic input dimension is safe, else why not
    /// (naming the first op that breaks the proof).
    pub fn padding_plan(&self) -> R<PaddingPlan> {
        let g = &self.graph.graph;
        let n_in = g.inputs.len() as u32;
        let mut recorded_sizes = HashMap::new();
        let mut arg_syms: HashMap<u32, ArgSyms> = HashMap::new();
        for s in &self.sizes {
            match &s.at {
                SymSlot::Dim { value, dim } => {
                    recorded_sizes.insert((*value, *dim), recorded(&s.expr));
                }
                SymSlot::Arg { node, arg, path } => {
                    arg_syms.entry(*node).or_default().insert((*arg, path.as_slice()), &s.expr);
                }
            }
        }
        let mut walk = Walk {
            types: g.value_types(),
            dims: vec![],
            recorded: recorded_sizes,
            padded: vec![],
            iota: HashMap::new(),
            limits: vec![],
            equal: vec![],
            at_least: vec![],
            at_most: vec![],
            rewrites: vec![],
        };
        let mut plan = PaddingPlan::default();
        for v in 0..n_in {
            let dims = walk.recorded_dims(v).map_err(|e| format!("input {v}: {e}"))?;
            if dims.iter().any(|d| d.is_padded() && !matches!(d, Padded { outer: 1, inner: 1, .. })) {
                return Err(format!("input {v} has a dimension that is not a bare symbolic size"));
            }
            plan.inputs.push(
                dims.iter()
                    .enumerate()
                    .filter_map(|(d, dim)| if let Padded { sym, .. } = dim { Some((d as u32, *sym)) } else { None })
                    .collect(),
            );
            walk.dims.push(dims);
        }
        let padded: Vec<u32> = plan.inputs.iter().flatten().map(|&(_, s)| s).collect();
        if padded.is_empty() {
            return Err("no input dimension is symbolic".into());
        }
        walk.padded = padded.clone();
        let mut sized = vec![];
        self.sizes.iter().filter(|s| matches!(s.at, SymSlot::Dim { .. })).for_each(|s| s.expr.symbols(&mut sized));
        for e in &self.scalars {
            plan.scalars.push(match e {
                SymExpr::Sym(k) if padded.contains(k) => Some(*k),
                // A number no size depends on (an integer Dynamo made dynamic, at most used as a
                // number: the same padded or not).
                SymExpr::Sym(k) if !sized.contains(k) => None,
                SymExpr::Const(_) => None,
                e => return Err(format!("a scalar input is the size {e:?}")),
            });
        }
        let mut first = n_in;
        let no_syms = ArgSyms::new();
        for (j, node) in g.nodes.iter().enumerate() {
            let syms = arg_syms.get(&(j as u32)).unwrap_or(&no_syms);
            let outs = walk.rule(j as u32, node, first, syms).map_err(|e| format!("{} (node {j}) {e}", node.op))?;
            walk.track_iota(node, first, syms);
            for (o, dims) in outs.into_iter().enumerate() {
                let value = first + o as u32;
                let want = walk.recorded_dims(value).map_err(|e| format!("{} (node {j}): {e}", node.op))?;
                let scale = |d: &Dim| match d {
                    Padded { sym, outer, inner } => Padded { sym: *sym, outer: outer * inner, inner: 1 },
                    s => *s,
                };
                if dims.len() != want.len() || dims.iter().map(scale).ne(want.iter().copied()) {
                    return Err(format!("{} (node {j}): derived sizes {dims:?} disagree with the trace {want:?}", node.op));
                }
                walk.dims.push(dims);
            }
            first += node.outputs.len() as u32;
        }
        for a in &g.aliases {
            if !plan.inputs[a.input as usize].is_empty() {
                return Err(format!("input {} is updated in place and has a symbolic dimension", a.input));
            }
        }
        for (o, &v) in g.outputs.iter().enumerate() {
            let mut cut = vec![];
            for (d, dim) in walk.dims[v as usize].iter().enumerate() {
                match dim.valid() {
                    Some((sym, by)) => cut.push((d as u32, sym, by)),
                    None if dim.is_padded() => {
                        return Err(format!("output {o} has a dimension of a multiple of a padded size"))
                    }
                    None => {}
                }
            }
            plan.outputs.push(cut);
        }
        plan.limits = walk.limits;
        // Packed tensors are converted at their true sizes, read at run time too.
        let packed: Vec<u32> = plan.packed_inputs().map(|i| plan.inputs[i][0].1).chain(plan.packed_outputs().map(|o| plan.outputs[o][0].1)).collect();
        for sym in walk.rewrites.iter().filter_map(|r| r.reads()).chain(packed) {
            if !plan.runtime.contains(&sym) {
                plan.runtime.push(sym);
            }
        }
        plan.rewrites = walk.rewrites;
        plan.equal = walk.equal;
        plan.at_least = walk.at_least;
        plan.at_most = walk.at_most;
        Ok(plan)
    }
}

/// Keyword arguments the rewrites add: read only by our own lowerings of `cat` and attention.
pub const APPEND_AT: &str = "tpu_append_at";
pub const KEYS_VALID: &str = "tpu_keys_valid";
pub const KEYS_VALID_PLUS: &str = "tpu_keys_valid_plus";

/// Makes room for `count` new inputs before input `at`: every later value moves up.
pub(crate) fn insert_inputs(g: &mut Graph, at: u32, new: impl ExactSizeIterator<Item = Input>) {
    let count = new.len() as u32;
    shift_values(g, at, count);
    g.aliases.iter_mut().filter(|a| a.input >= at).for_each(|a| a.input += count);
    g.inputs.splice(at as usize..at as usize, new);
}

/// Renumbers every use of a value from `from` on by `count` more (values inserted before it).
pub(crate) fn shift_values(g: &mut Graph, from: u32, count: u32) {
    fn shift(a: &mut Arg, from: u32, count: u32) {
        match a {
            Arg::Value(v) if *v >= from => *v += count,
            Arg::List(xs) => xs.iter_mut().for_each(|x| shift(x, from, count)),
            _ => {}
        }
    }
    for node in &mut g.nodes {
        node.args.iter_mut().chain(node.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| shift(a, from, count));
    }
    g.outputs.iter_mut().filter(|v| **v >= from).for_each(|v| *v += count);
}

fn add_kwarg(node: &mut Node, name: &str, value: Arg) {
    let at = node.kwargs.partition_point(|(k, _)| k.as_str() < name);
    node.kwargs.insert(at, (name.to_string(), value));
}

impl SymbolicGraph {
    /// The concrete graph for inputs padded per `plan` to these shapes: `specialize`'s, plus one
    /// 0-d i64 input per `plan.runtime` symbol (its true size), inserted before input `at`, and
    /// the `cat`s and attentions of `plan.rewrites` told to read them.
    pub fn specialize_padded(&self, plan: &PaddingPlan, shapes: &[Vec<i64>], scalars: &[i64], at: u32) -> R<GraphWithSources> {
        let mut out = self.specialize(shapes, scalars).map_err(|e| e.to_string())?;
        let g = &mut out.graph;
        if at as usize > g.inputs.len() {
            return Err(format!("cannot insert inputs at {at}: the graph has {} inputs", g.inputs.len()));
        }
        let length = Input { ty: TensorType::new(DType::I64, vec![]), kind: InputKind::User };
        insert_inputs(g, at, std::iter::repeat_n(length, plan.runtime.len()));
        let length_of = |sym: u32| {
            let i = plan.runtime.iter().position(|&s| s == sym).expect("every rewritten symbol is a runtime one");
            Arg::Value(at + i as u32)
        };
        // Sizes as values first: their argument positions count keyword arguments the
        // other rewrites add.
        for r in &plan.rewrites {
            if let Rewrite::TrueSize { node, arg, sym } = *r {
                let slot = arg_mut(&mut g.nodes[node as usize], arg, &[]).ok_or("a rewritten size argument is missing")?;
                *slot = length_of(sym);
            }
        }
        for r in &plan.rewrites {
            match *r {
                Rewrite::TrueSize { .. } => {}
                Rewrite::KeepAll { node, dim } => {
                    let Some(&Arg::Value(x)) = g.nodes[node as usize].args.first() else {
                        return Err("a kept slice has no input".into());
                    };
                    let whole = g.value_types()[x as usize].shape[dim as usize];
                    let node = &mut g.nodes[node as usize];
                    let start = match node.args.get_mut(2) {
                        Some(start) => Some(start),
                        None => node.kwargs.iter_mut().find(|(k, _)| k == "start").map(|(_, a)| a),
                    };
                    *start.ok_or("a kept slice has no start")? = Arg::Int(0);
                    node.outputs[0].shape[dim as usize] = whole;
                }
                Rewrite::AppendAt { node, sym } => add_kwarg(&mut g.nodes[node as usize], APPEND_AT, length_of(sym)),
                Rewrite::HideKeys { node, sym, by } => {
                    let node = &mut g.nodes[node as usize];
                    add_kwarg(node, KEYS_VALID, length_of(sym));
                    add_kwarg(node, KEYS_VALID_PLUS, Arg::Int(by));
                }
            }
        }
        Ok(out)
    }

    /// Makes the packed inputs and outputs (`PaddingPlan::packed_inputs`, `packed_outputs`) of
    /// `out`, this graph specialized by [`Self::specialize_padded`] with its true sizes inserted
    /// before input `at` (and anything else inserted there since), packed: each such input is
    /// read through an `UNPACK` node, each such output written through a `PACK` node. The last
    /// rewrite of a specialized graph: the others address its nodes by their index. Why: a
    /// dynamic cache's K and V are padded along the sequence, behind their batch and head
    /// dimensions. Padded, every step copied each layer's K and V on the host twice (padded in,
    /// cut out); packed, the true-size tensor is the prefix of the executable's buffer, so a
    /// result can be handed over as the tensor itself and fed back in without a copy.
    pub fn pack_padded(&self, plan: &PaddingPlan, out: &mut GraphWithSources, at: u32) {
        let inserted = (out.graph.inputs.len() - self.graph.graph.inputs.len()) as u32;
        let length_of = |sym: u32| {
            let i = plan.runtime.iter().position(|&s| s == sym).expect("every packed symbol is a runtime one");
            Arg::Value(at + i as u32)
        };
        let unpacked = packed_layout(&mut out.graph, plan, at, inserted, length_of);
        if !out.sources.is_empty() {
            out.sources.splice(0..0, std::iter::repeat_n(None, unpacked));
        }
    }
}

/// Op names of the nodes between the packed layout of a tensor padded along one dimension and
/// its padded layout, lowered by `lower::packing`. Args: the tensor, its true size along `dim`
/// (a 0-d i64), `dim`, and for `PACK` how many positions past the true size are exact (`by`).
pub const UNPACK: &str = "tpu.unpack";
pub const PACK: &str = "tpu.pack";

/// `SymbolicGraph::pack_padded`'s rewrite of `g`, with `inserted` inputs inserted before input
/// `at`; returns the count of `UNPACK` nodes, inserted first.
fn packed_layout(g: &mut Graph, plan: &PaddingPlan, at: u32, inserted: u32, length_of: impl Fn(u32) -> Arg) -> usize {
    let inputs: Vec<(u32, u32, u32)> = plan
        .packed_inputs()
        .map(|i| {
            let (dim, sym) = plan.inputs[i][0];
            let i = i as u32;
            (if i < at { i } else { i + inserted }, dim, sym)
        })
        .collect();
    let n_in = g.inputs.len() as u32;
    shift_values(g, n_in, inputs.len() as u32);
    let unpacked: HashMap<u32, u32> = inputs.iter().enumerate().map(|(u, &(v, ..))| (v, n_in + u as u32)).collect();
    fn rename(a: &mut Arg, to: &HashMap<u32, u32>) {
        match a {
            Arg::Value(v) => *v = *to.get(v).unwrap_or(v),
            Arg::List(xs) => xs.iter_mut().for_each(|x| rename(x, to)),
            _ => {}
        }
    }
    for node in &mut g.nodes {
        node.args.iter_mut().chain(node.kwargs.iter_mut().map(|(_, a)| a)).for_each(|a| rename(a, &unpacked));
    }
    g.outputs.iter_mut().for_each(|v| *v = *unpacked.get(v).unwrap_or(v));
    let unpacks = inputs.iter().map(|&(v, dim, sym)| Node {
        op: UNPACK.into(),
        args: vec![Arg::Value(v), length_of(sym), Arg::Int(dim as i64)],
        kwargs: vec![],
        outputs: vec![g.inputs[v as usize].ty.clone()],
    });
    g.nodes.splice(0..0, unpacks.collect::<Vec<_>>());
    for o in plan.packed_outputs() {
        let (dim, sym, by) = plan.outputs[o][0];
        let v = g.outputs[o];
        let (ty, next) = {
            let types = g.value_types();
            (types[v as usize].clone(), types.len() as u32)
        };
        g.nodes.push(Node {
            op: PACK.into(),
            args: vec![Arg::Value(v), length_of(sym), Arg::Int(dim as i64), Arg::Int(by)],
            kwargs: vec![],
            outputs: vec![ty],
        });
        g.outputs[o] = next;
    }
    inputs.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Alias, SymSize};

    const S: SymExpr = SymExpr::Sym(0);

    /// A graph over `inputs`, with `nodes` as `(op, args, output shape)` and symbolic `sizes`.
    fn graph(inputs: Vec<Vec<i64>>, nodes: Vec<(&str, Vec<Arg>, Vec<i64>)>, sizes: Vec<(SymSlot, SymExpr)>) -> SymbolicGraph {
        let n = (inputs.len() + nodes.len()) as u32;
        let graph = Graph {
            inputs: inputs.into_iter().map(|shape| Input { ty: TensorType::new(DType::F32, shape), kind: InputKind::User }).collect(),
            nodes: nodes
                .into_iter()
                .map(|(op, args, shape)| Node { op: op.into(), args, kwargs: vec![], outputs: vec![TensorType::new(DType::F32, shape)] })
                .collect(),
            outputs: vec![n - 1],
            aliases: vec![],
        };
        let sizes = sizes.into_iter().map(|(at, expr)| SymSize { at, expr }).collect();
        SymbolicGraph { graph: GraphWithSources { graph, sources: vec![] }, sizes, scalars: vec![] }
    }
    /// `g` specialized padded to `shapes` and packed, its true sizes inserted before input `at`.
    fn packed(g: &SymbolicGraph, plan: &PaddingPlan, shapes: &[Vec<i64>], at: u32) -> Graph {
        let mut c = g.specialize_padded(plan, shapes, &[], at).unwrap();
        g.pack_padded(plan, &mut c, at);
        c.graph
    }
    fn dim(value: u32, dim: u32) -> SymSlot {
        SymSlot::Dim { value, dim }
    }
    fn size_arg(node: u32, arg: u32, path: Vec<u32>) -> SymSlot {
        SymSlot::Arg { node, arg, path }
    }
    fn times(m: i64) -> SymExpr {
        SymExpr::Mul(vec![SymExpr::Const(m), S])
    }
    fn ints(v: &[i64]) -> Arg {
        Arg::List(v.iter().map(|&i| Arg::Int(i)).collect())
    }

    /// x: [2, s, 4] -> view [2s, 4] -> mm [4, 3] -> view [2, s, 3]: a Linear on a padded sequence.
    fn linear(back: Vec<i64>, back_sizes: Vec<(SymSlot, SymExpr)>) -> SymbolicGraph {
        let mut sizes = vec![
            (dim(0, 1), S),
            (dim(2, 0), times(2)),
            (size_arg(0, 1, vec![0]), times(2)),
            (dim(3, 0), times(2)),
        ];
        sizes.extend(back_sizes);
        graph(
            vec![vec![2, 0, 4], vec![4, 3]],
            vec![
                ("aten.view.default", vec![Arg::Value(0), ints(&[0, 4])], vec![0, 4]),
                ("aten.mm.default", vec![Arg::Value(2), Arg::Value(1)], vec![0, 3]),
                ("aten.view.default", vec![Arg::Value(3), ints(&back)], back.clone()),
            ],
            sizes,
        )
    }

    #[test]
    fn merged_rows_through_a_matmul_keep_the_proof() {
        let g = linear(vec![2, 0, 3], vec![(dim(4, 1), S), (size_arg(2, 1, vec![1]), S)]);
        let plan = g.padding_plan().unwrap();
        assert_eq!(plan.inputs, vec![vec![(1, 0)], vec![]]);
        assert_eq!(plan.outputs, vec![vec![(1, 0, 0)]]);
    }

    #[test]
    fn a_reshape_that_splits_the_position_digit_is_refused() {
        // [2s, 3] -> [s, 6]: row r of the result mixes batch rows 2r and 2r+1.
        let g = linear(vec![0, 6], vec![(dim(4, 0), S), (size_arg(2, 1, vec![0]), S)]);
        assert!(g.padding_plan().unwrap_err().contains("splits the padded dimension"));
    }

    #[test]
    fn reductions_over_padded_positions_and_sizes_as_values_are_refused() {
        let sum = graph(
            vec![vec![2, 0]],
            vec![("aten.sum.dim_IntList", vec![Arg::Value(0), ints(&[1])], vec![2])],
            vec![(dim(0, 1), S)],
        );
        assert!(sum.padding_plan().unwrap_err().contains("reduces over a padded dimension"));
        let clamp = graph(
            vec![vec![2, 0]],
            vec![("aten.clamp.default", vec![Arg::Value(0), Arg::Int(0)], vec![2, 0])],
            vec![(dim(0, 1), S), (dim(1, 1), S), (size_arg(0, 1, vec![]), S)],
        );
        assert!(clamp.padding_plan().unwrap_err().contains("used as a value"));
    }

    #[test]
    fn a_size_added_as_a_number_becomes_the_true_size_read_at_run_time() {
        let add = graph(
            vec![vec![2, 0]],
            vec![("aten.add.Scalar", vec![Arg::Value(0), Arg::Int(0)], vec![2, 0])],
            vec![(dim(0, 1), S), (dim(1, 1), S), (size_arg(0, 1, vec![]), S)],
        );
        let plan = add.padding_plan().unwrap();
        assert_eq!(plan.rewrites, vec![Rewrite::TrueSize { node: 0, arg: 1, sym: 0 }]);
        assert_eq!(plan.runtime, vec![0]);
        let c = packed(&add, &plan, &[vec![2, 8]], 1);
        // Node 0 unpacks the input (value 2).
        assert_eq!(c.nodes[1].args, vec![Arg::Value(2), Arg::Value(1)]);
    }

    /// `table[:, arange(s + 1) + offset]`: table `[2, t]` (input 0, its own symbol 1), the
    /// positions of a grown dimension.
    fn gather_positions(offset: i64) -> SymbolicGraph {
        let t = SymExpr::Sym(1);
        let grown = SymExpr::Add(vec![S, SymExpr::Const(1)]);
        let mut g = graph(
            vec![vec![2, 0], vec![0]],
            vec![
                ("aten.arange.start_step", vec![Arg::Int(0), Arg::Int(0), Arg::Int(1)], vec![0]),
                ("aten.add.Tensor", vec![Arg::Value(2), Arg::Int(offset)], vec![0]),
                ("aten.index.Tensor", vec![Arg::Value(0), Arg::List(vec![Arg::None, Arg::Value(3)])], vec![2, 0]),
            ],
            vec![
                (dim(0, 1), t),
                (dim(1, 0), S),
                (size_arg(0, 1, vec![]), grown.clone()),
                (dim(2, 0), grown.clone()),
                (dim(3, 0), grown.clone()),
                (dim(4, 1), grown),
            ],
        );
        for v in [2, 3] {
            g.graph.graph.nodes[v - 2].outputs[0].dtype = DType::I64;
        }
        g
    }

    #[test]
    fn a_gather_at_counted_positions_assumes_the_table_is_long_enough() {
        let plan = gather_positions(0).padding_plan().unwrap();
        assert_eq!(plan.at_least, vec![(1, 0, 1)]);
        assert_eq!(plan.outputs, vec![vec![(1, 0, 1)]]);
        assert_eq!(gather_positions(2).padding_plan().unwrap().at_least, vec![(1, 0, 3)]);
        // Negative positions would wrap to the padding's end.
        assert!(gather_positions(-1).padding_plan().unwrap_err().contains("not bounded"));
    }

    #[test]
    fn a_prefix_of_a_static_table_caps_the_padded_size() {
        // table[:s] + x, x: [s, 4], table: [10, 4].
        let g = graph(
            vec![vec![0, 4], vec![10, 4]],
            vec![
                ("aten.slice.Tensor", vec![Arg::Value(1), Arg::Int(0), Arg::Int(0), Arg::Int(0)], vec![0, 4]),
                ("aten.add.Tensor", vec![Arg::Value(0), Arg::Value(2)], vec![0, 4]),
            ],
            vec![(dim(0, 0), S), (dim(2, 0), S), (size_arg(0, 3, vec![]), S), (dim(3, 0), S)],
        );
        let plan = g.padding_plan().unwrap();
        assert_eq!(plan.limits, vec![(0, 10)]);
        assert_eq!(plan.outputs, vec![vec![(0, 0, 0)]]);
    }

    #[test]
    fn a_suffix_as_long_as_a_sliding_window_keeps_every_exact_position() {
        // cat([x, y], 1)[:, -4:], x: [2, s], y: [2, 1]: the window's last 4 entries.
        let grown = SymExpr::Add(vec![S, SymExpr::Const(1)]);
        let g = graph(
            vec![vec![2, 0], vec![2, 1]],
            vec![
                ("aten.cat.default", vec![Arg::List(vec![Arg::Value(0), Arg::Value(1)]), Arg::Int(1)], vec![2, 0]),
                ("aten.slice.Tensor", vec![Arg::Value(2), Arg::Int(1), Arg::Int(-4), Arg::Int(i64::MAX)], vec![2, 0]),
            ],
            vec![
                (dim(0, 1), S),
                (dim(2, 1), grown.clone()),
                (dim(3, 1), SymExpr::Min(vec![grown, SymExpr::Const(4)])),
            ],
        );
        let plan = g.padding_plan().unwrap();
        // Exact while s + 1 <= 4.
        assert_eq!(plan.at_most, vec![(0, 3)]);
        assert_eq!(plan.outputs, vec![vec![(1, 0, 1)]]);
        assert!(plan.rewrites.contains(&Rewrite::KeepAll { node: 1, dim: 1 }));
        assert_eq!(plan.runtime, vec![0]); // the cat's append, not the slice
        let c = packed(&g, &plan, &[vec![2, 8], vec![2, 1]], 2);
        assert_eq!(c.nodes[2].args[2], Arg::Int(0));
        assert_eq!(c.nodes[2].outputs[0].shape, vec![2, 9]);
        // A suffix that does not reach the end keeps no such promise.
        let mut short = g.clone();
        short.graph.graph.nodes[1].args[3] = Arg::Int(-1);
        assert!(short.padding_plan().unwrap_err().contains("other than as a prefix"));
    }

    #[test]
    fn a_softmax_and_a_product_over_padded_keys_hide_them() {
        // softmax(x, 1) @ v, x: [2, s], v: [s, 3]: eager attention's probabilities times values.
        let attention = |softmax: &str| {
            graph(
                vec![vec![2, 0], vec![0, 3]],
                vec![
                    (softmax, vec![Arg::Value(0), Arg::Int(1), Arg::Bool(false)], vec![2, 0]),
                    ("aten.mm.default", vec![Arg::Value(2), Arg::Value(1)], vec![2, 3]),
                ],
                vec![(dim(0, 1), S), (dim(1, 0), S), (dim(2, 1), S)],
            )
        };
        let plan = attention("aten._softmax.default").padding_plan().unwrap();
        assert_eq!(
            plan.rewrites,
            vec![Rewrite::HideKeys { node: 0, sym: 0, by: 0 }, Rewrite::HideKeys { node: 1, sym: 0, by: 0 }]
        );
        assert_eq!(plan.outputs, vec![vec![]]);
        // A log-softmax's padding would be -inf, not 0: refused.
        let log = attention("aten._log_softmax.default").padding_plan().unwrap_err();
        assert!(log.contains("normalizes over a padded dimension"));
    }

    const SDPA: &str = "aten._scaled_dot_product_flash_attention_for_cpu.default";

    /// A decode step: `cat([past, new], 2)` as keys and values of attention for one query;
    /// past `[1, 2, s, 4]` (input 0), new and q `[1, 2, 1, 4]`; outputs the grown cache and
    /// the attention.
    fn decode_step(causal: bool) -> SymbolicGraph {
        let mut g = graph(
            vec![vec![1, 2, 0, 4], vec![1, 2, 1, 4], vec![1, 2, 1, 4]],
            vec![
                ("aten.cat.default", vec![Arg::List(vec![Arg::Value(0), Arg::Value(1)]), Arg::Int(2)], vec![1, 2, 0, 4]),
                (SDPA, vec![Arg::Value(2), Arg::Value(3), Arg::Value(3), Arg::Float(crate::ir::FloatBits(0)), Arg::Bool(causal)], vec![1, 2, 1, 4]),
            ],
            vec![(dim(0, 2), S), (dim(3, 2), SymExpr::Add(vec![S, SymExpr::Const(1)]))],
        );
        let nodes = &mut g.graph.graph.nodes;
        nodes[1].outputs.push(TensorType::new(DType::F32, vec![1, 2, 1]));
        g.graph.graph.outputs = vec![3, 4];
        g
    }

    #[test]
    fn appending_to_a_padded_cache_reads_the_true_length_at_run_time() {
        let g = decode_step(false);
        let plan = g.padding_plan().unwrap();
        assert_eq!(plan.outputs, vec![vec![(2, 0, 1)], vec![]]);
        assert_eq!(plan.runtime, vec![0]);
        assert_eq!(plan.rewrites, vec![Rewrite::AppendAt { node: 0, sym: 0 }, Rewrite::HideKeys { node: 1, sym: 0, by: 1 }]);
        assert_eq!(plan.packed_inputs().collect::<Vec<_>>(), vec![0]);
        assert_eq!(plan.packed_outputs().collect::<Vec<_>>(), vec![0]);
        // The length goes in before input 1: later values move up by one. The packed cache is
        // read through an unpacking node first (value 4) and returned through a packing one.
        let c = packed(&g, &plan, &[vec![1, 2, 8, 4], vec![1, 2, 1, 4], vec![1, 2, 1, 4]], 1);
        assert_eq!(c.inputs[1].ty, TensorType::new(DType::I64, vec![]));
        assert_eq!(c.nodes[0].op, UNPACK);
        assert_eq!(c.nodes[0].args, vec![Arg::Value(0), Arg::Value(1), Arg::Int(2)]);
        assert_eq!(c.nodes[0].outputs[0].shape, vec![1, 2, 8, 4]);
        assert_eq!(c.nodes[1].args[0], Arg::List(vec![Arg::Value(4), Arg::Value(2)]));
        assert_eq!(c.nodes[1].kwargs, vec![(APPEND_AT.to_string(), Arg::Value(1))]);
        assert_eq!(c.nodes[1].outputs[0].shape, vec![1, 2, 9, 4]);
        assert_eq!(c.nodes[2].args[..3], [Arg::Value(3), Arg::Value(5), Arg::Value(5)]);
        assert_eq!(
            c.nodes[2].kwargs,
            vec![(KEYS_VALID.to_string(), Arg::Value(1)), (KEYS_VALID_PLUS.to_string(), Arg::Int(1))]
        );
        assert_eq!(c.nodes[3].op, PACK);
        assert_eq!(c.nodes[3].args, vec![Arg::Value(5), Arg::Value(1), Arg::Int(2), Arg::Int(1)]);
        assert_eq!(c.outputs, vec![8, 6]);
    }

    #[test]
    fn a_mask_padded_like_the_keys_is_hidden_with_them_one_padded_otherwise_is_refused() {
        // Keys cat([past, new], 2) with past [1, 2, s, 4]; the mask cat([m_past, m_new], 3)
        // with m_past [1, 1, 1, m]: padded like the keys when m is s.
        let masked = |m: SymExpr| {
            let plus_one = |e: SymExpr| SymExpr::Add(vec![e, SymExpr::Const(1)]);
            let mut g = graph(
                vec![vec![1, 2, 0, 4], vec![1, 2, 1, 4], vec![1, 2, 1, 4], vec![1, 1, 1, 0], vec![1, 1, 1, 1]],
                vec![
                    ("aten.cat.default", vec![Arg::List(vec![Arg::Value(0), Arg::Value(1)]), Arg::Int(2)], vec![1, 2, 0, 4]),
                    ("aten.cat.default", vec![Arg::List(vec![Arg::Value(3), Arg::Value(4)]), Arg::Int(3)], vec![1, 1, 1, 0]),
                    (SDPA, vec![Arg::Value(2), Arg::Value(5), Arg::Value(5)], vec![1, 2, 1, 4]),
                ],
                vec![(dim(0, 2), S), (dim(3, 3), m.clone()), (dim(5, 2), plus_one(S)), (dim(6, 3), plus_one(m))],
            );
            let attention = &mut g.graph.graph.nodes[2];
            attention.kwargs = vec![("attn_mask".into(), Arg::Value(6))];
            attention.outputs.push(TensorType::new(DType::F32, vec![1, 2, 1]));
            g.graph.graph.outputs = vec![7];
            g.padding_plan()
        };
        assert_eq!(
            masked(S).unwrap().rewrites,
            vec![
                Rewrite::AppendAt { node: 0, sym: 0 },
                Rewrite::AppendAt { node: 1, sym: 0 },
                Rewrite::HideKeys { node: 2, sym: 0, by: 1 }
            ]
        );
        assert!(masked(SymExpr::Sym(1)).unwrap_err().contains("pads a mask unlike its queries and keys"));
    }

    #[test]
    fn causal_attention_over_queries_and_keys_padded_alike_needs_no_mask() {
        // q = k = v = x: [1, 2, s, 4].
        let attention = |causal| {
            let mut g = graph(
                vec![vec![1, 2, 0, 4]],
                vec![(SDPA, vec![Arg::Value(0), Arg::Value(0), Arg::Value(0), Arg::Float(crate::ir::FloatBits(0)), Arg::Bool(causal)], vec![1, 2, 0, 4])],
                vec![(dim(0, 2), S), (dim(1, 2), S), (dim(2, 2), S)],
            );
            g.graph.graph.nodes[0].outputs.push(TensorType::new(DType::F32, vec![1, 2, 0]));
            g.graph.graph.outputs = vec![1];
            g.padding_plan().map(|p| p.rewrites)
        };
        assert_eq!(attention(true), Ok(vec![]));
        assert_eq!(attention(false), Ok(vec![Rewrite::HideKeys { node: 0, sym: 0, by: 0 }]));
    }

    #[test]
    fn prepending_to_a_padded_dimension_is_refused() {
        let g = graph(
            vec![vec![1], vec![0]],
            vec![("aten.cat.default", vec![Arg::List(vec![Arg::Value(0), Arg::Value(1)])], vec![0])],
            vec![(dim(1, 0), S), (dim(2, 0), SymExpr::Add(vec![S, SymExpr::Const(1)]))],
        );
        assert!(g.padding_plan().unwrap_err().contains("concatenates along a padded dimension"));
    }

    #[test]
    fn a_padded_input_updated_in_place_is_refused() {
        let mut g = graph(
            vec![vec![0]],
            vec![("aten.mul.Scalar", vec![Arg::Value(0), Arg::Float(crate::ir::FloatBits(2f64.to_bits()))], vec![0])],
            vec![(dim(0, 0), S), (dim(1, 0), S)],
        );
        g.graph.graph.aliases = vec![Alias { input: 0, output: 0 }];
        assert!(g.padding_plan().unwrap_err().contains("updated in place"));
    }
}
