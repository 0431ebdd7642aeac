//! Bad input returns errors and the process survives.

mod common;

use common::*;
use tpu_dynamo_runtime::*;

fn compile_err(
    client: &Client,
    text: &str,
    inputs: Vec<TensorSpec>,
    options: &CompileOptions,
) -> Error {
    let program = Program {
        code: ProgramCode::MlirText(text),
        inputs,
    };
    client
        .compile(&program, options)
        .expect_err("compile should fail")
}

#[test]
fn malformed_and_ill_typed_programs() {
    let client = client(1);
    let opts = CompileOptions::default();
    for text in [
        "",
        "this is not MLIR",
        "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {",
    ] {
        let err = compile_err(&client, text, vec![], &opts);
        assert!(matches!(err, Error::Pjrt { .. }), "{err}");
    }
    let ill_typed = r#"
func.func @main(%a: tensor<2xf32>, %b: tensor<3xf32>) -> tensor<2xf32> {
  %0 = "stablehlo.add"(%a, %b) : (tensor<2xf32>, tensor<3xf32>) -> tensor<2xf32>
  return %0 : tensor<2xf32>
}"#;
    let err = compile_err(
        &client,
        ill_typed,
        vec![f32_spec(&[2]), f32_spec(&[3])],
        &opts,
    );
    println!("ill-typed: {err}");
    assert!(
        matches!(&err, Error::Pjrt { message, .. } if message.contains("stablehlo.add")),
        "{err}"
    );
    let bytecode_garbage = Program {
        code: ProgramCode::MlirBytecode(b"ML\xefR garbage"),
        inputs: vec![],
    };
    assert!(matches!(
        client.compile(&bytecode_garbage, &opts),
        Err(Error::Pjrt { .. })
    ));
    // The client still works afterwards.
    let ok = "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }";
    let exe = compile(&client, ok, vec![f32_spec(&[2])]);
    let out = exe
        .execute(&[&upload(&client, &[1.5, -2.0], &[2], &client.devices()[0])])
        .unwrap();
    assert_eq!(download(&out[0]), vec![1.5, -2.0]);
}

#[test]
fn invalid_compile_options_never_reach_the_plugin() {
    let client = client(4);
    let ok = "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> { return %a : tensor<2xf32> }";
    let bad = [
        CompileOptions {
            num_replicas: 0,
            ..Default::default()
        },
        CompileOptions {
            num_partitions: 0,
            ..Default::default()
        },
        CompileOptions {
            num_replicas: -3,
            num_partitions: -1,
            device_ids: None,
        },
        CompileOptions::replicated(5),
        CompileOptions {
            num_replicas: i64::MAX,
            num_partitions: i64::MAX,
            device_ids: None,
        },
        CompileOptions {
            num_replicas: 2,
            num_partitions: 1,
            device_ids: Some(vec![0]),
        },
        CompileOptions {
            num_replicas: 2,
            num_partitions: 1,
            device_ids: Some(vec![1, 1]),
        },
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            device_ids: Some(vec![9]),
        },
    ];
    for options in &bad {
        let err = compile_err(&client, ok, vec![f32_spec(&[2])], options);
        assert!(
            matches!(err, Error::InvalidArgument(_)),
            "{options:?}: {err}"
        );
    }
    let err = compile_err(
        &client,
        ok,
        vec![f32_spec(&[-2])],
        &CompileOptions::default(),
    );
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn wrong_arguments_are_caught_before_the_plugin() {
    let client = client(1);
    let dev = &client.devices()[0];
    let text = r#"
func.func @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.add %a, %b : tensor<2x3xf32>
  return %0 : tensor<2x3xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[2, 3]); 2]);
    let mut rng = Rng::new(12);
    let good = upload(&client, &rng.f32s(6), &[2, 3], dev);
    let transposed = upload(&client, &rng.f32s(6), &[3, 2], dev);
    let ints = client
        .buffer_from_host(&rng.bytes(24), &TensorSpec::new(DType::I32, [2, 3]), dev)
        .unwrap();
    let foreign_client = common::client(1);
    let foreign = upload(
        &foreign_client,
        &rng.f32s(6),
        &[2, 3],
        &foreign_client.devices()[0],
    );
    let cases: [(&[&Buffer], &[&str]); 5] = [
        (&[&good], &["expected 2 arguments, got 1"]),
        (&[&good, &good, &good], &["expected 2 arguments, got 3"]),
        (
            &[&good, &transposed],
            &["argument 1", "F32[2,3]", "F32[3,2]"],
        ),
        (&[&ints, &good], &["argument 0", "F32[2,3]", "I32[2,3]"]),
        (&[&good, &foreign], &["argument 1", "another client"]),
    ];
    for (args, needles) in cases {
        match exe.execute(args) {
            Err(Error::InvalidArgument(message)) => {
                for needle in needles {
                    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
                }
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    let lists = [vec![&good, &transposed]];
    assert!(
        matches!(exe.execute_replicated(&lists), Err(Error::InvalidArgument(m)) if m.contains("argument 1"))
    );
    // Still usable.
    let out = exe.execute(&[&good, &good]).unwrap();
    assert_eq!(
        download(&out[0]),
        download(&good).iter().map(|v| v + v).collect::<Vec<_>>()
    );
}

#[test]
fn error_display_is_actionable() {
    let err = Error::PluginNotFound {
        searched: vec!["/a/xla_cpu_pjrt.so (XLA CPU plugin): not found".into()],
    };
    let text = err.to_string();
    for needle in [
        "/a/xla_cpu_pjrt.so",
        "pip install xla-cpu-pjrt",
        "pip install libtpu",
        "TPU_DYNAMO_PJRT_PLUGIN=",
    ] {
        assert!(text.contains(needle), "{text}");
    }
    let err = Error::Pjrt {
        code: ErrorCode::InvalidArgument,
        message: "bad".into(),
    };
    assert_eq!(err.to_string(), "PJRT error (InvalidArgument): bad");
}
