//! Householder QR as LAPACK computes it: geqrf's reflectors (dlarfg: `beta = -sign(alpha) *
//! norm`, `tau = 0` when there is nothing to annihilate), and products with `Q` (orgqr/ormqr).

use super::{
    batch_of, broadcast_batch, check_float, cmp_idx, column, entry, eye, flat, flat_rows, iota,
    keep, outer, spread, triangle, unflat,
};
use crate::ir::TensorType;
use crate::lower::builder::{Builder, Combiner, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.geqrf.default"], geqrf);
    r.add(&["aten.linalg_qr.default"], linalg_qr);
    r.add(
        &["aten.linalg_householder_product.default"],
        householder_product,
    );
    r.add(&["aten.ormqr.default"], ormqr);
}

/// geqrf of `a[B, m, n]`: `(R above the diagonal and reflectors below it, tau[B, min(m, n)])`.
pub fn factor<'a>(b: &Builder<'a>, a: &Val<'a>) -> R<(Val<'a>, Val<'a>)> {
    let (bsz, m, n) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let k_max = m.min(n);
    let tau = b.splat(
        Scalar::Int(0),
        &TensorType::new(a.dtype(), vec![bsz, k_max]),
    )?;
    let out = b.fori_loop(k_max, &[a, &tau], |b, k, s| {
        let (a, tau) = (&s[0], &s[1]);
        let shape = a.shape().to_vec();
        let rv = iota(&b, &[shape[0], shape[1]], 1)?;
        let col = column(&b, a, &k)?;
        let alpha = entry(&b, &col, &k)?;
        let x = keep(&b, &cmp_idx(&b, &rv, &k, "GT")?, &col)?;
        let xnorm2 = b.reduce(&b.mul(&x, &x)?, &[1], Combiner::Add, false)?;
        let zero = b.full_like(Scalar::Int(0), &alpha)?;
        let nothing = b.compare(&xnorm2, &zero, "EQ")?;
        let norm = b.unary("sqrt", &b.add(&b.mul(&alpha, &alpha)?, &xnorm2)?)?;
        let beta = b.select(
            &b.compare(&alpha, &zero, "GE")?,
            &b.unary("negate", &norm)?,
            &norm,
        )?;
        let t = b.select(&nothing, &zero, &b.div(&b.sub(&beta, &alpha)?, &beta)?)?;
        let one = b.full_like(Scalar::Int(1), &alpha)?;
        let scale = b.select(&nothing, &zero, &b.div(&one, &b.sub(&alpha, &beta)?)?)?;
        let below = b.mul(&x, &b.broadcast_in_dim(&scale, x.shape(), &[0])?)?;
        let v = b.add(&below, &b.convert(&cmp_idx(&b, &rv, &k, "EQ")?, a.dtype())?)?;
        // H = I - tau v v^T on the columns right of k.
        let w = b.reduce(
            &b.mul(a, &spread(&b, &v, &shape, 2)?)?,
            &[1],
            Combiner::Add,
            false,
        )?;
        let cv = iota(&b, &[shape[0], shape[2]], 1)?;
        let w = keep(&b, &cmp_idx(&b, &cv, &k, "GT")?, &w)?;
        let tv = b.mul(&v, &b.broadcast_in_dim(&t, v.shape(), &[0])?)?;
        let a = b.sub(a, &outer(&b, &tv, &w)?)?;
        let (rows, cols) = (iota(&b, &shape, 1)?, iota(&b, &shape, 2)?);
        let at_col = cmp_idx(&b, &cols, &k, "EQ")?;
        let under = b.binary("and", &at_col, &cmp_idx(&b, &rows, &k, "GT")?)?;
        let a = b.select(&under, &spread(&b, &below, &shape, 2)?, &a)?;
        let diag = b.binary("and", &at_col, &cmp_idx(&b, &rows, &k, "EQ")?)?;
        let a = b.select(
            &diag,
            &b.broadcast_in_dim(&b.select(&nothing, &alpha, &beta)?, &shape, &[0])?,
            &a,
        )?;
        let kv = iota(&b, tau.shape(), 1)?;
        let tau = b.select(
            &cmp_idx(&b, &kv, &k, "EQ")?,
            &b.broadcast_in_dim(&t, tau.shape(), &[0])?,
            tau,
        )?;
        Ok(vec![a, tau])
    })?;
    Ok((out[0].clone(), out[1].clone()))
}

/// Applies `Q = H_0 ... H_{K-1}` (reflector `i` in column `i` of `v[B, r, .]` below the
/// diagonal, `tau[B, K]`) to `c`: `Q c` / `Q^T c` from the left (`c[B, r, p]`) or `c Q` /
/// `c Q^T` from the right (`c[B, p, r]`).
pub fn apply_q<'a>(
    b: &Builder<'a>,
    v: &Val<'a>,
    tau: &Val<'a>,
    c: &Val<'a>,
    left: bool,
    transpose: bool,
) -> R<Val<'a>> {
    let k_max = tau.shape()[1];
    // Q c and c Q^T apply the last reflector first.
    let backward = left != transpose;
    let out = b.fori_loop(k_max, &[c, v, tau], |b, j, s| {
        let (c, v, tau) = (&s[0], &s[1], &s[2]);
        let i = if backward {
            b.sub(&b.scalar(Scalar::Int(k_max - 1), j.dtype())?, &j)?
        } else {
            j
        };
        let rv = iota(&b, &[v.shape()[0], v.shape()[1]], 1)?;
        let col = column(&b, v, &i)?;
        let h = b.add(
            &keep(&b, &cmp_idx(&b, &rv, &i, "GT")?, &col)?,
            &b.convert(&cmp_idx(&b, &rv, &i, "EQ")?, v.dtype())?,
        )?;
        let t = entry(&b, tau, &i)?;
        let th = b.mul(&h, &b.broadcast_in_dim(&t, h.shape(), &[0])?)?;
        let shape = c.shape().to_vec();
        let c = if left {
            // c - tau h (h^T c)
            let w = b.reduce(
                &b.mul(c, &spread(&b, &h, &shape, 2)?)?,
                &[1],
                Combiner::Add,
                false,
            )?;
            b.sub(c, &outer(&b, &th, &w)?)?
        } else {
            // c - (c h) tau h^T
            let w = b.reduce(
                &b.mul(c, &spread(&b, &h, &shape, 1)?)?,
                &[2],
                Combiner::Add,
                false,
            )?;
            b.sub(c, &outer(&b, &w, &th)?)?
        };
        Ok(vec![c, v.clone(), tau.clone()])
    })?;
    Ok(out[0].clone())
}

/// `geqrf(A) -> (a, tau)`.
fn geqrf(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "self")?;
    check_float(&n.op, &a)?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let (f, tau) = factor(b, &flat(b, &a)?)?;
    Ok(vec![unflat(b, &f, &batch)?, unflat(b, &tau, &batch)?])
}

/// `linalg_qr(A, mode) -> (Q, R)`: "reduced" (`Q[m, K]`, `R[K, n]`), "complete" (`Q[m, m]`,
/// `R[m, n]`) or "r" (empty `Q`).
fn linalg_qr(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "A")?;
    check_float(&n.op, &a)?;
    let mode = n.str_or(1, "mode", "reduced")?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let (f, tau) = factor(b, &flat(b, &a)?)?;
    let (bsz, m, cols) = (f.shape()[0], f.shape()[1], f.shape()[2]);
    let k = m.min(cols);
    let r_rows = if mode == "complete" { m } else { k };
    let r = triangle(
        b,
        &b.slice(&f, &[0, 0, 0], &[bsz, r_rows, cols], &[1, 1, 1])?,
        false,
        0,
    )?;
    let q = match mode.as_str() {
        "r" => b.splat(Scalar::Int(0), n.out(0)?)?,
        "reduced" | "complete" => {
            let q_cols = if mode == "complete" { m } else { k };
            let id = b.slice(
                &eye(b, bsz, m, a.dtype())?,
                &[0, 0, 0],
                &[bsz, m, q_cols],
                &[1, 1, 1],
            )?;
            unflat(b, &apply_q(b, &f, &tau, &id, true, false)?, &batch)?
        }
        other => return Err(format!("linalg_qr: unknown mode {other:?}")),
    };
    Ok(vec![q, unflat(b, &r, &batch)?])
}

/// `linalg_householder_product(A[m, n], tau[k])`: the first `n` columns of `H_0 ... H_{k-1}`.
fn householder_product(n: NodeCtx<'_>) -> Res<'_> {
    let (a, tau) = (n.tensor(0, "input")?, n.tensor(1, "tau")?);
    check_float(&n.op, &a)?;
    let b = &n.b;
    let batch = batch_of(&a)?;
    let fa = flat(b, &a)?;
    let (bsz, m, cols) = (fa.shape()[0], fa.shape()[1], fa.shape()[2]);
    let ft = flat_rows(b, &tau, &batch)?;
    let id = b.slice(
        &eye(b, bsz, m, a.dtype())?,
        &[0, 0, 0],
        &[bsz, m, cols],
        &[1, 1, 1],
    )?;
    Ok(vec![unflat(
        b,
        &apply_q(b, &fa, &ft, &id, true, false)?,
        &batch,
    )?])
}

/// `ormqr(A, tau, C, left, transpose)`: `op(Q) C` or `C op(Q)` with geqrf's reflectors in `A`.
fn ormqr(n: NodeCtx<'_>) -> Res<'_> {
    let (a, tau, c) = (
        n.tensor(0, "self")?,
        n.tensor(1, "input2")?,
        n.tensor(2, "input3")?,
    );
    check_float(&n.op, &a)?;
    let (left, transpose) = (
        n.bool_or(3, "left", true)?,
        n.bool_or(4, "transpose", false)?,
    );
    let b = &n.b;
    let (a, c, batch) = broadcast_batch(b, &a, &c)?;
    let fa = flat(b, &a)?;
    let ft = flat_rows(b, &tau, &batch)?;
    let y = apply_q(b, &fa, &ft, &flat(b, &c)?, left, transpose)?;
    Ok(vec![unflat(b, &y, &batch)?])
}

/// `q[B, r, k]` with its invalid columns replaced and extended to `cols` (`k` or `r`)
/// orthonormal columns. The columns where `valid[B, k]` holds are orthonormal and come first;
/// the rest are zero. The reflectors that triangularize `q` span the valid columns with their
/// first ones (up to sign), so their other columns complete the basis.
pub fn fill_basis<'a>(b: &Builder<'a>, q: &Val<'a>, valid: &Val<'a>, cols: i64) -> R<Val<'a>> {
    let (bsz, r, k) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (f, tau) = factor(b, q)?;
    let full = apply_q(b, &f, &tau, &eye(b, bsz, r, q.dtype())?, true, false)?;
    let head = b.slice(&full, &[0, 0, 0], &[bsz, r, k], &[1, 1, 1])?;
    let head = b.select(&spread(b, valid, q.shape(), 1)?, q, &head)?;
    let rest = b.slice(&full, &[0, 0, k], &[bsz, r, cols], &[1, 1, 1])?;
    b.concat(&[&head, &rest], 2)
}
