//! Where to find a PJRT plugin when the caller does not name one.
//!
//! Order: the explicit path; env `TPU_DYNAMO_PJRT_PLUGIN`; libtpu (env `TPU_LIBRARY_PATH` or
//! `libtpu/libtpu.so` in a site-packages) but only when TPU hardware is present; an XLA CPU
//! plugin in a site-packages, newest XLA first (see [`CPU_IN_SITE`]). Site-packages are, in
//! order: env `TPU_DYNAMO_SITE_PACKAGES` (':'-separated, set by the Python shell, which knows
//! `sys.path`), `$VIRTUAL_ENV`, and the `.venv` of the current directory and each parent.
//! A path named explicitly or by `TPU_DYNAMO_PJRT_PLUGIN` is final: if it is missing we fail
//! rather than silently run somewhere else. A variable set to the empty string counts as unset
//! (`TPU_DYNAMO_PJRT_PLUGIN= python …` is how a shell clears one for a command).

use crate::error::{Error, Result};
use crate::plugin::Plugin;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const PLUGIN_ENV: &str = "TPU_DYNAMO_PJRT_PLUGIN";
const SITE_PACKAGES_ENV: &str = "TPU_DYNAMO_SITE_PACKAGES";
const LIBTPU_IN_SITE: &str = "libtpu/libtpu.so";
/// XLA CPU plugins from PyPI, preferred first: `lammps-jax-pjrt-cpu` (PJRT API 0.115) can execute
/// on the calling thread (`asynchronous=false`, see the Python crate's `device.rs`), which
/// `xla-cpu-pjrt` (0.81) cannot.
const CPU_IN_SITE: [&str; 2] = [
    "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
    "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
];

pub(crate) fn discover(explicit: Option<&Path>) -> Result<Arc<Plugin>> {
    let search = Search {
        env: &|name| std::env::var_os(name),
        cwd: std::env::current_dir().ok(),
        tpu_present: &tpu_hardware_present,
    };
    let path = search
        .locate(explicit)
        .map_err(|searched| Error::PluginNotFound { searched })?;
    Plugin::load(&path)
}

/// True when this machine has a TPU: a PCI device of Google's vendor id 0x1ae0, `/dev/accel*`,
/// or a VFIO device group. Checked before libtpu is ever initialized.
pub fn tpu_hardware_present() -> bool {
    tpu_hardware_under(Path::new("/"))
}

fn tpu_hardware_under(root: &Path) -> bool {
    let entries = |dir: &str| -> Vec<PathBuf> {
        std::fs::read_dir(root.join(dir))
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let google_pci = entries("sys/bus/pci/devices")
        .iter()
        .any(|dev| std::fs::read_to_string(dev.join("vendor")).is_ok_and(|v| v.trim() == "0x1ae0"));
    let file_name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let accel = entries("dev")
        .iter()
        .filter_map(file_name)
        .any(|n| n.starts_with("accel"));
    let vfio_group = entries("dev/vfio")
        .iter()
        .filter_map(file_name)
        .any(|n| n.chars().all(|c| c.is_ascii_digit()));
    google_pci || accel || vfio_group
}

/// The inputs of a search, injectable so tests need not touch the process environment.
struct Search<'a> {
    env: &'a dyn Fn(&str) -> Option<OsString>,
    cwd: Option<PathBuf>,
    tpu_present: &'a dyn Fn() -> bool,
}

impl Search<'_> {
    /// A variable's value, None when it is unset or empty.
    fn var(&self, name: &str) -> Option<OsString> {
        (self.env)(name).filter(|value| !value.is_empty())
    }

    /// The plugin path to load, or every place looked at.
    fn locate(&self, explicit: Option<&Path>) -> std::result::Result<PathBuf, Vec<String>> {
        let mut searched = Vec::new();
        let named = explicit
            .map(|p| (p.to_path_buf(), "explicit path"))
            .or_else(|| self.var(PLUGIN_ENV).map(|p| (PathBuf::from(p), PLUGIN_ENV)));
        if let Some((path, source)) = named {
            return if path.is_file() {
                Ok(path)
            } else {
                Err(vec![format!("{} ({source}): no such file", path.display())])
            };
        }
        let sites = self.site_packages(&mut searched);
        let libtpu = self
            .var("TPU_LIBRARY_PATH")
            .map(PathBuf::from)
            .into_iter()
            .chain(sites.iter().map(|site| site.join(LIBTPU_IN_SITE)));
        let mut tpu_present = None;
        for path in libtpu {
            if !path.is_file() {
                searched.push(format!("{} (libtpu): not found", path.display()));
            } else if *tpu_present.get_or_insert_with(self.tpu_present) {
                return Ok(path);
            } else {
                searched.push(format!(
                    "{} (libtpu): present, but no TPU hardware",
                    path.display()
                ));
            }
        }
        for path in CPU_IN_SITE
            .iter()
            .flat_map(|file| sites.iter().map(move |site| site.join(file)))
        {
            if path.is_file() {
                return Ok(path);
            }
            searched.push(format!("{} (XLA CPU plugin): not found", path.display()));
        }
        Err(searched)
    }

    /// Site-packages directories to look in, without duplicates; notes venvs that have none.
    fn site_packages(&self, searched: &mut Vec<String>) -> Vec<PathBuf> {
        let mut sites: Vec<PathBuf> = self
            .var(SITE_PACKAGES_ENV)
            .map(|list| {
                std::env::split_paths(&list)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default();
        let venvs = self
            .var("VIRTUAL_ENV")
            .map(PathBuf::from)
            .into_iter()
            .chain(
                self.cwd
                    .iter()
                    .flat_map(|cwd| cwd.ancestors().map(|dir| dir.join(".venv"))),
            );
        for venv in venvs {
            let found = venv_site_packages(&venv);
            if found.is_empty() {
                if venv.is_dir() {
                    searched.push(format!("{}: no lib/python*/site-packages", venv.display()));
                }
                continue;
            }
            sites.extend(found);
        }
        let mut unique = Vec::new();
        for site in sites {
            let key = site.canonicalize().unwrap_or_else(|_| site.clone());
            if !unique.iter().any(|(k, _)| *k == key) {
                unique.push((key, site));
            }
        }
        unique.into_iter().map(|(_, site)| site).collect()
    }
}

fn venv_site_packages(venv: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(venv.join("lib")) else {
        return vec![];
    };
    let mut sites: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| e.path().join("site-packages"))
        .filter(|p| p.is_dir())
        .collect();
    sites.sort();
    sites
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fresh directory tree under the system temp dir, removed on drop.
    struct Tree(PathBuf);
    impl Tree {
        fn new(name: &str, files: &[&str]) -> Tree {
            let root =
                std::env::temp_dir().join(format!("tpu-dynamo-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for file in files {
                let path = root.join(file);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, b"").unwrap();
            }
            std::fs::create_dir_all(&root).unwrap();
            Tree(root)
        }
    }
    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn locate(
        vars: &[(&str, PathBuf)],
        cwd: &Path,
        tpu: bool,
        explicit: Option<&Path>,
    ) -> std::result::Result<PathBuf, Vec<String>> {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone().into_os_string()))
            .collect();
        let env = move |name: &str| vars.get(name).cloned();
        let tpu_present = move || tpu;
        Search {
            env: &env,
            cwd: Some(cwd.to_path_buf()),
            tpu_present: &tpu_present,
        }
        .locate(explicit)
    }

    #[test]
    fn order_and_libtpu_gating() {
        let venv_cpu =
            ".venv/lib/python3.11/site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";
        let venv_tpu = ".venv/lib/python3.11/site-packages/libtpu/libtpu.so";
        let t = Tree::new(
            "discover",
            &[venv_cpu, venv_tpu, "other/plugin.so", "proj/sub/.keep"],
        );
        // The preferred CPU plugin wins over the other one, wherever each is installed.
        let both = Tree::new(
            "discover-cpu",
            &[
                "a/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
                "b/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
            ],
        );
        let sites = std::env::join_paths([both.0.join("a"), both.0.join("b")]).unwrap();
        assert_eq!(
            locate(
                &[(SITE_PACKAGES_ENV, PathBuf::from(sites))],
                &both.0,
                false,
                None
            )
            .unwrap(),
            both.0
                .join("b/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so")
        );
        let cwd = t.0.join("proj/sub");
        let venv = t.0.join(".venv");
        // Found from a parent's .venv; libtpu skipped without TPU hardware, with the reason listed.
        assert_eq!(locate(&[], &cwd, false, None).unwrap(), t.0.join(venv_cpu));
        // With TPU hardware libtpu wins.
        assert_eq!(locate(&[], &cwd, true, None).unwrap(), t.0.join(venv_tpu));
        // The env var beats discovery; the explicit path beats the env var.
        let other = t.0.join("other/plugin.so");
        let env = [(PLUGIN_ENV, other.clone())];
        assert_eq!(locate(&env, &cwd, true, None).unwrap(), other);
        assert_eq!(
            locate(&env, &cwd, true, Some(&t.0.join(venv_cpu))).unwrap(),
            t.0.join(venv_cpu)
        );
        // An empty variable is unset: discovery goes on.
        let unset = [
            (PLUGIN_ENV, PathBuf::new()),
            ("TPU_LIBRARY_PATH", PathBuf::new()),
            ("VIRTUAL_ENV", PathBuf::new()),
        ];
        assert_eq!(
            locate(&unset, &cwd, false, None).unwrap(),
            t.0.join(venv_cpu)
        );
        // A named but missing path is an error, not a fallback.
        let missing = locate(&[(PLUGIN_ENV, t.0.join("nope.so"))], &cwd, false, None).unwrap_err();
        assert!(missing[0].contains("nope.so"), "{missing:?}");
        // Site-packages from the Python shell and VIRTUAL_ENV are searched; misses are listed.
        let empty = Tree::new("discover-empty", &["a/.keep"]);
        let env = [
            (SITE_PACKAGES_ENV, empty.0.join("a")),
            ("VIRTUAL_ENV", venv),
        ];
        assert_eq!(
            locate(&env, &empty.0, false, None).unwrap(),
            t.0.join(venv_cpu)
        );
        let searched = locate(&env[..1], &empty.0, false, None).unwrap_err();
        assert!(
            searched.iter().any(|s| s.contains("a/xla_plugins")),
            "{searched:?}"
        );
        assert!(
            searched.iter().any(|s| s.contains("a/libtpu")),
            "{searched:?}"
        );
    }

    #[test]
    fn tpu_hardware_detection() {
        let none = Tree::new(
            "hw-none",
            &["sys/bus/pci/devices/0000:00:01.0/vendor", "dev/vfio/vfio"],
        );
        assert!(!tpu_hardware_under(&none.0));
        let pci = Tree::new("hw-pci", &["sys/bus/pci/devices/0000:00:04.0/vendor"]);
        std::fs::write(
            pci.0.join("sys/bus/pci/devices/0000:00:04.0/vendor"),
            "0x1ae0\n",
        )
        .unwrap();
        assert!(tpu_hardware_under(&pci.0));
        assert!(tpu_hardware_under(
            &Tree::new("hw-accel", &["dev/accel0"]).0
        ));
        assert!(tpu_hardware_under(
            &Tree::new("hw-vfio", &["dev/vfio/12"]).0
        ));
    }
}
