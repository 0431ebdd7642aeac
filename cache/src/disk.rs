//! [`DiskCache`]: one `<key hex>.tpuexe` file per executable in a vetted directory.
//!
//! Shared by concurrent processes without locks: a writer fills a private temp file, fsyncs it
//! and renames it over the entry, so readers see a whole old file or a whole new one. Recency is
//! the file's mtime, refreshed on every hit; after each write the least recently used entries
//! are removed until the total fits `max_bytes`. Two processes evicting at once may remove a
//! little more than needed, never a file being read (an open file outlives its name).

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime};

use crate::dir::{create_temp, prepare, DiskConfig, Mode, TEMP_SUFFIX};
use crate::entry::{hash_file, Entry, PluginIdentity, Reject};
use crate::{Key, KeyBuilder};

const EXTENSION: &str = "tpuexe";
/// Remembered plugin-file hashes ([`DiskCache::file_hash`]); not entries, never evicted.
const FILE_HASH_EXTENSION: &str = "filehash";
/// Temp files older than this belong to a crashed writer and are swept.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// The result of [`DiskCache::get`].
#[derive(Debug)]
pub enum Lookup {
    Hit(Entry),
    Miss,
    /// A stored entry was unusable and has been removed (unless read-only); log the reason,
    /// then treat it as a miss.
    Rejected(Reject),
}

/// Why [`DiskCache::put`] stored nothing.
#[derive(Debug)]
pub enum PutError {
    /// The cache is off or read-only, or an earlier write failed: expected, nothing to log.
    NotWritable,
    /// The encoded entry alone exceeds `max_bytes`.
    TooLarge { bytes: u64, max_bytes: u64 },
    /// The entry's metadata cannot be encoded (over the size limit).
    Invalid(io::Error),
    /// The write failed (directory gone, disk full, ...). Writes stay off for this process
    /// afterwards, so this is reported once; log it.
    Io(io::Error),
}

impl std::fmt::Display for PutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PutError::NotWritable => f.write_str("the disk cache is not writable"),
            PutError::TooLarge { bytes, max_bytes } => {
                write!(
                    f,
                    "entry of {bytes} bytes exceeds TPU_DYNAMO_CACHE_MAX_BYTES={max_bytes}"
                )
            }
            PutError::Invalid(e) => write!(f, "cannot encode cache entry: {e}"),
            PutError::Io(e) => write!(
                f,
                "cannot write to the disk cache ({e}); executables are cached in memory only"
            ),
        }
    }
}

impl std::error::Error for PutError {}

/// Counters since [`DiskCache::open`]. `misses` includes `rejects`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub hits: u64,
    pub misses: u64,
    pub rejects: u64,
    pub writes: u64,
    pub write_errors: u64,
    pub evictions: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    rejects: AtomicU64,
    writes: AtomicU64,
    write_errors: AtomicU64,
    evictions: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

/// One stored entry as listed by [`DiskCache::list`] (not decoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub key_hex: String,
    pub path: PathBuf,
    pub bytes: u64,
    /// The mtime, which hits refresh.
    pub last_used: SystemTime,
}

/// A summary for logs and `tpu_dynamo.cache_info()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    pub dir: PathBuf,
    /// The effective mode (may be below the configured one; see `warning`).
    pub mode: Mode,
    pub max_bytes: u64,
    pub entries: usize,
    pub bytes: u64,
    pub warning: Option<String>,
}

/// The persistent executable cache. `Sync`: keep one per process.
pub struct DiskCache {
    dir: PathBuf,
    mode: Mode,
    max_bytes: u64,
    warning: Option<String>,
    /// Set by the first failed write so a broken directory costs one error, not one per compile.
    writes_failed: AtomicBool,
    counters: Counters,
}

impl DiskCache {
    /// Opens (creating it if read-write) the cache directory. Never fails: an unusable
    /// directory yields a cache that is off or read-only, with [`Self::warning`] saying why.
    pub fn open(config: DiskConfig) -> DiskCache {
        let (mode, warning) = prepare(&config);
        DiskCache {
            dir: config.dir,
            mode,
            max_bytes: config.max_bytes,
            warning,
            writes_failed: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// [`DiskConfig::from_env`] then [`Self::open`]; a bad variable leaves the cache off with
    /// the parse error as its warning.
    pub fn from_env() -> DiskCache {
        match DiskConfig::from_env() {
            Ok(config) => Self::open(config),
            Err(warning) => {
                let mut off = Self::open(DiskConfig {
                    mode: Mode::Off,
                    ..DiskConfig::new("")
                });
                off.warning = Some(warning);
                off
            }
        }
    }

    /// Why the cache runs below its configured mode, if it does; log it once.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds (or would hold) `key`'s entry.
    pub fn path(&self, key: &Key) -> PathBuf {
        self.dir.join(format!("{}.{EXTENSION}", key.to_hex()))
    }

    fn writable(&self) -> bool {
        self.mode == Mode::ReadWrite && !self.writes_failed.load(Relaxed)
    }

    /// Loads `key`'s entry if it is intact and was compiled by `plugin`. Anything else found
    /// under the key's name is removed and reported as [`Lookup::Rejected`].
    pub fn get(&self, key: &Key, plugin: &PluginIdentity) -> Lookup {
        if self.mode == Mode::Off {
            return Lookup::Miss;
        }
        let path = self.path(key);
        let mut file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.counters.misses.fetch_add(1, Relaxed);
                return Lookup::Miss;
            }
            Err(e) => return self.reject(&path, None, Reject::Unreadable(e.to_string())),
        };
        let meta = match file.metadata() {
            Ok(meta) => meta,
            Err(e) => return self.reject(&path, None, Reject::Unreadable(e.to_string())),
        };
        if meta.len() > self.max_bytes {
            return self.reject(&path, Some(&meta), Reject::TooLarge(meta.len()));
        }
        // The length is bounded just above; `take` guards against the file growing meanwhile.
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        if let Err(e) = (&mut file)
            .take(self.max_bytes.saturating_add(1))
            .read_to_end(&mut bytes)
        {
            return self.reject(&path, Some(&meta), Reject::Unreadable(e.to_string()));
        }
        match Entry::decode(&bytes, key, plugin) {
            Ok(entry) => {
                self.counters.hits.fetch_add(1, Relaxed);
                self.counters
                    .bytes_read
                    .fetch_add(bytes.len() as u64, Relaxed);
                if self.mode == Mode::ReadWrite {
                    // Recency for eviction. Best effort: a shared directory's files may be
                    // someone else's.
                    let _ = file.set_modified(SystemTime::now());
                }
                Lookup::Hit(entry)
            }
            Err(reason) => self.reject(&path, Some(&meta), reason),
        }
    }

    /// Counts a rejection and removes the file, but only if `path` still names the file that
    /// was read: a concurrent writer may have just renamed a good entry over it.
    fn reject(&self, path: &Path, read: Option<&fs::Metadata>, reason: Reject) -> Lookup {
        self.counters.rejects.fetch_add(1, Relaxed);
        self.counters.misses.fetch_add(1, Relaxed);
        if self.mode == Mode::ReadWrite {
            let id = |m: &fs::Metadata| (m.dev(), m.ino());
            let now = fs::symlink_metadata(path).ok().map(|m| id(&m));
            if now.is_some() && (read.is_none() || read.map(id) == now) {
                let _ = fs::remove_file(path);
            }
        }
        Lookup::Rejected(reason)
    }

    /// Stores `entry` under `key` atomically (temp file, fsync, rename), replacing any older
    /// one, then evicts least recently used entries past `max_bytes`.
    pub fn put(&self, key: &Key, entry: &Entry) -> Result<(), PutError> {
        if !self.writable() {
            return Err(PutError::NotWritable);
        }
        let path = self.path(key);
        let (temp, file) = create_temp(&self.dir, &key.to_hex()).map_err(|e| self.failed(e))?;
        let outcome = match write_synced(file, key, entry) {
            Ok(bytes) if bytes > self.max_bytes => Err(PutError::TooLarge {
                bytes,
                max_bytes: self.max_bytes,
            }),
            Ok(bytes) => fs::rename(&temp, &path)
                .map(|()| bytes)
                .map_err(|e| self.failed(e)),
            Err(e) => Err(self.failed(e)),
        };
        if outcome.is_err() {
            let _ = fs::remove_file(&temp);
        }
        let bytes = outcome?;
        // Make the rename itself durable; failing that loses nothing but durability.
        let _ = File::open(&self.dir).and_then(|d| d.sync_all());
        self.counters.writes.fetch_add(1, Relaxed);
        self.counters.bytes_written.fetch_add(bytes, Relaxed);
        self.evict(&path);
        Ok(())
    }

    /// blake3 hex of `path` (a PJRT plugin: hundreds of MB, read in ~150 ms), remembered in the
    /// cache directory under the file's identity (path, device, inode, size, mtime, ctime), so
    /// only the first process after an install or upgrade reads the whole file. A memo that is
    /// unreadable or malformed is recomputed; without a usable directory it is always computed.
    pub fn file_hash(&self, path: &Path) -> io::Result<String> {
        let Some(memo) = self.file_hash_memo(path)? else {
            return hash_file(path);
        };
        if let Ok(text) = fs::read_to_string(&memo) {
            if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(text);
            }
        }
        let hash = hash_file(path)?;
        if self.writable() {
            let stem = memo.file_stem().and_then(|s| s.to_str()).unwrap_or("filehash");
            if let Ok((temp, mut file)) = create_temp(&self.dir, stem) {
                if file.write_all(hash.as_bytes()).is_err() || fs::rename(&temp, &memo).is_err() {
                    let _ = fs::remove_file(&temp);
                }
            }
        }
        Ok(hash)
    }

    /// Where `path`'s hash is remembered, `None` when the cache is off.
    fn file_hash_memo(&self, path: &Path) -> io::Result<Option<PathBuf>> {
        if self.mode == Mode::Off {
            return Ok(None);
        }
        let meta = fs::metadata(path)?;
        let identity = KeyBuilder::new()
            .field(fs::canonicalize(path)?.as_os_str().as_bytes())
            .field(&meta.dev().to_le_bytes())
            .field(&meta.ino().to_le_bytes())
            .field(&meta.size().to_le_bytes())
            .field(&meta.mtime().to_le_bytes())
            .field(&meta.mtime_nsec().to_le_bytes())
            .field(&meta.ctime().to_le_bytes())
            .field(&meta.ctime_nsec().to_le_bytes())
            .finish();
        Ok(Some(self.dir.join(format!("{}.{FILE_HASH_EXTENSION}", identity.to_hex()))))
    }

    /// Classifies a write error; an I/O failure turns writes off for this process.
    fn failed(&self, e: io::Error) -> PutError {
        if e.kind() == io::ErrorKind::InvalidInput {
            return PutError::Invalid(e);
        }
        self.counters.write_errors.fetch_add(1, Relaxed);
        self.writes_failed.store(true, Relaxed);
        PutError::Io(e)
    }

    /// Removes least recently used entries (never `keep`, the one just written) until the
    /// total fits, and sweeps stale temp files.
    fn evict(&self, keep: &Path) {
        let mut files = self.scan(true);
        let mut total: u64 = files.iter().map(|f| f.bytes).sum();
        files.sort_by_key(|f| f.last_used);
        for file in files.iter().filter(|f| f.path != keep) {
            if total <= self.max_bytes {
                break;
            }
            match fs::remove_file(&file.path) {
                Ok(()) => {
                    self.counters.evictions.fetch_add(1, Relaxed);
                    total -= file.bytes;
                }
                // Another process evicted or replaced it first.
                Err(e) if e.kind() == io::ErrorKind::NotFound => total -= file.bytes,
                Err(_) => {}
            }
        }
    }

    /// The entries on disk (files named `<64 hex>.tpuexe`), in no particular order. With
    /// `sweep`, also removes temp files older than [`STALE_TEMP`].
    fn scan(&self, sweep: bool) -> Vec<Listed> {
        let Ok(dir) = fs::read_dir(&self.dir) else {
            return vec![];
        };
        let now = SystemTime::now();
        let mut found = vec![];
        for item in dir.flatten() {
            let name = item.file_name();
            let Some(name) = name.to_str() else { continue };
            let Ok(meta) = item.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let last_used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if sweep && name.starts_with('.') && name.ends_with(TEMP_SUFFIX) {
                if now
                    .duration_since(last_used)
                    .is_ok_and(|age| age > STALE_TEMP)
                {
                    let _ = fs::remove_file(item.path());
                }
                continue;
            }
            let Some(hex) = name
                .strip_suffix(EXTENSION)
                .and_then(|s| s.strip_suffix('.'))
            else {
                continue;
            };
            if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                found.push(Listed {
                    key_hex: hex.to_string(),
                    path: item.path(),
                    bytes: meta.len(),
                    last_used,
                });
            }
        }
        found
    }

    /// Stored entries, most recently used first.
    pub fn list(&self) -> Vec<Listed> {
        if self.mode == Mode::Off {
            return vec![];
        }
        let mut files = self.scan(false);
        files.sort_by_key(|f| std::cmp::Reverse(f.last_used));
        files
    }

    pub fn info(&self) -> Info {
        let files = self.list();
        Info {
            dir: self.dir.clone(),
            mode: self.mode,
            max_bytes: self.max_bytes,
            entries: files.len(),
            bytes: files.iter().map(|f| f.bytes).sum(),
            warning: self.warning.clone(),
        }
    }

    /// Removes every entry (and stale temp files); returns how many entries were removed.
    /// Refused when read-only; a no-op when off.
    pub fn clear(&self) -> io::Result<usize> {
        match self.mode {
            Mode::Off => return Ok(0),
            Mode::ReadOnly => {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the disk cache is read-only",
                ))
            }
            Mode::ReadWrite => {}
        }
        let mut removed = 0;
        for file in self.scan(true) {
            match fs::remove_file(&file.path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }

    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            hits: c.hits.load(Relaxed),
            misses: c.misses.load(Relaxed),
            rejects: c.rejects.load(Relaxed),
            writes: c.writes.load(Relaxed),
            write_errors: c.write_errors.load(Relaxed),
            evictions: c.evictions.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
        }
    }
}

/// Writes the encoded entry through a buffer and fsyncs it, returning its size.
fn write_synced(file: File, key: &Key, entry: &Entry) -> io::Result<u64> {
    let mut writer = BufWriter::new(file);
    let bytes = entry.write_to(key, &mut writer)?;
    writer
        .into_inner()
        .map_err(io::IntoInnerError::into_error)?
        .sync_all()?;
    Ok(bytes)
}
