//! The entry decoder on valid, damaged and hostile bytes. A counting allocator checks that no
//! input makes it allocate more than the input's size or the metadata limit.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{encode, entry, key, plugin, reseal, Rng};
use tpu_dynamo_cache::entry::{FORMAT_VERSION, META_LIMIT};
use tpu_dynamo_cache::{Entry, Reject};

/// Records the largest single allocation made by the current thread.
struct PeakAlloc;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = PEAK.try_with(|p| p.set(p.get().max(layout.size())));
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = PEAK.try_with(|p| p.set(p.get().max(layout.size())));
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = PEAK.try_with(|p| p.set(p.get().max(new_size)));
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Decodes against the fixtures' key and plugin, asserting the allocation bound.
fn decode(bytes: &[u8]) -> Result<Entry, Reject> {
    PEAK.with(|p| p.set(0));
    let result = Entry::decode(bytes, &key("k"), &plugin());
    let peak = PEAK.with(|p| p.get());
    assert!(
        peak <= bytes.len().max(META_LIMIT),
        "allocated {peak} bytes decoding {} bytes",
        bytes.len()
    );
    result
}

fn valid() -> Vec<u8> {
    encode(&key("k"), &entry(1, 300))
}

/// Offset of the first plugin string's length (after the 16-byte header and the 32-byte key).
const LIBRARY_HASH_LEN_AT: usize = 16 + 32;

/// Offset of the input list's length: after the six short plugin strings (1-byte lengths).
fn inputs_len_at() -> usize {
    let p = plugin();
    let strings = [
        &p.library_hash,
        &p.pjrt_api_version,
        &p.xla_version,
        &p.platform,
        &p.platform_version,
        &p.cpu_features,
    ];
    LIBRARY_HASH_LEN_AT + strings.iter().map(|s| 1 + s.len()).sum::<usize>()
}

/// Replaces the one-byte varint at `at` with `varint`, fixes the meta length and reseals.
fn splice_varint(at: usize, varint: &[u8]) -> Vec<u8> {
    let mut bytes = valid();
    bytes.splice(at..at + 1, varint.iter().copied());
    let meta_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) + varint.len() as u32 - 1;
    bytes[12..16].copy_from_slice(&meta_len.to_le_bytes());
    reseal(&mut bytes);
    bytes
}

fn set_meta_len(len: u32) -> Vec<u8> {
    let mut bytes = valid();
    bytes[12..16].copy_from_slice(&len.to_le_bytes());
    reseal(&mut bytes);
    bytes
}

fn malformed(bytes: &[u8]) {
    assert!(
        matches!(decode(bytes), Err(Reject::Malformed(_))),
        "{:?}",
        decode(bytes)
    );
}

#[test]
fn round_trip() {
    let e = entry(1, 300);
    assert_eq!(decode(&encode(&key("k"), &e)), Ok(e));
    let empty = entry(2, 0);
    assert_eq!(decode(&encode(&key("k"), &empty)), Ok(empty));
}

#[test]
fn damage_is_rejected() {
    let good = valid();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x40;
    assert_eq!(decode(&flipped), Err(Reject::Checksum));
    assert_eq!(decode(&good[..good.len() - 1]), Err(Reject::Checksum));
    assert_eq!(decode(&good[..40]), Err(Reject::Truncated(40)));
    assert_eq!(decode(&[]), Err(Reject::Truncated(0)));
    let mut magic = good.clone();
    magic[0] = b'X';
    assert_eq!(decode(&magic), Err(Reject::WrongMagic));
    let mut version = good.clone();
    version[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    assert_eq!(
        decode(&version),
        Err(Reject::ForeignVersion(FORMAT_VERSION + 1))
    );
}

#[test]
fn binding_to_key_and_plugin() {
    let good = valid();
    assert_eq!(
        Entry::decode(&good, &key("other"), &plugin()),
        Err(Reject::WrongKey)
    );
    let mut newer_xla = plugin();
    newer_xla.xla_version.push('+');
    assert_eq!(
        Entry::decode(&good, &key("k"), &newer_xla),
        Err(Reject::OtherPlugin("xla_version"))
    );
    let mut other_host = plugin();
    other_host.cpu_features = "sse2".into();
    assert_eq!(
        Entry::decode(&good, &key("k"), &other_host),
        Err(Reject::OtherPlugin("cpu_features"))
    );
}

#[test]
fn hostile_lengths_are_rejected_without_allocating() {
    malformed(&set_meta_len(u32::MAX));
    malformed(&set_meta_len(0));
    // The meta length swallows the executable: trailing bytes.
    let whole = valid().len() as u32 - 16 - 32;
    malformed(&set_meta_len(whole));
    // A string claiming 2^40 bytes, one claiming just under the limit, a list claiming 2^64 - 1.
    malformed(&splice_varint(
        LIBRARY_HASH_LEN_AT,
        &[[253].as_slice(), &(1u64 << 40).to_le_bytes()].concat(),
    ));
    malformed(&splice_varint(
        LIBRARY_HASH_LEN_AT,
        &[[252].as_slice(), &(META_LIMIT as u32 - 1).to_le_bytes()].concat(),
    ));
    malformed(&splice_varint(
        inputs_len_at(),
        &[[253].as_slice(), &u64::MAX.to_le_bytes()].concat(),
    ));
    // Sanity: the offsets point at the fields (a harmless same-length rewrite still decodes).
    assert!(decode(&splice_varint(inputs_len_at(), &[2])).is_ok());
}

#[test]
fn mutations_never_panic_or_over_allocate() {
    let good = valid();
    let mut rng = Rng(0x5eed);
    let mut reached_meta = 0;
    for i in 0..4000 {
        let mut bytes = good.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len());
            match rng.below(6) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes[at] = [0, 0xFB, 0xFC, 0xFD, 0xFE, 0xFF][rng.below(6)],
                2 => bytes.truncate(at),
                3 => bytes
                    .splice(at..at, (0..1 + rng.below(16)).map(|_| rng.next() as u8))
                    .for_each(drop),
                4 => bytes
                    .drain(at..(at + 1 + rng.below(16)).min(bytes.len()))
                    .for_each(drop),
                _ => bytes[12..16].copy_from_slice(&(rng.next() as u32 % 512).to_le_bytes()),
            }
            if bytes.len() < 48 {
                break;
            }
        }
        // Mostly reseal, so the mutation reaches the metadata decoder instead of the checksum.
        let sealed = i % 4 != 0 && bytes.len() >= 48;
        if sealed {
            reseal(&mut bytes);
        }
        match decode(&bytes) {
            Ok(_) if !sealed => assert_eq!(bytes, good, "damage passed the checksum"),
            Err(Reject::Malformed(_) | Reject::WrongKey | Reject::OtherPlugin(_)) => {
                reached_meta += 1
            }
            _ => {}
        }
    }
    assert!(
        reached_meta > 1000,
        "only {reached_meta} mutations reached the metadata decoder"
    );
    // Random bytes behind a valid header.
    for _ in 0..1000 {
        let mut bytes = good[..12].to_vec();
        bytes.extend((0..rng.below(600)).map(|_| rng.next() as u8));
        bytes.extend([0; 32]);
        reseal(&mut bytes);
        let _ = decode(&bytes);
    }
}
