//! Window functions (`torch.{hann,hamming,blackman,bartlett,kaiser}_window`): made from an iota as
//! PyTorch's factories make them from an arange, in the same order of operations, so a window
//! feeding an `stft` in a model's forward compiles instead of failing (torch 2.15 decomposes
//! only `hann_window`, torch 2.11 none of them).
//!
//! PyTorch builds a periodic window of length N as the symmetric one of length N + 1 without its
//! last point; both are "the first N points at spacing 1/D", with D = N when periodic and N - 1
//! when not.

use super::builder::{opmath, Builder, Scalar, Val, R};
use super::special::i0;
use super::{NodeCtx, Registry, Res};
use crate::ir::TensorType;
use std::f64::consts::PI;

pub fn register(r: &mut Registry) {
    r.add(
        &[
            "aten.hann_window.default",
            "aten.hann_window.periodic",
            "aten.hamming_window.default",
            "aten.hamming_window.periodic",
            "aten.hamming_window.periodic_alpha",
            "aten.hamming_window.periodic_alpha_beta",
            "aten.blackman_window.default",
            "aten.blackman_window.periodic",
            "aten.bartlett_window.default",
            "aten.bartlett_window.periodic",
            "aten.kaiser_window.default",
            "aten.kaiser_window.periodic",
            "aten.kaiser_window.beta",
        ],
        window,
    );
}

fn window(n: NodeCtx<'_>) -> Res<'_> {
    let len = n.int(0, "window_length")?;
    if len < 0 {
        return Err(format!("window_length must be non-negative, got {len}"));
    }
    let out = n.out_dtype()?;
    let b = &n.b;
    // Lengths 0 and 1 are special-cased by PyTorch (an empty window, and [1]).
    if len <= 1 {
        return Ok(vec![
            b.splat(Scalar::Int(1), &TensorType::new(out, vec![len]))?
        ]);
    }
    let periodic = n.bool_or(1, "periodic", true)?;
    let spacing = (if periodic { len } else { len - 1 }) as f64;
    let k = b.iota(&TensorType::new(opmath(out), vec![len]), 0)?;
    let num = |v: f64| b.full_like(Scalar::Float(v), &k);
    let name = n.op.trim_start_matches("aten.");
    let name = &name[..name.find('.').unwrap_or(name.len())];
    let w = match name {
        "hann_window" => cosine_sum(b, &k, 2.0 * PI / spacing, 0.5, 0.5)?,
        "hamming_window" => {
            let alpha = n.float_or(2, "alpha", 0.54)?;
            let beta = n.float_or(3, "beta", 0.46)?;
            cosine_sum(b, &k, 2.0 * PI / spacing, alpha, beta)?
        }
        "blackman_window" => {
            // 0.42 - 0.5 cos(2 pi k / D) + 0.08 cos(4 pi k / D), as PyTorch orders it.
            let t = b.mul(&k, &num(PI / spacing)?)?;
            let c4 = b.unary("cosine", &b.mul(&t, &num(4.0)?)?)?;
            let c2 = b.unary("cosine", &b.mul(&t, &num(2.0)?)?)?;
            let w = b.sub(&b.mul(&c4, &num(0.08)?)?, &b.mul(&c2, &num(0.5)?)?)?;
            b.add(&w, &num(0.42)?)?
        }
        "bartlett_window" => {
            // 2k / D rising, then 2 - 2k / D from the middle on.
            let t = b.mul(&k, &num(2.0 / spacing)?)?;
            let first_half = ((spacing as i64) >> 1) + 1;
            let falling = b.compare(&k, &num(first_half as f64)?, "GE")?;
            b.select(&falling, &b.sub(&num(2.0)?, &t)?, &t)?
        }
        "kaiser_window" => {
            // I0(beta sqrt(|1 - ((k - D/2) / (D/2))^2|)) / I0(beta).
            let beta = n.float_or(2, "beta", 12.0)?;
            let half = num(spacing / 2.0)?;
            let r = b.div(&b.sub(&k, &half)?, &half)?;
            let arg = b.unary("abs", &b.sub(&num(1.0)?, &b.mul(&r, &r)?)?)?;
            let arg = b.mul(&num(beta)?, &b.unary("sqrt", &arg)?)?;
            b.div(&i0(b, &arg, true)?, &i0(b, &num(beta)?, true)?)?
        }
        _ => return Err(format!("no window rule for {}", n.op)),
    };
    Ok(vec![b.convert(&w, out)?])
}

/// `alpha - beta cos(step k)`, as `cos(step k) * -beta + alpha` (PyTorch's hamming, and hann with
/// alpha = beta = 0.5).
fn cosine_sum<'a>(b: &Builder<'a>, k: &Val<'a>, step: f64, alpha: f64, beta: f64) -> R<Val<'a>> {
    let num = |v: f64| b.full_like(Scalar::Float(v), k);
    let c = b.unary("cosine", &b.mul(k, &num(step)?)?)?;
    b.add(&b.mul(&c, &num(-beta)?)?, &num(alpha)?)
}
