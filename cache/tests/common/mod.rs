//! Shared fixtures for the cache's integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use tpu_dynamo_cache::{Entry, Key, KeyBuilder, PluginIdentity, TensorSig};

pub fn plugin() -> PluginIdentity {
    PluginIdentity {
        library_hash: "a".repeat(64),
        pjrt_api_version: "0.54".into(),
        xla_version: "xla-test".into(),
        platform: "cpu".into(),
        platform_version: "cpu 1".into(),
        cpu_features: "avx2 fma sse4_2".into(),
    }
}

pub fn key(name: &str) -> Key {
    KeyBuilder::new().field(name.as_bytes()).finish()
}

/// An entry whose executable is `len` bytes derived from `seed`, so entries from different
/// writers differ in every block and a torn mix of two could not pass the checksum.
pub fn entry(seed: u64, len: usize) -> Entry {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    Entry {
        plugin: plugin(),
        inputs: vec![TensorSig::new("f32", [2, 3]), TensorSig::new("i64", [])],
        outputs: vec![TensorSig::new("f32", [3, 2])],
        executable: (0..len).map(|_| rng.next() as u8).collect(),
    }
}

pub fn encode(key: &Key, entry: &Entry) -> Vec<u8> {
    let mut bytes = vec![];
    entry.write_to(key, &mut bytes).unwrap();
    bytes
}

/// Recomputes the trailing checksum, so a test can hand the decoder hostile contents that a
/// damaged file could never present but a crafted one can.
pub fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 32;
    let sum = *blake3::hash(&bytes[..n]).as_bytes();
    bytes[n..].copy_from_slice(&sum);
}

/// xorshift64: enough randomness for mutation loops without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
