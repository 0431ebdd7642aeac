//! One error type for the whole crate, so callers see plugin failures, missing plugins and our own
//! argument checks through a single `Result`.

use std::fmt;
use std::path::PathBuf;

/// The status codes a PJRT plugin reports (the absl/gRPC canonical codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl ErrorCode {
    /// Maps a raw `PJRT_Error_Code`; a code this crate does not know becomes `Unknown`.
    pub(crate) fn from_raw(code: u32) -> Self {
        use ErrorCode::*;
        match code {
            1 => Cancelled,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            _ => Unknown,
        }
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The plugin returned an error (compile failure, bad buffer, ...).
    Pjrt { code: ErrorCode, message: String },
    /// Discovery found no usable plugin; `searched` lists every place looked at.
    PluginNotFound { searched: Vec<String> },
    /// A plugin file exists but could not be loaded or initialized.
    Load { path: PathBuf, message: String },
    /// A caller error caught before anything reached the plugin.
    InvalidArgument(String),
}

/// Shorthand used by every fallible function of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument(message.into())
    }

    /// The error for a function the loaded plugin's API table is too old to contain.
    pub(crate) fn unimplemented(function: &str, version: (i32, i32)) -> Self {
        Error::Pjrt {
            code: ErrorCode::Unimplemented,
            message: format!(
                "{function} is not provided by this PJRT plugin (API {}.{}); use a newer plugin",
                version.0, version.1
            ),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Pjrt { code, message } => write!(f, "PJRT error ({code:?}): {message}"),
            Error::PluginNotFound { searched } => {
                writeln!(f, "no PJRT plugin found. Looked at:")?;
                for place in searched {
                    writeln!(f, "  - {place}")?;
                }
                write!(
                    f,
                    "Install one: `pip install xla-cpu-pjrt` (CPU; faster on small machines: \
                     `pip install --no-deps lammps-jax-pjrt-cpu`), `pip install libtpu` on a TPU \
                     VM, or set TPU_DYNAMO_PJRT_PLUGIN=/path/to/plugin.so"
                )
            }
            Error::Load { path, message } => {
                write!(f, "cannot load PJRT plugin {}: {message}", path.display())
            }
            Error::InvalidArgument(message) => write!(f, "invalid argument: {message}"),
        }
    }
}

impl std::error::Error for Error {}
