//! Embeds the eBPF object built by `cargo xtask build-ebpf` into the agent binary.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let default = manifest.join("../target/bpf/bpfel-unknown-none/release/gardenet");
    let src = env::var_os("GARDENET_EBPF_OBJECT").map(PathBuf::from).unwrap_or(default);
    println!("cargo:rerun-if-env-changed=GARDENET_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", src.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("gardenet.bpf.o");
    if let Err(e) = fs::copy(&src, &out) {
        panic!("\n\nThe eBPF object {} is missing ({e}).\nBuild it first with:\n\n    cargo xtask build-ebpf\n\n", src.display());
    }
}
