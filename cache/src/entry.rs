//! The on-disk entry format: one serialized executable plus what it was compiled for.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! magic "TPUDYNEX" (8) | format version u32 | meta length u32 | meta | executable | blake3 (32)
//! ```
//!
//! `meta` is bincode (standard config, limited to [`META_LIMIT`]) of the key, the
//! [`PluginIdentity`] and the input/output signatures. The executable bytes are a raw tail whose
//! length is whatever the file holds, so the only length field that can drive an allocation is
//! inside `meta` and bincode's limit caps it; nothing is allocated from a length the file
//! cannot back. The checksum covers every byte before it. It detects damage, not tampering:
//! trust comes from the directory's ownership and mode (see `dir`).

use std::fmt;
use std::io::{self, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Key;

const MAGIC: [u8; 8] = *b"TPUDYNEX";
/// Bumped whenever the layout or the meta schema changes; other versions are rejected.
pub const FORMAT_VERSION: u32 = 1;
/// Upper bound on the encoded meta (identity strings and signatures are far smaller).
pub const META_LIMIT: usize = 1 << 20;
const HEADER_LEN: usize = 16;
const CHECKSUM_LEN: usize = 32;

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<META_LIMIT>()
}

/// What an executable was compiled by. An entry is only reused by the identical plugin build on
/// a host of the same kind, because serialized executables are not portable across either.
/// The caller fills it (the cache does not depend on the runtime crate).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginIdentity {
    /// blake3 hex of the plugin shared library ([`hash_file`]).
    pub library_hash: String,
    /// PJRT C API version, e.g. "0.54".
    pub pjrt_api_version: String,
    /// The plugin's `xla_version` attribute (empty if it reports none).
    pub xla_version: String,
    /// Platform name, e.g. "cpu" or "tpu".
    pub platform: String,
    /// The client's platform version string.
    pub platform_version: String,
    /// [`host_cpu_features`] for the CPU platform (XLA:CPU code uses the host's ISA
    /// extensions); empty for accelerators.
    pub cpu_features: String,
}

impl PluginIdentity {
    fn fields(&self) -> [(&'static str, &str); 6] {
        [
            ("library_hash", &self.library_hash),
            ("pjrt_api_version", &self.pjrt_api_version),
            ("xla_version", &self.xla_version),
            ("platform", &self.platform),
            ("platform_version", &self.platform_version),
            ("cpu_features", &self.cpu_features),
        ]
    }

    /// Names the first field where `stored` differs from `self`, for the rejection message.
    fn mismatch(&self, stored: &PluginIdentity) -> Option<&'static str> {
        self.fields()
            .into_iter()
            .zip(stored.fields())
            .find(|(a, b)| a.1 != b.1)
            .map(|(a, _)| a.0)
    }
}

/// One tensor of an executable's signature, kept opaque: the caller's dtype name and dims.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSig {
    pub dtype: String,
    pub dims: Vec<i64>,
}

impl TensorSig {
    pub fn new(dtype: impl Into<String>, dims: impl Into<Vec<i64>>) -> Self {
        TensorSig {
            dtype: dtype.into(),
            dims: dims.into(),
        }
    }
}

/// A cached executable: opaque serialized bytes plus what is needed to load and check them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub plugin: PluginIdentity,
    pub inputs: Vec<TensorSig>,
    pub outputs: Vec<TensorSig>,
    pub executable: Vec<u8>,
}

/// Everything but the executable, bincode-encoded.
#[derive(Serialize, Deserialize)]
struct Meta {
    key: [u8; 32],
    plugin: PluginIdentity,
    inputs: Vec<TensorSig>,
    outputs: Vec<TensorSig>,
}

/// Why a stored entry was not used. Every variant means the file was dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Shorter than the fixed header and checksum.
    Truncated(u64),
    WrongMagic,
    /// Written by another format version.
    ForeignVersion(u32),
    /// The checksum does not match the contents (truncation or corruption).
    Checksum,
    /// The checksum matches but the meta does not decode; says why.
    Malformed(String),
    /// The entry is bound to another key (a renamed or misplaced file).
    WrongKey,
    /// Compiled by a different plugin build or host; names the first differing field.
    OtherPlugin(&'static str),
    /// Larger than the cache may hold.
    TooLarge(u64),
    /// The file exists but could not be read.
    Unreadable(String),
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::Truncated(n) => write!(f, "truncated ({n} bytes)"),
            Reject::WrongMagic => f.write_str("not a tpu_dynamo cache entry (bad magic)"),
            Reject::ForeignVersion(v) => {
                write!(f, "format version {v}, this build reads {FORMAT_VERSION}")
            }
            Reject::Checksum => f.write_str("checksum mismatch (corrupted or truncated)"),
            Reject::Malformed(why) => write!(f, "malformed metadata: {why}"),
            Reject::WrongKey => f.write_str("entry belongs to a different key"),
            Reject::OtherPlugin(field) => write!(
                f,
                "compiled for a different plugin or host ({field} differs)"
            ),
            Reject::TooLarge(n) => write!(f, "{n} bytes exceeds the cache size limit"),
            Reject::Unreadable(why) => write!(f, "unreadable: {why}"),
        }
    }
}

impl Entry {
    /// Streams the encoded entry for `key` into `w`, returning the bytes written.
    pub fn write_to(&self, key: &Key, w: &mut impl Write) -> io::Result<u64> {
        let meta = Meta {
            key: key.0,
            plugin: self.plugin.clone(),
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
        };
        let invalid = |why: String| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cache entry metadata: {why}"),
            )
        };
        let meta = bincode::serde::encode_to_vec(&meta, bincode_config())
            .map_err(|e| invalid(e.to_string()))?;
        // The limit binds decoding only; refuse here what could never be read back.
        if meta.len() > META_LIMIT {
            return Err(invalid(format!(
                "{} bytes, over the {META_LIMIT} limit",
                meta.len()
            )));
        }
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..].copy_from_slice(&(meta.len() as u32).to_le_bytes());
        let mut hasher = blake3::Hasher::new();
        for part in [&header[..], &meta, &self.executable] {
            hasher.update(part);
            w.write_all(part)?;
        }
        w.write_all(hasher.finalize().as_bytes())?;
        Ok((HEADER_LEN + meta.len() + self.executable.len() + CHECKSUM_LEN) as u64)
    }

    /// Decodes `bytes` (a whole file) and checks that it belongs to `key` and was compiled by
    /// `plugin`. Never panics; allocations are bounded by `bytes.len()` and [`META_LIMIT`].
    pub fn decode(bytes: &[u8], key: &Key, plugin: &PluginIdentity) -> Result<Entry, Reject> {
        if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
            return Err(Reject::Truncated(bytes.len() as u64));
        }
        if bytes[..8] != MAGIC {
            return Err(Reject::WrongMagic);
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            return Err(Reject::ForeignVersion(version));
        }
        let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        if blake3::hash(body).as_bytes() != checksum {
            return Err(Reject::Checksum);
        }
        let meta_len = u32::from_le_bytes(body[12..16].try_into().expect("4 bytes")) as usize;
        let rest = &body[HEADER_LEN..];
        if meta_len > META_LIMIT || meta_len > rest.len() {
            return Err(Reject::Malformed(format!(
                "meta length {meta_len} out of bounds"
            )));
        }
        let (meta_bytes, executable) = rest.split_at(meta_len);
        let (meta, used): (Meta, usize) =
            bincode::serde::decode_from_slice(meta_bytes, bincode_config())
                .map_err(|e| Reject::Malformed(e.to_string()))?;
        if used != meta_len {
            return Err(Reject::Malformed(format!(
                "{} trailing meta bytes",
                meta_len - used
            )));
        }
        if meta.key != key.0 {
            return Err(Reject::WrongKey);
        }
        if let Some(field) = plugin.mismatch(&meta.plugin) {
            return Err(Reject::OtherPlugin(field));
        }
        Ok(Entry {
            plugin: meta.plugin,
            inputs: meta.inputs,
            outputs: meta.outputs,
            executable: executable.to_vec(),
        })
    }
}

/// blake3 hex of a file's contents (for [`PluginIdentity::library_hash`]); hash it once per
/// process, the plugin is tens of megabytes.
pub fn hash_file(path: &Path) -> io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(std::fs::File::open(path)?)?;
    Ok(hasher.finalize().to_hex().to_string())
}

/// The host CPU's feature flags, sorted and space-separated, from the first `flags` (x86) or
/// `Features` (arm) line of /proc/cpuinfo; empty if there is none. XLA:CPU executables use the
/// compiling host's ISA extensions, so they are only reused on hosts with the same set.
pub fn host_cpu_features() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        matches!(name.trim(), "flags" | "Features").then_some(value)
    });
    let mut flags: Vec<&str> = flags.unwrap_or_default().split_whitespace().collect();
    flags.sort_unstable();
    flags.dedup();
    flags.join(" ")
}
