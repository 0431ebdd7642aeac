//! Our host kernels, called by XLA:CPU as typed-FFI custom calls, against exact products.

mod common;

use common::*;
use tpu_dynamo_runtime::host_kernels::{register, BF16_MATVEC_TARGET, BF16_VECMAT_TARGET, F32_ATTENTION_TARGET, F32_CAUSAL_ATTENTION_TARGET, F32_MATMUL_NN_TARGET, F32_MATMUL_NT_TARGET};
use tpu_dynamo_runtime::*;

fn bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

fn widen(v: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(v) << 16))
}

fn upload_bf16(client: &Client, data: &[u16], dims: &[i64]) -> Buffer {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    client
        .buffer_from_host(&bytes, &TensorSpec::new(DType::Bf16, dims), &client.devices()[0])
        .unwrap()
}

/// The result as f64, from bf16 or f32 bytes.
fn download_any(buffer: &Buffer, dtype: DType) -> Vec<f64> {
    let mut bytes = vec![0u8; buffer.spec().unwrap().byte_size().unwrap()];
    buffer.to_host(&mut bytes).unwrap();
    match dtype {
        DType::Bf16 => bytes.chunks_exact(2).map(|c| widen(u16::from_le_bytes([c[0], c[1]]))).collect(),
        _ => bytes.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap()))).collect(),
    }
}

/// Whether the plugin takes our kernel `target` (a bf16 matrix-vector product, or an f32
/// product or attention), asserting that it does exactly where it must: the embedded plugin
/// (PJRT 0.115) on an x86-64 CPU with AVX2 (bf16), or AVX2 and FMA or AVX-512 (f32); no other is
/// tested.
fn registers(client: &Client, target: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(target_arch = "x86_64")]
    let expected = client.plugin().api_version().1 <= 115
        && if target.starts_with("tpu_dynamo.f32_") {
            std::arch::is_x86_feature_detected!("avx512f") || (avx2 && std::arch::is_x86_feature_detected!("fma"))
        } else {
            avx2
        };
    #[cfg(not(target_arch = "x86_64"))]
    let expected = false;
    assert_eq!(register(client.plugin()).contains(&target), expected, "{target}");
    expected
}

/// A bf16 vector `[1, 1, K]` times weights stored `[N, K]` (a decode step's linear layer) and
/// `[K, N]` (GPT-2's `Conv1D`), with K and N off the kernels' block sizes too, in both result
/// types: within f32 summation's rounding of the exact product (and one bf16 rounding for a
/// bf16 result).
#[test]
fn bf16_matvec_matches_the_exact_product() {
    let client = client(1);
    if !registers(&client, BF16_MATVEC_TARGET) {
        return;
    }
    let mut rng = Rng::new(7);
    let shapes = [(576i64, 1536i64), (1536, 576), (100, 7), (33, 130), (768, 2304)];
    for ((k, n), row_per_input) in shapes.into_iter().flat_map(|s| [(s, false), (s, true)]) {
        let (target, w_dims) = if row_per_input { (BF16_VECMAT_TARGET, [k, n]) } else { (BF16_MATVEC_TARGET, [n, k]) };
        // Element (output, input) of the weight.
        let at = |o: usize, i: usize| if row_per_input { i * n as usize + o } else { o * k as usize + i };
        for (dtype, name) in [(DType::Bf16, "bf16"), (DType::F32, "f32")] {
            let w_ty = format!("tensor<{}x{}xbf16>", w_dims[0], w_dims[1]);
            let text = format!(
                r#"
func.func @main(%x: tensor<1x1x{k}xbf16>, %w: {w_ty}) -> tensor<1x1x{n}x{name}> {{
  %y = stablehlo.custom_call @{target}(%x, %w) {{api_version = 4 : i32, backend_config = {{}}}} : (tensor<1x1x{k}xbf16>, {w_ty}) -> tensor<1x1x{n}x{name}>
  return %y : tensor<1x1x{n}x{name}>
}}"#
            );
            let spec = |d: &[i64]| TensorSpec::new(DType::Bf16, d);
            let exe = compile(&client, &text, vec![spec(&[1, 1, k]), spec(&w_dims)]);
            let x: Vec<u16> = rng.f32s(k as usize).into_iter().map(bf16).collect();
            let w: Vec<u16> = rng.f32s((n * k) as usize).into_iter().map(bf16).collect();
            let out = exe.execute(&[&upload_bf16(&client, &x, &[1, 1, k]), &upload_bf16(&client, &w, &w_dims)]).unwrap();
            let got = download_any(&out[0], dtype);
            for (row, &got) in got.iter().enumerate() {
                let terms = (0..k as usize).map(|i| widen(x[i]) * widen(w[at(row, i)]));
                let exact: f64 = terms.clone().sum();
                let magnitude: f64 = terms.map(f64::abs).sum();
                let rounding = if dtype == DType::Bf16 { exact.abs() / 256.0 } else { 0.0 };
                let allowed = magnitude * k as f64 * f64::from(f32::EPSILON) + rounding;
                assert!((got - exact).abs() <= allowed, "{target} {name} {w_dims:?} output {row}: {got} vs {exact}");
            }
        }
    }
}

/// Operands the kernel does not take (f32 here; the compiler never emits such a call) fail the
/// execute with the kernel's message, instead of leaving the result unwritten.
#[test]
fn a_call_on_other_operands_is_an_error() {
    let client = client(1);
    if !register(client.plugin()).contains(&BF16_MATVEC_TARGET) {
        return; // bf16_matvec_matches_the_exact_product checks where it must register
    }
    let text = format!(
        r#"
func.func @main(%x: tensor<1x8xf32>, %w: tensor<4x8xf32>) -> tensor<1x4xf32> {{
  %y = stablehlo.custom_call @{BF16_MATVEC_TARGET}(%x, %w) {{api_version = 4 : i32, backend_config = {{}}}} : (tensor<1x8xf32>, tensor<4x8xf32>) -> tensor<1x4xf32>
  return %y : tensor<1x4xf32>
}}"#
    );
    let exe = compile(&client, &text, vec![f32_spec(&[1, 8]), f32_spec(&[4, 8])]);
    let dev = &client.devices()[0];
    let error = exe
        .execute(&[&upload(&client, &[1.0; 8], &[1, 8], dev), &upload(&client, &[1.0; 32], &[4, 8], dev)])
        .map(|_| ())
        .unwrap_err();
    assert!(error.to_string().contains("tpu_dynamo host kernel tpu_dynamo.bf16_matvec: expects bf16"), "{error}");
}

/// f32 rows `[B, M, K]` times weights stored `[N, K]` and `[K, N]`, split over the host's
/// threads, with M, N and K off the kernel's tiles too: within f32 summation's rounding of
/// the exact product.
#[test]
fn f32_matmul_matches_the_exact_product() {
    let client = client(1);
    if !registers(&client, F32_MATMUL_NT_TARGET) {
        return;
    }
    let mut rng = Rng::new(11);
    let shapes = [(1i64, 128i64, 64i64, 64i64), (8, 128, 64, 172), (2, 37, 100, 45), (1, 16, 768, 2304), (3, 25, 7, 33)];
    for ((b, m, k, n), row_per_input) in shapes.into_iter().flat_map(|s| [(s, false), (s, true)]) {
        let (target, w_dims) = if row_per_input { (F32_MATMUL_NN_TARGET, [k, n]) } else { (F32_MATMUL_NT_TARGET, [n, k]) };
        let at = |o: usize, i: usize| if row_per_input { i * n as usize + o } else { o * k as usize + i };
        let w_ty = format!("tensor<{}x{}xf32>", w_dims[0], w_dims[1]);
        let text = format!(
            r#"
func.func @main(%x: tensor<{b}x{m}x{k}xf32>, %w: {w_ty}) -> tensor<{b}x{m}x{n}xf32> {{
  %y = stablehlo.custom_call @{target}(%x, %w) {{api_version = 4 : i32, backend_config = {{}}}} : (tensor<{b}x{m}x{k}xf32>, {w_ty}) -> tensor<{b}x{m}x{n}xf32>
  return %y : tensor<{b}x{m}x{n}xf32>
}}"#
        );
        let exe = compile(&client, &text, vec![f32_spec(&[b, m, k]), f32_spec(&w_dims)]);
        let x = rng.f32s((b * m * k) as usize);
        let w = rng.f32s((n * k) as usize);
        let dev = &client.devices()[0];
        let out = exe.execute(&[&upload(&client, &x, &[b, m, k], dev), &upload(&client, &w, &w_dims, dev)]).unwrap();
        let got = download_any(&out[0], DType::F32);
        let (k, n) = (k as usize, n as usize);
        for (index, &got) in got.iter().enumerate() {
            let (row, col) = (index / n, index % n);
            let terms = (0..k).map(|i| f64::from(x[row * k + i]) * f64::from(w[at(col, i)]));
            let exact: f64 = terms.clone().sum();
            let magnitude: f64 = terms.map(f64::abs).sum();
            let allowed = magnitude * k as f64 * f64::from(f32::EPSILON);
            assert!((got - exact).abs() <= allowed, "{target} {b}x{m}x{k} by {w_dims:?} at {row},{col}: {got} vs {exact}");
        }
    }
}

/// A decode step's attention over its cache grown by the step's row (the layout's `appended`):
/// caches `[1, 2, 7, 24]` holding 5 rows a head packed (head 1's from row 5), a key count of 6;
/// the grown copies `[1, 2, 8, 24]` hold the 6 rows a head packed, the output is that of the 6
/// keys (within 1e-5 of f64); a count the new row does not fit in fails with the kernel's message.
#[test]
fn f32_attention_grows_a_packed_cache() {
    let client = client(1);
    if !registers(&client, F32_ATTENTION_TARGET) {
        return;
    }
    let (q_t, new_t, cache_t, grown_t) = ("tensor<1x4x1x24xf32>", "tensor<1x2x1x24xf32>", "tensor<1x2x7x24xf32>", "tensor<1x2x8x24xf32>");
    let layout = [2, 8, 0, 0, 96, 24, 24, 0, 48, 24, 24, 0, 48, 24, 24, 1, 1, 1].map(|x: i64| x.to_string()).join(", ");
    let call = |count: i64| {
        let text = format!(
            r#"
func.func @main(%q: {q_t}, %k: {new_t}, %v: {new_t}, %ck: {cache_t}, %cv: {cache_t}) -> ({q_t}, tensor<1x4x1xf32>, {grown_t}, {grown_t}) {{
  %s = stablehlo.constant dense<5.000000e-01> : tensor<f32>
  %n = stablehlo.constant dense<{count}> : tensor<i64>
  %l = stablehlo.constant dense<[{layout}]> : tensor<18xi64>
  %o:4 = stablehlo.custom_call @{F32_ATTENTION_TARGET}(%q, %k, %v, %ck, %cv, %n, %s, %l) {{api_version = 4 : i32, backend_config = {{}}}} : ({q_t}, {new_t}, {new_t}, {cache_t}, {cache_t}, tensor<i64>, tensor<f32>, tensor<18xi64>) -> ({q_t}, tensor<1x4x1xf32>, {grown_t}, {grown_t})
  return %o#0, %o#1, %o#2, %o#3 : {q_t}, tensor<1x4x1xf32>, {grown_t}, {grown_t}
}}"#
        );
        compile(&client, &text, [[1, 4, 1, 24], [1, 2, 1, 24], [1, 2, 1, 24], [1, 2, 7, 24], [1, 2, 7, 24]].iter().map(|d| f32_spec(d)).collect())
    };
    let mut rng = Rng::new(9);
    let (q, new_k, new_v, cache_k, cache_v) = (rng.f32s(4 * 24), rng.f32s(2 * 24), rng.f32s(2 * 24), rng.f32s(2 * 7 * 24), rng.f32s(2 * 7 * 24));
    let dev = &client.devices()[0];
    let inputs = [
        upload(&client, &q, &[1, 4, 1, 24], dev),
        upload(&client, &new_k, &[1, 2, 1, 24], dev),
        upload(&client, &new_v, &[1, 2, 1, 24], dev),
        upload(&client, &cache_k, &[1, 2, 7, 24], dev),
        upload(&client, &cache_v, &[1, 2, 7, 24], dev),
    ];
    let out = call(6).execute(&inputs.iter().collect::<Vec<_>>()).unwrap();
    // Head `h`'s 6 rows: the cache's 5 from row 5h, then the new one.
    let grown = |cache: &[f32], new: &[f32]| (0..2).flat_map(|h| [&cache[h * 5 * 24..(h + 1) * 5 * 24], &new[h * 24..(h + 1) * 24]].concat()).collect::<Vec<f32>>();
    let (keys, values) = (grown(&cache_k, &new_k), grown(&cache_v, &new_v));
    for (copy, want) in [(&out[2], &keys), (&out[3], &values)] {
        let got = download_any(copy, DType::F32);
        assert!(got[..2 * 6 * 24].iter().zip(want.iter()).all(|(&g, &w)| g == f64::from(w)), "the grown cache, packed");
    }
    let (got, lse) = (download_any(&out[0], DType::F32), download_any(&out[1], DType::F32));
    for h in 0..4 {
        let kv = h / 2 * 6 * 24;
        let scores: Vec<f64> = (0..6).map(|j| (0..24).map(|e| f64::from(q[h * 24 + e] * 0.5) * f64::from(keys[kv + j * 24 + e])).sum()).collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        assert!((lse[h] - (max + sum.ln())).abs() < 1e-5, "lse of head {h}");
        for e in 0..24 {
            let want: f64 = scores.iter().enumerate().map(|(j, s)| (s - max).exp() / sum * f64::from(values[kv + j * 24 + e])).sum();
            assert!((got[h * 24 + e] - want).abs() < 1e-5, "head {h} lane {e}");
        }
    }
    let error = call(0).execute(&inputs.iter().collect::<Vec<_>>()).map(|_| ()).unwrap_err();
    assert!(error.to_string().contains("a key count of 1 to 8"), "{error}");
}

/// Causal attention of grouped query heads (`[1, 4, 30, 24]` over `[1, 2, 30, 24]`, scaled by
/// 0.5): output and logsumexp within 1e-5 of f64; the same operands read from one fused
/// projection's `[1, 30, 192]` (queries, keys and values side by side in each row, as a layout
/// places them) with the output written `[1, 30, 4, 24]`: the same bits, and the keys and values
/// copied out as `[1, 2, 30, 24]`; and calls whose shapes
/// disagree, or whose layout reaches past an operand, fail the execute with the kernel's message.
#[test]
fn f32_attention_matches_f64_and_names_bad_shapes() {
    let client = client(1);
    if !registers(&client, F32_CAUSAL_ATTENTION_TARGET) {
        return;
    }
    const SCALE: &str = "%s = stablehlo.constant dense<5.000000e-01> : tensor<f32>";
    // Keys and values of `k_len` and `v_len` positions (the kernel wants them equal).
    let call = |k_len: i64, v_len: i64| {
        let (q, k, v) = ("tensor<1x4x30x24xf32>", format!("tensor<1x2x{k_len}x24xf32>"), format!("tensor<1x2x{v_len}x24xf32>"));
        let text = format!(
            r#"
func.func @main(%q: {q}, %k: {k}, %v: {v}) -> ({q}, tensor<1x4x30xf32>) {{
  {SCALE}
  %o:2 = stablehlo.custom_call @{F32_CAUSAL_ATTENTION_TARGET}(%q, %k, %v, %s) {{api_version = 4 : i32, backend_config = {{}}}} : ({q}, {k}, {v}, tensor<f32>) -> ({q}, tensor<1x4x30xf32>)
  return %o#0, %o#1 : {q}, tensor<1x4x30xf32>
}}"#
        );
        compile(&client, &text, vec![f32_spec(&[1, 4, 30, 24]), f32_spec(&[1, 2, k_len, 24]), f32_spec(&[1, 2, v_len, 24])])
    };
    // q at column 0 of each row of 192, k at 96, v at 144 (k's and v's moved by `shift`).
    let fused = |shift: i64| {
        let layout = [2, 30, 1, 0, 30 * 192, 24, 192, 96 + shift, 30 * 192, 24, 192, 144 + shift, 30 * 192, 24, 192, 1, 1, 0];
        let layout = layout.map(|x| x.to_string()).join(", ");
        let (x, o, kv) = ("tensor<1x30x192xf32>", "tensor<1x30x4x24xf32>", "tensor<1x2x30x24xf32>");
        let text = format!(
            r#"
func.func @main(%x: {x}) -> ({o}, tensor<1x4x30xf32>, {kv}, {kv}) {{
  {SCALE}
  %l = stablehlo.constant dense<[{layout}]> : tensor<18xi64>
  %o:4 = stablehlo.custom_call @{F32_CAUSAL_ATTENTION_TARGET}(%x, %x, %x, %s, %l) {{api_version = 4 : i32, backend_config = {{}}}} : ({x}, {x}, {x}, tensor<f32>, tensor<18xi64>) -> ({o}, tensor<1x4x30xf32>, {kv}, {kv})
  return %o#0, %o#1, %o#2, %o#3 : {o}, tensor<1x4x30xf32>, {kv}, {kv}
}}"#
        );
        compile(&client, &text, vec![f32_spec(&[1, 30, 192])])
    };
    let mut rng = Rng::new(5);
    let (q, k, v) = (rng.f32s(4 * 30 * 24), rng.f32s(2 * 30 * 24), rng.f32s(2 * 30 * 24));
    let dev = &client.devices()[0];
    let inputs = [upload(&client, &q, &[1, 4, 30, 24], dev), upload(&client, &k, &[1, 2, 30, 24], dev), upload(&client, &v, &[1, 2, 30, 24], dev)];
    let out = call(30, 30).execute(&inputs.iter().collect::<Vec<_>>()).unwrap();
    let (got, lse) = (download_any(&out[0], DType::F32), download_any(&out[1], DType::F32));
    for (h, i) in (0..4).flat_map(|h| (0..30).map(move |i| (h, i))) {
        let kv = h / 2 * 30 * 24;
        let scores: Vec<f64> = (0..=i).map(|j| (0..24).map(|e| f64::from(q[(h * 30 + i) * 24 + e] * 0.5) * f64::from(k[kv + j * 24 + e])).sum()).collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        assert!((lse[h * 30 + i] - (max + sum.ln())).abs() < 1e-5, "lse of head {h} query {i}");
        for e in 0..24 {
            let want: f64 = scores.iter().enumerate().map(|(j, s)| (s - max).exp() / sum * f64::from(v[kv + j * 24 + e])).sum();
            assert!((got[(h * 30 + i) * 24 + e] - want).abs() < 1e-5, "head {h} query {i} lane {e}");
        }
    }
    // Row `i` of the fused projection: q's four heads, then k's two, then v's two.
    let heads_of = |t: &[f32], heads: usize, i: usize| (0..heads).flat_map(|h| t[(h * 30 + i) * 24..][..24].to_vec()).collect::<Vec<_>>();
    let x: Vec<f32> = (0..30).flat_map(|i| [heads_of(&q, 4, i), heads_of(&k, 2, i), heads_of(&v, 2, i)].concat()).collect();
    let placed = fused(0).execute(&[&upload(&client, &x, &[1, 30, 192], dev)]).unwrap();
    let (placed_out, placed_lse) = (download_any(&placed[0], DType::F32), download_any(&placed[1], DType::F32));
    assert_eq!(placed_lse, lse);
    let widened = |t: &[f32]| t.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    assert_eq!([download_any(&placed[2], DType::F32), download_any(&placed[3], DType::F32)], [widened(&k), widened(&v)], "the keys' and values' copies");
    for (h, i, e) in (0..4).flat_map(|h| (0..30).flat_map(move |i| (0..24).map(move |e| (h, i, e)))) {
        assert_eq!(placed_out[(i * 4 + h) * 24 + e], got[(h * 30 + i) * 24 + e], "head {h} query {i} lane {e}");
    }
    let past = fused(1).execute(&[&upload(&client, &x, &[1, 30, 192], dev)]).map(|_| ()).unwrap_err();
    assert!(past.to_string().contains("does not fit out [1, 30, 4, 24]"), "{past}");
    let short = [upload(&client, &q, &[1, 4, 30, 24], dev), upload(&client, &k[..2 * 29 * 24], &[1, 2, 29, 24], dev), upload(&client, &v, &[1, 2, 30, 24], dev)];
    let error = call(29, 30).execute(&short.iter().collect::<Vec<_>>()).map(|_| ()).unwrap_err();
    assert!(error.to_string().contains("tpu_dynamo host kernel tpu_dynamo.f32_causal_attention: expects f32 q"), "{error}");
}
