//! Project tasks: `cargo xtask <setup|build-ebpf|test|demo|soak|bench>`.
use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod kmatrix;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build and tests need (Debian packages, bpf-linker). Idempotent.
    Setup,
    /// Compile the eBPF crate for bpfel-unknown-none on a stable rustc, linked by bpf-linker, with BTF.
    BuildEbpf {
        /// Print the toolchain decision and the command, do not build.
        #[arg(long)]
        dry_run: bool,
    },
    /// Set up, build and run every test: unit, API double and privileged namespace tests on
    /// this kernel, then the privileged suites in a VM on the oldest kernel of the matrix.
    Test {
        /// Run the privileged suites only, in VMs on these kernels: 5.10, 6.1, 6.12 (comma
        /// separated) or `all`. Nothing runs on the host kernel then.
        #[arg(long)]
        kernel: Option<String>,
        /// Only this kernel: skip the VM run of the oldest kernel.
        #[arg(long, conflicts_with = "kernel")]
        host_only: bool,
        /// With --kernel: only these suites (comma separated), e.g. dataplane,ipv6.
        #[arg(long, requires = "kernel")]
        suites: Option<String>,
        /// Extra arguments for `cargo test` (after `--`); with --kernel, for each test binary.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up, build and run the Service load-balancing demo in network namespaces.
    Demo {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The restart soak (issue 14, "kill -9 under load"), long form: the agent is SIGKILLed
    /// and restarted again and again while new connections and long transfers run through
    /// socket LB, TC LB and a source-NATed NodePort, in both families; prints per path the
    /// connections attempted and failed and the transfers broken (must be 0). The short form
    /// (the `soak` suite's defaults: 20 restarts) runs in every `cargo xtask test`.
    Soak {
        /// SIGKILLs and restarts of the agent.
        #[arg(long, default_value_t = 100)]
        restarts: u32,
        /// The kill/restart phase lasts at least this long (seconds); the restarts are spread
        /// over it.
        #[arg(long, default_value_t = 300)]
        seconds: u64,
        /// Long transfers per path.
        #[arg(long, default_value_t = 2)]
        streams: u32,
        /// Seed of the random pauses (a run prints its seed).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// End-to-end test in a real cluster: `kind` (needs Docker, kind and kubectl).
    E2e {
        /// Only `kind` for now.
        which: String,
        /// Keep the cluster afterwards (for debugging).
        #[arg(long)]
        keep: bool,
    },
    /// Benchmarks that print tables: `dataplane`, `control-plane` or `podnet`.
    Bench {
        which: String,
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup => setup(),
        Cmd::BuildEbpf { dry_run } => build_ebpf(dry_run),
        Cmd::Test { kernel, host_only, suites, args } => {
            setup()?;
            build_ebpf(false)?;
            cargo(&["build", "-p", "gardenet-agent", "-p", "gardenet-cni", "-p", "gardenet-tests", "--bins"])?;
            if let Some(spec) = kernel {
                return kernel_matrix(&kmatrix::kernels(&spec)?, suites.as_deref(), &args);
            }
            // Style and lints first: a diff or a warning fails the run (the eBPF crate is
            // formatted too, but builds only for its target, so clippy skips it).
            cargo(&["fmt", "--all", "--", "--check"])?;
            cargo(&[
                "clippy",
                "--no-deps",
                "--all-targets",
                "-p",
                "gardenet-common",
                "-p",
                "gardenet-agent",
                "-p",
                "gardenet-cni",
                "-p",
                "gardenet-tests",
                "-p",
                "gardenet-extension",
                "-p",
                "xtask",
                "--",
                "-D",
                "warnings",
            ])?;
            let mut a = vec!["test".to_string()];
            if !args.is_empty() {
                a.push("--".into());
                a.extend(args.iter().cloned());
            }
            cargo(&a.iter().map(String::as_str).collect::<Vec<_>>())?;
            if host_only {
                return Ok(());
            }
            kernel_matrix(&kmatrix::KERNELS[..1].iter().collect::<Vec<_>>(), None, &[])
        }
        Cmd::Demo { args } => {
            setup()?;
            build_ebpf(false)?;
            cargo(&["build", "-p", "gardenet-agent", "-p", "gardenet-cni", "-p", "gardenet-tests", "--bins"])?;
            run(Command::new(root().join("target/debug/gardenet-demo")).args(args))
        }
        Cmd::Soak { restarts, seconds, streams, seed } => {
            setup()?;
            build_ebpf(false)?;
            cargo(&["build", "-p", "gardenet-agent", "-p", "gardenet-cni", "-p", "gardenet-tests", "--bins"])?;
            let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
            // The suite writes its table past the test harness's capture; the agents' logs
            // are shown only when it fails.
            cmd.current_dir(root()).args(["test", "-p", "gardenet-tests", "--test", "soak"]);
            cmd.env("GARDENET_SOAK_RESTARTS", restarts.to_string()).env("GARDENET_SOAK_SECONDS", seconds.to_string());
            cmd.env("GARDENET_SOAK_STREAMS", streams.to_string());
            if let Some(seed) = seed {
                cmd.env("GARDENET_SOAK_SEED", seed.to_string());
            }
            run(&mut cmd)
        }
        Cmd::E2e { which, keep } => {
            if which != "kind" {
                bail!("unknown e2e target {which:?}: kind");
            }
            e2e_kind(keep)
        }
        Cmd::Bench { which, args } => {
            let bin = match which.as_str() {
                "dataplane" => "gardenet-bench-dataplane",
                "control-plane" => "gardenet-bench-control-plane",
                "podnet" => "gardenet-bench-podnet",
                other => bail!("unknown benchmark {other:?}: dataplane, control-plane or podnet"),
            };
            setup()?;
            build_ebpf(false)?;
            cargo(&["build", "--release", "-p", "gardenet-agent", "-p", "gardenet-cni", "-p", "gardenet-tests", "--bins"])?;
            run(Command::new(root().join("target/release").join(bin)).args(args))
        }
    }
}

/// Builds the privileged suites' test binaries and runs them on `kernels` in VMs.
fn kernel_matrix(kernels: &[&kmatrix::Kernel], only: Option<&str>, args: &[String]) -> Result<()> {
    let wanted: Vec<&str> = match only {
        Some(list) => list.split(',').collect(),
        None => kmatrix::PRIVILEGED_SUITES.to_vec(),
    };
    let suites: Vec<(String, PathBuf)> = test_executables()?.into_iter().filter(|(n, _)| wanted.contains(&n.as_str())).collect();
    for w in &wanted {
        if !suites.iter().any(|(n, _)| n == w) {
            bail!("no test suite {w:?} in gardenet-tests");
        }
    }
    kmatrix::run_matrix(kernels, &suites, args, &root().join("target/kmatrix"))
}

/// (suite name, executable) of every integration test of the tests package, built.
fn test_executables() -> Result<Vec<(String, PathBuf)>> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args(["test", "-p", "gardenet-tests", "--tests", "--no-run", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut v = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) else { continue };
        if msg["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "test")) {
            v.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    Ok(v)
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn cargo(args: &[&str]) -> Result<()> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(cargo).current_dir(root()).args(args))
}

fn have(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {cmd} >/dev/null 2>&1")).status().is_ok_and(|s| s.success())
}

fn deb_installed(pkg: &str) -> bool {
    Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]).output().is_ok_and(|o| o.stdout.ends_with(b"install ok installed"))
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// The rustc that cargo uses for host builds (rustup's, normally).
fn host_rustc() -> OsString {
    env::var_os("RUSTC").unwrap_or_else(|| "rustc".into())
}

fn sysroot(rustc: &OsString) -> Option<PathBuf> {
    let o = Command::new(rustc).args(["--print", "sysroot"]).output().ok()?;
    o.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
}

fn has_rust_src(sysroot: &Path) -> bool {
    sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml").exists()
}

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";

fn setup() -> Result<()> {
    let mut pkgs: Vec<&str> = Vec::new();
    // qemu and xz: the kernel matrix's VMs (`cargo xtask test` runs the oldest kernel in one).
    for (bin, pkg) in
        [("ip", "iproute2"), ("nsenter", "util-linux"), ("iptables-restore", "iptables"), ("qemu-system-x86_64", "qemu-system-x86"), ("xz", "xz-utils")]
    {
        if !have(bin) {
            pkgs.push(pkg);
        }
    }
    // The dataplane bench: kube-proxy's nftables-mode ruleset, and a font for its plot.
    if !have("nft") {
        pkgs.push("nftables");
    }
    // The CNI suites delegate addresses to the reference host-local plugin (and chain portmap).
    if !Path::new("/usr/lib/cni/host-local").exists() {
        pkgs.push("containernetworking-plugins");
    }
    // The pod_network suite: a real container runtime (podman calls CNI plugins through
    // libcni) running a static busybox as the pods' root file system.
    if !have("podman") {
        pkgs.push("podman");
    }
    if !deb_installed("busybox-static") {
        pkgs.push("busybox-static");
    }
    if !Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        pkgs.push("fonts-dejavu-core");
    }
    let toolchain_src = sysroot(&host_rustc()).is_some_and(|s| has_rust_src(&s));
    let debian_src = Path::new(DEBIAN_RUSTC).exists() && Path::new("/usr/lib/rustlib/src/rust/library/core/Cargo.toml").exists();
    if !toolchain_src && !debian_src {
        pkgs.extend(["rustc-web", "rust-web-src"]);
    }
    if !pkgs.is_empty() {
        if !is_root() || !have("apt-get") {
            bail!("missing packages {pkgs:?}: install them (Debian: apt-get install {})", pkgs.join(" "));
        }
        eprintln!("xtask: installing {}", pkgs.join(" "));
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get").args(["install", "-y", "-qq", "--no-install-recommends"]).args(&pkgs).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    if !have("bpf-linker") && !cargo_bin("bpf-linker").exists() {
        install_bpf_linker()?;
    }
    Ok(())
}

fn cargo_bin(name: &str) -> PathBuf {
    let home = env::var_os("CARGO_HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env::var_os("HOME").unwrap_or_default()).join(".cargo"));
    home.join("bin").join(name)
}

/// bpf-linker built against the LLVM that ships with the active rustup toolchain, so no
/// system LLVM is needed and its version matches the rustc that emits the bitcode.
fn install_bpf_linker() -> Result<()> {
    let sr = sysroot(&host_rustc()).context("cannot find the toolchain sysroot")?;
    let lib = sr.join("lib");
    let llvm = std::fs::read_dir(&lib)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so.") || (n.starts_with("libLLVM-") && n.ends_with(".so")))
        .with_context(|| format!("no libLLVM in {}: install bpf-linker by hand (cargo install bpf-linker)", lib.display()))?;
    let major = llvm.trim_start_matches("libLLVM.so.").trim_start_matches("libLLVM-").split(['.', '-']).next().unwrap_or("").to_string();
    eprintln!("xtask: installing bpf-linker against {}/{llvm} (LLVM {major})", lib.display());
    let flags = format!("-L {} -C link-arg=-l:{llvm} -C link-arg=-Wl,-rpath,{}", lib.display(), lib.display());
    run(Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["install", "bpf-linker", "--no-default-features", "--features"])
        .arg(format!("llvm-{major},no-llvm-linking"))
        .env("RUSTFLAGS", flags))
}

/// Picks the compiler for the eBPF build: one with its own rust-src (rustup with the
/// `rust-src` component), else Debian's stable rustc with its packaged library source.
fn ebpf_rustc() -> Result<(OsString, &'static str)> {
    let host = host_rustc();
    if sysroot(&host).is_some_and(|s| has_rust_src(&s)) {
        return Ok((host, "the active toolchain (it has rust-src)"));
    }
    if Path::new(DEBIAN_RUSTC).exists() && sysroot(&DEBIAN_RUSTC.into()).is_some_and(|s| has_rust_src(&s)) {
        return Ok((DEBIAN_RUSTC.into(), "Debian's rustc with rust-web-src"));
    }
    bail!(
        "no Rust toolchain with library source (rust-src) for -Z build-std=core. Fix either way:\n  \
         - rustup users: rustup component add rust-src\n  \
         - Debian 12: apt-get install rustc-web rust-web-src   (or run `cargo xtask setup` as root)"
    )
}

fn build_ebpf(dry_run: bool) -> Result<()> {
    let (rustc, why) = ebpf_rustc()?;
    let linker_dir = cargo_bin("bpf-linker").parent().unwrap().to_path_buf();
    if !have("bpf-linker") && !linker_dir.join("bpf-linker").exists() {
        bail!("bpf-linker is not installed: run `cargo xtask setup` (or cargo install bpf-linker)");
    }
    let target_dir = root().join("target/bpf");
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root().join("ebpf"))
        .args(["build", "--release", "-Z", "build-std=core", "--target", "bpfel-unknown-none", "--target-dir"])
        .arg(&target_dir)
        .env("RUSTC", &rustc)
        // -Z build-std on a stable compiler; no nightly toolchain involved.
        .env("RUSTC_BOOTSTRAP", "1")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTFLAGS")
        .env("CARGO_ENCODED_RUSTFLAGS", ["-C", "debuginfo=2", "-C", "link-arg=--btf"].join("\x1f"))
        .env("PATH", {
            let mut p = OsString::from(&linker_dir);
            p.push(":");
            p.push(env::var_os("PATH").unwrap_or_default());
            p
        });
    eprintln!("xtask: building eBPF with {} ({why})", rustc.to_string_lossy());
    if dry_run {
        eprintln!("{cmd:?}");
        return Ok(());
    }
    run(&mut cmd)?;
    let obj = target_dir.join("bpfel-unknown-none/release/gardenet");
    let bytes = std::fs::read(&obj).with_context(|| format!("reading {}", obj.display()))?;
    if !bytes.windows(5).any(|w| w == b".BTF\0") {
        bail!("{} has no .BTF section", obj.display());
    }
    eprintln!("xtask: {} ({} bytes, with BTF)", obj.display(), bytes.len());
    Ok(())
}

const KIND_CLUSTER: &str = "gardenet-e2e";
const E2E_IMAGE: &str = "gardenet-agent:e2e";

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn kubectl(args: &[&str]) -> Result<()> {
    run(Command::new("kubectl").args(["--context", &format!("kind-{KIND_CLUSTER}")]).args(args))
}

/// Builds the image, creates a kind cluster without kube-proxy, deploys gardenet from
/// `deploy/`, and checks that a ClusterIP Service (and cluster DNS, itself a Service) work.
fn e2e_kind(keep: bool) -> Result<()> {
    for tool in ["docker", "kind", "kubectl"] {
        if !have(tool) {
            bail!("`{tool}` is not installed; `cargo xtask e2e kind` needs Docker, kind and kubectl");
        }
    }
    output(Command::new("docker").arg("info")).context("no Docker engine is reachable")?;
    build_ebpf(false)?;
    run(Command::new("docker").current_dir(root()).args(["build", "-f", "deploy/Dockerfile", "-t", E2E_IMAGE, "."]))?;

    let cfg = std::env::temp_dir().join("gardenet-kind.yaml");
    std::fs::write(
        &cfg,
        "kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnetworking:\n  kubeProxyMode: \"none\"\nnodes:\n- role: control-plane\n- role: worker\n- role: worker\n",
    )?;
    let _ = Command::new("kind").args(["delete", "cluster", "--name", KIND_CLUSTER]).status();
    run(Command::new("kind").args(["create", "cluster", "--name", KIND_CLUSTER, "--config"]).arg(&cfg))?;
    let result = (|| -> Result<()> {
        run(Command::new("kind").args(["load", "docker-image", E2E_IMAGE, "--name", KIND_CLUSTER]))?;
        let deploy = root().join("deploy");
        for f in ["crd-network.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml"] {
            kubectl(&["apply", "-f", &deploy.join(f).display().to_string()])?;
        }
        // Nothing routes the `kubernetes` Service yet: the agent talks to the API server directly.
        let api = output(Command::new("docker").args([
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            &format!("{KIND_CLUSTER}-control-plane"),
        ]))?;
        kubectl(&["-n", "kube-system", "set", "image", "ds/gardenet-agent", &format!("*={E2E_IMAGE}")])?;
        kubectl(&["-n", "kube-system", "set", "env", "ds/gardenet-agent", &format!("KUBERNETES_SERVICE_HOST={api}"), "KUBERNETES_SERVICE_PORT=6443"])?;
        kubectl(&["-n", "kube-system", "rollout", "status", "ds/gardenet-agent", "--timeout=240s"])?;

        // Smoke test: three echo backends behind a ClusterIP, reached by name (DNS is a
        // Service too) from a client pod; every backend must answer.
        kubectl(&[
            "create",
            "deployment",
            "echo",
            "--image=registry.k8s.io/e2e-test-images/agnhost:2.53",
            "--replicas=3",
            "--",
            "/agnhost",
            "netexec",
            "--http-port=8080",
        ])?;
        kubectl(&["expose", "deployment", "echo", "--port=80", "--target-port=8080"])?;
        kubectl(&["rollout", "status", "deployment/echo", "--timeout=180s"])?;
        kubectl(&["-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=180s"])?;
        let script = "for i in $(seq 1 60); do curl -s --max-time 2 http://echo.default.svc.cluster.local/hostname; echo; done";
        let out = output(Command::new("kubectl").args([
            "--context",
            &format!("kind-{KIND_CLUSTER}"),
            "run",
            "e2e-client",
            "--rm",
            "-i",
            "--restart=Never",
            "--image=registry.k8s.io/e2e-test-images/agnhost:2.53",
            "--command",
            "--",
            "sh",
            "-c",
            script,
        ]))?;
        let mut seen: std::collections::BTreeMap<&str, u32> = Default::default();
        for l in out.lines().map(str::trim).filter(|l| l.starts_with("echo-")) {
            *seen.entry(l).or_default() += 1;
        }
        println!("answers per backend pod: {seen:?}");
        if seen.len() < 3 {
            bail!("expected answers from 3 backend pods through the ClusterIP, got {seen:?}");
        }
        kubectl(&["-n", "kube-system", "logs", "ds/gardenet-agent", "--tail=20"])?;
        println!("e2e kind: OK");
        Ok(())
    })();
    if !keep {
        let _ = Command::new("kind").args(["delete", "cluster", "--name", KIND_CLUSTER]).status();
    }
    result
}
