//! Device copies of resident inputs (parameters, buffers, constants), one per host tensor
//! version for the whole process. A graph whose sizes vary gets one executable per input shape
//! (each decode step with a growing cache is another), and every one of them takes the same
//! weights: with a copy per executable, a decode held its weights 32 times over, and going
//! round the steps read them from 32 places, beyond the CPU's caches (2.5x slower per step).
//!
//! The registry only finds copies; the graphs that use one own it (`Weak` here), so a copy
//! lives as long as some graph keeps it resident and no longer.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use tpu_dynamo_runtime::{Buffer, TensorSpec};

/// What a copy was made from: the host memory and its version, read as `spec`, on one target.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub target: usize,
    pub ptr: usize,
    pub version: i64,
    pub spec: TensorSpec,
}

struct Registry {
    copies: HashMap<Key, Weak<Buffer>>,
    /// Size at which dropped copies' entries are swept out.
    sweep_at: usize,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| {
    Mutex::new(Registry {
        copies: HashMap::new(),
        sweep_at: 256,
    })
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// The copy some graph made of `key`'s memory, if one still holds it.
pub fn find(key: &Key) -> Option<Arc<Buffer>> {
    registry().copies.get(key)?.upgrade()
}

/// Makes `copy` (of `key`'s memory) findable by other graphs.
pub fn publish(key: Key, copy: &Arc<Buffer>) {
    let mut r = registry();
    r.copies.insert(key, Arc::downgrade(copy));
    if r.copies.len() >= r.sweep_at {
        r.copies.retain(|_, copy| copy.strong_count() > 0);
        r.sweep_at = (2 * r.copies.len()).max(256);
    }
}
