//! Scaled dot-product attention (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA on
//! CPU tensors dispatches to), lowered as one unit instead of through PyTorch's math
//! decomposition.
//!
//! The decomposition normalizes the whole `[L, S]` probability matrix and then multiplies it by
//! V. Here the exponentials go into the product unnormalized and the `[L, E]` result is divided
//! by the row sums: one pass fewer over the largest tensor of the layer (UNet at 32x32 has
//! 3.2 M scores per attention). Scores, softmax and products run in f32 for half inputs, as the
//! CPU flash kernel accumulates.
//!
//! Where the process's plugin has our attention kernel (XLA:CPU on a CPU with AVX-512; for bf16
//! in AMX tiles' layouts, one with AMX or AVX-512 BF16), the whole op is one call of it instead
//! (`host_attention`), reading the queries, keys and values where the projections leave them and
//! writing the output as what reads it next wants it (`Placements`), and growing a padded decode
//! step's cache by its new keys and values where the step returns it (`Grown`).

use super::builder::{broadcast_shapes, lowering_target, opmath, Builder, Combiner, Scalar, Val, R};
use super::patterns::{value, Uses};
use super::reduction::{exponentials, zero_rows};
use super::{NodeCtx, Registry, Res, A};
use crate::ir::{Arg, DType, Node, TensorType, ValueId};
use crate::padding::{APPEND_AT, KEYS_VALID, KEYS_VALID_PLUS, PACK, UNPACK};
use std::collections::HashMap;

const FLASH_ATTENTION: &str = "aten._scaled_dot_product_flash_attention_for_cpu.default";

pub fn register(r: &mut Registry) {
    r.add(&[FLASH_ATTENTION], |n| flash_attention(&n, None));
}

/// Where our attention kernels read each attention's operands and write its output, by
/// the node: eager's CPU flash kernel takes strided operands and writes `[B, L, H, E]`, so the
/// projections' `view(B, L, H, E).transpose(1, 2)` and the output's `transpose(1, 2)` cost it
/// nothing, where XLA:CPU copied each operand into `[B, H, L, E]` (and, reading a fused
/// projection's third, sliced it out first) and the output back: GPT-2 at batch 8 ran eight
/// loops a layer around its attention.
pub struct Placements {
    by_node: HashMap<usize, Placement>,
}

/// An attention's operands read in place (`None`: as the node's operand), whether its output
/// is written `[B, L, H, E]` (only transposes back read it), and the key and value operands the
/// kernel also writes out: each where it is read in place and the graph reads it elsewhere
/// too (a cache's update: XLA:CPU made each in two loops).
#[derive(Clone, Copy, Debug, Default)]
struct Placement {
    operands: [Option<InPlace>; 3],
    interleaved: bool,
    presents: [Option<ValueId>; 2],
    grown: Option<Grown>,
}

/// A padded decode step's keys and values, each its cache grown by the step's new rows
/// (`cat([unpack(cache), new], -2)`, appended at the cache's true length) and read only by the
/// attention and by the `pack` that returns it: the kernel reads the caches (`caches`, packed)
/// and the new rows (`news`, `rows` of them a head) and writes the grown caches packed, the
/// values of the packs (`packed`). XLA:CPU unpacked each cache to the bucket's capacity,
/// appended the rows and packed it again: three loops over the capacity each (SmolLM-135M
/// after a 1024-token prompt: 180 loops writing 1.6 MB each, a step).
#[derive(Clone, Copy, Debug)]
struct Grown {
    caches: [ValueId; 2],
    news: [ValueId; 2],
    packed: [ValueId; 2],
    rows: i64,
}

/// An operand `[B, H, L, E]` that is `[B, L, H, E]` rows transposed: `base`'s rows (`width`
/// values each, whatever its shape) hold the `H · E` values from column `offset`.
#[derive(Clone, Copy, Debug)]
struct InPlace {
    base: ValueId,
    offset: i64,
    width: i64,
}

impl Placements {
    /// The placements of `uses`' graph's f32 and bf16 attentions where the plugin has our
    /// kernel for their type (none elsewhere).
    pub fn of(uses: &Uses) -> Self {
        let mut by_node = HashMap::new();
        let target = lowering_target();
        let ours = |dtype: DType| match dtype {
            DType::F32 => target.host_attention.is_some(),
            DType::Bf16 => target.host_bf16_attention.is_some(),
            _ => false,
        };
        for (i, node) in uses.graph.nodes.iter().enumerate() {
            let operands = node.args.iter().take(3).map(value).collect::<Option<Vec<_>>>();
            let Some(operands) = operands.filter(|o| node.op == FLASH_ATTENTION && o.len() == 3) else {
                continue;
            };
            let dtype = uses.types[operands[0] as usize].dtype;
            if !ours(dtype) || operands.iter().any(|&v| uses.types[v as usize].dtype != dtype || uses.types[v as usize].rank() != 4) {
                continue;
            }
            let grown = grown(uses, i, [operands[1], operands[2]]);
            let read = |j: usize| match grown {
                Some(g) if j > 0 => g.news[j - 1],
                _ => operands[j],
            };
            let placed = [0, 1, 2].map(|j| in_place(uses, read(j)));
            let elsewhere = |v: ValueId| uses.graph.outputs.contains(&v) || uses.readers(v).iter().any(|&r| r != i);
            let placement = Placement {
                operands: placed,
                interleaved: only_transposed(uses, uses.output(i)),
                presents: [1, 2].map(|j| placed[j].and(Some(operands[j])).filter(|&v| grown.is_none() && elsewhere(v))),
                grown,
            };
            if placement.interleaved || grown.is_some() || placed.iter().any(Option::is_some) {
                by_node.insert(i, placement);
            }
        }
        Placements { by_node }
    }

    /// Node `i` lowered with its placement, where it has one, and the values the kernel wrote
    /// for others (the keys and values), which replace theirs; `values`: those lowered so far.
    pub fn lower<'a>(&self, i: usize, n: &NodeCtx<'a>, values: &[Option<Val<'a>>]) -> Option<R<WithWritten<'a>>> {
        let placement = self.by_node.get(&i)?;
        let value = |v: ValueId| values.get(v as usize).cloned().flatten();
        let operands = placement.operands.map(|o| o.and_then(|o| value(o.base).map(|base| Placed { base, offset: o.offset, width: o.width })));
        let appended = placement.grown.and_then(|g| {
            let [caches, news] = [g.caches, g.news].map(|vs| vs.map(value));
            let [Some(k), Some(v)] = caches else { return None };
            let [Some(new_k), Some(new_v)] = news else { return None };
            Some((Appended { caches: [k, v], news: [new_k, new_v], rows: g.rows }, g.packed))
        });
        // Copies only of operands read in place (their base lowered), or of the grown caches.
        let presents = match &appended {
            Some((_, packed)) => packed.map(Some),
            None => [1, 2].map(|j| placement.presents[j - 1].filter(|_| operands[j].is_some())),
        };
        let layout = Layout { presents: presents.map(|p| p.is_some()), operands, interleaved: placement.interleaved, appended: appended.map(|(a, _)| a) };
        Some(flash_attention(n, Some(&layout)).map(|mut outs| {
            let written = outs.split_off(2);
            (outs, presents.into_iter().flatten().zip(written).collect())
        }))
    }
}

/// `v` as `[B, L, H, E]` rows transposed, where it is (`InPlace`): `permute(x, [0, 2, 1, 3])`,
/// or a cache's update from nothing (`cat([empty, that], -2)`), `x` read where it is or, where
/// it views a slice of a wider result's columns (a fused projection's `split`), where that
/// result is.
fn in_place(uses: &Uses, v: ValueId) -> Option<InPlace> {
    let graph = uses.graph;
    let shape = |v: ValueId| &uses.types[v as usize].shape;
    let v = match uses.node_of(v, "aten.cat.default") {
        Some(cat) => match &graph.nodes[cat].args[..] {
            [Arg::List(items), ..] => {
                let mut parts = items.iter().filter_map(value).filter(|&t| uses.types[t as usize].numel() != 0 || uses.types[t as usize].rank() != 1);
                match (parts.next(), parts.next(), items.len()) {
                    (Some(t), None, 2) => t,
                    _ => return None,
                }
            }
            _ => return None,
        },
        None => v,
    };
    let permute = uses.node_of(v, "aten.permute.default")?;
    let [Arg::Value(x), Arg::List(perm)] = &graph.nodes[permute].args[..] else { return None };
    if perm.iter().map(|p| match p { Arg::Int(p) => Some(*p), _ => None }).ne([0, 2, 1, 3].map(Some)) {
        return None;
    }
    let &[batch, len, heads, dim] = &shape(*x)[..] else { return None };
    let placed = InPlace { base: *x, offset: 0, width: heads * dim };
    // `x` a view of `y`'s rows of `H · E`, `y` the columns `offset..` of `z`'s rows.
    let y = uses.viewed(*x).map(|(_, y)| y);
    let columns = y.filter(|&y| shape(y).last() == Some(&(heads * dim)) && uses.types[y as usize].numel() == batch * len * heads * dim).and_then(|y| {
        let last = shape(y).len() as i64 - 1;
        let on_last = |d: &Arg| matches!(d, Arg::Int(d) if *d == last || *d == -1);
        if let Some(slice) = uses.node_of(y, "aten.slice.Tensor") {
            let (z, start) = match &graph.nodes[slice].args[..] {
                [Arg::Value(z), d, Arg::Int(start), _, Arg::Int(1)] | [Arg::Value(z), d, Arg::Int(start), _] if on_last(d) => (*z, *start),
                _ => return None,
            };
            return Some((z, start));
        }
        let split = uses.node_of(y, "aten.split_with_sizes.default").or_else(|| uses.node_of(y, "aten.split.Tensor"))?;
        let (z, d) = match &graph.nodes[split].args[..] {
            [Arg::Value(z), _, d] => (*z, d),
            [Arg::Value(z), _] => (*z, &Arg::Int(0)),
            _ => return None,
        };
        let first = uses.output(split);
        let before: i64 = (first..y).map(|o| shape(o).last().copied().unwrap_or(0)).sum();
        on_last(d).then_some((z, before))
    });
    let Some((z, offset)) = columns else { return Some(placed) };
    let (zs, ys) = (shape(z), shape(y?));
    let width = *zs.last()?;
    let rows_agree = zs.len() == ys.len() && zs[..zs.len() - 1] == ys[..ys.len() - 1];
    if !rows_agree || uses.types[z as usize].dtype != uses.types[*x as usize].dtype || offset < 0 || offset + heads * dim > width {
        return Some(placed);
    }
    Some(InPlace { base: z, offset, width })
}

/// Whether only `permute(v, [0, 2, 1, 3])`s read `v`, directly or through (up to four) views
/// of its own shape, and it is not a graph output.
fn only_transposed(uses: &Uses, v: ValueId) -> bool {
    let shape = &uses.types[v as usize].shape;
    let same_shape_view = |node: &Node| {
        matches!(node.op.as_str(), "aten.view.default" | "aten._unsafe_view.default") && node.outputs.first().is_some_and(|t| t.shape == *shape)
    };
    let transposed = |node: &Node| node.op == "aten.permute.default" && matches!(&node.args[..], [Arg::Value(_), Arg::List(perm)] if *perm == [0, 2, 1, 3].map(Arg::Int));
    uses.only_read_by(v, &same_shape_view, &transposed)
}

/// Where attention `node`'s keys and values (`kv`) are both a padded decode step's grown caches
/// (`Grown`), as the padding's rewrites leave them: each cat appends at its cache's true length
/// (the keys' the one the key count counts from), the new rows are what the count adds, and
/// the pack returns the grown cache exact to those rows. The values' length is a symbol of its
/// own, equal to the keys' in any graph that ran eagerly (the product by the probabilities
/// needs it): the kernel grows both by the key count.
fn grown(uses: &Uses, node: usize, kv: [ValueId; 2]) -> Option<Grown> {
    let graph = uses.graph;
    let kwarg = |i: usize, name: &str| graph.nodes[i].kwargs.iter().find(|(k, _)| k == name).map(|(_, a)| a.clone());
    let (Some(Arg::Value(length)), Some(Arg::Int(rows))) = (kwarg(node, KEYS_VALID), kwarg(node, KEYS_VALID_PLUS)) else {
        return None;
    };
    let part = |x: ValueId, counted: bool| -> Option<(ValueId, ValueId, ValueId)> {
        let cat = uses.node_of(x, "aten.cat.default")?;
        let (Some(Arg::Value(at)), [Arg::List(items), Arg::Int(-2 | 2)]) = (kwarg(cat, APPEND_AT), &graph.nodes[cat].args[..]) else {
            return None;
        };
        let [Arg::Value(unpacked), Arg::Value(new)] = &items[..] else { return None };
        let unpack = uses.node_of(*unpacked, UNPACK)?;
        let [Arg::Value(cache), Arg::Value(unpacked_at), Arg::Int(2)] = graph.nodes[unpack].args[..] else {
            return None;
        };
        let length = if counted { length } else { at };
        let readers = uses.readers(x);
        let pack = *readers.iter().find(|&&r| r != node)?;
        let packs_it = matches!(graph.nodes[pack].args[..], [Arg::Value(y), Arg::Value(l), Arg::Int(2), Arg::Int(by)] if y == x && l == length && by == rows);
        let new_rows = uses.types[*new as usize].shape.get(2) == Some(&rows) && uses.types[*new as usize].dtype == uses.types[x as usize].dtype;
        let fits = uses.types[cache as usize] == uses.types[*unpacked as usize];
        let only = readers.len() == 2 && readers.contains(&node) && !graph.outputs.contains(&x);
        (graph.nodes[pack].op == PACK && packs_it && at == length && unpacked_at == length && new_rows && fits && only).then_some((cache, *new, uses.output(pack)))
    };
    let [(k_cache, k_new, k_packed), (v_cache, v_new, v_packed)] = [part(kv[0], true)?, part(kv[1], false)?];
    (kv[0] != kv[1]).then_some(Grown { caches: [k_cache, v_cache], news: [k_new, v_new], packed: [k_packed, v_packed], rows })
}

/// A node's outputs, and the values of other nodes its kernel wrote (which replace theirs).
pub type WithWritten<'a> = (Vec<Val<'a>>, Vec<(ValueId, Val<'a>)>);

/// An operand read in place (`InPlace` with its base lowered).
struct Placed<'a> {
    base: Val<'a>,
    offset: i64,
    width: i64,
}

/// One attention's placement as lowered: its q, k and v where read in place, whether the
/// output is written `[B, L, H, E]`, whether the kernel writes the keys and the values out, and
/// whether they are caches grown by new rows (then k and v are the new rows, the copies the
/// grown caches).
struct Layout<'a> {
    operands: [Option<Placed<'a>>; 3],
    interleaved: bool,
    presents: [bool; 2],
    appended: Option<Appended<'a>>,
}

/// `Grown` as lowered.
struct Appended<'a> {
    caches: [Val<'a>; 2],
    news: [Val<'a>; 2],
    rows: i64,
}

/// `(output [B, H, L, E], logsumexp [B, H, L])` for q `[B, H, L, E]`, k/v `[B, Hkv, S, E]`
/// (grouped-query when `H` is a multiple of `Hkv`: query head `h` reads key/value head
/// `h / (H / Hkv)`).
///
/// Rows whose mask hides every key give 0, output and logsumexp, as the CPU kernel does. They
/// are told by the mask (a reduce over `[L, S]`, not over every head's scores); their
/// exponentials are NaN (-inf - -inf) until the final select replaces them.
///
/// With a `layout` that asks for them, where our kernel runs, the keys and values it wrote
/// (those asked for, in that order) follow the two outputs.
fn flash_attention<'a>(n: &NodeCtx<'a>, layout: Option<&Layout<'a>>) -> Res<'a> {
    let (q, k, v) = (
        n.tensor(0, "query")?,
        n.tensor(1, "key")?,
        n.tensor(2, "value")?,
    );
    if n.float_or(3, "dropout_p", 0.0)? != 0.0 {
        return Err("dropout_p must be 0 (inference)".into());
    }
    let causal = n.bool_or(4, "is_causal", false)?;
    let mask = n.opt_tensor(5, "attn_mask")?;
    if mask.as_ref().is_some_and(|m| !m.dtype().is_float()) {
        // SDPA turns a bool mask into this float one before calling the op.
        return Err("attn_mask must be a float tensor (0 to keep a key, -inf to hide it)".into());
    }
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err("query, key and value must be 4-d".into());
    }
    let [batch, heads, len_q, dim] = [0, 1, 2, 3].map(|i| q.shape()[i]);
    let (kv_heads, len_kv) = (k.shape()[1], k.shape()[2]);
    if k.shape() != v.shape()
        || k.shape()[0] != batch
        || k.shape()[3] != dim
        || kv_heads == 0
        || heads % kv_heads != 0
    {
        return Err("key/value must be [B, Hkv, S, E] with Hkv dividing the query heads".into());
    }
    let scale = match n.arg(6, "scale") {
        None | Some(A::None) => 1.0 / (dim as f64).sqrt(),
        Some(A::Float(s)) => *s,
        Some(A::Int(s)) => *s as f64,
        Some(_) => return Err("scale must be a number".into()),
    };
    let b = &n.b;
    let f = opmath(q.dtype());
    let mask = mask.map(|m| b.convert(&m, f)).transpose()?;
    let count = keys_count(n)?;
    let host = lowering_target();
    let scale_value = b.scalar(Scalar::Float(scale), DType::F32)?;
    let extras = (mask.as_ref(), count.as_ref(), &scale_value);
    let packed = Layout { operands: [None, None, None], interleaved: false, presents: [false; 2], appended: None };
    let layout = layout.unwrap_or(&packed);
    if let (Some(targets), true) = (host.host_bf16_attention, [&q, &k, &v].iter().all(|t| t.dtype() == DType::Bf16)) {
        if let Some((out, lse, presents)) = host_attention(b, targets, [&q, &k, &v], layout, causal, extras)? {
            return Ok([vec![out, b.convert(&lse, n.out(1)?.dtype)?], presents].concat());
        }
    }
    let (q, k, mut v) = (b.convert(&q, f)?, b.convert(&k, f)?, b.convert(&v, f)?);
    if let (Some(targets), DType::F32) = (host.host_attention, f) {
        // Half inputs widened: read as the widening leaves them.
        let layout = if q.dtype() == n.tensor(0, "query")?.dtype() { layout } else { &packed };
        if let Some((out, lse, presents)) = host_attention(b, targets, [&q, &k, &v], layout, causal, extras)? {
            return Ok([vec![b.convert(&out, n.out(0)?.dtype)?, b.convert(&lse, n.out(1)?.dtype)?], presents].concat());
        }
    }
    // Scaled before the product: fewer multiplies than on the scores, and none that XLA:CPU
    // would feed to the product's fusion as a materialized [L, S] broadcast of the scale.
    let q = b.mul_scalar(&q, scale)?;
    let visible = count.map(|count| keys_below(b, &count, len_kv)).transpose()?;
    if let Some(visible) = &visible {
        // Padding may hold anything, and 0 * inf is NaN: hidden values become 0 too.
        v = b.select(&b.reshape(visible, &[len_kv, 1])?, &v, &b.scalar(Scalar::Float(0.0), f)?)?;
    }
    let (mut outs, mut lses) = (vec![], vec![]);
    for rows in row_blocks(causal, mask.is_some(), len_q, len_kv) {
        let (out, lse) = attend(
            b,
            &b.slice_dim(&q, 2, rows.start, rows.end, 1)?,
            (&b.slice_dim(&k, 2, 0, rows.keys, 1)?, &b.slice_dim(&v, 2, 0, rows.keys, 1)?),
            visible.as_ref().map(|m| b.slice_dim(m, 0, 0, rows.keys, 1)).transpose()?,
            mask.as_ref().map(|m| mask_block(b, m, &rows, len_q, len_kv)).transpose()?,
            causal.then_some(rows.start),
        )?;
        outs.push(out);
        lses.push(lse);
    }
    let out = b.concat(&outs.iter().collect::<Vec<_>>(), 2)?;
    let lse = b.reshape(&b.concat(&lses.iter().collect::<Vec<_>>(), 2)?, &[batch, heads, len_q])?;
    Ok(vec![
        b.convert(&out, n.out(0)?.dtype)?,
        b.convert(&lse, n.out(1)?.dtype)?,
    ])
}

/// `(output, logsumexp)` of queries `q` over `k`, `v`, by our host kernel
/// (`tpu_dynamo_runtime::host_kernels`, `targets` without a mask and with the causal one)
/// where a head's keys fit its scratch: one kernel where XLA:CPU runs two products and a
/// softmax, each writing all the scores out: in f32 (half inputs widened), or for bf16 on the
/// tiles, the f32 `scale` applied as eager applies it. Each operand is read where `layout`
/// says, or as it is, the output written `[B, L, H, E]` where it says so (transposed back
/// here, which what reads it undoes), and `k` and `v` written out (the third result) where it
/// asks. A float mask (in f32) reaches it as a bias `[B or 1, H or 1, L, S]` added to
/// the scores; a padded graph's true key count as a 0-d i64, past which it reads neither keys,
/// values nor mask (padding may hold anything).
fn host_attention<'a>(
    b: &Builder<'a>,
    (plain, causal_target): (&'static str, &'static str),
    [q, k, v]: [&Val<'a>; 3],
    layout: &Layout<'a>,
    causal: bool,
    (mask, count, scale): (Option<&Val<'a>>, Option<&Val<'a>>, &Val<'a>),
) -> R<Option<(Val<'a>, Val<'a>, Vec<Val<'a>>)>> {
    let [batch, heads, len_q, dim] = [0, 1, 2, 3].map(|i| q.shape()[i]);
    let (kv_heads, len_kv) = (k.shape()[1], k.shape()[2]);
    if len_kv == 0 || len_kv > HOST_MAX_KEYS || dim > HOST_MAX_DIM || dim * len_kv > HOST_MAX_KEY_ELEMENTS {
        return Ok(None);
    }
    let interleaved = layout.interleaved;
    // The runtime's `AttentionLayout`: the key heads and count, the output's order, each
    // operand's offset and batch, head and row strides, the copies asked for and the new rows
    // appended to the caches.
    let mut placement = vec![kv_heads, len_kv, i64::from(interleaved)];
    let mut operands: Vec<&Val<'a>> = vec![];
    let read = match &layout.appended {
        Some(a) => [q, &a.news[0], &a.news[1]],
        None => [q, k, v],
    };
    for (t, placed) in read.into_iter().zip(&layout.operands) {
        let [h, l, e] = [1, 2, 3].map(|i| t.shape()[i]);
        match placed {
            Some(p) => {
                placement.extend([p.offset, l * p.width, e, p.width]);
                operands.push(&p.base);
            }
            None => {
                placement.extend([0, h * l * e, l * e, e]);
                operands.push(t);
            }
        }
    }
    let bias = match mask {
        Some(m) => {
            // The mask's batch and head dims as they are (1 or the scores'), its rows and keys
            // as the scores'.
            let lead = |i: usize| if m.rank() + i >= 4 { m.shape()[m.rank() + i - 4] } else { 1 };
            Some(b.broadcast_to(m, &[lead(0), lead(1), len_q, len_kv])?)
        }
        None => None,
    };
    let count = count.map(|c| b.convert(&b.reshape(c, &[])?, DType::I64)).transpose()?;
    placement.extend(layout.presents.map(i64::from));
    placement.push(layout.appended.as_ref().map_or(0, |a| a.rows));
    let placement = b.constant_i64(&placement)?;
    operands.extend(layout.appended.iter().flat_map(|a| &a.caches));
    operands.extend(bias.as_ref());
    operands.extend(count.as_ref());
    operands.push(scale);
    operands.push(&placement);
    let out = if interleaved { TensorType::new(q.dtype(), vec![batch, len_q, heads, dim]) } else { q.ty.clone() };
    let mut results = vec![out, TensorType::new(DType::F32, vec![batch, heads, len_q])];
    results.extend([k, v].iter().zip(layout.presents).filter(|(_, asked)| *asked).map(|(t, _)| t.ty.clone()));
    let mut outs = b.host_call(if causal { causal_target } else { plain }, &operands, results)?;
    let presents = outs.split_off(2);
    let lse = outs.remove(1);
    let out = outs.remove(0);
    Ok(Some((if interleaved { b.transpose(&out, &[0, 2, 1, 3])? } else { out }, lse, presents)))
}

/// The largest head size, key count and head of keys (elements) our attention kernel takes:
/// each of XLA's threads keeps a head's keys in its scratch (8 MiB at most; 32768 keys of 64),
/// with 12 queries' scores against them (3 MiB at most).
const HOST_MAX_DIM: i64 = 512;
const HOST_MAX_KEYS: i64 = 1 << 16;
const HOST_MAX_KEY_ELEMENTS: i64 = 1 << 21;

/// Queries per block of a long masked or causal attention (`row_blocks`), and the fewest
/// queries that are split. Measured on the CPU plugin, `[1, 9, L, 64]` queries over 3 key
/// heads, causal, eager's flash kernel at 1.0: one block 1.2-1.4 (L = 512), 2.5 (1024), 3.6-3.9
/// (2048), 3.8-4.7 (4096); blocks of 128 rows 0.9-1.3, 0.95, 0.92-1.03, 1.0-1.04 (of 64 and
/// 256 rows about the same; at L = 256-384 neither better nor worse than one block). With a
/// `[L, S]` mask (a padded batch's) and no causal flag: 1.4-2.0 -> 1.1-1.3 at L = 2048.
const ROW_BLOCK: i64 = 128;
const BLOCKED_FROM: i64 = 512;

/// Queries `start..end` and the keys `0..keys` they attend to.
struct Rows {
    start: i64,
    end: i64,
    keys: i64,
}

/// The blocks of queries an attention is computed in. A long attention with a mask (causal or
/// given) is split by rows, so that each block's scores, and the part of the mask every head
/// adds to them, stay in cache across heads, where the whole `[H, L, S]` scores were written
/// out and read back from memory and the `[L, S]` mask read once per head; a causal block also
/// reads only the keys its last query sees (query `i` sees keys up to `i`), about half the
/// products and exponentials in all. Otherwise one block.
fn row_blocks(causal: bool, masked: bool, len_q: i64, len_kv: i64) -> Vec<Rows> {
    if !(causal || masked) || len_q < BLOCKED_FROM {
        return vec![Rows { start: 0, end: len_q, keys: len_kv }];
    }
    (0..len_q)
        .step_by(ROW_BLOCK as usize)
        .map(|start| {
            let end = (start + ROW_BLOCK).min(len_q);
            Rows { start, end, keys: if causal { end.min(len_kv) } else { len_kv } }
        })
        .collect()
}

/// The part of `mask` (broadcastable to `[B, H, L, S]`) that applies to `rows`: its query and
/// key dims sliced where they are not broadcast (a slice of all of a dim is no slice).
fn mask_block<'a>(
    b: &Builder<'a>,
    mask: &Val<'a>,
    rows: &Rows,
    len_q: i64,
    len_kv: i64,
) -> R<Val<'a>> {
    let rank = mask.rank();
    let mut m = mask.clone();
    if rank >= 2 && m.shape()[rank - 2] == len_q {
        m = b.slice_dim(&m, rank - 2, rows.start, rows.end, 1)?;
    }
    if rank >= 1 && m.shape()[rank - 1] == len_kv {
        m = b.slice_dim(&m, rank - 1, 0, rows.keys, 1)?;
    }
    Ok(m)
}

/// `(output [B, H, l, E], logsumexp [B, H, l, 1])` of queries `q` `[B, H, l, E]` (scaled, in
/// `f`) over keys and values `[B, Hkv, s, E]`; `visible`: `[s]`, the keys below a padded
/// graph's true count; `mask`: broadcastable to the scores; `causal_from`: the index of the
/// first query when causal.
fn attend<'a>(
    b: &Builder<'a>,
    q: &Val<'a>,
    (k, v): (&Val<'a>, &Val<'a>),
    visible: Option<Val<'a>>,
    mask: Option<Val<'a>>,
    causal_from: Option<i64>,
) -> R<(Val<'a>, Val<'a>)> {
    let [batch, heads, len_q, dim] = [0, 1, 2, 3].map(|i| q.shape()[i]);
    let (kv_heads, len_kv) = (k.shape()[1], k.shape()[2]);
    let f = q.dtype();
    let group = heads / kv_heads;
    // Grouped query heads share their key/value head's batch entry: [B, Hkv, group * l, E].
    let q = b.reshape(q, &[batch, kv_heads, group * len_q, dim])?;
    let scores = b.dot_general(&q, k, (&[0, 1], &[0, 1]), (&[3], &[3]), f)?;
    let full = [batch, heads, len_q, len_kv];
    let mut scores = b.reshape(&scores, &full)?;
    if let Some(visible) = &visible {
        scores = b.select(visible, &scores, &b.scalar(Scalar::Float(f64::NEG_INFINITY), f)?)?;
    }
    let masked = mask.is_some();
    let mut bias = bias(b, mask, causal_from, len_q, len_kv, f)?;
    if let (Some(mask), Some(visible)) = (&bias, &visible) {
        // A mask padded along the keys holds anything there (-inf + inf would be NaN); hidden
        // keys read as masked, so a row whose true keys are all masked is still found below.
        let shape = broadcast_shapes(mask.shape(), &[len_kv])?;
        let neg_inf = b.splat(Scalar::Float(f64::NEG_INFINITY), &TensorType::new(f, shape.clone()))?;
        bias = Some(b.select(&b.broadcast_to(visible, &shape)?, &b.broadcast_to(mask, &shape)?, &neg_inf)?);
    }
    let scores = match &bias {
        Some(bias) => b.add(&scores, &b.broadcast_to_each_use(bias, &full)?)?,
        None => scores,
    };

    let rows = exponentials(b, &scores, 3, false)?;

    let e = b.reshape(&rows.e, &[batch, kv_heads, group * len_q, len_kv])?;
    let weighted = b.dot_general(&e, v, (&[0, 1], &[0, 1]), (&[3], &[2]), f)?;
    let weighted = b.reshape(&weighted, &[batch, heads, len_q, dim])?;
    let mut out = b.div(&weighted, &rows.total)?;
    let mut lse = b.add(&rows.shift, &b.unary("log", &rows.total)?)?;
    // The causal mask alone never hides a whole row: query i always sees key 0.
    if let Some(bias) = bias.as_ref().filter(|_| masked) {
        let neg_inf = b.full_like(Scalar::Float(f64::NEG_INFINITY), bias)?;
        let last = bias.rank() - 1;
        let hidden = b.reduce(
            &b.compare(bias, &neg_inf, "EQ")?,
            &[last],
            Combiner::And,
            true,
        )?;
        (out, lse) = (zero_rows(b, &hidden, &out)?, zero_rows(b, &hidden, &lse)?);
    }
    Ok((out, lse))
}

/// `x` with its positions along `dim` at or past the keys' count set to `fill`, when the graph
/// runs padded to a bucket and they are padded keys (see `crate::padding`); `x` otherwise.
pub(crate) fn hide_padded_keys<'a>(n: &NodeCtx<'a>, x: Val<'a>, dim: usize, fill: f64) -> R<Val<'a>> {
    let Some(visible) = keys_visible(n, x.shape()[dim])? else {
        return Ok(x);
    };
    let b = &n.b;
    let visible = b.broadcast_in_dim(&visible, x.shape(), &[dim])?;
    b.select(&visible, &x, &b.splat(Scalar::Float(fill), &x.ty)?)
}

/// `[S]`, true for the keys below the count read at run time, when the graph runs padded to a
/// bucket and its keys are padded (see `crate::padding`); None otherwise.
fn keys_visible<'a>(n: &NodeCtx<'a>, len_kv: i64) -> R<Option<Val<'a>>> {
    keys_count(n)?.map(|count| keys_below(&n.b, &count, len_kv)).transpose()
}

/// The true count of keys read at run time, when the graph runs padded to a bucket and its keys
/// are padded (see `crate::padding`); None otherwise.
fn keys_count<'a>(n: &NodeCtx<'a>) -> R<Option<Val<'a>>> {
    let Some(valid) = n.opt_tensor(usize::MAX, KEYS_VALID)? else {
        return Ok(None);
    };
    let plus = n.b.scalar(Scalar::Int(n.int_or(usize::MAX, KEYS_VALID_PLUS, 0)?), valid.dtype())?;
    Ok(Some(n.b.add(&valid, &plus)?))
}

/// `[S]`, true for the positions below `count`.
fn keys_below<'a>(b: &Builder<'a>, count: &Val<'a>, len_kv: i64) -> R<Val<'a>> {
    let position = b.iota(&TensorType::new(count.dtype(), vec![len_kv]), 0)?;
    b.compare(&position, count, "LT")
}

/// What the masks add to the scores, `[L, S]` or the mask's own shape (broadcast to the
/// scores by the caller): the float mask as it is, and for the causal mask -inf where key `j`
/// is hidden from query `i` (`j > i`; `i` counted from `causal_from`). Added rather than
/// selected, the mask keeps the max, shift and exponential in one fusion with the product that
/// makes the scores (XLA:CPU's library fusions take elementwise adds, not selects: causal GPT-2
/// attention at 4x128x128 ran 114-133 -> 58-67 us), and the select runs once per mask, not once
/// per head.
fn bias<'a>(
    b: &Builder<'a>,
    mask: Option<Val<'a>>,
    causal_from: Option<i64>,
    len_q: i64,
    len_kv: i64,
    f: DType,
) -> R<Option<Val<'a>>> {
    let causal = if let Some(first) = causal_from {
        let grid = TensorType::new(DType::I64, vec![len_q, len_kv]);
        let query = b.add(&b.iota(&grid, 0)?, &b.splat(Scalar::Int(first), &grid)?)?;
        let visible = b.compare(&b.iota(&grid, 1)?, &query, "LE")?;
        let ty = TensorType::new(f, vec![len_q, len_kv]);
        Some(b.select(
            &visible,
            &b.splat(Scalar::Float(0.0), &ty)?,
            &b.splat(Scalar::Float(f64::NEG_INFINITY), &ty)?,
        )?)
    } else {
        None
    };
    match (causal, mask) {
        (Some(c), Some(m)) => {
            let shape = broadcast_shapes(c.shape(), m.shape())?;
            Ok(Some(b.add(
                &b.broadcast_to(&c, &shape)?,
                &b.broadcast_to(&m, &shape)?,
            )?))
        }
        (c, m) => Ok(c.or(m)),
    }
}

