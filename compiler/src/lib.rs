//! tpu-dynamo-compiler: the graph IR that Python hands over, and its lowering to StableHLO.
//!
//! `ir` is the contract; `lower` turns a [`ir::Graph`] into a StableHLO module (text and
//! bytecode) through MLIR, with one module per ATen op family; `specialize` turns a symbolic graph
//! into the concrete graph for one call's shapes; `padding` proves when a symbolic graph may run
//! on padded inputs (buckets); `numbers` lets it read integer scalars at run time.

pub mod cost;
pub mod ir;
pub mod lower;
pub mod numbers;
pub mod padding;
pub mod specialize;

pub use lower::{lower, LowerError, LowerErrorKind, Lowered};

/// The LLVM/MLIR release this build links (`llvm-config --version` at build time). The lowering's
/// output depends on it, so it is part of the executable cache key.
pub const MLIR_VERSION: &str = env!("TPU_DYNAMO_MLIR_VERSION");

/// blake3 of this build's compiler sources. The same graph lowered by different rules is a
/// different program, so this is part of the executable cache key too.
pub const SOURCE_HASH: &str = env!("TPU_DYNAMO_COMPILER_SOURCE_HASH");
