//! Device copies of resident inputs (parameters, buffers, constants), one per host tensor
//! version for the whole process. A graph whose sizes vary gets one executable per input shape
//! (each decode step with a growing cache is another), and every one of them takes the same
//! weights: with a copy per executable, a 32-token decode held its weights 32 times over (a
//! 177 MB Llama grew by 5.5 GB and decoded 2-3x slower).
//!
//! The registry only finds copies; the graphs that use one own it, so a copy lives as long as
//! some graph keeps it resident and no longer.

use std::sync::LazyLock;

use tpu_dynamo_runtime::{Buffer, TensorSpec};

use crate::weak_map::WeakMap;

/// What a copy was made from: the host memory and its version, read as `spec`, on one target.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub target: usize,
    pub ptr: usize,
    pub version: i64,
    pub spec: TensorSpec,
}

pub static COPIES: LazyLock<WeakMap<Key, Buffer>> = LazyLock::new(WeakMap::new);
