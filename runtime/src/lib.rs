//! tpu-dynamo-runtime: a safe API over any PJRT plugin — find and load the plugin, create a
//! client, move tensors between host and device, compile StableHLO, execute, and (de)serialize
//! executables.
//!
//! Everything the plugin allocates is owned by an RAII handle, every plugin error becomes an
//! [`Error`], and arguments are checked before they reach the plugin, because a bad call into
//! XLA can abort the whole process. Plugins newer than the PJRT C API 0.54 that pjrt-sys was
//! generated from are supported (see `compat`): functions missing from an older plugin's table
//! return an error instead of being called.

mod buffer;
mod client;
mod compat;
pub mod discover;
mod env_flags;
mod error;
mod event;
mod executable;
pub mod host_kernels;
mod plugin;
mod tensor;

pub use buffer::{Buffer, Handle};
pub use client::{Client, ClientOptions, Device};
pub use error::{Error, ErrorCode, Result};
pub use executable::{CompileOptions, Executable, MemoryStats, Program, ProgramCode};
pub use plugin::{AttrValue, Plugin};
pub use tensor::{DType, TensorSpec};

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<Plugin>();
        send_sync::<Client>();
        send_sync::<Device>();
        send_sync::<Buffer>();
        send_sync::<Executable>();
    }
}
