//! Compiler flags from the environment that would kill the process.
//!
//! XLA reads `XLA_FLAGS` when a plugin creates its first client and, on a flag its build does
//! not know (misspelt, or removed since the flag was written down) or a value it cannot parse,
//! logs a fatal error and aborts: a Python session would end with no exception to catch. So
//! before the first client of a plugin under a non-empty `XLA_FLAGS`, a forked child creates
//! one; when the child dies blaming `XLA_FLAGS`, its complaint becomes an error here instead.
//! The verdict is kept per (plugin, flags), so a process pays the probe (a fork and one client,
//! ~20 ms on the CPU plugin) once, and nothing when `XLA_FLAGS` is unset. libtpu is not probed:
//! its client owns the chips and takes seconds to start.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::client::create_raw;
use crate::error::{Error, Result};
use crate::plugin::Plugin;

const VARIABLE: &str = "XLA_FLAGS";
/// A child still running after this is stuck (e.g. on a lock another thread held at the fork);
/// it is killed and the flags are not judged.
const PROBE_LIMIT: Duration = Duration::from_secs(20);

/// (plugin path, flags) -> the child's complaint, if it died of them.
type Verdicts = HashMap<(PathBuf, String), Option<String>>;
static VERDICTS: LazyLock<Mutex<Verdicts>> = LazyLock::new(Mutex::default);

/// `Err` when `plugin` would abort the process on the `XLA_FLAGS` set now.
pub(crate) fn check(plugin: &Plugin) -> Result<()> {
    let flags = std::env::var(VARIABLE).unwrap_or_default();
    let is_libtpu = plugin.path().file_name().is_some_and(|n| n.to_string_lossy().starts_with("libtpu"));
    if flags.trim().is_empty() || is_libtpu {
        return Ok(());
    }
    let mut verdicts = VERDICTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let complaint = verdicts
        .entry((plugin.path().to_path_buf(), flags.clone()))
        .or_insert_with(|| probe(plugin).and_then(|output| complaint_in(&output)))
        .clone();
    match complaint {
        None => Ok(()),
        Some(line) => Err(Error::invalid(format!(
            "the PJRT plugin {} rejects {VARIABLE}={flags:?} and would abort the process: {line}; \
             fix or remove the flag (its name and value must be ones this plugin's XLA knows)",
            plugin.path().display()
        ))),
    }
}

/// What a dead child logged about the flags (absl error and fatal lines, without their prefix):
/// an unknown name is itself the fatal line, a bad value an error line before a generic fatal
/// one. `None` when nothing blames the flags (it died of something else).
fn complaint_in(output: &str) -> Option<String> {
    let logged = |severity: char| -> Vec<&str> {
        output
            .lines()
            .filter(|l| l.starts_with(severity) && l[1..].starts_with(|c: char| c.is_ascii_digit()))
            .filter_map(|l| l.split_once("] ").map(|(_, message)| message.trim()))
            .collect()
    };
    let (errors, fatal) = (logged('E'), logged('F'));
    let blames_flags = |m: &&str| m.contains(VARIABLE) || m.contains("Flag parsing failed");
    if !fatal.iter().any(blames_flags) {
        return None;
    }
    Some(if errors.is_empty() { fatal } else { errors }.join("; "))
}

/// What a forked child that created a client wrote before it died, or `None` when it lived (or
/// the probe itself could not run: then the real client creation decides).
fn probe(plugin: &Plugin) -> Option<String> {
    let mut fds = [0; 2];
    // SAFETY: plain POSIX calls on descriptors this function owns. The child runs only this
    // thread: it creates a client through the already-loaded plugin, touches no Python or Rust
    // state shared with the parent, and leaves with `_exit`, running no destructors or atexit
    // handlers of the parent's.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return None;
        }
        let [read_end, write_end] = fds;
        let pid = libc::fork();
        if pid == 0 {
            libc::dup2(write_end, 1);
            libc::dup2(write_end, 2);
            let code = if create_raw(plugin, &[]).is_ok() { 0 } else { 1 };
            libc::_exit(code);
        }
        libc::close(write_end);
        if pid < 0 {
            libc::close(read_end);
            return None;
        }
        let (output, finished) = read_until_exit(read_end, Instant::now() + PROBE_LIMIT);
        libc::close(read_end);
        if !finished {
            libc::kill(pid, libc::SIGKILL);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        let died = libc::WIFSIGNALED(status) || (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) != 0);
        (finished && died).then(|| String::from_utf8_lossy(&output).into_owned())
    }
}

/// Everything written into the pipe until the child closes it (exits), or until `deadline`;
/// the flag says which came first.
///
/// # Safety
/// `fd` must be an open descriptor this function may read.
unsafe fn read_until_exit(fd: libc::c_int, deadline: Instant) -> (Vec<u8>, bool) {
    let mut output = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (output, false);
        }
        let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let timeout = left.as_millis().min(i32::MAX as u128) as libc::c_int;
        match libc::poll(&mut poll, 1, timeout) {
            0 => return (output, false),
            n if n < 0 => {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return (output, false);
            }
            _ => {}
        }
        match libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) {
            0 => return (output, true),
            n if n > 0 => output.extend_from_slice(&chunk[..n as usize]),
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return (output, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::complaint_in;

    #[test]
    fn the_complaint_is_what_the_plugin_logged_about_the_flags() {
        let banner = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n";
        let unknown = format!(
            "{banner}F0000 00:00:1796164348.609930   26518 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_bogus=1\n\
             *** Check failure stack trace: ***\n"
        );
        assert_eq!(complaint_in(&unknown).as_deref(), Some("Unknown flag in XLA_FLAGS: --xla_bogus=1"));
        let bad_value = format!(
            "{banner}E0000 00:00:1796164718.464210   29327 command_line_flags.cc:93] Couldn't interpret value notabool for flag xla_cpu_enable_fast_math.\n\
             F0000 00:00:1796164718.464296   29327 parse_flags_from_env.cc:220] Check failed: tsl::Flags::Parse(&env_argv->argc, env_argv->argv.data(), flag_list) Flag parsing failed.\n\
             usage: --xla_cpu_enable_fast_math=notabool\n\
             \t--xla_flags_reset=false\tbool\tWhether to reset XLA_FLAGS next time to parse.\n"
        );
        assert_eq!(
            complaint_in(&bad_value).as_deref(),
            Some("Couldn't interpret value notabool for flag xla_cpu_enable_fast_math.")
        );
        assert_eq!(complaint_in("Segmentation fault\n"), None);
        assert_eq!(complaint_in("F0000 00:00:1.0 1 cuda.cc:1] no CUDA device\n"), None);
    }
}
