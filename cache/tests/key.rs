//! The cache key changes when any of its fields changes, and a disk entry is only found under
//! the exact key it was stored with.

mod common;

use common::{entry, plugin};
use tpu_dynamo_cache::{DiskCache, DiskConfig, Key, KeyBuilder, Lookup};

/// The fields the python crate keys on: canonical graph, plugin identity, compile options and
/// the cache version.
const FIELDS: [&[u8]; 4] = [
    b"graph f32[2,3] add",
    b"path=/p.so;pjrt_api=0.54",
    b"CompileOptions { .. }",
    b"v1",
];

fn build(fields: &[&[u8]]) -> Key {
    fields
        .iter()
        .fold(KeyBuilder::new(), |b, f| b.field(f))
        .finish()
}

#[test]
fn any_field_change_changes_the_key() {
    let base = build(&FIELDS);
    assert_eq!(base, build(&FIELDS));
    let mut keys = vec![base];
    for i in 0..FIELDS.len() {
        let appended = [FIELDS[i], b"x"].concat();
        for changed in [b"".as_slice(), &appended] {
            let mut fields = FIELDS;
            fields[i] = changed;
            keys.push(build(&fields));
        }
        let mut fewer = FIELDS.to_vec();
        fewer.remove(i);
        keys.push(build(&fewer));
    }
    let mut unique = keys.clone();
    unique.sort_by_key(|k| k.0);
    unique.dedup();
    assert_eq!(
        unique.len(),
        keys.len(),
        "two field lists produced the same key"
    );
}

#[test]
fn entries_are_found_only_under_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(DiskConfig::new(dir.path()));
    let (stored, other) = (build(&FIELDS), build(&FIELDS[1..]));
    cache.put(&stored, &entry(1, 64)).unwrap();
    assert!(matches!(cache.get(&stored, &plugin()), Lookup::Hit(_)));
    assert!(matches!(cache.get(&other, &plugin()), Lookup::Miss));
}
