//! Where the disk cache lives, how it may be used, and whether its directory can be trusted.
//!
//! Environment (read by [`DiskConfig::from_env`]):
//!
//! | variable | meaning |
//! |---|---|
//! | `TPU_DYNAMO_CACHE` | `1`/`on` (default): read and write; `readonly`/`ro`: read only; `0`/`off`: no disk cache |
//! | `TPU_DYNAMO_CACHE_DIR` | the directory; else `$XDG_CACHE_HOME/tpu_dynamo`, else `~/.cache/tpu_dynamo` |
//! | `TPU_DYNAMO_CACHE_MAX_BYTES` | size bound, bytes with an optional `K`/`M`/`G`/`T` (binary) suffix; default 2G |
//! | `TPU_DYNAMO_CACHE_SHARED` | `1`: trust a directory owned by another user or writable by group/others |
//!
//! Loading an executable runs its code, so a directory someone else can write to is refused
//! unless the user opts in: the checksum only detects damage, not a planted entry.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;

/// How the disk cache may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Off,
    /// Hits are served; nothing in the directory is created, touched or removed.
    ReadOnly,
    ReadWrite,
}

/// Settings for [`crate::DiskCache::open`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub mode: Mode,
    /// Bound on the total size of entries; least recently used ones are evicted past it.
    pub max_bytes: u64,
    /// Trust a directory owned by another user or writable by group/others.
    pub allow_shared: bool,
}

impl DiskConfig {
    /// Read-write at `dir` with the default bound.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DiskConfig {
            dir: dir.into(),
            mode: Mode::ReadWrite,
            max_bytes: DEFAULT_MAX_BYTES,
            allow_shared: false,
        }
    }

    /// Parses the process environment (see the module docs). `Err` is a warning to log once;
    /// the cache is then off.
    pub fn from_env() -> Result<DiskConfig, String> {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// [`Self::from_env`] over any variable lookup, so parsing is testable without touching
    /// the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<DiskConfig, String> {
        let text = |name: &str| {
            var(name)
                .map(|v| v.to_string_lossy().trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let mode = match text("TPU_DYNAMO_CACHE")
            .map(|v| v.to_ascii_lowercase())
            .as_deref()
        {
            None | Some("1" | "on" | "true" | "rw" | "readwrite") => Mode::ReadWrite,
            Some("0" | "off" | "false") => Mode::Off,
            Some("ro" | "readonly") => Mode::ReadOnly,
            Some(other) => {
                return Err(format!(
                    "TPU_DYNAMO_CACHE={other:?}: expected 1, 0 or readonly; disk cache off"
                ))
            }
        };
        let dir = var("TPU_DYNAMO_CACHE_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                // The XDG spec says to ignore a relative XDG_CACHE_HOME.
                let xdg = var("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .filter(|d| d.is_absolute());
                xdg.or_else(|| {
                    var("HOME")
                        .filter(|h| !h.is_empty())
                        .map(|h| PathBuf::from(h).join(".cache"))
                })
                .map(|base| base.join("tpu_dynamo"))
            });
        let dir = match (dir, mode) {
            (Some(dir), _) => dir,
            (None, Mode::Off) => PathBuf::new(),
            (None, _) => {
                return Err(
                    "no cache directory (set TPU_DYNAMO_CACHE_DIR or HOME); disk cache off".into(),
                )
            }
        };
        let max_bytes = match text("TPU_DYNAMO_CACHE_MAX_BYTES") {
            None => DEFAULT_MAX_BYTES,
            Some(v) => parse_size(&v)
                .ok_or_else(|| format!("TPU_DYNAMO_CACHE_MAX_BYTES={v:?}: expected a positive size like 2G; disk cache off"))?,
        };
        let allow_shared = text("TPU_DYNAMO_CACHE_SHARED").as_deref() == Some("1");
        Ok(DiskConfig {
            dir,
            mode,
            max_bytes,
            allow_shared,
        })
    }
}

/// `123`, `64K`, `512M`, `2G`, `1T` (powers of 1024); zero and overflow are rejected.
fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.char_indices().last()? {
        (i, c) if c.is_ascii_digit() => (&text[..=i], 0),
        (i, c) => (&text[..i], 10 * (1 + "KMGT".find(c.to_ascii_uppercase())?)),
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1 << shift).filter(|&n| n > 0)
}

/// Creates (read-write only) and vets `config.dir`. Returns the mode the cache can actually
/// run in and, if that is less than asked for, the one warning to log.
pub(crate) fn prepare(config: &DiskConfig) -> (Mode, Option<String>) {
    let dir = config.dir.display();
    if config.mode == Mode::Off {
        return (Mode::Off, None);
    }
    if config.mode == Mode::ReadWrite {
        if let Err(e) = DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&config.dir)
        {
            return (Mode::Off, Some(format!("cannot create cache directory {dir}: {e}; executables are cached in memory only")));
        }
    }
    let meta = match fs::metadata(&config.dir) {
        Ok(m) if m.is_dir() => m,
        Ok(_) => {
            return (
                Mode::Off,
                Some(format!(
                    "cache path {dir} is not a directory; disk cache off"
                )),
            )
        }
        Err(e) => {
            return (
                Mode::Off,
                Some(format!(
                    "cannot use cache directory {dir}: {e}; disk cache off"
                )),
            )
        }
    };
    if !config.allow_shared {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let why = if meta.uid() != me {
            Some(format!(
                "owned by uid {}, not by this user (uid {me})",
                meta.uid()
            ))
        } else if meta.mode() & 0o022 != 0 {
            Some(format!(
                "writable by group or others (mode {:o})",
                meta.mode() & 0o7777
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return (
                Mode::Off,
                Some(format!("refusing cache directory {dir}: {why}; set TPU_DYNAMO_CACHE_SHARED=1 to trust it")),
            );
        }
    }
    if config.mode == Mode::ReadWrite {
        let probe = create_temp(&config.dir, "probe").and_then(|(path, _)| fs::remove_file(path));
        if let Err(e) = probe {
            return (
                Mode::ReadOnly,
                Some(format!("cache directory {dir} is not writable ({e}); new executables are cached in memory only")),
            );
        }
    }
    (config.mode, None)
}

/// Suffix of in-progress files; entries only ever appear by renaming one of these.
pub(crate) const TEMP_SUFFIX: &str = ".tmp";

/// Creates a fresh `.{stem}.{pid}.{n}.tmp` (mode 0600) in `dir`. Names are unique per process
/// and `create_new` skips any left by a crashed process that had the same pid.
pub(crate) fn create_temp(dir: &Path, stem: &str) -> io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(".{stem}.{}.{n}{TEMP_SUFFIX}", std::process::id()));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("64k"), Some(64 << 10));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        for bad in ["", "0", "G", "2X", "-1", "1.5G", "99999999999T"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}
