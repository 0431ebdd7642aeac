//! Zero-copy host views on the CPU plugin: an execute reads the caller's memory directly. (The
//! plugin never donates a view: an aliased output gets fresh memory, so in-place updates go the
//! other way round, host tensors viewing the executable's buffers.)

mod common;

use common::*;

/// 64-byte aligned host memory, as torch allocates it (XLA's CPU views demand that alignment).
#[repr(C, align(64))]
struct Aligned<const N: usize>([f32; N]);

#[test]
fn view_reads_caller_memory_without_copy() {
    let client = client(1);
    let dev = &client.devices()[0];
    let text = r#"
func.func @main(%a: tensor<16xf32>) -> tensor<16xf32> {
  %m = stablehlo.multiply %a, %a : tensor<16xf32>
  return %m : tensor<16xf32>
}"#;
    let exe = compile(&client, text, vec![f32_spec(&[16])]);
    let mut host = Box::new(Aligned([0f32; 16]));
    let a = &mut host.0;
    for (i, x) in a.iter_mut().enumerate() {
        *x = i as f32 - 7.5;
    }
    // SAFETY: `a` outlives `view`, and is only written between executes.
    let view = unsafe { client.view_host(a.as_mut_ptr().cast(), 64, &f32_spec(&[16]), dev) }.unwrap();
    let first = download(&exe.execute(&[&view]).unwrap()[0]);
    assert_eq!(first, a.iter().map(|x| x * x).collect::<Vec<_>>());
    // A write to the caller's memory is seen by the next execute: the view is not a copy.
    a[3] = 10.0;
    let second = download(&exe.execute(&[&view]).unwrap()[0]);
    assert_eq!(second[3], 100.0);
    assert!(unsafe { client.view_host(std::ptr::null_mut(), 64, &f32_spec(&[16]), dev) }.is_err());
    // Misaligned memory is refused (callers then upload a copy).
    let odd = unsafe { client.view_host(a.as_mut_ptr().add(1).cast(), 60, &f32_spec(&[15]), dev) };
    assert!(odd.unwrap_err().to_string().contains("align"));
}
