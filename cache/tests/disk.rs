//! DiskCache behaviour: round trips, rejection of bad entries, directory trust, degradation,
//! eviction, configuration and concurrent writer processes.

mod common;

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{chown, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use common::{encode, entry, key, plugin, reseal};
use tpu_dynamo_cache::entry::FORMAT_VERSION;
use tpu_dynamo_cache::{DiskCache, DiskConfig, Lookup, Mode, PutError, Reject};

const NOBODY: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn open(dir: &Path) -> DiskCache {
    let cache = DiskCache::open(DiskConfig::new(dir));
    assert_eq!((cache.mode(), cache.warning()), (Mode::ReadWrite, None));
    cache
}

fn hit(lookup: Lookup) -> tpu_dynamo_cache::Entry {
    match lookup {
        Lookup::Hit(e) => e,
        other => panic!("expected a hit, got {other:?}"),
    }
}

/// The test binary re-run as a child executing only test `name`, with `env` set.
fn child(name: &str, env: &[(&str, &OsString)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--test-threads=1", "--nocapture"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

#[test]
fn round_trip_with_stats_list_info_and_clear() {
    let dir = temp_dir();
    let cache = open(&dir.path().join("c"));
    assert_eq!(fs::metadata(cache.dir()).unwrap().mode() & 0o777, 0o700);
    let (k, e) = (key("a"), entry(1, 1000));
    assert!(matches!(cache.get(&k, &plugin()), Lookup::Miss));
    cache.put(&k, &e).unwrap();
    assert_eq!(hit(cache.get(&k, &plugin())), e);
    assert!(matches!(cache.get(&key("b"), &plugin()), Lookup::Miss));
    let file_len = fs::metadata(cache.path(&k)).unwrap().len();
    assert_eq!(fs::metadata(cache.path(&k)).unwrap().mode() & 0o777, 0o600);

    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.rejects, stats.writes),
        (1, 2, 0, 1)
    );
    assert_eq!(
        (stats.bytes_written, stats.bytes_read),
        (file_len, file_len)
    );
    let listed = cache.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].key_hex.as_str(), listed[0].bytes),
        (k.to_hex().as_str(), file_len)
    );
    let info = cache.info();
    assert_eq!(
        (info.entries, info.bytes, info.mode),
        (1, file_len, Mode::ReadWrite)
    );
    // No temp files are left behind.
    assert_eq!(fs::read_dir(cache.dir()).unwrap().count(), 1);

    // A second process's view: a fresh cache on the same directory hits.
    assert_eq!(hit(open(cache.dir()).get(&k, &plugin())), e);
    assert_eq!(cache.clear().unwrap(), 1);
    assert!(matches!(cache.get(&k, &plugin()), Lookup::Miss));
}

#[test]
fn bad_entries_are_rejected_and_removed() {
    let dir = temp_dir();
    let cache = open(dir.path());
    let k = key("k");
    let good = encode(&k, &entry(1, 500));
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        b
    };
    let mut other_plugin = plugin();
    other_plugin.library_hash = "b".repeat(64);
    let cases: Vec<(&str, Vec<u8>, Reject)> = vec![
        ("corrupted byte", with(&|b| b[300] ^= 1), Reject::Checksum),
        (
            "truncated",
            good[..good.len() - 7].to_vec(),
            Reject::Checksum,
        ),
        (
            "truncated header",
            good[..10].to_vec(),
            Reject::Truncated(10),
        ),
        (
            "wrong magic",
            with(&|b| b[..8].copy_from_slice(b"PK\x03\x04....")),
            Reject::WrongMagic,
        ),
        (
            "foreign version",
            with(&|b| b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes())),
            Reject::ForeignVersion(FORMAT_VERSION + 1),
        ),
        (
            "wrong key",
            encode(&key("other"), &entry(1, 500)),
            Reject::WrongKey,
        ),
        (
            "other plugin",
            encode(
                &k,
                &tpu_dynamo_cache::Entry {
                    plugin: other_plugin,
                    ..entry(1, 500)
                },
            ),
            Reject::OtherPlugin("library_hash"),
        ),
        (
            "hostile meta length",
            with(&|b| {
                b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
                reseal(b)
            }),
            Reject::Malformed("meta length 4294967295 out of bounds".into()),
        ),
    ];
    for (i, (what, bytes, want)) in cases.into_iter().enumerate() {
        fs::write(cache.path(&k), bytes).unwrap();
        match cache.get(&k, &plugin()) {
            Lookup::Rejected(got) => assert_eq!(got, want, "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert!(!cache.path(&k).exists(), "{what}: file kept");
        assert_eq!(cache.stats().rejects, i as u64 + 1);
    }
    // Too large for the configured bound.
    let small = DiskCache::open(DiskConfig {
        max_bytes: 100,
        ..DiskConfig::new(dir.path())
    });
    fs::write(cache.path(&k), &good).unwrap();
    assert!(matches!(
        small.get(&k, &plugin()),
        Lookup::Rejected(Reject::TooLarge(_))
    ));
    assert!(!cache.path(&k).exists());
}

#[test]
fn read_only_serves_hits_and_changes_nothing() {
    let dir = temp_dir();
    let (k, e) = (key("k"), entry(1, 100));
    open(dir.path()).put(&k, &e).unwrap();
    let before = fs::metadata(dir.path().join(format!("{}.tpuexe", k.to_hex())))
        .unwrap()
        .modified()
        .unwrap();
    let ro = DiskCache::open(DiskConfig {
        mode: Mode::ReadOnly,
        ..DiskConfig::new(dir.path())
    });
    assert_eq!((ro.mode(), ro.warning()), (Mode::ReadOnly, None));
    assert_eq!(hit(ro.get(&k, &plugin())), e);
    assert_eq!(
        fs::metadata(ro.path(&k)).unwrap().modified().unwrap(),
        before
    );
    assert!(matches!(
        ro.put(&key("new"), &e),
        Err(PutError::NotWritable)
    ));
    assert!(ro.clear().is_err());
    let mut other = plugin();
    other.platform = "tpu".into();
    assert!(matches!(
        ro.get(&k, &other),
        Lookup::Rejected(Reject::OtherPlugin("platform"))
    ));
    assert!(ro.path(&k).exists(), "read-only must not remove files");
    // A missing directory is not created.
    let absent = DiskCache::open(DiskConfig {
        mode: Mode::ReadOnly,
        ..DiskConfig::new(dir.path().join("absent"))
    });
    assert_eq!(absent.mode(), Mode::Off);
    assert!(absent.warning().is_some());
}

#[test]
fn off_does_nothing() {
    let dir = temp_dir();
    let off = DiskCache::open(DiskConfig {
        mode: Mode::Off,
        ..DiskConfig::new(dir.path().join("c"))
    });
    assert_eq!((off.mode(), off.warning()), (Mode::Off, None));
    assert!(matches!(
        off.put(&key("k"), &entry(1, 10)),
        Err(PutError::NotWritable)
    ));
    assert!(matches!(off.get(&key("k"), &plugin()), Lookup::Miss));
    assert!(!dir.path().join("c").exists());
}

#[test]
fn group_or_world_writable_dir_is_refused_unless_shared() {
    let dir = temp_dir();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let refused = DiskCache::open(DiskConfig::new(dir.path()));
    assert_eq!(refused.mode(), Mode::Off);
    assert!(
        refused
            .warning()
            .unwrap()
            .contains("writable by group or others (mode 777)"),
        "{:?}",
        refused.warning()
    );
    assert!(refused
        .warning()
        .unwrap()
        .contains("TPU_DYNAMO_CACHE_SHARED=1"));
    assert!(matches!(
        refused.put(&key("k"), &entry(1, 10)),
        Err(PutError::NotWritable)
    ));
    let shared = DiskCache::open(DiskConfig {
        allow_shared: true,
        ..DiskConfig::new(dir.path())
    });
    assert_eq!((shared.mode(), shared.warning()), (Mode::ReadWrite, None));
}

#[test]
fn dir_owned_by_another_user_is_refused_unless_shared() {
    if !is_root() {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let dir = temp_dir();
    chown(dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let refused = DiskCache::open(DiskConfig::new(dir.path()));
    assert_eq!(refused.mode(), Mode::Off);
    assert!(
        refused.warning().unwrap().contains("owned by uid 65534"),
        "{:?}",
        refused.warning()
    );
    let shared = DiskCache::open(DiskConfig {
        allow_shared: true,
        ..DiskConfig::new(dir.path())
    });
    assert_eq!(shared.mode(), Mode::ReadWrite);
}

#[test]
fn uncreatable_dir_means_memory_only() {
    let dir = temp_dir();
    let file = dir.path().join("file");
    fs::write(&file, b"").unwrap();
    let cache = DiskCache::open(DiskConfig::new(file.join("c")));
    assert_eq!(cache.mode(), Mode::Off);
    assert!(
        cache
            .warning()
            .unwrap()
            .contains("cannot create cache directory"),
        "{:?}",
        cache.warning()
    );
    assert!(matches!(
        cache.put(&key("k"), &entry(1, 10)),
        Err(PutError::NotWritable)
    ));
}

/// Child half of `unwritable_dir_is_read_only`: runs as the directory's owner, who may read
/// but not write it.
#[test]
fn unwritable_child() {
    let Some(dir) = std::env::var_os("TPU_DYNAMO_TEST_UNWRITABLE") else {
        return;
    };
    let cache = DiskCache::open(DiskConfig::new(PathBuf::from(dir)));
    assert_eq!(cache.mode(), Mode::ReadOnly);
    assert!(
        cache.warning().unwrap().contains("is not writable"),
        "{:?}",
        cache.warning()
    );
    assert_eq!(hit(cache.get(&key("k"), &plugin())), entry(1, 100));
    assert!(matches!(
        cache.put(&key("new"), &entry(2, 100)),
        Err(PutError::NotWritable)
    ));
}

#[test]
fn unwritable_dir_is_read_only() {
    let dir = temp_dir();
    let cache_dir = dir.path().join("c");
    open(&cache_dir).put(&key("k"), &entry(1, 100)).unwrap();
    let mut cmd = child(
        "unwritable_child",
        &[("TPU_DYNAMO_TEST_UNWRITABLE", &cache_dir.clone().into())],
    );
    if is_root() {
        // Root writes anywhere, so the child drops to nobody, who owns the directory.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        for path in [
            cache_dir.clone(),
            cache_dir.join(format!("{}.tpuexe", key("k").to_hex())),
        ] {
            chown(&path, Some(NOBODY), Some(NOBODY)).unwrap();
        }
        // SAFETY: setgid/setuid are async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgid(NOBODY) != 0 || libc::setuid(NOBODY) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    fs::set_permissions(&cache_dir, fs::Permissions::from_mode(0o500)).unwrap();
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn failed_write_is_reported_once_then_writes_stop() {
    let dir = temp_dir();
    let cache_dir = dir.path().join("c");
    let cache = open(&cache_dir);
    fs::remove_dir(&cache_dir).unwrap();
    fs::write(&cache_dir, b"not a directory").unwrap();
    assert!(matches!(
        cache.put(&key("a"), &entry(1, 10)),
        Err(PutError::Io(_))
    ));
    assert!(matches!(
        cache.put(&key("b"), &entry(1, 10)),
        Err(PutError::NotWritable)
    ));
    assert_eq!((cache.stats().write_errors, cache.stats().writes), (1, 0));
}

#[test]
fn too_large_entry_is_not_stored() {
    let dir = temp_dir();
    let cache = DiskCache::open(DiskConfig {
        max_bytes: 1000,
        ..DiskConfig::new(dir.path())
    });
    let err = cache.put(&key("k"), &entry(1, 2000)).unwrap_err();
    assert!(
        matches!(
            err,
            PutError::TooLarge {
                max_bytes: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    // Writes stay on: size is the entry's problem, not the directory's.
    cache.put(&key("k"), &entry(1, 100)).unwrap();
}

fn set_age(path: &Path, seconds_ago: u64) {
    let file = fs::File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - Duration::from_secs(seconds_ago))
        .unwrap();
}

#[test]
fn eviction_removes_least_recently_used_down_to_the_bound() {
    let dir = temp_dir();
    let one = encode(&key("a"), &entry(0, 1000)).len() as u64;
    let max_bytes = one * 7 / 2;
    let cache = DiskCache::open(DiskConfig {
        max_bytes,
        ..DiskConfig::new(dir.path())
    });
    let [a, b, c, d] = ["a", "b", "c", "d"].map(key);
    for (i, k) in [a, b, c].iter().enumerate() {
        cache.put(k, &entry(i as u64, 1000)).unwrap();
        set_age(&cache.path(k), 300 - 100 * i as u64);
    }
    // A stale temp file from a crashed writer is swept by the next write.
    let stale = dir.path().join(".dead.1.0.tmp");
    fs::write(&stale, b"partial").unwrap();
    set_age(&stale, 7200);
    // A hit makes `a`, the oldest write, the most recently used.
    hit(cache.get(&a, &plugin()));
    cache.put(&d, &entry(3, 1000)).unwrap();
    // Compared as sets: a write's kernel-set mtime is coarser than a hit's explicit one.
    let mut left: Vec<String> = cache.list().into_iter().map(|f| f.key_hex).collect();
    let mut want = [a, c, d].map(|k| k.to_hex());
    left.sort();
    want.sort();
    assert_eq!(left, want);
    assert!(cache.info().bytes <= max_bytes);
    assert_eq!(cache.stats().evictions, 1);
    assert!(!stale.exists());
}

#[test]
fn config_from_environment() {
    let parse = |vars: &[(&str, &str)]| {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        DiskConfig::from_vars(|k| vars.get(k).cloned())
    };
    let home = parse(&[("HOME", "/home/u")]).unwrap();
    assert_eq!(home, DiskConfig::new("/home/u/.cache/tpu_dynamo"));
    assert_eq!(
        parse(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")])
            .unwrap()
            .dir,
        PathBuf::from("/x/tpu_dynamo")
    );
    assert_eq!(
        parse(&[("HOME", "/h"), ("XDG_CACHE_HOME", "rel")])
            .unwrap()
            .dir,
        PathBuf::from("/h/.cache/tpu_dynamo")
    );
    let full = parse(&[
        ("XDG_CACHE_HOME", "/x"),
        ("TPU_DYNAMO_CACHE_DIR", "/d"),
        ("TPU_DYNAMO_CACHE", "readonly"),
        ("TPU_DYNAMO_CACHE_MAX_BYTES", "512M"),
        ("TPU_DYNAMO_CACHE_SHARED", "1"),
    ])
    .unwrap();
    assert_eq!(
        full,
        DiskConfig {
            dir: "/d".into(),
            mode: Mode::ReadOnly,
            max_bytes: 512 << 20,
            allow_shared: true
        }
    );
    assert_eq!(parse(&[("TPU_DYNAMO_CACHE", "0")]).unwrap().mode, Mode::Off);
    assert!(parse(&[]).unwrap_err().contains("no cache directory"));
    assert!(parse(&[("HOME", "/h"), ("TPU_DYNAMO_CACHE", "maybe")])
        .unwrap_err()
        .contains("TPU_DYNAMO_CACHE"));
    assert!(parse(&[("HOME", "/h"), ("TPU_DYNAMO_CACHE_MAX_BYTES", "lots")]).is_err());
}

/// Child half of `concurrent_writer_processes_never_tear_an_entry`: two threads each write
/// and read the shared key repeatedly.
#[test]
fn writer_child() {
    let Some(dir) = std::env::var_os("TPU_DYNAMO_TEST_WRITER") else {
        return;
    };
    let seed: u64 = std::env::var("TPU_DYNAMO_TEST_SEED")
        .unwrap()
        .parse()
        .unwrap();
    let cache = DiskCache::open(DiskConfig::new(PathBuf::from(dir)));
    std::thread::scope(|s| {
        for t in 0..2 {
            let cache = &cache;
            s.spawn(move || {
                for i in 0..20 {
                    cache
                        .put(&key("shared"), &entry(seed * 100 + t * 50 + i, 200_000))
                        .unwrap();
                    assert!(!matches!(
                        cache.get(&key("shared"), &plugin()),
                        Lookup::Rejected(_)
                    ));
                }
            });
        }
    });
}

#[test]
fn concurrent_writer_processes_never_tear_an_entry() {
    let dir = temp_dir();
    let cache = open(dir.path());
    let dir_arg: OsString = dir.path().into();
    let mut children: Vec<_> = (0..4u64)
        .map(|seed| {
            let seed = OsString::from(seed.to_string());
            child(
                "writer_child",
                &[
                    ("TPU_DYNAMO_TEST_WRITER", &dir_arg),
                    ("TPU_DYNAMO_TEST_SEED", &seed),
                ],
            )
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    // Read while they write: every lookup is a miss or a whole entry.
    while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        if let Lookup::Rejected(why) = cache.get(&key("shared"), &plugin()) {
            panic!("torn entry: {why}");
        }
    }
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    }
    let last = hit(cache.get(&key("shared"), &plugin()));
    assert!((0..400).any(|s| last == entry(s, 200_000)));
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        1,
        "temp files left behind"
    );
}

#[test]
fn file_hash_is_remembered_by_file_identity() {
    let dir = temp_dir();
    let cache = open(&dir.path().join("c"));
    let lib = dir.path().join("plugin.so");
    fs::write(&lib, b"first build of the plugin").unwrap();
    let first = cache.file_hash(&lib).unwrap();
    assert_eq!(first, tpu_dynamo_cache::hash_file(&lib).unwrap());
    let memo: Vec<PathBuf> = fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "filehash"))
        .collect();
    assert_eq!(memo.len(), 1, "one memo file");
    assert!(cache.list().is_empty(), "a memo is not a cache entry");

    // A later process trusts the memo instead of reading the file: prove it by planting one.
    let planted = "ab".repeat(32);
    fs::write(&memo[0], &planted).unwrap();
    assert_eq!(open(cache.dir()).file_hash(&lib).unwrap(), planted);

    // A malformed memo is recomputed and rewritten.
    fs::write(&memo[0], "not a hash").unwrap();
    assert_eq!(cache.file_hash(&lib).unwrap(), first);
    assert_eq!(fs::read_to_string(&memo[0]).unwrap(), first);

    // A new build of the file (new size and mtime) is hashed afresh.
    fs::write(&lib, b"second, longer build of the plugin").unwrap();
    let second = cache.file_hash(&lib).unwrap();
    assert_ne!(second, first);
    assert_eq!(second, tpu_dynamo_cache::hash_file(&lib).unwrap());

    // With the cache off nothing is written and the hash is computed.
    let off = DiskCache::open(DiskConfig { mode: Mode::Off, ..DiskConfig::new(dir.path().join("off")) });
    assert_eq!(off.file_hash(&lib).unwrap(), second);
    assert!(!dir.path().join("off").exists());
}
