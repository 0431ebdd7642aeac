//! One program on every device of a 4-device client, each with its own inputs.

mod common;

use common::*;
use tpu_dynamo_runtime::*;

const AXPY: &str = r#"
func.func @main(%x: tensor<128xf32>, %y: tensor<128xf32>, %a: tensor<f32>) -> tensor<128xf32> {
  %ab = stablehlo.broadcast_in_dim %a, dims = [] : (tensor<f32>) -> tensor<128xf32>
  %ax = stablehlo.multiply %ab, %x : tensor<128xf32>
  %r = stablehlo.add %ax, %y : tensor<128xf32>
  return %r : tensor<128xf32>
}"#;

fn specs() -> Vec<TensorSpec> {
    vec![f32_spec(&[128]), f32_spec(&[128]), f32_spec(&[])]
}

/// Per-device inputs and the expected `a*x + y`, uploaded to `devices` in order.
fn run_replicated(client: &Client, exe: &Executable, devices: &[Device], seed: u64) {
    let mut rng = Rng::new(seed);
    let inputs: Vec<(Vec<f32>, Vec<f32>, f32)> = devices
        .iter()
        .map(|_| (rng.f32s(128), rng.f32s(128), rng.f32()))
        .collect();
    let buffers: Vec<[Buffer; 3]> = inputs
        .iter()
        .zip(devices)
        .map(|((x, y, a), d)| {
            [
                upload(client, x, &[128], d),
                upload(client, y, &[128], d),
                upload(client, &[*a], &[], d),
            ]
        })
        .collect();
    let lists: Vec<Vec<&Buffer>> = buffers.iter().map(|b| b.iter().collect()).collect();
    let outputs = exe.execute_replicated(&lists).unwrap();
    assert_eq!(outputs.len(), devices.len());
    for ((out, (x, y, a)), device) in outputs.iter().zip(&inputs).zip(devices) {
        assert_eq!(out.len(), 1);
        assert_eq!(&out[0].device().unwrap(), device);
        let want: Vec<f32> = x.iter().zip(y).map(|(x, y)| a * x + y).collect();
        // XLA may fuse into an FMA: one rounding instead of two.
        assert_close(&download(&out[0]), &want, 1e-6, 1e-6);
    }
}

#[test]
fn four_replicas_default_assignment() {
    let client = client(4);
    assert_eq!(client.devices().len(), 4);
    let program = Program {
        code: ProgramCode::MlirText(AXPY),
        inputs: specs(),
    };
    let exe = client
        .compile(&program, &CompileOptions::replicated(4))
        .unwrap();
    let devices = exe.devices().unwrap();
    assert_eq!(
        devices.iter().map(Device::id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    run_replicated(&client, &exe, &devices, 10);
    // Too few argument lists, or plain execute, are caller errors.
    assert!(matches!(
        exe.execute_replicated(&[vec![]]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(exe.execute(&[]), Err(Error::InvalidArgument(_))));
}

#[test]
fn explicit_device_assignment() {
    let client = client(4);
    let program = Program {
        code: ProgramCode::MlirText(AXPY),
        inputs: specs(),
    };
    let options = CompileOptions {
        num_replicas: 2,
        num_partitions: 1,
        device_ids: Some(vec![3, 1]),
    };
    let exe = client.compile(&program, &options).unwrap();
    let devices = exe.devices().unwrap();
    assert_eq!(
        devices.iter().map(Device::id).collect::<Vec<_>>(),
        vec![3, 1]
    );
    run_replicated(&client, &exe, &devices, 11);
}

#[test]
fn single_device_program_runs_on_each_device() {
    let client = client(4);
    let exe = compile(&client, AXPY, specs());
    assert!(
        exe.devices().unwrap().is_empty(),
        "1x1 programs compile portable"
    );
    for (i, device) in client.devices().iter().enumerate() {
        run_replicated(&client, &exe, std::slice::from_ref(device), 20 + i as u64);
    }
}

#[test]
fn two_partitions_spmd() {
    let client = client(4);
    let program = Program {
        code: ProgramCode::MlirText(AXPY),
        inputs: specs(),
    };
    let options = CompileOptions {
        num_replicas: 1,
        num_partitions: 2,
        device_ids: Some(vec![2, 0]),
    };
    let exe = client.compile(&program, &options).unwrap();
    let devices = exe.devices().unwrap();
    assert_eq!(
        devices.iter().map(Device::id).collect::<Vec<_>>(),
        vec![2, 0]
    );
    // Without sharding annotations every operand is replicated: both partitions get the same
    // inputs and compute the whole result.
    let mut rng = Rng::new(30);
    let (x, y, a) = (rng.f32s(128), rng.f32s(128), rng.f32());
    let buffers: Vec<[Buffer; 3]> = devices
        .iter()
        .map(|d| {
            [
                upload(&client, &x, &[128], d),
                upload(&client, &y, &[128], d),
                upload(&client, &[a], &[], d),
            ]
        })
        .collect();
    let lists: Vec<Vec<&Buffer>> = buffers.iter().map(|b| b.iter().collect()).collect();
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| a * x + y).collect();
    for out in exe.execute_replicated(&lists).unwrap() {
        assert_close(&download(&out[0]), &want, 1e-6, 1e-6);
    }
}
