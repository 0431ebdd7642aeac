//! Scaled dot-product attention (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA on
//! CPU tensors dispatches to), lowered as one unit instead of through PyTorch's math
//! decomposition.
//!
//! The decomposition normalizes the whole `[L, S]` probability matrix and then multiplies it by
//! V. Here the exponentials go into the product unnormalized and the `[L, E]` result is divided
//! by the row sums: one pass fewer over the largest tensor of the layer (UNet at 32x32 has
//! 3.2 M scores per attention). Scores, softmax and products run in f32 for half inputs, as the
//! CPU flash kernel accumulates.

use super::builder::{opmath, Builder, Scalar, Val, R};
use super::reduction::{exponentials, zero_masked_rows};
use super::{NodeCtx, Registry, Res, A};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &["aten._scaled_dot_product_flash_attention_for_cpu.default"],
        flash_attention_for_cpu,
    );
}

/// `(output [B, H, L, E], logsumexp [B, H, L])` for q `[B, H, L, E]`, k/v `[B, Hkv, S, E]`
/// (grouped-query when `H` is a multiple of `Hkv`: query head `h` reads key/value head
/// `h / (H / Hkv)`).
///
/// Rows that mask every key (all scores -inf) give 0 as eager does (`exponentials` with masked
/// rows: their exponentials, sum and product with V are all 0).
fn flash_attention_for_cpu(n: NodeCtx<'_>) -> Res<'_> {
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
    let group = heads / kv_heads;
    // Grouped query heads share their key/value head's batch entry: [B, Hkv, group * L, E].
    let q = b.reshape(
        &b.mul_scalar(&b.convert(&q, f)?, scale)?,
        &[batch, kv_heads, group * len_q, dim],
    )?;
    let (k, v) = (b.convert(&k, f)?, b.convert(&v, f)?);
    let scores = b.dot_general(&q, &k, (&[0, 1], &[0, 1]), (&[3], &[3]), f)?;
    let full = [batch, heads, len_q, len_kv];
    let scores = masked(b, b.reshape(&scores, &full)?, mask, causal)?;

    let rows = exponentials(b, &scores, 3, true)?;

    let e = b.reshape(&rows.e, &[batch, kv_heads, group * len_q, len_kv])?;
    let weighted = b.dot_general(&e, &v, (&[0, 1], &[0, 1]), (&[3], &[2]), f)?;
    let weighted = b.reshape(&weighted, &[batch, heads, len_q, dim])?;
    let out = zero_masked_rows(b, &b.div(&weighted, &rows.total)?, &rows.total)?;
    let lse = b.add(&rows.shift, &b.unary("log", &rows.total)?)?;
    let lse = b.reshape(&lse, &[batch, heads, len_q])?;
    Ok(vec![
        b.convert(&out, n.out(0)?.dtype)?,
        b.convert(&lse, n.out(1)?.dtype)?,
    ])
}

/// `scores` with the mask applied: a bool mask (or the causal one, key `j` visible to query
/// `i` when `j <= i`) sets hidden scores to -inf, a float mask is added.
fn masked<'a>(b: &Builder<'a>, scores: Val<'a>, mask: Option<Val<'a>>, causal: bool) -> R<Val<'a>> {
    let shape = scores.shape().to_vec();
    let neg_inf = b.full_like(Scalar::Float(f64::NEG_INFINITY), &scores)?;
    let scores = if causal {
        let grid = TensorType::new(DType::I64, vec![shape[2], shape[3]]);
        let visible = b.compare(&b.iota(&grid, 1)?, &b.iota(&grid, 0)?, "LE")?;
        b.select(&b.broadcast_to(&visible, &shape)?, &scores, &neg_inf)?
    } else {
        scores
    };
    match mask {
        None => Ok(scores),
        Some(m) if m.dtype() == DType::Bool => {
            b.select(&b.broadcast_to(&m, &shape)?, &scores, &neg_inf)
        }
        Some(m) => b.add(
            &scores,
            &b.broadcast_to(&b.convert(&m, scores.dtype())?, &shape)?,
        ),
    }
}
