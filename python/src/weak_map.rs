//! A process-wide map to objects that others own: it finds an object while something keeps it
//! alive and never keeps one alive itself.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

pub struct WeakMap<K, V> {
    entries: Mutex<Entries<K, V>>,
}

struct Entries<K, V> {
    map: HashMap<K, Weak<V>>,
    /// Size at which entries whose objects are gone are swept out.
    sweep_at: usize,
}

const FIRST_SWEEP: usize = 256;

impl<K: Eq + Hash, V> WeakMap<K, V> {
    pub fn new() -> Self {
        WeakMap {
            entries: Mutex::new(Entries {
                map: HashMap::new(),
                sweep_at: FIRST_SWEEP,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Entries<K, V>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The object `key` names, if something still keeps it.
    pub fn get(&self, key: &K) -> Option<Arc<V>> {
        self.lock().map.get(key)?.upgrade()
    }

    /// Points `key` at `value`.
    pub fn insert(&self, key: K, value: &Arc<V>) {
        let mut e = self.lock();
        e.map.insert(key, Arc::downgrade(value));
        if e.map.len() >= e.sweep_at {
            e.map.retain(|_, v| v.strong_count() > 0);
            e.sweep_at = (2 * e.map.len()).max(FIRST_SWEEP);
        }
    }

    /// Drops `key`'s entry if its object is gone (not a live one registered under it since).
    pub fn forget_if_gone(&self, key: &K) {
        let mut e = self.lock();
        if e.map.get(key).is_some_and(|v| v.strong_count() == 0) {
            e.map.remove(key);
        }
    }
}
