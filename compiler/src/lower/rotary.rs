//! Rotary position embeddings as transformers apply them to queries and keys
//! (`apply_rotary_pos_emb`: `x · cos + rotate_half(x) · sin`, `x` `[B, H, L, D]`, `cos` and
//! `sin` `[B or 1, 1, L, D]`), found among their ATen ops and lowered as one call of our kernel,
//! which reads `x` from the projection's rows where `x` is their `transpose(1, 2)`.
//!
//! XLA:CPU made each a loop of scalar reads through the transpose, the slices and the
//! concatenation: a batch-8 tiny Llama's query and key of a layer (98 K values) took it 123-156
//! µs. The kernel's results are eager's to the bit (see the runtime's `rotary`).

use super::builder::{lowering_target, Builder, Scalar, Val, R};
use super::patterns::{number, value, Uses};
use crate::ir::{Arg, DType, TensorType, ValueId};
use std::collections::HashMap;

/// Values below which a rotation stays XLA's, fused with its neighbours: a decode step's
/// queries and keys (a row a head) are cheaper in a fusion than as a call.
const MIN_VALUES: i64 = 1 << 12;

/// A rotation's operands: `x`, read as `[B, L, H, D]` rows (`rows_first`, `x` then being the
/// value the graph transposes) or as `[B, H, L, D]`, and its tables.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Rotary {
    x: ValueId,
    rows_first: bool,
    cos: ValueId,
    sin: ValueId,
}

/// The rotations of a graph lowered as our kernel, by the `add` node holding each one's result.
pub struct Rotaries {
    by_node: HashMap<usize, Rotary>,
}

impl Rotaries {
    /// The f32 rotations of `uses`' graph, where the plugin has our kernel (none elsewhere).
    pub fn of(uses: &Uses) -> Self {
        let by_node = match lowering_target().host_rotary {
            Some(_) => uses.graph.nodes.iter().enumerate().filter(|(_, n)| n.op == "aten.add.Tensor").filter_map(|(i, _)| Some((i, rotary(uses, i)?))).collect(),
            None => HashMap::new(),
        };
        Rotaries { by_node }
    }

    /// Node `i`'s value as our kernel's, where it is a rotation's result; `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, b: &Builder<'a>, values: &[Option<Val<'a>>], out: &TensorType) -> Option<R<Vec<Val<'a>>>> {
        let rotary = self.by_node.get(&i)?;
        let target = lowering_target().host_rotary?;
        let operand = |v: ValueId| values.get(v as usize).cloned().flatten().ok_or_else(|| format!("%{v} is not a value"));
        let lowered = || -> R<Vec<Val<'a>>> {
            let &[batches, heads, tokens, width] = out.shape.as_slice() else { return Err("a rotation of other than 4 dims".into()) };
            let x = b.reshape(&operand(rotary.x)?, &if rotary.rows_first { [batches, tokens, heads, width] } else { [batches, heads, tokens, width] })?;
            let table = |v: ValueId| -> R<Val<'a>> {
                let t = operand(v)?;
                let n = t.ty.numel();
                b.reshape(&t, &[n / (tokens * width), tokens, width])
            };
            let rows_first = b.scalar(Scalar::Int(i64::from(rotary.rows_first)), DType::I64)?;
            b.host_call(target, &[&x, &table(rotary.cos)?, &table(rotary.sin)?, &rows_first], vec![out.clone()])
        };
        Some(lowered())
    }
}

/// The rotation whose result is `add`'s: `mul(x, cos) + mul(rotate_half(x), sin)`, each
/// product's factors and the sum's terms in either order, of f32 `x` `[B, H, L, D]` and tables
/// `[B or 1, 1, L, D]` (fewer leading dims of 1 too).
fn rotary(uses: &Uses, add: usize) -> Option<Rotary> {
    let node = &uses.graph.nodes[add];
    let [Arg::Value(p), Arg::Value(q)] = node.args[..] else { return None };
    if !node.kwargs.is_empty() {
        return None;
    }
    let factors = |v: ValueId| -> Option<[ValueId; 2]> {
        match uses.graph.nodes[uses.node_of(v, "aten.mul.Tensor")?].args[..] {
            [Arg::Value(a), Arg::Value(b)] => Some([a, b]),
            _ => None,
        }
    };
    let (fp, fq) = (factors(p)?, factors(q)?);
    let (x, cos, sin) = [(fp, fq), (fq, fp)].into_iter().find_map(|(plain, rotated)| {
        [(rotated[0], rotated[1]), (rotated[1], rotated[0])].into_iter().find_map(|(half_turned, sin)| {
            let x = rotate_half_of(uses, half_turned)?;
            let cos = match plain {
                [a, c] if a == x => c,
                [c, a] if a == x => c,
                _ => return None,
            };
            Some((x, cos, sin))
        })
    })?;
    let ty = uses.types[x as usize];
    let &[batches, _, tokens, width] = ty.shape.as_slice() else { return None };
    let table = |v: ValueId| {
        let t = uses.types[v as usize];
        let mut dims = vec![1; 4usize.saturating_sub(t.rank())];
        dims.extend(&t.shape);
        t.dtype == DType::F32 && matches!(dims[..], [b, 1, l, d] if (b == 1 || b == batches) && l == tokens && d == width)
    };
    let fits = ty.dtype == DType::F32 && ty.numel() >= MIN_VALUES && node.outputs.first() == Some(ty) && table(cos) && table(sin);
    let rows_first = uses.permuted(x).filter(|(_, perm)| perm == &[0, 2, 1, 3]);
    let (x, rows_first) = rows_first.map_or((x, false), |(rows, _)| (rows, true));
    fits.then_some(Rotary { x, rows_first, cos, sin })
}

/// `x` where `v` is `rotate_half(x)`: `cat([-x[..., D/2:], x[..., :D/2]], -1)`, `D` even.
fn rotate_half_of(uses: &Uses, v: ValueId) -> Option<ValueId> {
    let nodes = &uses.graph.nodes;
    let cat = &nodes[uses.node_of(v, "aten.cat.default")?];
    let [Arg::List(ref parts), ref dim] = cat.args[..] else { return None };
    let [Arg::Value(negated), Arg::Value(first)] = parts[..] else { return None };
    let neg = &nodes[uses.node_of(negated, "aten.neg.default")?];
    let (x, second_half) = last_dim_slice(uses, value(neg.args.first()?)?)?;
    let (x_again, first_half) = last_dim_slice(uses, first)?;
    let ty = uses.types[x as usize];
    let width = *ty.shape.last()?;
    let last = number(dim)? as i64;
    (x == x_again && width % 2 == 0 && (last == -1 || last == ty.rank() as i64 - 1) && second_half == (width / 2, width) && first_half == (0, width / 2)).then_some(x)
}

/// Where `v` is a slice of another value along its last dim with step 1: that value, and the
/// slice's start and end (clamped to the dim).
fn last_dim_slice(uses: &Uses, v: ValueId) -> Option<(ValueId, (i64, i64))> {
    let slice = &uses.graph.nodes[uses.node_of(v, "aten.slice.Tensor")?];
    let x = value(slice.args.first()?)?;
    let ty = uses.types[x as usize];
    let (rank, width) = (ty.rank() as i64, *ty.shape.last()?);
    let int = |j: usize, default: i64| match slice.args.get(j) {
        None | Some(Arg::None) => Some(default),
        Some(a) => number(a).map(|n| n as i64),
    };
    let dim = int(1, 0)?;
    let clamp = |i: i64| if i < 0 { (i + width).max(0) } else { i.min(width) };
    let (start, end) = (clamp(int(2, 0)?), clamp(int(3, width)?));
    ((dim == -1 || dim == rank - 1) && int(4, 1)? == 1 && slice.kwargs.is_empty()).then_some((x, (start, end)))
}
