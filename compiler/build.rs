//! Records the version of the LLVM/MLIR this crate links (`MLIR_VERSION`), asking the same
//! `llvm-config` that mlir-sys links against.
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=MLIR_SYS_220_PREFIX");
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
}
