//! Elementwise, comparison, conversion and creation rules, executed on the PJRT CPU plugin.
mod common;
use common::*;
use tpu_dynamo_compiler::ir::{Arg, DType, DType::*};

/// Runs a unary op on random `dtype[3, 4]` input and compares with `reference` (applied in f64,
/// then rounded to `dtype`).
fn check_unary(
    op: &str,
    extra: Vec<(&str, Arg)>,
    dtype: DType,
    reference: impl Fn(f64) -> f64,
    tol: f64,
) {
    let mut g = G::new();
    let x = g.input(dtype, &[3, 4]);
    let y = g
        .node(op, vec![x], extra, vec![t(dtype, &[3, 4])])
        .remove(0);
    g.output(&[&y]);
    let (inp, out) = run_random(&g.graph, 7, 2.0);
    let want: Vec<f64> = inp[0]
        .iter()
        .map(|&v| quantize(dtype, reference(v)))
        .collect();
    assert_close(&out[0], &want, tol, tol);
}

fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26 is too coarse; integrate the series instead (|x| <= 4 here).
    let mut term = x;
    let mut sum = x;
    for k in 1..80 {
        term *= -x * x / k as f64;
        sum += term / (2 * k + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn unary_f32() {
    type Case = (&'static str, fn(f64) -> f64);
    let cases: Vec<Case> = vec![
        ("aten.neg.default", |x| -x),
        ("aten.abs.default", f64::abs),
        ("aten.exp.default", f64::exp),
        ("aten.sin.default", f64::sin),
        ("aten.cos.default", f64::cos),
        ("aten.tanh.default", f64::tanh),
        ("aten.sigmoid.default", |x| 1.0 / (1.0 + (-x).exp())),
        ("aten.relu.default", |x| x.max(0.0)),
        ("aten.erf.default", erf),
        ("aten.gelu.default", |x| {
            0.5 * x * (1.0 + erf(x / 2f64.sqrt()))
        }),
        ("aten.silu.default", |x| x / (1.0 + (-x).exp())),
        ("aten.reciprocal.default", |x| 1.0 / x),
        ("aten.floor.default", f64::floor),
        ("aten.trunc.default", f64::trunc),
    ];
    for (op, f) in cases {
        check_unary(op, vec![], F32, f, 2e-5);
    }
    check_unary("aten.rsqrt.default", vec![], F32, |x| 1.0 / x.sqrt(), 2e-5);
    check_unary("aten.log.default", vec![], F32, f64::ln, 2e-5);
}

#[test]
fn gelu_tanh_and_bf16() {
    let tanh_gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    check_unary(
        "aten.gelu.default",
        vec![("approximate", Arg::Str("tanh".into()))],
        F32,
        tanh_gelu,
        2e-5,
    );
    // bf16: computed in f32 and rounded once, so within one bf16 ulp of the exact value.
    check_unary(
        "aten.gelu.default",
        vec![("approximate", Arg::Str("tanh".into()))],
        Bf16,
        tanh_gelu,
        8e-3,
    );
    check_unary("aten.sin.default", vec![], Bf16, f64::sin, 8e-3);
}

#[test]
fn binary_broadcast_scalar_alpha() {
    let mut g = G::new();
    let a = g.input(F32, &[2, 3]);
    let b = g.input(F32, &[3]);
    let s = g
        .node(
            "aten.sub.Tensor",
            vec![a.clone(), b.clone()],
            vec![("alpha", f(0.5))],
            vec![t(F32, &[2, 3])],
        )
        .remove(0);
    let d = g.op(
        "aten.div.Tensor",
        vec![s.clone(), b.clone()],
        t(F32, &[2, 3]),
    );
    let p = g.op(
        "aten.pow.Tensor_Scalar",
        vec![a.clone(), i(3)],
        t(F32, &[2, 3]),
    );
    let q = g.op(
        "aten.pow.Tensor_Scalar",
        vec![a.clone(), f(0.5)],
        t(F32, &[2, 3]),
    );
    let r = g.op("aten.add.Scalar", vec![a.clone(), f(1.5)], t(F32, &[2, 3]));
    let m = g.op(
        "aten.maximum.default",
        vec![a.clone(), b.clone()],
        t(F32, &[2, 3]),
    );
    g.output(&[&d, &p, &q, &r, &m]);
    let (x, out) = run_random(&g.graph, 3, 1.0);
    let at = |k: usize| (x[0][k], x[1][k % 3]);
    let want =
        |f: &dyn Fn(f64, f64) -> f64| (0..6).map(|k| f(at(k).0, at(k).1)).collect::<Vec<_>>();
    assert_close(&out[0], &want(&|a, b| (a - 0.5 * b) / b), 1e-5, 1e-5);
    assert_close(&out[1], &want(&|a, _| a * a * a), 1e-6, 1e-6);
    assert_close(&out[2], &want(&|a, _| a.sqrt()), 1e-6, 1e-6);
    assert_close(&out[3], &want(&|a, _| a + 1.5), 1e-6, 1e-6);
    assert_close(&out[4], &want(&|a, b| a.max(b)), 0.0, 0.0);
}

#[test]
fn integer_division_and_remainder_follow_python() {
    let mut g = G::new();
    let a = g.input(I64, &[8]);
    let b = g.input(I64, &[8]);
    let fl = g
        .node(
            "aten.div.Tensor_mode",
            vec![a.clone(), b.clone()],
            vec![("rounding_mode", Arg::Str("floor".into()))],
            vec![t(I64, &[8])],
        )
        .remove(0);
    let tr = g
        .node(
            "aten.div.Tensor_mode",
            vec![a.clone(), b.clone()],
            vec![("rounding_mode", Arg::Str("trunc".into()))],
            vec![t(I64, &[8])],
        )
        .remove(0);
    let rem = g.op(
        "aten.remainder.Tensor",
        vec![a.clone(), b.clone()],
        t(I64, &[8]),
    );
    let div = g.op("aten.div.Tensor", vec![a.clone(), b.clone()], t(F32, &[8]));
    g.output(&[&fl, &tr, &rem, &div]);
    let xa = vec![7.0, -7.0, 7.0, -7.0, 6.0, -6.0, 0.0, 5.0];
    let xb = vec![2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 4.0, 9.0];
    let out = run(&g.graph, &[xa.clone(), xb.clone()]);
    let zip = |f: fn(f64, f64) -> f64| {
        xa.iter()
            .zip(&xb)
            .map(|(&a, &b)| f(a, b))
            .collect::<Vec<_>>()
    };
    assert_close(&out[0], &zip(|a, b| (a / b).floor()), 0.0, 0.0);
    assert_close(&out[1], &zip(|a, b| (a / b).trunc()), 0.0, 0.0);
    assert_close(&out[2], &zip(|a, b| a - b * (a / b).floor()), 0.0, 0.0);
    assert_close(&out[3], &zip(|a, b| a / b), 1e-6, 1e-6);
}

#[test]
fn compare_logical_where() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    let y = g.input(F32, &[2, 3]);
    let m = g.input(I64, &[2, 3]);
    let gt = g.op(
        "aten.gt.Tensor",
        vec![x.clone(), y.clone()],
        t(Bool, &[2, 3]),
    );
    let le = g.op("aten.le.Scalar", vec![x.clone(), f(0.0)], t(Bool, &[2, 3]));
    let eq = g.op("aten.eq.Scalar", vec![m.clone(), i(3)], t(Bool, &[2, 3]));
    let and = g.op(
        "aten.logical_and.default",
        vec![gt.clone(), le.clone()],
        t(Bool, &[2, 3]),
    );
    let not = g.op(
        "aten.logical_not.default",
        vec![and.clone()],
        t(Bool, &[2, 3]),
    );
    let band = g.op(
        "aten.bitwise_and.Tensor",
        vec![not.clone(), eq.clone()],
        t(Bool, &[2, 3]),
    );
    let w = g.op(
        "aten.where.self",
        vec![gt.clone(), x.clone(), y.clone()],
        t(F32, &[2, 3]),
    );
    g.output(&[&gt, &le, &eq, &and, &not, &band, &w]);
    let (inp, out) = run_random(&g.graph, 11, 1.0);
    let b = |v: bool| v as i64 as f64;
    let e = |f: &dyn Fn(usize) -> f64| (0..6).map(f).collect::<Vec<_>>();
    let (xs, ys, ms) = (&inp[0], &inp[1], &inp[2]);
    assert_close(&out[0], &e(&|k| b(xs[k] > ys[k])), 0.0, 0.0);
    assert_close(&out[1], &e(&|k| b(xs[k] <= 0.0)), 0.0, 0.0);
    assert_close(&out[2], &e(&|k| b(ms[k] == 3.0)), 0.0, 0.0);
    assert_close(
        &out[4],
        &e(&|k| b(!(xs[k] > ys[k] && xs[k] <= 0.0))),
        0.0,
        0.0,
    );
    assert_close(
        &out[5],
        &e(&|k| b(!(xs[k] > ys[k] && xs[k] <= 0.0) && ms[k] == 3.0)),
        0.0,
        0.0,
    );
    assert_close(&out[6], &e(&|k| xs[k].max(ys[k])), 0.0, 0.0);
}

#[test]
fn conversions_and_creation() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    let h = g
        .node(
            "aten._to_copy.default",
            vec![x.clone()],
            vec![("dtype", Arg::DType(Bf16))],
            vec![t(Bf16, &[2, 3])],
        )
        .remove(0);
    let back = g
        .node(
            "prims.convert_element_type.default",
            vec![h.clone(), Arg::DType(F32)],
            vec![],
            vec![t(F32, &[2, 3])],
        )
        .remove(0);
    let n = g
        .node(
            "aten._to_copy.default",
            vec![x.clone()],
            vec![("dtype", Arg::DType(I64))],
            vec![t(I64, &[2, 3])],
        )
        .remove(0);
    let full = g
        .node(
            "aten.full.default",
            vec![ints(&[2, 2]), f(-1.5)],
            vec![("dtype", Arg::DType(F32))],
            vec![t(F32, &[2, 2])],
        )
        .remove(0);
    let like = g
        .node(
            "aten.full_like.default",
            vec![x.clone(), i(7)],
            vec![],
            vec![t(F32, &[2, 3])],
        )
        .remove(0);
    let st = g
        .node(
            "aten.scalar_tensor.default",
            vec![f(2.5)],
            vec![("dtype", Arg::DType(F32))],
            vec![t(F32, &[])],
        )
        .remove(0);
    let ar = g
        .node(
            "aten.arange.start_step",
            vec![i(2), i(11), i(3)],
            vec![("dtype", Arg::DType(I64))],
            vec![t(I64, &[3])],
        )
        .remove(0);
    let arf = g
        .node(
            "aten.arange.start_step",
            vec![f(0.0), f(1.0), f(0.25)],
            vec![("dtype", Arg::DType(F32))],
            vec![t(F32, &[4])],
        )
        .remove(0);
    let fresh = g.op(
        "aten.lift_fresh_copy.default",
        vec![x.clone()],
        t(F32, &[2, 3]),
    );
    g.output(&[&back, &n, &full, &like, &st, &ar, &arf, &fresh]);
    let (inp, out) = run_random(&g.graph, 5, 3.0);
    let xs = &inp[0];
    assert_close(
        &out[0],
        &xs.iter().map(|&v| quantize(Bf16, v)).collect::<Vec<_>>(),
        0.0,
        0.0,
    );
    assert_close(
        &out[1],
        &xs.iter().map(|v| v.trunc()).collect::<Vec<_>>(),
        0.0,
        0.0,
    );
    assert_close(&out[2], &[-1.5; 4], 0.0, 0.0);
    assert_close(&out[3], &[7.0; 6], 0.0, 0.0);
    assert_close(&out[4], &[2.5], 0.0, 0.0);
    assert_close(&out[5], &[2.0, 5.0, 8.0], 0.0, 0.0);
    assert_close(&out[6], &[0.0, 0.25, 0.5, 0.75], 0.0, 0.0);
    assert_close(&out[7], xs, 0.0, 0.0);
}

#[test]
fn bf16_binary_rounds_once_from_f32() {
    let mut g = G::new();
    let x = g.input(Bf16, &[16]);
    let y = g.op("aten.mul.Scalar", vec![x.clone(), f(0.1)], t(Bf16, &[16]));
    let z = g.op(
        "aten.add.Tensor",
        vec![y.clone(), x.clone()],
        t(Bf16, &[16]),
    );
    g.output(&[&y, &z]);
    let (inp, out) = run_random(&g.graph, 9, 4.0);
    let y_want: Vec<f64> = inp[0]
        .iter()
        .map(|&v| quantize(Bf16, (v as f32 * 0.1f32) as f64))
        .collect();
    assert_close(&out[0], &y_want, 0.0, 0.0);
    let z_want: Vec<f64> = y_want
        .iter()
        .zip(&inp[0])
        .map(|(a, b)| quantize(Bf16, a + b))
        .collect();
    assert_close(&out[1], &z_want, 0.0, 0.0);
}
