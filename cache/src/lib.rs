//! tpu-dynamo-cache: the shape-keyed executable cache, in memory and on disk.
//!
//! A [`Key`] is a blake3 digest over length-prefixed fields, so `("ab", "c")` and `("a", "bc")`
//! never collide. A [`MemoryStore`] maps keys to shared values; callers keep one per process
//! (a `static`) so identical graphs compiled from different Dynamo frames share one executable.
//! A [`DiskCache`] persists serialized executables across processes (see `disk`, `entry` for the
//! file format and `dir` for the environment variables and the directory trust rules). This
//! crate stores opaque bytes; the caller serializes, deserializes and fills the
//! [`PluginIdentity`].

use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;

pub mod dir;
pub mod disk;
pub mod entry;

pub use dir::{DiskConfig, Mode};
pub use disk::{DiskCache, Info, Listed, Lookup, PutError, Stats};
pub use entry::{host_cpu_features, hash_file, Entry, PluginIdentity, Reject, TensorSig};

/// A 32-byte cache key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(pub [u8; 32]);

impl Key {
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

/// Builds a [`Key`] from an ordered list of fields.
#[derive(Default)]
pub struct KeyBuilder(blake3::Hasher);

impl KeyBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one field; its length goes first so field boundaries are part of the key.
    pub fn field(mut self, bytes: &[u8]) -> Self {
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }

    pub fn finish(self) -> Key {
        Key(*self.0.finalize().as_bytes())
    }
}

/// A process-wide in-memory map from [`Key`] to a cheaply clonable value (an `Arc`).
pub struct MemoryStore<V> {
    map: DashMap<Key, V>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl<V: Clone> Default for MemoryStore<V> {
    fn default() -> Self {
        MemoryStore { map: DashMap::new(), hits: AtomicU64::new(0), misses: AtomicU64::new(0) }
    }
}

impl<V: Clone> MemoryStore<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Returns the stored value for `key` (a hit) or stores what `make` builds (a miss).
    ///
    /// `make` runs without any lock held, so two threads missing the same key may both build;
    /// the first to finish wins and both get its value. Compiles are idempotent, and holding a
    /// shard lock across a compile of seconds would stall unrelated keys.
    pub fn get_or_try_insert<E>(&self, key: Key, make: impl FnOnce() -> Result<V, E>) -> Result<(V, bool), E> {
        if let Some(v) = self.map.get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((v.clone(), true));
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let value = make()?;
        Ok((self.map.entry(key).or_insert(value).clone(), false))
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// Drops every entry and zeroes the counters.
    pub fn clear(&self) {
        self.map.clear();
        self.hits.store(0, Ordering::Relaxed);
        self.misses.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_boundaries_are_part_of_the_key() {
        let a = KeyBuilder::new().field(b"ab").field(b"c").finish();
        let b = KeyBuilder::new().field(b"a").field(b"bc").finish();
        assert_ne!(a, b);
        assert_eq!(a, KeyBuilder::new().field(b"ab").field(b"c").finish());
    }

    #[test]
    fn second_lookup_hits_and_errors_store_nothing() {
        let store = MemoryStore::<u32>::new();
        let k = KeyBuilder::new().field(b"k").finish();
        assert_eq!(store.get_or_try_insert::<()>(k, || Err(())), Err(()));
        assert!(store.is_empty());
        assert_eq!(store.get_or_try_insert::<()>(k, || Ok(7)), Ok((7, false)));
        assert_eq!(store.get_or_try_insert::<()>(k, || Ok(8)), Ok((7, true)));
        assert_eq!((store.hits(), store.misses()), (1, 2));
    }
}
