//! Serialized executables reload in a fresh client and compute the same outputs.

mod common;

use common::*;
use std::time::Instant;
use tpu_dynamo_runtime::*;

const PROGRAM: &str = r#"
func.func @main(%a: tensor<32x32xf32>, %b: tensor<32x32xf32>) -> (tensor<32x32xf32>, tensor<32xf32>) {
  %p = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<32x32xf32>, tensor<32x32xf32>) -> tensor<32x32xf32>
  %t = stablehlo.tanh %p : tensor<32x32xf32>
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%t init: %zero) across dimensions = [0] : (tensor<32x32xf32>, tensor<f32>) -> tensor<32xf32>
    reducer(%x: tensor<f32>, %y: tensor<f32>) {
      %r = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %r : tensor<f32>
    }
  return %t, %s : tensor<32x32xf32>, tensor<32xf32>
}"#;

fn run(client: &Client, exe: &Executable, a: &[f32], b: &[f32]) -> Vec<Vec<f32>> {
    let dev = &client.devices()[0];
    let (a, b) = (
        upload(client, a, &[32, 32], dev),
        upload(client, b, &[32, 32], dev),
    );
    exe.execute(&[&a, &b])
        .unwrap()
        .iter()
        .map(download)
        .collect()
}

#[test]
fn serialize_then_deserialize_in_fresh_client() {
    let inputs = vec![f32_spec(&[32, 32]); 2];
    let mut rng = Rng::new(8);
    let (a, b) = (rng.f32s(1024), rng.f32s(1024));
    let (bytes, expected) = {
        let client = client(1);
        let start = Instant::now();
        let exe = compile(&client, PROGRAM, inputs.clone());
        let compiled = start.elapsed();
        let start = Instant::now();
        let bytes = exe.serialize().unwrap();
        println!(
            "compile {compiled:?}, serialize {:?} ({} bytes)",
            start.elapsed(),
            bytes.len()
        );
        (bytes, run(&client, &exe, &a, &b))
    };
    let client = client(1);
    let start = Instant::now();
    let exe = client
        .deserialize_executable(&bytes, inputs.clone())
        .unwrap();
    println!("deserialize {:?}", start.elapsed());
    assert_eq!(exe.inputs(), inputs.as_slice());
    assert_eq!(
        exe.output_specs().unwrap(),
        vec![f32_spec(&[32, 32]), f32_spec(&[32])]
    );
    // Same machine code, same inputs: bit-identical outputs.
    assert_eq!(run(&client, &exe, &a, &b), expected);
    // Sanity of the values themselves: tanh bounds and the column sums.
    let sums: Vec<f32> = (0..32)
        .map(|j| (0..32).map(|i| expected[0][i * 32 + j]).sum())
        .collect();
    assert!(expected[0].iter().all(|v| v.abs() <= 1.0));
    assert_close(&expected[1], &sums, 1e-4, 0.0);
    // The reloaded executable still validates its arguments.
    let dev = &client.devices()[0];
    let wrong = upload(&client, &a[..32], &[32], dev);
    assert!(matches!(
        exe.execute(&[&wrong, &wrong]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn garbage_bytes_do_not_deserialize() {
    let client = client(1);
    let err = client
        .deserialize_executable(&Rng::new(9).bytes(256), vec![])
        .unwrap_err();
    assert!(matches!(err, Error::Pjrt { .. }), "{err}");
}
