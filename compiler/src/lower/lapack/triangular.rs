//! Triangular solves (`stablehlo.triangular_solve`, which XLA's CPU pipeline expands into
//! blocked substitution) and the Cholesky-factor solvers built on them.

use super::{broadcast_batch, check_float, eye, flat, mt, unflat};
use crate::lower::builder::{Builder, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.triangular_solve.default"], triangular_solve);
    r.add(&["aten.linalg_solve_triangular.default"], solve_triangular);
    r.add(&["aten.cholesky_solve.default"], cholesky_solve);
    r.add(&["aten.cholesky_inverse.default"], cholesky_inverse);
}

/// How a triangular matrix `a` enters `op(a) x = rhs` (or `x op(a) = rhs` when not `left`).
#[derive(Clone, Copy)]
pub struct Tri {
    pub left: bool,
    pub lower: bool,
    pub unit: bool,
    pub transpose: bool,
}

/// Solves with `a[B, n, n]` triangular for `rhs[B, ., .]`; empty systems solve to themselves.
pub fn tri_solve<'a>(b: &Builder<'a>, a: &Val<'a>, rhs: &Val<'a>, t: Tri) -> R<Val<'a>> {
    if rhs.ty.numel() == 0 {
        return Ok(rhs.clone());
    }
    let transpose = if t.transpose {
        "TRANSPOSE"
    } else {
        "NO_TRANSPOSE"
    };
    let attrs = [
        ("left_side", t.left.to_string()),
        ("lower", t.lower.to_string()),
        ("unit_diagonal", t.unit.to_string()),
        ("transpose_a", format!("#stablehlo<transpose {transpose}>")),
    ];
    b.op(
        "stablehlo.triangular_solve",
        &[a, rhs],
        &attrs,
        rhs.ty.clone(),
    )
}

/// `triangular_solve(b, A, upper, transpose, unitriangular) -> (x, A)`: `op(A) x = b`, batch
/// dims broadcast; the second output is `A` broadcast to the common batch.
fn triangular_solve(n: NodeCtx<'_>) -> Res<'_> {
    let (rhs, a) = (n.tensor(0, "self")?, n.tensor(1, "A")?);
    check_float(&n.op, &a)?;
    let t = Tri {
        left: true,
        lower: !n.bool_or(2, "upper", true)?,
        unit: n.bool_or(4, "unitriangular", false)?,
        transpose: n.bool_or(3, "transpose", false)?,
    };
    let bd = &n.b;
    let (rhs, a, batch) = broadcast_batch(bd, &rhs, &a)?;
    let x = tri_solve(bd, &flat(bd, &a)?, &flat(bd, &rhs)?, t)?;
    Ok(vec![unflat(bd, &x, &batch)?, a])
}

/// `linalg_solve_triangular(A, B, *, upper, left, unitriangular)`.
fn solve_triangular(n: NodeCtx<'_>) -> Res<'_> {
    let (a, rhs) = (n.tensor(0, "self")?, n.tensor(1, "B")?);
    check_float(&n.op, &a)?;
    let t = Tri {
        left: n.bool_or(3, "left", true)?,
        lower: !n.bool_or(2, "upper", false)?,
        unit: n.bool_or(4, "unitriangular", false)?,
        transpose: false,
    };
    let bd = &n.b;
    let (a, rhs, batch) = broadcast_batch(bd, &a, &rhs)?;
    let x = tri_solve(bd, &flat(bd, &a)?, &flat(bd, &rhs)?, t)?;
    Ok(vec![unflat(bd, &x, &batch)?])
}

/// `A^-1 rhs` for `A = L L^T` (or `U^T U`) given the factor `f[B, n, n]`.
fn solve_factored<'a>(b: &Builder<'a>, f: &Val<'a>, rhs: &Val<'a>, upper: bool) -> R<Val<'a>> {
    let t = |transpose| Tri {
        left: true,
        lower: !upper,
        unit: false,
        transpose,
    };
    // Lower: L y = rhs, then L^T x = y. Upper: U^T y = rhs, then U x = y.
    let y = tri_solve(b, f, rhs, t(upper))?;
    tri_solve(b, f, &y, t(!upper))
}

/// `cholesky_solve(b, L, upper)`: solves `A x = b` with `A`'s Cholesky factor.
fn cholesky_solve(n: NodeCtx<'_>) -> Res<'_> {
    let (rhs, f) = (n.tensor(0, "self")?, n.tensor(1, "input2")?);
    check_float(&n.op, &f)?;
    let upper = n.bool_or(2, "upper", false)?;
    let bd = &n.b;
    let (rhs, f, batch) = broadcast_batch(bd, &rhs, &f)?;
    let x = solve_factored(bd, &flat(bd, &f)?, &flat(bd, &rhs)?, upper)?;
    Ok(vec![unflat(bd, &x, &batch)?])
}

/// `cholesky_inverse(L, upper)`: `(L L^T)^-1`, symmetrized as LAPACK's potri returns it.
fn cholesky_inverse(n: NodeCtx<'_>) -> Res<'_> {
    let f = n.tensor(0, "self")?;
    check_float(&n.op, &f)?;
    let upper = n.bool_or(1, "upper", false)?;
    let bd = &n.b;
    let batch = super::batch_of(&f)?;
    let ff = flat(bd, &f)?;
    let (bsz, dim) = (ff.shape()[0], ff.shape()[1]);
    let x = solve_factored(bd, &ff, &eye(bd, bsz, dim, f.dtype())?, upper)?;
    let sym = bd.mul_scalar(&bd.add(&x, &mt(bd, &x)?)?, 0.5)?;
    Ok(vec![unflat(bd, &sym, &batch)?])
}
