mod common;
use common::*;
use tpu_dynamo_compiler::ir::DType::*;

#[test]
fn add_mul_scalar_f32() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    let y = g.input(F32, &[3]);
    let s = g.node("aten.add.Tensor", vec![x.clone(), y.clone()], vec![("alpha", f(2.0))], vec![t(F32, &[2, 3])]).remove(0);
    let m = g.op("aten.mul.Scalar", vec![s.clone(), f(0.5)], t(F32, &[2, 3]));
    g.output(&[&m, &x]);
    let lowered = tpu_dynamo_compiler::lower(&g.graph, &[]).unwrap();
    println!("{}", lowered.text);
    let (inp, out) = run_random(&g.graph, 1, 1.0);
    let want: Vec<f64> = (0..6).map(|k| (inp[0][k] + 2.0 * inp[1][k % 3]) * 0.5).collect();
    assert_close(&out[0], &want, 1e-6, 1e-6);
    assert_close(&out[1], &inp[0], 0.0, 0.0);
}
