//! Helpers shared by the integration tests: the plugin, clients, a PRNG and f32 transfers.
#![allow(dead_code)] // each test binary uses a different subset

use std::sync::Arc;
use tpu_dynamo_runtime::*;

/// The plugin under test: `TPU_DYNAMO_PJRT_PLUGIN`, `VIRTUAL_ENV`, or the repo's `.venv`.
pub fn plugin() -> Arc<Plugin> {
    Plugin::discover(None).unwrap_or_else(|e| panic!("{e}"))
}

pub fn client(devices: i64) -> Client {
    Client::new(
        plugin(),
        &ClientOptions::default().cpu_device_count(devices),
    )
    .unwrap()
}

/// xorshift64*: deterministic, dependency-free test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1), never exactly zero in practice.
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

pub fn f32_spec(dims: &[i64]) -> TensorSpec {
    TensorSpec::new(DType::F32, dims)
}

pub fn upload(client: &Client, data: &[f32], dims: &[i64], device: &Device) -> Buffer {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    client
        .buffer_from_host(&bytes, &f32_spec(dims), device)
        .unwrap()
}

pub fn download(buffer: &Buffer) -> Vec<f32> {
    let mut bytes = vec![0u8; buffer.spec().unwrap().byte_size().unwrap()];
    buffer.to_host(&mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn compile(client: &Client, text: &str, inputs: Vec<TensorSpec>) -> Executable {
    let program = Program {
        code: ProgramCode::MlirText(text),
        inputs,
    };
    client
        .compile(&program, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise, naming the first mismatch.
pub fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "element {i}: got {g}, want {w}"
        );
    }
}
