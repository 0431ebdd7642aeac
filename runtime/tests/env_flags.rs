//! Flags in `XLA_FLAGS` that the plugin does not know, or values it cannot parse: an error, not an
//! aborted process. Its own test binary (one process), since it sets the variable every client of
//! the process reads.

mod common;

use common::*;
use tpu_dynamo_runtime::*;

#[test]
fn an_unknown_xla_flag_or_bad_value_is_an_error_and_a_known_flag_is_taken() {
    let plugin = plugin();
    std::env::set_var("XLA_FLAGS", "--xla_no_such_flag_anywhere=1");
    let err = Client::new(plugin.clone(), &ClientOptions::default()).expect_err("the plugin rejects the flag");
    let message = err.to_string();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(message.contains("--xla_no_such_flag_anywhere=1"), "{message}");
    assert!(message.contains("would abort the process"), "{message}");
    // The verdict is remembered: asking again does not fork again and says the same.
    let again = Client::new(plugin.clone(), &ClientOptions::default()).expect_err("still rejected");
    assert_eq!(again.to_string(), message);

    std::env::set_var("XLA_FLAGS", "--xla_cpu_enable_fast_math=notabool");
    let bad_value = Client::new(plugin.clone(), &ClientOptions::default()).expect_err("a value XLA cannot parse");
    assert!(bad_value.to_string().contains("Couldn't interpret value notabool for flag xla_cpu_enable_fast_math"), "{bad_value}");

    std::env::set_var("XLA_FLAGS", "--xla_cpu_enable_fast_math=false");
    let client = Client::new(plugin, &ClientOptions::default()).expect("a flag XLA knows is accepted");
    let text = r#"func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = "stablehlo.add"(%a, %a) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[4])]);
    let x = Rng::new(7).f32s(4);
    let out = exe.execute(&[&upload(&client, &x, &[4], &client.devices()[0])]).unwrap();
    assert_eq!(download(&out[0]), x.iter().map(|v| v + v).collect::<Vec<_>>());
}
