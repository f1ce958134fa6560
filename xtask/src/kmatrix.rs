//! The kernel matrix: the privileged namespace suites, run inside VMs that boot Debian's
//! kernels, against the same build as on the host.
//!
//! Kernels come from Debian's archive through an apt state of our own (its own sources list,
//! lists and cache under the matrix directory; the machine's apt configuration is never
//! touched), resolved from each suite's `linux-image-amd64` metapackage, so a point release of
//! the suite needs no change here. A VM is qemu under software emulation (TCG: `/dev/kvm` on
//! the project's machines crashes stock kernels), one vCPU, the host's root file system shared
//! read-only over 9p with a tmpfs overlay in the guest (`kmatrix/init`), no network device.
//! The guest script runs each suite's test binary and prints markers that the host reads off
//! the serial console.
use std::{
    collections::BTreeMap,
    env, fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// A kernel of the matrix: the name users pass to `--kernel` and the Debian suite whose
/// `linux-image-amd64` it is.
pub struct Kernel {
    pub name: &'static str,
    suite: &'static str,
}

/// Oldest first: the first is the floor that `cargo xtask test` (and so CI) always runs.
pub const KERNELS: &[Kernel] =
    &[Kernel { name: "5.10", suite: "bullseye" }, Kernel { name: "6.1", suite: "bookworm" }, Kernel { name: "6.12", suite: "trixie" }];

/// The privileged namespace suites (`tests/tests/*.rs` that need root and a kernel). Suites
/// that only measure speed (`cargo xtask bench`) stay on the host.
pub const PRIVILEGED_SUITES: &[&str] = &[
    "dataplane",
    "ipv6",
    "interfaces",
    "links_watch",
    "nodeport_snat",
    "icmp_pmtu",
    "control_plane",
    "kube_agent",
    "kernel_features",
    "endpoint_selection",
    "local_redirect",
    // ~7 min in the 5.10 VM (20 SIGKILLs; each start takes 10-30 s there under the load).
    "soak",
    "packet_corpus",
    "cni_plugin",
];

/// Per-suite limit inside a VM (a hung suite must not hold the matrix).
const SUITE_TIMEOUT_S: u64 = 1_800;

pub fn kernels(spec: &str) -> Result<Vec<&'static Kernel>> {
    if spec == "all" {
        return Ok(KERNELS.iter().collect());
    }
    spec.split(',').map(|n| KERNELS.iter().find(|k| k.name == n).with_context(|| format!("unknown kernel {n:?}: one of 5.10, 6.1, 6.12 or all"))).collect()
}

/// Where kernels, tools and initrds are cached (outside the checkout: a fresh clone reuses them).
fn kmx_dir() -> PathBuf {
    env::var_os("GARDENET_KMX_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/var/cache/gardenet-kmatrix"))
}

fn run(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The Debian mirror this machine's own apt sources use.
fn mirror() -> Result<String> {
    if let Some(m) = env::var_os("GARDENET_KMX_MIRROR") {
        return Ok(m.to_string_lossy().into_owned());
    }
    let deb822 = fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let from_deb822 = deb822.lines().find_map(|l| l.strip_prefix("URIs:")).and_then(|u| u.split_whitespace().next());
    let legacy = fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    let from_legacy = legacy.lines().find_map(|l| l.strip_prefix("deb ")).and_then(|r| r.split_whitespace().find(|w| w.contains("://")));
    from_deb822
        .or(from_legacy)
        .map(str::to_string)
        .context("no Debian mirror in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list (set GARDENET_KMX_MIRROR)")
}

/// apt with a private state for one Debian suite.
struct Apt {
    dir: PathBuf,
}

impl Apt {
    fn new(suite: &str) -> Result<Apt> {
        let dir = kmx_dir().join("apt").join(suite);
        for d in ["lists/partial", "cache/archives/partial", "parts"] {
            fs::create_dir_all(dir.join(d))?;
        }
        let list = dir.join("sources.list");
        if !list.exists() {
            let line = format!("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {} {suite} main\n", mirror()?);
            fs::write(&list, line)?;
        }
        let apt = Apt { dir };
        // Lists older than a week may name packages the mirror has dropped.
        let fresh = fs::read_dir(apt.dir.join("lists"))?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with("InRelease"))
            .filter_map(|e| e.metadata().and_then(|m| m.modified()).ok())
            .any(|t| t.elapsed().unwrap_or_default() < Duration::from_secs(7 * 86_400));
        if !fresh {
            eprintln!("xtask: kernel matrix: apt update for {suite}");
            run(apt.cmd("apt-get").args(["update", "-qq"]))?;
        }
        Ok(apt)
    }

    fn cmd(&self, tool: &str) -> Command {
        let d = &self.dir;
        let mut c = Command::new(tool);
        for (k, v) in [
            ("Dir::Etc::sourcelist", d.join("sources.list")),
            ("Dir::Etc::sourceparts", d.join("parts")),
            ("Dir::State::Lists", d.join("lists")),
            ("Dir::Cache", d.join("cache")),
        ] {
            c.arg("-o").arg(format!("{k}={}", v.display()));
        }
        c.args(["-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache=", "-o", "APT::Get::List-Cleanup=0", "-o", "APT::Sandbox::User=root"]);
        c.args(["-o", "APT::Update::Post-Invoke-Success::=", "-o", "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"]);
        c
    }

    /// Downloads `pkg` into `dir` and returns the .deb.
    fn download(&self, pkg: &str, dir: &Path) -> Result<PathBuf> {
        fs::create_dir_all(dir)?;
        let find = || {
            fs::read_dir(dir)
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{pkg}_")) && n.to_string_lossy().ends_with(".deb")))
        };
        if let Some(deb) = find() {
            return Ok(deb);
        }
        run(self.cmd("apt-get").current_dir(dir).args(["download", "-qq", pkg]))?;
        find().with_context(|| format!("apt-get download {pkg} left no .deb in {}", dir.display()))
    }
}

fn extract(deb: &Path, into: &Path) -> Result<()> {
    fs::create_dir_all(into)?;
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(into))
}

/// busybox (the guest's PID 1 and shell before the switch) and kmod (modprobe/depmod: the host
/// has none), from bookworm.
fn tools() -> Result<PathBuf> {
    let t = kmx_dir().join("tools");
    if t.join("bin/busybox").exists() && t.join("kbin/modprobe").exists() {
        return Ok(t);
    }
    let apt = Apt::new("bookworm")?;
    let debs = kmx_dir().join("debs");
    extract(&apt.download("busybox-static", &debs)?, &t)?;
    extract(&apt.download("kmod", &debs)?, &t)?;
    fs::create_dir_all(t.join("kbin"))?;
    for n in ["modprobe", "depmod"] {
        let _ = fs::remove_file(t.join("kbin").join(n));
        std::os::unix::fs::symlink(t.join("bin/kmod"), t.join("kbin").join(n))?;
    }
    Ok(t)
}

/// A fetched kernel: its release string and where its modules live.
pub struct Fetched {
    pub release: String,
    root: PathBuf,
    moddir: PathBuf,
}

/// Fetches (once) and prepares the newest kernel of `k`'s suite.
pub fn fetch(k: &Kernel) -> Result<Fetched> {
    let tools = tools()?;
    let apt = Apt::new(k.suite)?;
    let deps = output(apt.cmd("apt-cache").args(["depends", "linux-image-amd64"]))?;
    let pkg = deps
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-"))
        .with_context(|| format!("{}: linux-image-amd64 depends on no linux-image-*", k.suite))?
        .to_string();
    let release = pkg.trim_start_matches("linux-image-").to_string();
    let root = kmx_dir().join("k").join(&release);
    if !root.join("boot").join(format!("vmlinuz-{release}")).exists() {
        eprintln!("xtask: kernel matrix: fetching {pkg} ({})", k.suite);
        let tmp = root.with_extension("partial");
        let _ = fs::remove_dir_all(&tmp);
        extract(&apt.download(&pkg, &kmx_dir().join("debs"))?, &tmp)?;
        let _ = fs::remove_dir_all(&root);
        fs::rename(&tmp, &root)?;
    }
    let moddir =
        ["lib/modules", "usr/lib/modules"].iter().map(|d| root.join(d)).find(|d| d.join(&release).exists()).context("kernel package without modules")?;
    // kmod's depmod writes the binary indexes the guest's modprobe needs for autoloading.
    if !moddir.join(&release).join("modules.dep.bin").exists() {
        run(Command::new(tools.join("kbin/depmod")).arg("-b").arg(moddir.parent().unwrap().parent().unwrap()).arg(&release))?;
    }
    let xdir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kmatrix");
    run(Command::new("bash").arg(xdir.join("mkinitrd.sh")).arg(kmx_dir()).arg(&release).arg(xdir.join("init")))?;
    Ok(Fetched { release, root, moddir })
}

/// Boots `kernel` and runs `script` (a path on the host's root) as root in it. Returns the
/// guest script's exit code (None: the VM died or timed out) and the console text.
fn boot(kernel: &Fetched, script: &Path, console: &Path, timeout: Duration) -> Result<(Option<i32>, String)> {
    let tools = kmx_dir().join("tools");
    let append = format!(
        "console=ttyS0 quiet loglevel=3 panic=-1 oops=panic kmx.script={} kmx.moddir={} kmx.tools={}",
        script.display(),
        kernel.moddir.display(),
        tools.display()
    );
    let log = fs::File::create(console)?;
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-cpu", "max", "-machine", "q35", "-m", "1536M", "-smp", "1", "-nographic", "-no-reboot", "-nic", "none"])
        .args(["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"])
        .arg("-kernel")
        .arg(kernel.root.join("boot").join(format!("vmlinuz-{}", kernel.release)))
        .arg("-initrd")
        .arg(kmx_dir().join("initrd").join(format!("{}.cpio.gz", kernel.release)))
        .arg("-append")
        .arg(append)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting qemu-system-x86_64 (Debian package qemu-system-x86)")?;
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let text = String::from_utf8_lossy(&fs::read(console)?).replace('\r', "");
    let rc = text.lines().rev().filter_map(|l| l.strip_prefix("KMX_RC=")).find_map(|v| v.trim().parse().ok());
    if status.is_none() {
        eprintln!("xtask: kernel matrix: VM for {} timed out after {:?}", kernel.release, timeout);
    }
    Ok((rc, text))
}

/// One suite's result on one kernel.
#[derive(Clone, Debug, Default)]
pub struct SuiteResult {
    pub passed: u32,
    pub failed: u32,
    /// The binary's exit code (None: it never finished).
    pub rc: Option<i32>,
    pub secs: f64,
}

impl SuiteResult {
    fn cell(&self) -> String {
        match self.rc {
            Some(0) => format!("{} passed", self.passed),
            Some(_) if self.passed + self.failed > 0 => format!("{} passed, {} FAILED", self.passed, self.failed),
            Some(rc) => format!("FAILED (exit {rc})"),
            None => "NOT RUN".into(),
        }
    }
}

/// Runs the suites (name, test executable) on each kernel and prints one table. Errors when
/// any suite failed anywhere.
pub fn run_matrix(kernels: &[&Kernel], suites: &[(String, PathBuf)], test_args: &[String], out_dir: &Path) -> Result<()> {
    fs::create_dir_all(out_dir)?;
    let repo_tests = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("tests");
    let mut results: BTreeMap<(&str, String), SuiteResult> = BTreeMap::new();
    let mut releases = Vec::new();
    let mut ok = true;
    for k in kernels {
        let fetched = fetch(k)?;
        let dir = out_dir.join(k.name);
        fs::create_dir_all(&dir)?;
        let script = dir.join("guest.sh");
        fs::write(&script, guest_script(&repo_tests, suites, test_args))?;
        let t0 = Instant::now();
        eprintln!("xtask: kernel matrix: booting {} ({} suites, console in {})", fetched.release, suites.len(), dir.join("console.log").display());
        let budget = Duration::from_secs(SUITE_TIMEOUT_S * suites.len() as u64 + 120);
        let (rc, text) = boot(&fetched, &script, &dir.join("console.log"), budget)?;
        let per = parse_console(&text);
        for (name, _) in suites {
            let r = per.get(name).cloned().unwrap_or_default();
            ok &= r.rc == Some(0);
            results.insert((k.name, name.clone()), r);
        }
        ok &= rc == Some(0);
        eprintln!("xtask: kernel matrix: {} done in {:.0} s (guest exit {rc:?})", fetched.release, t0.elapsed().as_secs_f64());
        releases.push((k.name, fetched.release));
    }
    let table = table(&releases, suites, &results);
    println!("\n{table}");
    let (passed, failed) = results.values().fold((0, 0), |(p, f), r| (p + r.passed, f + r.failed));
    println!("matrix: {passed} passed, {failed} failed");
    let names: Vec<&str> = kernels.iter().map(|k| k.name).collect();
    fs::write(out_dir.join(format!("results-{}.md", names.join(","))), &table)?;
    if !ok {
        bail!("kernel matrix: some suites failed (consoles under {})", out_dir.display());
    }
    Ok(())
}

/// The guest script: each suite's binary from the tests package directory (as cargo runs it),
/// between markers the host parses. `GARDENET_EMULATED=1` tells the suites they run under
/// software emulation: the few that measure a latency the issue tracker promised print it
/// there instead of asserting it (see `local_redirect`).
fn guest_script(tests_dir: &Path, suites: &[(String, PathBuf)], test_args: &[String]) -> String {
    let mut s = String::from("#!/bin/bash\n# Written by `cargo xtask test --kernel`: runs in the VM.\nrc=0\n");
    s += &format!("cd {}\nexport RUST_BACKTRACE=1 GARDENET_EMULATED=1\n", tests_dir.display());
    let args = test_args.iter().map(|a| format!("'{}'", a.replace('\'', "'\\''"))).collect::<Vec<_>>().join(" ");
    for (name, exe) in suites {
        s += &format!(
            "echo KMX_SUITE_BEGIN {name}; t0=$(cut -d' ' -f1 /proc/uptime)\n\
             timeout {SUITE_TIMEOUT_S} {} {args} 2>&1; r=$?; [ $r = 0 ] || rc=1\n\
             echo KMX_SUITE_END {name} rc=$r start=$t0 end=$(cut -d' ' -f1 /proc/uptime)\n",
            exe.display()
        );
    }
    s += "exit $rc\n";
    s
}

fn parse_console(text: &str) -> BTreeMap<String, SuiteResult> {
    let mut out = BTreeMap::new();
    let mut cur: Option<(String, SuiteResult)> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("KMX_SUITE_BEGIN ") {
            cur = Some((name.trim().to_string(), SuiteResult::default()));
        } else if let Some(rest) = line.strip_prefix("KMX_SUITE_END ") {
            if let Some((name, mut r)) = cur.take() {
                let field = |k: &str| rest.split_whitespace().find_map(|w| w.strip_prefix(k));
                r.rc = field("rc=").and_then(|v| v.parse().ok());
                let t = |k| field(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
                r.secs = t("end=") - t("start=");
                out.insert(name, r);
            }
        } else if let (Some((_, r)), Some(rest)) = (cur.as_mut(), line.strip_prefix("test result: ")) {
            // "test result: ok. 9 passed; 0 failed; 0 ignored; ..."
            let num = |k: &str| {
                rest.split(';')
                    .find_map(|p| p.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").strip_suffix(k))
                    .and_then(|n| n.trim().parse::<u32>().ok())
            };
            r.passed += num(" passed").unwrap_or(0);
            r.failed += num(" failed").unwrap_or(0);
        }
    }
    out
}

fn table(releases: &[(&str, String)], suites: &[(String, PathBuf)], results: &BTreeMap<(&str, String), SuiteResult>) -> String {
    let mut t = String::from("| suite |");
    for (_, rel) in releases {
        t += &format!(" {rel} |");
    }
    t += "\n|---|";
    t += &"---|".repeat(releases.len());
    t += "\n";
    let mut totals = vec![(0u32, 0u32, 0f64); releases.len()];
    for (name, _) in suites {
        t += &format!("| {name} |");
        for (i, (k, _)) in releases.iter().enumerate() {
            let r = results.get(&(*k, name.clone())).cloned().unwrap_or_default();
            totals[i].0 += r.passed;
            totals[i].1 += r.failed;
            totals[i].2 += r.secs;
            t += &format!(" {} ({:.0} s) |", r.cell(), r.secs);
        }
        t += "\n";
    }
    t += "| **all** |";
    for (p, f, s) in totals {
        t += &format!(" {p} passed, {f} failed ({:.0} min) |", s / 60.0);
    }
    t + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_markers_and_cargo_summaries_are_parsed() {
        let text = "noise\nKMX_SUITE_BEGIN dataplane\nrunning 9 tests\ntest result: FAILED. 7 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 81.2s\n\
                    KMX_SUITE_END dataplane rc=101 start=3.5 end=90.0\nKMX_SUITE_BEGIN ipv6\ntest result: ok. 10 passed; 0 failed; 0 ignored\nKMX_SUITE_END ipv6 rc=0 start=90 end=100\n";
        let r = parse_console(text);
        assert_eq!((r["dataplane"].passed, r["dataplane"].failed, r["dataplane"].rc), (7, 2, Some(101)));
        assert!((r["dataplane"].secs - 86.5).abs() < 1e-9);
        assert_eq!((r["ipv6"].passed, r["ipv6"].rc), (10, Some(0)));
        assert!(!r.contains_key("interfaces"));
    }

    #[test]
    fn kernel_names_resolve() {
        assert_eq!(kernels("all").unwrap().len(), 3);
        assert_eq!(kernels("6.1,5.10").unwrap().iter().map(|k| k.suite).collect::<Vec<_>>(), ["bookworm", "bullseye"]);
        assert!(kernels("4.19").is_err());
    }
}
