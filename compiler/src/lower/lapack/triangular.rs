//! Triangular solves (`stablehlo.triangular_solve`, which XLA's CPU pipeline expands into
//! blocked substitution), Cholesky (a loop of ours: XLA's `cholesky` turns the whole factor
//! into NaN for a matrix that is not definite, which hides potrf's `info`) and the
//! Cholesky-factor solvers.

use super::{
    broadcast_batch, check_float, cmp_idx, column, entry, eye, flat, iota, keep, mt, outer, spread,
    symmetric_from_lower, triangle, unflat,
};
use crate::ir::{DType, TensorType};
use crate::lower::builder::{Builder, Scalar, Val, R};
use crate::lower::{NodeCtx, Registry, Res};

pub fn register(r: &mut Registry) {
    r.add(&["aten.triangular_solve.default"], triangular_solve);
    r.add(&["aten.linalg_solve_triangular.default"], solve_triangular);
    r.add(&["aten.cholesky_solve.default"], cholesky_solve);
    r.add(&["aten.cholesky_inverse.default"], cholesky_inverse);
    r.add(&["aten.linalg_cholesky_ex.default"], cholesky_ex);
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

/// `linalg_cholesky_ex(A, upper, check_errors) -> (L, info)`: the lower factor of the
/// symmetric matrix `A`'s lower triangle describes (right-looking, one column per step), or its
/// transpose. `info` is potrf's: the order of the first leading minor that is not positive
/// definite, 0 when there is none; the factor of such a matrix is unspecified (NaN here).
fn cholesky_ex(n: NodeCtx<'_>) -> Res<'_> {
    let a = n.tensor(0, "self")?;
    check_float(&n.op, &a)?;
    let upper = n.bool_or(1, "upper", false)?;
    let b = &n.b;
    let batch = super::batch_of(&a)?;
    let fa = flat(b, &a)?;
    let (bsz, dim) = (fa.shape()[0], fa.shape()[1]);
    let sym = symmetric_from_lower(b, &fa)?;
    let info = b.splat(Scalar::Int(0), &TensorType::new(DType::I32, vec![bsz]))?;
    let out = b.fori_loop(dim, &[&sym, &info], |b, k, s| {
        let (a, info) = (&s[0], &s[1]);
        let shape = a.shape().to_vec();
        let col = column(&b, a, &k)?;
        let d = entry(&b, &col, &k)?;
        let fails = b.unary(
            "not",
            &b.compare(&d, &b.full_like(Scalar::Int(0), &d)?, "GT")?,
        )?;
        let first = b.binary(
            "and",
            &fails,
            &b.compare(info, &b.full_like(Scalar::Int(0), info)?, "EQ")?,
        )?;
        let k1 = b.convert(
            &b.add(&k, &b.scalar(Scalar::Int(1), DType::I64)?)?,
            DType::I32,
        )?;
        let info = b.select(&first, &b.broadcast_in_dim(&k1, info.shape(), &[])?, info)?;
        let root = b.unary("sqrt", &d)?;
        let rv = iota(&b, &[shape[0], shape[1]], 1)?;
        let l = keep(
            &b,
            &cmp_idx(&b, &rv, &k, "GT")?,
            &b.div(&col, &b.broadcast_in_dim(&root, col.shape(), &[0])?)?,
        )?;
        let a = b.sub(a, &outer(&b, &l, &l)?)?;
        let (rows, cols) = (iota(&b, &shape, 1)?, iota(&b, &shape, 2)?);
        let at_col = cmp_idx(&b, &cols, &k, "EQ")?;
        let a = b.select(
            &b.binary("and", &at_col, &cmp_idx(&b, &rows, &k, "GT")?)?,
            &spread(&b, &l, &shape, 2)?,
            &a,
        )?;
        let a = b.select(
            &b.binary("and", &at_col, &cmp_idx(&b, &rows, &k, "EQ")?)?,
            &b.broadcast_in_dim(&root, &shape, &[0])?,
            &a,
        )?;
        Ok(vec![a, info])
    })?;
    let l = triangle(b, &out[0], true, 0)?;
    let l = if upper { mt(b, &l)? } else { l };
    Ok(vec![unflat(b, &l, &batch)?, b.reshape(&out[1], &batch)?])
}
