//! Process-wide counters behind `tpu_dynamo.stats()`; relaxed atomics, read as a snapshot.
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

#[derive(Default)]
pub struct Stats {
    pub compiles: AtomicU64,
    pub memory_hits: AtomicU64,
    pub compile_nanos: AtomicU64,
    pub lower_nanos: AtomicU64,
    pub executions: AtomicU64,
    pub execute_nanos: AtomicU64,
    pub uploads: AtomicU64,
    /// Resident inputs whose device buffer is the host tensor's own memory (CPU plugins).
    pub uploads_in_place: AtomicU64,
    /// Uploads that were a small input copied into the buffer its graph keeps for it.
    pub uploads_staged: AtomicU64,
    pub resident_hits: AtomicU64,
    /// Resident inputs another graph had uploaded already (the same host tensor version).
    pub resident_shared_hits: AtomicU64,
    /// Inputs that were a host tensor viewing an executable buffer (no upload).
    pub view_hits: AtomicU64,
    /// Inputs in a GPU's memory read where they are (a CUDA tensor's view; no copy).
    pub device_views: AtomicU64,
    /// Packed inputs read where they lie, in the executable buffer behind the host tensor (a
    /// dynamic cache's K or V fed back in; no copy).
    pub packed_in_place: AtomicU64,
    /// Inputs updated in place: left where the executable wrote them (host tensor re-pointed or
    /// already there) / copied back into the host tensor.
    pub updates_in_place: AtomicU64,
    pub updates_copied: AtomicU64,
    /// Disk cache lookups that loaded an executable (no compile).
    pub disk_hits: AtomicU64,
    /// Disk cache lookups that found nothing usable; includes `disk_rejects`.
    pub disk_misses: AtomicU64,
    /// Entries found but unusable (damaged, foreign, undeserializable), logged and recompiled.
    pub disk_rejects: AtomicU64,
    pub disk_writes: AtomicU64,
    /// Serialized executable bytes loaded / stored.
    pub disk_bytes_read: AtomicU64,
    pub disk_bytes_written: AtomicU64,
    /// Converted graphs found on disk by their Dynamo graph (`graph_cache.py`: no AOTAutograd,
    /// no conversion), not found (`graph_rejects` included), found damaged, and stored.
    pub graph_hits: AtomicU64,
    pub graph_misses: AtomicU64,
    pub graph_rejects: AtomicU64,
    pub graph_writes: AtomicU64,
    /// Disk lookups including deserialize-and-load onto the device.
    pub load_nanos: AtomicU64,
    /// Serializing and writing new entries.
    pub store_nanos: AtomicU64,
    /// Building the plugin identity (hashing the plugin file), once per process.
    pub identity_nanos: AtomicU64,
    /// Symbolic graphs converted (once each) and handed to Rust.
    pub symbolic_graphs: AtomicU64,
    /// Concrete graphs made from a symbolic one, and the time that took (compiles excluded).
    pub specializations: AtomicU64,
    pub specialize_nanos: AtomicU64,
    /// First executes run on zeros in the background (`warm_up.rs`), and the time they took.
    pub warm_ups: AtomicU64,
    pub warm_up_nanos: AtomicU64,
}

pub static STATS: Stats = Stats {
    compiles: AtomicU64::new(0),
    memory_hits: AtomicU64::new(0),
    compile_nanos: AtomicU64::new(0),
    lower_nanos: AtomicU64::new(0),
    executions: AtomicU64::new(0),
    execute_nanos: AtomicU64::new(0),
    uploads: AtomicU64::new(0),
    uploads_in_place: AtomicU64::new(0),
    uploads_staged: AtomicU64::new(0),
    resident_hits: AtomicU64::new(0),
    resident_shared_hits: AtomicU64::new(0),
    disk_hits: AtomicU64::new(0),
    disk_misses: AtomicU64::new(0),
    disk_rejects: AtomicU64::new(0),
    disk_writes: AtomicU64::new(0),
    disk_bytes_read: AtomicU64::new(0),
    disk_bytes_written: AtomicU64::new(0),
    graph_hits: AtomicU64::new(0),
    graph_misses: AtomicU64::new(0),
    graph_rejects: AtomicU64::new(0),
    graph_writes: AtomicU64::new(0),
    load_nanos: AtomicU64::new(0),
    store_nanos: AtomicU64::new(0),
    identity_nanos: AtomicU64::new(0),
    symbolic_graphs: AtomicU64::new(0),
    specializations: AtomicU64::new(0),
    specialize_nanos: AtomicU64::new(0),
    view_hits: AtomicU64::new(0),
    device_views: AtomicU64::new(0),
    packed_in_place: AtomicU64::new(0),
    updates_in_place: AtomicU64::new(0),
    updates_copied: AtomicU64::new(0),
    warm_ups: AtomicU64::new(0),
    warm_up_nanos: AtomicU64::new(0),
};

pub fn add_time(counter: &AtomicU64, d: Duration) {
    counter.fetch_add(d.as_nanos() as u64, Relaxed);
}

impl Stats {
    fn all(&self) -> [(&'static str, &AtomicU64); 34] {
        [
            ("compiles", &self.compiles),
            ("memory_hits", &self.memory_hits),
            ("compile_seconds", &self.compile_nanos),
            ("lower_seconds", &self.lower_nanos),
            ("executions", &self.executions),
            ("execute_seconds", &self.execute_nanos),
            ("uploads", &self.uploads),
            ("uploads_in_place", &self.uploads_in_place),
            ("uploads_staged", &self.uploads_staged),
            ("resident_hits", &self.resident_hits),
            ("resident_shared_hits", &self.resident_shared_hits),
            ("view_hits", &self.view_hits),
            ("device_views", &self.device_views),
            ("packed_in_place", &self.packed_in_place),
            ("updates_in_place", &self.updates_in_place),
            ("updates_copied", &self.updates_copied),
            ("disk_hits", &self.disk_hits),
            ("disk_misses", &self.disk_misses),
            ("disk_rejects", &self.disk_rejects),
            ("disk_writes", &self.disk_writes),
            ("disk_bytes_read", &self.disk_bytes_read),
            ("disk_bytes_written", &self.disk_bytes_written),
            ("graph_hits", &self.graph_hits),
            ("graph_misses", &self.graph_misses),
            ("graph_rejects", &self.graph_rejects),
            ("graph_writes", &self.graph_writes),
            ("load_seconds", &self.load_nanos),
            ("store_seconds", &self.store_nanos),
            ("plugin_identity_seconds", &self.identity_nanos),
            ("symbolic_graphs", &self.symbolic_graphs),
            ("specializations", &self.specializations),
            ("specialize_seconds", &self.specialize_nanos),
            ("warm_ups", &self.warm_ups),
            ("warm_up_seconds", &self.warm_up_nanos),
        ]
    }

    /// `(name, value)` pairs; `*_seconds` entries hold nanoseconds.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        self.all().into_iter().map(|(name, c)| (name, c.load(Relaxed))).collect()
    }

    pub fn reset(&self) {
        for (_, c) in self.all() {
            c.store(0, Relaxed);
        }
    }
}
