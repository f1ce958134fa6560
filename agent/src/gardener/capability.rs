//! Can this node run gardenet's dataplane? Gardener's contract wants a precise answer when
//! kube-proxy is disabled and gardenet cannot route Services: the Network's `lastError`
//! must say *what* is missing. [`check`] returns exactly that, as human-readable strings.
//!
//! The host is behind the [`HostProbe`] trait so the decision logic is testable without
//! root; [`LinuxHost`] is the real probe.

use std::io;
use std::path::{Path, PathBuf};

/// `statfs` magic of bpffs.
pub const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// `statfs` magic of cgroup v2.
pub const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Capability bit numbers (linux/capability.h) the dataplane depends on.
pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_SYS_ADMIN: u32 = 21;

/// Oldest kernel gardenet supports: the first LTS with everything the datapath uses
/// (cgroup sock_addr hooks incl. getpeername, BTF, bpf_link for cgroups and XDP).
pub const MIN_KERNEL: KernelVersion = KernelVersion { major: 5, minor: 10 };

/// `major.minor` of a kernel release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
}

impl KernelVersion {
    /// Parses the leading `major.minor` of a release string such as `5.15.0-91-generic`
    /// or `6.6.12+`; `None` when there is none.
    pub fn parse(release: &str) -> Option<Self> {
        let mut parts = release.trim().splitn(3, '.');
        let major = parts.next()?.parse().ok()?;
        let minor_part = parts.next()?;
        let digits = minor_part.find(|c: char| !c.is_ascii_digit()).unwrap_or(minor_part.len());
        let minor = minor_part[..digits].parse().ok()?;
        Some(Self { major, minor })
    }
}

impl std::fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What the dataplane needs from this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirements {
    /// Where maps and programs are pinned (`--bpffs`); must be on a bpffs, or mountable.
    pub bpffs: PathBuf,
    /// Root of the cgroup v2 hierarchy for the socket LB hooks (`--cgroup`); `None` when
    /// socket LB is disabled and no cgroup is needed.
    pub cgroup: Option<PathBuf>,
    pub min_kernel: KernelVersion,
}

impl Requirements {
    pub fn new(bpffs: impl Into<PathBuf>, cgroup: Option<PathBuf>) -> Self {
        Self { bpffs: bpffs.into(), cgroup, min_kernel: MIN_KERNEL }
    }
}

/// Everything [`check`] asks the host. All methods must be side-effect free (apart from
/// the short-lived probe map of [`HostProbe::bpf_map_create`]).
pub trait HostProbe {
    /// The kernel release (`uname -r`).
    fn kernel_release(&self) -> io::Result<String>;
    /// `statfs(path).f_type`; an error of kind `NotFound` when `path` does not exist.
    fn fs_magic(&self, path: &Path) -> io::Result<i64>;
    /// The effective capability set of this process, as a bit mask.
    fn effective_capabilities(&self) -> io::Result<u64>;
    /// Whether the kernel knows filesystem type `fstype` (`/proc/filesystems`).
    fn filesystem_supported(&self, fstype: &str) -> io::Result<bool>;
    /// Creates (and closes) a 1-entry BPF array map; `Err(errno)` when the kernel refuses.
    fn bpf_map_create(&self) -> Result<(), i32>;
}

/// Result of [`check`]: what is missing, one human-readable item each. Empty means the
/// node can run the dataplane as far as a probe can tell; program loading (verifier) can
/// still fail later, see [`CapabilityReport::add`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapabilityReport {
    pub missing: Vec<String>,
}

impl CapabilityReport {
    pub fn is_capable(&self) -> bool {
        self.missing.is_empty()
    }

    /// Records a problem found outside the probe, e.g. programs rejected by the verifier.
    pub fn add(&mut self, what: impl Into<String>) {
        self.missing.push(what.into());
    }

    /// All items in one line, for status messages.
    pub fn summary(&self) -> String {
        self.missing.join("; ")
    }
}

/// Probes the host for everything in `req`; never fails, an unanswerable question becomes
/// a missing item that says why.
pub fn check(probe: &dyn HostProbe, req: &Requirements) -> CapabilityReport {
    let mut report = CapabilityReport::default();

    match probe.kernel_release() {
        Ok(release) => match KernelVersion::parse(&release) {
            Some(v) if v >= req.min_kernel => {}
            Some(v) => report.add(format!("kernel {v} ({release}) is too old: gardenet needs Linux >= {}", req.min_kernel)),
            None => report.add(format!("kernel release {release:?} cannot be parsed: gardenet needs Linux >= {}", req.min_kernel)),
        },
        Err(e) => report.add(format!("kernel release unknown (uname failed: {e})")),
    }

    let caps = probe.effective_capabilities();
    let has_cap = |bit: u32| caps.as_ref().map(|c| c & (1u64 << bit) != 0).unwrap_or(false);
    if let Err(e) = &caps {
        report.add(format!("effective capabilities unknown: {e}"));
    }
    // Loading TC and cgroup-sock programs and attaching them needs CAP_NET_ADMIN in
    // addition to CAP_BPF; the bpf() probe below cannot see that.
    if caps.is_ok() && !has_cap(CAP_NET_ADMIN) {
        report.add("capability NET_ADMIN is missing (needed to load and attach TC and cgroup programs)");
    }
    let can_mount = has_cap(CAP_SYS_ADMIN);

    match probe.bpf_map_create() {
        Ok(()) => {}
        Err(libc::EPERM) => report.add(
            "bpf() is not permitted (EPERM): the agent needs capability BPF (or SYS_ADMIN on kernels \
             before 5.8), a seccomp profile that allows bpf(), and on kernels before 5.11 a \
             sufficient RLIMIT_MEMLOCK (capability SYS_RESOURCE)",
        ),
        Err(libc::ENOSYS) => report.add("the kernel has no bpf() syscall (CONFIG_BPF_SYSCALL is off)"),
        Err(errno) => report.add(format!("creating a BPF map failed: {}", io::Error::from_raw_os_error(errno))),
    }

    check_bpffs(probe, &req.bpffs, can_mount, &mut report);
    if let Some(cgroup) = &req.cgroup {
        check_cgroup2(probe, cgroup, can_mount, &mut report);
    }
    report
}

/// The pin path may not exist yet (the agent creates it); what counts is that it would be
/// on a bpffs, i.e. the nearest existing ancestor is one, or that bpffs can be mounted there.
fn check_bpffs(probe: &dyn HostProbe, path: &Path, can_mount: bool, report: &mut CapabilityReport) {
    let mut at = Some(path);
    while let Some(p) = at {
        match probe.fs_magic(p) {
            Ok(BPF_FS_MAGIC) => return,
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => at = p.parent(),
            Err(e) => {
                report.add(format!("cannot inspect bpffs path {}: {e}", p.display()));
                return;
            }
        }
    }
    if !mountable(probe, "bpf", can_mount) {
        report.add(format!("bpffs is not mounted at {} (nor at a parent) and cannot be mounted: {}", path.display(), mount_obstacle(probe, "bpf", can_mount)));
    }
}

/// Unlike the pin path, the cgroup path must itself be a cgroup2 mount: programs attached to
/// a sub-directory would only see that subtree's sockets.
fn check_cgroup2(probe: &dyn HostProbe, path: &Path, can_mount: bool, report: &mut CapabilityReport) {
    match probe.fs_magic(path) {
        Ok(CGROUP2_SUPER_MAGIC) => return,
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            report.add(format!("cannot inspect cgroup2 path {}: {e}", path.display()));
            return;
        }
    }
    if !mountable(probe, "cgroup2", can_mount) {
        report.add(format!(
            "cgroup2 is not mounted at {} and cannot be mounted: {} (socket LB needs cgroup v2)",
            path.display(),
            mount_obstacle(probe, "cgroup2", can_mount)
        ));
    }
}

fn mountable(probe: &dyn HostProbe, fstype: &str, can_mount: bool) -> bool {
    can_mount && probe.filesystem_supported(fstype).unwrap_or(false)
}

fn mount_obstacle(probe: &dyn HostProbe, fstype: &str, can_mount: bool) -> String {
    match probe.filesystem_supported(fstype) {
        Ok(false) => format!("the kernel does not support filesystem type {fstype}"),
        Err(e) => format!("cannot read the supported filesystems: {e}"),
        Ok(true) if !can_mount => "the agent lacks capability SYS_ADMIN".to_owned(),
        Ok(true) => "unknown".to_owned(),
    }
}

/// The real host, via libc and procfs.
#[derive(Clone, Copy, Debug, Default)]
pub struct LinuxHost;

impl HostProbe for LinuxHost {
    fn kernel_release(&self) -> io::Result<String> {
        // SAFETY: utsname is plain old data; uname fills it and we read a NUL-terminated field.
        let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
        if unsafe { libc::uname(&mut uts) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let release = unsafe { std::ffi::CStr::from_ptr(uts.release.as_ptr()) };
        Ok(release.to_string_lossy().into_owned())
    }

    fn fs_magic(&self, path: &Path) -> io::Result<i64> {
        use std::os::unix::ffi::OsStrExt;
        let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
        // SAFETY: statfs writes into a zeroed, properly sized struct; the path is NUL-terminated.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // f_type's C type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        Ok(st.f_type as i64)
    }

    fn effective_capabilities(&self) -> io::Result<u64> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        parse_cap_eff(&status).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no CapEff in /proc/self/status"))
    }

    fn filesystem_supported(&self, fstype: &str) -> io::Result<bool> {
        let list = std::fs::read_to_string("/proc/filesystems")?;
        Ok(list.lines().any(|l| l.split_whitespace().last() == Some(fstype)))
    }

    fn bpf_map_create(&self) -> Result<(), i32> {
        /// The BPF_MAP_CREATE part of `union bpf_attr`, padded with zeros: the kernel
        /// accepts a larger attr as long as the bytes it does not know are zero.
        #[repr(C)]
        struct MapCreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            rest: [u32; 28],
        }
        const BPF_MAP_CREATE: libc::c_long = 0;
        const BPF_MAP_TYPE_ARRAY: u32 = 2;
        let attr = MapCreateAttr { map_type: BPF_MAP_TYPE_ARRAY, key_size: 4, value_size: 4, max_entries: 1, rest: [0; 28] };
        // SAFETY: the attr pointer and size describe a live, initialized struct.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &attr as *const MapCreateAttr, std::mem::size_of::<MapCreateAttr>() as libc::c_uint) };
        if fd < 0 {
            return Err(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
        }
        // SAFETY: fd was just returned to us by the kernel and is closed exactly once.
        unsafe { libc::close(fd as libc::c_int) };
        Ok(())
    }
}

/// The `CapEff:` bit mask of a `/proc/<pid>/status` text.
fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(line.trim(), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A scripted host.
    struct FakeHost {
        release: &'static str,
        mounts: HashMap<&'static str, i64>,
        caps: u64,
        filesystems: &'static [&'static str],
        bpf: Result<(), i32>,
    }

    const ALL_CAPS: u64 = (1 << 41) - 1;
    const TMPFS: i64 = 0x0102_1994;
    const SYSFS: i64 = 0x6265_6572;

    impl FakeHost {
        /// A node with everything in place.
        fn good() -> Self {
            Self {
                release: "6.1.0-18-cloud-amd64",
                mounts: HashMap::from([
                    ("/", 0xef53),
                    ("/sys/fs/bpf", BPF_FS_MAGIC),
                    ("/sys/fs", SYSFS),
                    ("/sys", SYSFS),
                    ("/run", TMPFS),
                    ("/run/gardenet", TMPFS),
                    ("/run/gardenet/cgroupv2", CGROUP2_SUPER_MAGIC),
                ]),
                caps: ALL_CAPS,
                filesystems: &["sysfs", "bpf", "cgroup2"],
                bpf: Ok(()),
            }
        }
    }

    impl HostProbe for FakeHost {
        fn kernel_release(&self) -> io::Result<String> {
            Ok(self.release.to_owned())
        }
        fn fs_magic(&self, path: &Path) -> io::Result<i64> {
            let key = path.to_str().unwrap();
            self.mounts.get(key).copied().ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
        }
        fn effective_capabilities(&self) -> io::Result<u64> {
            Ok(self.caps)
        }
        fn filesystem_supported(&self, fstype: &str) -> io::Result<bool> {
            Ok(self.filesystems.contains(&fstype))
        }
        fn bpf_map_create(&self) -> Result<(), i32> {
            self.bpf
        }
    }

    fn req() -> Requirements {
        Requirements::new("/sys/fs/bpf/gardenet", Some("/run/gardenet/cgroupv2".into()))
    }

    #[test]
    fn capable_node_has_nothing_missing() {
        let r = check(&FakeHost::good(), &req());
        assert!(r.is_capable(), "{r:?}");
    }

    #[test]
    fn kernel_versions() {
        assert_eq!(KernelVersion::parse("5.10.0"), Some(KernelVersion { major: 5, minor: 10 }));
        assert_eq!(KernelVersion::parse("6.6.12+"), Some(KernelVersion { major: 6, minor: 6 }));
        assert_eq!(KernelVersion::parse("5.4-rc1"), Some(KernelVersion { major: 5, minor: 4 }));
        assert_eq!(KernelVersion::parse("garbage"), None);
        assert!(KernelVersion::parse("5.9.1").unwrap() < MIN_KERNEL);
        assert!(KernelVersion::parse("5.10.1").unwrap() >= MIN_KERNEL);

        let host = FakeHost { release: "4.19.0-25-amd64", ..FakeHost::good() };
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 1, "{r:?}");
        assert!(r.missing[0].contains("too old") && r.missing[0].contains(">= 5.10"), "{r:?}");
    }

    #[test]
    fn bpf_not_permitted() {
        let host = FakeHost { bpf: Err(libc::EPERM), ..FakeHost::good() };
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 1);
        assert!(r.summary().contains("bpf() is not permitted"), "{r:?}");
    }

    #[test]
    fn missing_net_admin() {
        let host = FakeHost { caps: ALL_CAPS & !(1 << CAP_NET_ADMIN), ..FakeHost::good() };
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 1);
        assert!(r.missing[0].contains("NET_ADMIN"), "{r:?}");
    }

    #[test]
    fn unmounted_filesystems_are_fine_when_mountable() {
        let mut host = FakeHost::good();
        host.mounts.insert("/sys/fs/bpf", SYSFS);
        host.mounts.remove("/run/gardenet/cgroupv2");
        assert!(check(&host, &req()).is_capable());
    }

    #[test]
    fn unmounted_filesystems_without_sys_admin() {
        let mut host = FakeHost { caps: ALL_CAPS & !(1 << CAP_SYS_ADMIN), ..FakeHost::good() };
        host.mounts.insert("/sys/fs/bpf", SYSFS);
        host.mounts.insert("/run/gardenet/cgroupv2", TMPFS);
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 2, "{r:?}");
        assert!(r.missing[0].starts_with("bpffs is not mounted at /sys/fs/bpf/gardenet"), "{r:?}");
        assert!(r.missing[0].contains("SYS_ADMIN"), "{r:?}");
        assert!(r.missing[1].starts_with("cgroup2 is not mounted at /run/gardenet/cgroupv2"), "{r:?}");
    }

    #[test]
    fn no_cgroup2_in_kernel() {
        let mut host = FakeHost { filesystems: &["bpf"], ..FakeHost::good() };
        host.mounts.remove("/run/gardenet/cgroupv2");
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 1, "{r:?}");
        assert!(r.missing[0].contains("does not support filesystem type cgroup2"), "{r:?}");
        // Without socket LB the cgroup does not matter.
        let no_sock = Requirements::new("/sys/fs/bpf/gardenet", None);
        assert!(check(&host, &no_sock).is_capable());
    }

    #[test]
    fn cgroup_subdirectory_is_not_enough() {
        let mut host = FakeHost { caps: ALL_CAPS & !(1 << CAP_SYS_ADMIN), ..FakeHost::good() };
        host.mounts.remove("/run/gardenet/cgroupv2");
        host.mounts.insert("/run/gardenet", CGROUP2_SUPER_MAGIC);
        let r = check(&host, &req());
        assert_eq!(r.missing.len(), 1, "{r:?}");
    }

    #[test]
    fn verifier_rejection_can_be_added() {
        let mut r = check(&FakeHost::good(), &req());
        r.add("eBPF programs rejected by the verifier: gn_connect4: invalid mem access");
        assert!(!r.is_capable());
        assert!(r.summary().contains("verifier"));
    }

    #[test]
    fn cap_eff_parsing() {
        let status = "Name:\tgardenet\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x1ff_ffff_ffff));
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }

    /// The real probe must not panic and must answer the questions that need no privilege.
    #[test]
    fn linux_host_smoke() {
        let host = LinuxHost;
        assert!(KernelVersion::parse(&host.kernel_release().unwrap()).is_some());
        assert!(host.effective_capabilities().is_ok());
        assert!(host.filesystem_supported("proc").unwrap());
        assert_eq!(host.fs_magic(Path::new("/definitely/not/here")).unwrap_err().kind(), io::ErrorKind::NotFound);
        // May be Ok or an errno depending on privileges; only the call itself is tested.
        let _ = host.bpf_map_create();
        let _ = check(&host, &req());
    }
}
