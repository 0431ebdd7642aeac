//! One executable and client shared by several threads executing at once.

mod common;

use common::*;
use std::sync::Arc;

#[test]
fn concurrent_execution_from_threads() {
    let client = client(2);
    let text = r#"
func.func @main(%a: tensor<512xf32>) -> tensor<512xf32> {
  %0 = stablehlo.multiply %a, %a : tensor<512xf32>
  return %0 : tensor<512xf32>
}"#;
    let exe = Arc::new(compile(&client, text, vec![f32_spec(&[512])]));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (client, exe) = (client.clone(), exe.clone());
            std::thread::spawn(move || {
                let device = &client.devices()[t as usize % 2];
                let mut rng = Rng::new(100 + t);
                for _ in 0..200 {
                    let a = rng.f32s(512);
                    let out = exe
                        .execute(&[&upload(&client, &a, &[512], device)])
                        .unwrap();
                    assert_eq!(&out[0].device().unwrap(), device);
                    assert_eq!(
                        download(&out[0]),
                        a.iter().map(|x| x * x).collect::<Vec<_>>()
                    );
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}
