//! Hand-written StableHLO programs executed on random inputs, checked against Rust references.
//!
//! Programs are MLIR text, in both the pretty form and the generic form the compiler emits, plus
//! one checked-in bytecode file made by upstream `mlir-opt` (see `data/mul_add.mlir`). The
//! compiler crate tests bytecode end to end with the modules it writes through melior.

mod common;

use common::*;
use tpu_dynamo_runtime::*;

#[test]
fn elementwise_add_mul_exp() {
    let client = client(1);
    let text = r#"
func.func @main(%a: tensor<64xf32>, %b: tensor<64xf32>) -> (tensor<64xf32>, tensor<64xf32>, tensor<64xf32>) {
  %sum = stablehlo.add %a, %b : tensor<64xf32>
  %prod = stablehlo.multiply %a, %b : tensor<64xf32>
  %e = stablehlo.exponential %a : tensor<64xf32>
  %d = stablehlo.subtract %e, %b : tensor<64xf32>
  return %sum, %prod, %d : tensor<64xf32>, tensor<64xf32>, tensor<64xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[64]); 2]);
    assert_eq!(exe.num_outputs(), 3);
    assert_eq!(exe.output_specs().unwrap(), vec![f32_spec(&[64]); 3]);
    let mut rng = Rng::new(1);
    let (a, b) = (rng.f32s(64), rng.f32s(64));
    let dev = &client.devices()[0];
    let out = exe
        .execute(&[
            &upload(&client, &a, &[64], dev),
            &upload(&client, &b, &[64], dev),
        ])
        .unwrap();
    let zip = |f: fn(f32, f32) -> f32| a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect::<Vec<_>>();
    // IEEE add and multiply are exact to the rounding of the same operation in Rust.
    assert_eq!(download(&out[0]), zip(|x, y| x + y));
    assert_eq!(download(&out[1]), zip(|x, y| x * y));
    // XLA's vectorized exp: within 1e-6 relative (plus 1e-6 absolute for the subtraction).
    assert_close(&download(&out[2]), &zip(|x, y| x.exp() - y), 1e-6, 1e-6);
}

#[test]
fn memory_stats_count_arguments_and_outputs() {
    let client = client(1);
    let text = r#"
func.func @main(%a: tensor<64x32xf32>, %b: tensor<64x32xf32>) -> tensor<64xf32> {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %sum = stablehlo.add %a, %b : tensor<64x32xf32>
  %rows = stablehlo.reduce(%sum init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<64x32xf32>, tensor<f32>) -> tensor<64xf32>
  return %rows : tensor<64xf32>
}"#;
    let stats = compile(&client, text, vec![f32_spec(&[64, 32]); 2])
        .memory_stats()
        .unwrap();
    assert_eq!(
        (stats.argument_bytes, stats.output_bytes),
        (2 * 64 * 32 * 4, 64 * 4)
    );
    assert!(stats.temp_bytes >= 0, "{stats:?}");
}

/// Row-major `[m,k] x [k,n]` reference in f64.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                .sum::<f64>() as f32;
        }
    }
    c
}

#[test]
fn dot_general_plain_and_batched() {
    let client = client(1);
    let text = r#"
func.func @main(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>, %x: tensor<2x3x5xf32>, %y: tensor<2x5x4xf32>)
    -> (tensor<8x4xf32>, tensor<2x3x4xf32>) {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  %1 = "stablehlo.dot_general"(%x, %y) {
    dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [0], rhs_batching_dimensions = [0],
                                           lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>
  } : (tensor<2x3x5xf32>, tensor<2x5x4xf32>) -> tensor<2x3x4xf32>
  return %0, %1 : tensor<8x4xf32>, tensor<2x3x4xf32>
}"#;
    let dims: [&[i64]; 4] = [&[8, 16], &[16, 4], &[2, 3, 5], &[2, 5, 4]];
    let exe = compile(&client, text, dims.iter().map(|d| f32_spec(d)).collect());
    let mut rng = Rng::new(2);
    let data: Vec<Vec<f32>> = dims
        .iter()
        .map(|d| rng.f32s(d.iter().product::<i64>() as usize))
        .collect();
    let dev = &client.devices()[0];
    let bufs: Vec<Buffer> = data
        .iter()
        .zip(dims)
        .map(|(v, d)| upload(&client, v, d, dev))
        .collect();
    let out = exe.execute(&bufs.iter().collect::<Vec<_>>()).unwrap();
    // f32 accumulation over k <= 16 terms in [-1,1): error well below 1e-5.
    assert_close(
        &download(&out[0]),
        &matmul(&data[0], &data[1], 8, 16, 4),
        1e-5,
        1e-5,
    );
    let batched: Vec<f32> = (0..2)
        .flat_map(|b| {
            matmul(
                &data[2][b * 15..(b + 1) * 15],
                &data[3][b * 20..(b + 1) * 20],
                3,
                5,
                4,
            )
        })
        .collect();
    assert_close(&download(&out[1]), &batched, 1e-5, 1e-5);
}

#[test]
fn reduce_with_region_sum_and_max() {
    let client = client(1);
    let text = r#"
func.func @main(%a: tensor<6x10xf32>) -> (tensor<6xf32>, tensor<10xf32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %sum = stablehlo.reduce(%a init: %zero) across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
    reducer(%x: tensor<f32>, %y: tensor<f32>) {
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }
  %ninf = "stablehlo.constant"() {value = dense<0xFF800000> : tensor<f32>} : () -> tensor<f32>
  %max = "stablehlo.reduce"(%a, %ninf) ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %m = "stablehlo.maximum"(%x, %y) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%m) : (tensor<f32>) -> ()
  }) {dimensions = array<i64: 0>} : (tensor<6x10xf32>, tensor<f32>) -> tensor<10xf32>
  return %sum, %max : tensor<6xf32>, tensor<10xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[6, 10])]);
    assert_eq!(
        exe.output_specs().unwrap(),
        vec![f32_spec(&[6]), f32_spec(&[10])]
    );
    let a = Rng::new(3).f32s(60);
    let out = exe
        .execute(&[&upload(&client, &a, &[6, 10], &client.devices()[0])])
        .unwrap();
    let sums: Vec<f32> = a.chunks(10).map(|row| row.iter().sum()).collect();
    // Summation order may differ from Rust's: 10 terms in [-1,1) stay within 1e-5.
    assert_close(&download(&out[0]), &sums, 1e-5, 0.0);
    let maxes: Vec<f32> = (0..10)
        .map(|j| (0..6).map(|i| a[i * 10 + j]).fold(f32::MIN, f32::max))
        .collect();
    assert_eq!(download(&out[1]), maxes);
}

#[test]
fn broadcast_in_dim_then_add() {
    let client = client(1);
    let text = r#"
func.func @main(%m: tensor<4x3xf32>, %v: tensor<3xf32>, %s: tensor<f32>) -> tensor<4x3xf32> {
  %bv = stablehlo.broadcast_in_dim %v, dims = [1] : (tensor<3xf32>) -> tensor<4x3xf32>
  %bs = "stablehlo.broadcast_in_dim"(%s) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<4x3xf32>
  %0 = stablehlo.add %m, %bv : tensor<4x3xf32>
  %1 = stablehlo.multiply %0, %bs : tensor<4x3xf32>
  return %1 : tensor<4x3xf32>
}"#;
    let exe = compile(
        &client,
        text,
        vec![f32_spec(&[4, 3]), f32_spec(&[3]), f32_spec(&[])],
    );
    let mut rng = Rng::new(4);
    let (m, v, s) = (rng.f32s(12), rng.f32s(3), rng.f32s(1));
    let dev = &client.devices()[0];
    let args = [
        upload(&client, &m, &[4, 3], dev),
        upload(&client, &v, &[3], dev),
        upload(&client, &s, &[], dev),
    ];
    let out = exe.execute(&args.iter().collect::<Vec<_>>()).unwrap();
    let want: Vec<f32> = (0..12).map(|i| (m[i] + v[i % 3]) * s[0]).collect();
    assert_eq!(download(&out[0]), want);
}

#[test]
fn compare_and_select() {
    let client = client(1);
    let text = r#"
func.func @main(%a: tensor<16xf32>, %b: tensor<16xf32>) -> (tensor<16xf32>, tensor<16xi1>) {
  %gt = stablehlo.compare GT, %a, %b, FLOAT : (tensor<16xf32>, tensor<16xf32>) -> tensor<16xi1>
  %max = stablehlo.select %gt, %a, %b : tensor<16xi1>, tensor<16xf32>
  return %max, %gt : tensor<16xf32>, tensor<16xi1>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[16]); 2]);
    assert_eq!(
        exe.output_specs().unwrap()[1],
        TensorSpec::new(DType::Bool, [16])
    );
    let mut rng = Rng::new(5);
    let (a, b) = (rng.f32s(16), rng.f32s(16));
    let dev = &client.devices()[0];
    let out = exe
        .execute(&[
            &upload(&client, &a, &[16], dev),
            &upload(&client, &b, &[16], dev),
        ])
        .unwrap();
    assert_eq!(
        download(&out[0]),
        a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect::<Vec<_>>()
    );
    let mut mask = vec![0u8; 16];
    out[1].to_host(&mut mask).unwrap();
    assert_eq!(
        mask,
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x > y) as u8)
            .collect::<Vec<_>>()
    );
    assert!(mask.contains(&0) && mask.contains(&1));
}

#[test]
fn mlir_bytecode_program() {
    let client = client(1);
    let program = Program {
        code: ProgramCode::MlirBytecode(include_bytes!("data/mul_add.mlirbc")),
        inputs: vec![f32_spec(&[4]); 2],
    };
    let exe = client
        .compile(&program, &CompileOptions::default())
        .unwrap();
    let mut rng = Rng::new(14);
    let (a, b) = (rng.f32s(4), rng.f32s(4));
    let dev = &client.devices()[0];
    let out = exe
        .execute(&[
            &upload(&client, &a, &[4], dev),
            &upload(&client, &b, &[4], dev),
        ])
        .unwrap();
    // a*b + b: allow one rounding of difference in case XLA fuses into an FMA.
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x * y + y).collect();
    assert_close(&download(&out[0]), &want, 1e-6, 1e-6);
}
