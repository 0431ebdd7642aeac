//! Matrix products (and `_trilinear`). Half-precision operands accumulate in f32 (the dot yields
//! f32, rounded once), which is what PyTorch's CPU GEMMs do.

use super::builder::{
    broadcast_shapes, lowering_target, norm_dim, opmath, Builder, Combiner, Scalar, Val, R,
};
use super::reduction::sum_to;
use super::attention::hide_padded_keys;
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.mm.default",
            "aten.bmm.default",
            "aten.addmm.default",
            "aten.baddbmm.default",
            "aten.addbmm.default",
        ],
        matmul,
    );
    r.add(&["transformers.grouped_mm_fallback.default"], grouped_mm);
    r.add(&["aten._cdist_forward.default"], cdist);
    r.add(&["aten._pdist_forward.default"], pdist);
    r.add(&["aten._trilinear.default"], trilinear);
}

/// `_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim)` (behind
/// `nn.functional.bilinear`): each input gets size-1 dims at its `expand` positions, the three
/// are multiplied with broadcasting and `sumdim` is summed out (in f32 for half inputs).
/// `unroll_dim` only picks ATen's loop order.
fn trilinear(n: NodeCtx<'_>) -> Res<'_> {
    let b = &n.b;
    let inputs = [n.tensor(0, "i1")?, n.tensor(1, "i2")?, n.tensor(2, "i3")?];
    let expands = [
        n.ints(3, "expand1")?,
        n.ints(4, "expand2")?,
        n.ints(5, "expand3")?,
    ];
    let total = inputs[0].rank() + expands[0].len();
    let out = n.out_dtype()?;
    let mut product: Option<Val> = None;
    for (x, expand) in inputs.iter().zip(&expands) {
        let expand = expand
            .iter()
            .map(|&d| norm_dim(d, total))
            .collect::<R<Vec<_>>>()?;
        if x.rank() + expand.len() != total {
            return Err(format!("_trilinear: inputs do not expand to rank {total}"));
        }
        let mut dims = x.shape().iter();
        let shape: Vec<i64> = (0..total)
            .map(|i| {
                if expand.contains(&i) {
                    1
                } else {
                    *dims.next().unwrap_or(&1)
                }
            })
            .collect();
        let x = b.reshape(&b.convert(x, opmath(out))?, &shape)?;
        product = Some(match product {
            None => x,
            Some(p) => b.mul(&p, &x)?,
        });
    }
    let product = product.ok_or("_trilinear: no inputs")?;
    let mut sumdim = n
        .ints(6, "sumdim")?
        .iter()
        .map(|&d| norm_dim(d, total))
        .collect::<R<Vec<_>>>()?;
    sumdim.sort_unstable();
    sumdim.dedup();
    let y = sum_to(b, &product, &sumdim, true, out)?;
    Ok(vec![b.reshape(&y, &n.out(0)?.shape)?])
}

/// Contractions up to this long are asked of the backend as bf16 products (`product_type`).
const BF16_PRODUCT_MAX_K: i64 = 256;

/// The type a matrix product of `out` values contracting `k` elements is computed in: f32 (and
/// then rounded) by default, so a half-precision product accumulates in f32 and rounds once, as
/// PyTorch's do. A short bf16 product is asked for in bf16 itself: backends accumulate it in f32
/// and round once all the same (on XLA:CPU with the same roundings as eager), and XLA:CPU's
/// YNNPACK GEMM then writes bf16 where an f32 product was written out and converted in a
/// second pass, which is dear next to a short contraction's work (µs, alternating builds:
/// `[1024, 64] x [64, 1000]` 556-741 -> 450-464, a LoRA up-projection `[1024, 64] x [64, 3072]`
/// 1420-1537 -> 1117-1197, attention scores over 64 dims 1667-2572 -> 1461-1485; GPT-2 and
/// Llama at hidden 64, batch 8, raw execute 8-10 % less). Longer ones stay f32 until measured
/// better: isolated they gained little (K = 576: 243-286 -> 236-256 µs), and SmolLM-135M's
/// forward, all of whose products are K >= 576, ran 7 % slower with them in bf16 in four
/// pairs of processes (this VM's swings reach 17 % between identical builds).
/// With a bias to add (`fused`) the product stays f32 so that the sum rounds once, as eager's
/// does; f16 too (XLA:CPU's f16 products round differently from eager's).
fn product_type(out: DType, fused: bool, k: i64) -> DType {
    if out == DType::Bf16 && !fused && k <= BF16_PRODUCT_MAX_K {
        out
    } else {
        opmath(out)
    }
}

/// `mm`, `bmm`, and `addmm`/`baddbmm`/`addbmm` (`beta * input + alpha * (a @ b)`).
fn matmul(n: NodeCtx<'_>) -> Res<'_> {
    let fused = matches!(
        n.op.as_str(),
        "aten.addmm.default" | "aten.baddbmm.default" | "aten.addbmm.default"
    );
    let first = fused as usize;
    let (a, b) = (n.tensor(first, "mat1")?, n.tensor(first + 1, "mat2")?);
    let out = n.out_dtype()?;
    let bd = &n.b;
    let prod = if n.op == "aten.addbmm.default" {
        // The batch dim is contracted too: the sum of the batch's products.
        bd.dot_general(&a, &b, (&[], &[]), (&[0, 2], &[0, 1]), opmath(out))?
    } else {
        let batch: &[i64] = if a.rank() == 3 { &[0] } else { &[] };
        let k = a.rank() as i64 - 1;
        let a = hide_padded_keys(&n, a, k as usize, 0.0)?;
        let b = hide_padded_keys(&n, b, k as usize - 1, 0.0)?;
        let contract: (&[i64], &[i64]) = (&[k], &[k - 1]);
        let on_tiles = bd.bf16_product_on_tiles(&a, &b, (batch, batch), contract, out);
        if n.op == "aten.addmm.default" && n.float_or(3, "beta", 1.0)? == 1.0 && n.float_or(4, "alpha", 1.0)? == 1.0 {
            // The bias `[N]` added by our product kernel, where it computes the product: to f32
            // results, or to a bf16 product's f32 sums before they are rounded once.
            let bias = n.tensor(0, "self")?;
            let kernels = if out == DType::Bf16 { lowering_target().host_bf16_gemm_bias } else { lowering_target().host_gemm_bias };
            let y = if bias.shape() == [b.shape()[b.rank() - 1]] { bd.host_product_then(kernels, &a, &b, &[&bias])? } else { None };
            if let Some(y) = y {
                return Ok(vec![y]);
            }
        }
        // A bf16 product on the tiles is rounded by the kernel, as an f32 one converted would be.
        let product = if on_tiles && !fused { out } else { product_type(out, fused, a.shape()[k as usize]) };
        bd.dot_general(&a, &b, (batch, batch), contract, product)?
    };
    if !fused {
        return Ok(vec![bd.convert(&prod, out)?]);
    }
    let bias = bd.convert(&n.tensor(0, "self")?, opmath(out))?;
    let alpha = n.float_or(4, "alpha", 1.0)?;
    let beta = n.float_or(3, "beta", 1.0)?;
    let prod = if alpha != 1.0 {
        bd.mul_scalar(&prod, alpha)?
    } else {
        prod
    };
    let bias = if beta != 1.0 {
        bd.mul_scalar(&bias, beta)?
    } else {
        bias
    };
    Ok(vec![bd.convert(&bd.add(&prod, &bias)?, out)?])
}

/// transformers' `grouped_mm_fallback(input[S, K], weight[E, K, N], offs[E])`: rows
/// `offs[e-1]..offs[e]` use expert `e`'s weight, rows past `offs[E-1]` stay zero. Computed as
/// every expert on every row, then each row keeps its own expert's product (static shapes).
fn grouped_mm(n: NodeCtx<'_>) -> Res<'_> {
    let (x, w, offs) = (
        n.tensor(0, "input")?,
        n.tensor(1, "weight")?,
        n.tensor(2, "offs")?,
    );
    let b = &n.b;
    let (s, e, out_dim) = (x.shape()[0], w.shape()[0], w.shape()[2]);
    let out = n.out_dtype()?;
    // [S, E, N]: row s through expert e.
    let all = b.dot_general(&x, &w, (&[], &[]), (&[1], &[1]), opmath(out))?;
    let offs = b.convert(&offs, DType::I64)?;
    let row = b.iota(&TensorType::new(DType::I64, vec![s, e]), 0)?;
    let past = b.compare(&row, &b.broadcast_in_dim(&offs, &[s, e], &[1])?, "GE")?;
    // The expert of row s is how many groups end at or before it.
    let group = sum_to(b, &b.convert(&past, DType::I64)?, &[1], false, DType::I64)?;
    let expert = b.iota(&TensorType::new(DType::I64, vec![s, e]), 1)?;
    let mine = b.compare(&b.broadcast_in_dim(&group, &[s, e], &[0])?, &expert, "EQ")?;
    let mine = b.broadcast_in_dim(&b.convert(&mine, all.dtype())?, &[s, e, out_dim], &[0, 1])?;
    let y = sum_to(b, &b.mul(&all, &mine)?, &[1], false, opmath(out))?;
    Ok(vec![b.convert(&y, out)?])
}

/// p-norm distances between the rows of `x1` (`[..., P, M]`) and `x2` (`[..., R, M]`), batch
/// dims broadcast: `[..., P, R]`, from the explicit differences (PyTorch's p = 0 counts the
/// nonzero ones, p = inf takes the largest).
fn distances<'a>(b: &Builder<'a>, x1: &Val<'a>, x2: &Val<'a>, p: f64) -> R<Val<'a>> {
    let (r1, r2) = (x1.rank(), x2.rank());
    let batch = broadcast_shapes(&x1.shape()[..r1 - 2], &x2.shape()[..r2 - 2])?;
    let (rows, cols, m) = (x1.shape()[r1 - 2], x2.shape()[r2 - 2], x1.shape()[r1 - 1]);
    let k = batch.len();
    let mut shape = batch.clone();
    shape.extend([rows, cols, m]);
    let spread = |x: &Val<'a>, skip: usize| {
        let x = b.broadcast_to(
            x,
            &[batch.clone(), x.shape()[x.rank() - 2..].to_vec()].concat(),
        )?;
        let dims: Vec<usize> = (0..k + 3).filter(|&d| d != skip).collect();
        b.broadcast_in_dim(&x, &shape, &dims)
    };
    let diff = b.unary("abs", &b.sub(&spread(x1, k + 1)?, &spread(x2, k)?)?)?;
    let last = [k + 2];
    if p == 0.0 {
        let nonzero = b.convert(&b.convert(&diff, DType::Bool)?, diff.dtype())?;
        b.reduce(&nonzero, &last, Combiner::Add, false)
    } else if p == f64::INFINITY {
        b.reduce(&diff, &last, Combiner::Max, false)
    } else if p == 1.0 {
        b.reduce(&diff, &last, Combiner::Add, false)
    } else {
        let pow = |x: &Val<'a>, e: f64| b.binary("power", x, &b.full_like(Scalar::Float(e), x)?);
        let sum = b.reduce(&pow(&diff, p)?, &last, Combiner::Add, false)?;
        if p == 2.0 {
            b.unary("sqrt", &sum)
        } else {
            pow(&sum, 1.0 / p)
        }
    }
}

/// `_cdist_forward(x1, x2, p, compute_mode)`: all pairwise distances (the mode only picks
/// PyTorch's kernel).
fn cdist(n: NodeCtx<'_>) -> Res<'_> {
    let (x1, x2) = (n.tensor(0, "x1")?, n.tensor(1, "x2")?);
    let p = n.float_or(2, "p", 2.0)?;
    Ok(vec![distances(&n.b, &x1, &x2, p)?])
}

/// `_pdist_forward(x, p)`: distances between rows `i < j` of `x`, row-major: the upper
/// triangle of the full distance matrix, one row slice at a time.
fn pdist(n: NodeCtx<'_>) -> Res<'_> {
    let x = n.tensor(0, "self")?;
    let p = n.float_or(1, "p", 2.0)?;
    let b = &n.b;
    let rows = x.shape()[0];
    let out = n.out(0)?;
    if rows < 2 {
        return Ok(vec![b.splat(Scalar::Int(0), out)?]);
    }
    let full = distances(b, &x, &x, p)?;
    let parts = (0..rows - 1)
        .map(|i| {
            b.reshape(
                &b.slice(&full, &[i, i + 1], &[i + 1, rows], &[1, 1])?,
                &[rows - 1 - i],
            )
        })
        .collect::<R<Vec<_>>>()?;
    Ok(vec![b.concat(&parts.iter().collect::<Vec<_>>(), 0)?])
}
