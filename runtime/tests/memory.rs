//! Compile-free upload/execute/download cycles must not leak: resident memory stays flat.
//! (Alone in its own test binary so no other test's allocations disturb the numbers.)

mod common;

use common::*;
use std::time::Instant;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn ten_thousand_cycles_keep_rss_flat() {
    let client = client(1);
    let dev = client.devices().remove(0);
    let text = r#"
func.func @main(%a: tensor<256xf32>, %b: tensor<256xf32>) -> (tensor<256xf32>, tensor<256xf32>) {
  %0 = stablehlo.multiply %a, %b : tensor<256xf32>
  %1 = stablehlo.add %0, %a : tensor<256xf32>
  return %0, %1 : tensor<256xf32>, tensor<256xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[256]); 2]);
    let mut rng = Rng::new(13);
    let (a, b) = (rng.f32s(256), rng.f32s(256));
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
    let cycle = || {
        let (ba, bb) = (
            upload(&client, &a, &[256], &dev),
            upload(&client, &b, &[256], &dev),
        );
        let out = exe.execute(&[&ba, &bb]).unwrap();
        assert_eq!(download(&out[0]), want);
    };
    (0..1_000).for_each(|_| cycle());
    let warm = rss_kib();
    let start = Instant::now();
    (0..10_000).for_each(|_| cycle());
    let elapsed = start.elapsed();
    let end = rss_kib();
    let growth = end as i64 - warm as i64;
    println!(
        "RSS after 1000 warm-up cycles: {warm} KiB, after 10000 more: {end} KiB, growth {growth} KiB; \
         {:.1} µs per cycle (2 uploads, execute, download)",
        elapsed.as_secs_f64() * 1e6 / 10_000.0
    );
    // A leak of one 1 KiB buffer per cycle would be ~10 MiB; allow allocator noise only.
    assert!(growth < 4 * 1024, "RSS grew {growth} KiB over 10000 cycles");
}
