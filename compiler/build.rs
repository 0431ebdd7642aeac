//! Records what an executable built from this compiler depends on besides the graph:
//! - `MLIR_VERSION`: the LLVM/MLIR release, from the same `llvm-config` that mlir-sys links against;
//! - `SOURCE_HASH`: blake3 of the lowering sources, so a cached executable lowered by another
//!   build of the rules (a fixed or changed rule) is never served for the same graph.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=MLIR_SYS_220_PREFIX");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    let llvm_config = std::env::var("MLIR_SYS_220_PREFIX")
        .map(|prefix| format!("{prefix}/bin/llvm-config"))
        .unwrap_or_else(|_| "llvm-config".into());
    let version = Command::new(&llvm_config)
        .arg("--version")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TPU_DYNAMO_MLIR_VERSION={version}");
    println!("cargo:rustc-env=TPU_DYNAMO_COMPILER_SOURCE_HASH={}", source_hash(Path::new("src")));
}

/// blake3 over every file under `root` (relative path and contents), in sorted path order.
fn source_hash(root: &Path) -> String {
    let mut files = vec![];
    collect(root, &mut files);
    files.sort();
    let mut hasher = blake3::Hasher::new();
    for file in files {
        let contents = std::fs::read(&file).expect("reading a compiler source file");
        for part in [file.to_string_lossy().as_bytes(), &contents] {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
    }
    hasher.finalize().to_hex().to_string()
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("listing the compiler sources").flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, files);
        } else {
            files.push(path);
        }
    }
}
