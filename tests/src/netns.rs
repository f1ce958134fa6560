//! Test hosts in network namespaces, a test-owned cgroup2 directory, and processes started
//! inside both. Everything created here is removed on drop (also when a test panics), and
//! leftovers of killed earlier runs are swept at start.
//!
//! Network-safety rule: namespaces get no default route; addresses come from 198.18.0.0/15
//! (RFC 2544 benchmarking range) and only exist inside the namespaces.
use std::{
    ffi::CString,
    fs,
    os::fd::{AsRawFd, OwnedFd},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context, Result};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip (install iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (CAP_NET_ADMIN, CAP_BPF, CAP_SYS_ADMIN): run it through `cargo xtask test` as root");
    }
}

/// A unique short tag for this process and call: interface and namespace names are short.
pub fn unique_tag() -> String {
    format!("gt{}x{}", std::process::id() % 100_000, SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Deletes namespaces, cgroups and bpffs pins left by test processes that no longer exist.
pub fn sweep_leftovers() {
    let dead = |name: &str| -> bool {
        name.strip_prefix("gt")
            .and_then(|r| r.split(['x', '-']).next())
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|p| p != std::process::id() % 100_000 && !pid_alive_mod(p))
    };
    if let Ok(rd) = fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = ip(&["netns", "del", &n]);
            }
        }
    }
    if let Ok(root) = cgroup2_mount() {
        if let Ok(rd) = fs::read_dir(&root) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if dead(&n) {
                    let _ = fs::remove_dir(e.path());
                }
            }
        }
    }
    if let Ok(rd) = fs::read_dir("/sys/fs/bpf") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if dead(&n) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Tags carry the pid modulo 100000: treat the tag as alive if any live pid maps onto it.
fn pid_alive_mod(p: u32) -> bool {
    let Ok(rd) = fs::read_dir("/proc") else { return true };
    rd.flatten().filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok())).any(|pid| pid % 100_000 == p)
}

/// A network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: &str) -> Result<Self> {
        ip(&["netns", "add", name])?;
        let ns = Netns { name: name.to_owned() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip -n NAME ARGS`
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut a = vec!["-n", &self.name];
        a.extend_from_slice(args);
        ip(&a)
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    pub fn sysctl(&self, key: &str, val: &str) -> Result<()> {
        let out = Command::new("ip").args(["netns", "exec", &self.name, "sysctl", "-qw", &format!("{key}={val}")]).output()?;
        if !out.status.success() {
            bail!("sysctl {key}={val} in {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// The value of `key` in this namespace (as `sysctl -n` prints it).
    pub fn sysctl_value(&self, key: &str) -> Result<String> {
        let out = Command::new("ip").args(["netns", "exec", &self.name, "sysctl", "-n", key]).output()?;
        if !out.status.success() {
            bail!("sysctl {key} in {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// A command that will run inside this namespace (and optionally a cgroup).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>, cgroup: Option<&TestCgroup>) -> Result<Command> {
        command_in(&self.path(), program, cgroup)
    }
}

/// A command that will run inside the network namespace at `netns` (a `/run/netns` name or
/// a process's `/proc/PID/ns/net`), and optionally a cgroup.
pub fn command_in(netns: &std::path::Path, program: impl AsRef<std::ffi::OsStr>, cgroup: Option<&TestCgroup>) -> Result<Command> {
    let nsfd: OwnedFd = fs::File::open(netns).with_context(|| format!("opening {}", netns.display()))?.into();
    let cgfd: Option<OwnedFd> = match cgroup {
        Some(cg) => Some(fs::OpenOptions::new().write(true).open(cg.path.join("cgroup.procs"))?.into()),
        None => None,
    };
    let mut cmd = Command::new(program);
    // SAFETY: only async-signal-safe syscalls between fork and exec; the fds are moved
    // into the closure and stay open until exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(nsfd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = &cgfd {
                // Writing "0" moves the writing process itself.
                if libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(cmd)
}

impl Netns {
    /// A veth pair from this namespace (`dev`) to `peer` (`peer_dev`), both ends up, addressed
    /// 198.18.N.a/24 + fd00:18:N::a/64 here and .b / ::b there (the same digits in both
    /// families, so `(10, 2, 1)` gives 198.18.10.2 and fd00:18:10::2 here).
    pub fn veth_dual(&self, dev: &str, peer: &Netns, peer_dev: &str, (net, a, b): (u8, u8, u8)) -> Result<()> {
        self.ip(&["link", "add", dev, "type", "veth", "peer", "name", peer_dev, "netns", &peer.name])?;
        for (ns, d, h) in [(self, dev, a), (peer, peer_dev, b)] {
            ns.ip(&["addr", "add", &format!("198.18.{net}.{h}/24"), "dev", d])?;
            ns.ip(&["-6", "addr", "add", &format!("fd00:18:{net}::{h}/64"), "dev", d, "nodad"])?;
            ns.ip(&["link", "set", d, "up"])?;
        }
        Ok(())
    }

    /// One route per family: `v4` and `v6` are (destination, gateway).
    pub fn route_dual(&self, v4: (&str, &str), v6: (&str, &str)) -> Result<()> {
        self.ip(&["route", "add", v4.0, "via", v4.1])?;
        self.ip(&["-6", "route", "add", v6.0, "via", v6.1])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// The first cgroup2 mount, mounting one under /run if the machine has none (cgroup v1 hosts).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    if let Some(mp) = mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
    }) {
        return Ok(mp);
    }
    let mp = PathBuf::from("/run/gardenet-test/cgroup2");
    fs::create_dir_all(&mp)?;
    let (src, target, ty) = (CString::new("cgroup2")?, CString::new(mp.as_os_str().as_encoded_bytes())?, CString::new("cgroup2")?);
    // SAFETY: mount(2) with valid C strings.
    if unsafe { libc::mount(src.as_ptr(), target.as_ptr(), ty.as_ptr(), 0, std::ptr::null()) } != 0 {
        bail!("mounting cgroup2 at {}: {}", mp.display(), std::io::Error::last_os_error());
    }
    Ok(mp)
}

/// A cgroup2 directory owned by the test; socket LB attaches here, never to the root.
pub struct TestCgroup {
    pub path: PathBuf,
}

impl TestCgroup {
    pub fn new(tag: &str) -> Result<Self> {
        let path = cgroup2_mount()?.join(tag);
        fs::create_dir_all(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(TestCgroup { path })
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Members are killed by their guards first; a cgroup with live members cannot go.
        if let Ok(procs) = fs::read_to_string(self.path.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) on pids that are members of our own test cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for _ in 0..50 {
            if fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// A child process killed (SIGTERM, then SIGKILL) on drop.
pub struct Proc {
    pub child: Child,
    pub what: String,
}

impl Proc {
    pub fn spawn(mut cmd: Command, what: &str) -> Result<Self> {
        let child = cmd.stdin(Stdio::null()).spawn().with_context(|| format!("starting {what}"))?;
        Ok(Proc { child, what: what.to_owned() })
    }

    pub fn terminate(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            for _ in 0..100 {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// SIGKILL (no chance to clean up, as a crash or the OOM killer), then reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// Path of a binary built next to the running executable (target/<profile>/NAME).
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(format!("GARDENET_{}_BIN", name.to_uppercase().replace('-', "_"))) {
        return Ok(p.into());
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(2) {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("{name} not found next to {} (build it: cargo build -p gardenet-agent -p gardenet-tests --bins)", exe.display())
}

impl Netns {
    /// Runs `f` on a thread that has entered this namespace (netlink sockets, ifindex
    /// lookups and BPF_PROG_QUERY on interfaces then refer to it).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        let fd: OwnedFd = fs::File::open(self.path())?.into();
        std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: setns on this (scoped, short-lived) thread only.
                if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(anyhow::anyhow!("setns: {}", std::io::Error::last_os_error()));
                }
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in {} panicked", self.name))?
        })
    }

    /// Names of the programs attached to `iface` at a tcx hook (kernel's view).
    /// Names of the BPF programs on an interface's TC hook (`ty`: `TcxIngress` or `TcxEgress`),
    /// as the kernel reports them: tcx where the kernel has it, else the clsact qdisc's
    /// cls_bpf filters (one per line of `tc filter show`, named by program).
    pub fn tc_programs(&self, iface: &str, ty: gardenet_agent::links::pinned::AttachType) -> Result<Vec<String>> {
        if gardenet_agent::dataplane::features::KernelFeatures::probe().tcx {
            return self.tcx_programs(iface, ty);
        }
        let dir = if ty == gardenet_agent::links::pinned::AttachType::TcxIngress { "ingress" } else { "egress" };
        let out = Command::new("tc").args(["-n", &self.name, "filter", "show", "dev", iface, dir]).output()?;
        if !out.status.success() {
            bail!("tc filter show dev {iface} {dir}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let filters = text.lines().filter(|l| l.contains(" bpf ") && l.contains(" handle "));
        Ok(filters.filter_map(|l| l.split_whitespace().find(|w| w.starts_with("gn_")).map(String::from)).collect())
    }

    pub fn tcx_programs(&self, iface: &str, ty: gardenet_agent::links::pinned::AttachType) -> Result<Vec<String>> {
        let iface = CString::new(iface)?;
        self.run_in(move || -> Result<Vec<String>> {
            // SAFETY: valid C string.
            let idx = unsafe { libc::if_nametoindex(iface.as_ptr()) };
            if idx == 0 {
                bail!("no such interface");
            }
            let ids = gardenet_agent::links::pinned::prog_query(idx, ty)?;
            Ok(ids.into_iter().map(|id| gardenet_agent::links::pinned::prog_name(id).unwrap_or_default()).collect())
        })?
    }
}

impl TestCgroup {
    /// Names of the programs attached to this cgroup at a hook (kernel's view).
    pub fn programs(&self, ty: gardenet_agent::links::pinned::AttachType) -> Result<Vec<String>> {
        let f = fs::File::open(&self.path)?;
        let ids = gardenet_agent::links::pinned::prog_query(f.as_raw_fd() as u32, ty)?;
        Ok(ids.into_iter().map(|id| gardenet_agent::links::pinned::prog_name(id).unwrap_or_default()).collect())
    }
}
