//! Keeps the kernel from giving the node's own sockets the ports TC LB answers on.
//!
//! TC LB translates packets addressed to the node's own addresses by port: a NodePort's
//! packets are DNATed to a backend, and replies to its source-NAT ports (`SNAT_PORT_MIN..`) are
//! sent back to a client. A node-local connection whose ephemeral port is one of those would
//! have its replies taken over (a SYN-ACK to node:30080 DNATed to a pod). kube-proxy's NAT
//! does not meet this (netfilter conntrack knows the local socket's flow), and with Linux's
//! default `ip_local_port_range` (32768-60999) neither range is ephemeral. Nodes tuned for
//! many connections often widen it ("1024 65535"): then the overlapping ports are added to
//! `net.ipv4.ip_local_reserved_ports`, which only stops the kernel from choosing them for a
//! socket (an explicit `bind()` still works), as Cilium does for its NodePort range.
//! Nothing is removed again: the reservation outlives the agent until the node reboots.
use std::{
    fmt,
    path::{Path, PathBuf},
    str::FromStr,
};

/// An inclusive port range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    pub fn new(lo: u16, hi: u16) -> Option<Self> {
        (lo <= hi).then_some(PortRange { lo, hi })
    }

    fn intersect(self, o: PortRange) -> Option<PortRange> {
        PortRange::new(self.lo.max(o.lo), self.hi.min(o.hi))
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lo == self.hi {
            write!(f, "{}", self.lo)
        } else {
            write!(f, "{}-{}", self.lo, self.hi)
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PortsError {
    #[error("{0:?}: not a port or a range of ports (LOW-HIGH)")]
    Syntax(String),
    #[error("{path}: {err}")]
    Io { path: String, err: String },
    #[error("no way to write ip_local_reserved_ports = {0:?}")]
    Nowhere(String),
}

impl FromStr for PortRange {
    type Err = PortsError;
    /// `30000-32767` or `8080`.
    fn from_str(s: &str) -> Result<Self, PortsError> {
        let bad = || PortsError::Syntax(s.to_string());
        let port = |p: &str| p.trim().parse::<u16>().map_err(|_| bad());
        let (lo, hi) = match s.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => (port(s)?, port(s)?),
        };
        PortRange::new(lo, hi).ok_or_else(bad)
    }
}

/// `ip_local_port_range`: two numbers separated by white space.
pub fn parse_ephemeral(s: &str) -> Result<PortRange, PortsError> {
    let bad = || PortsError::Syntax(s.trim().to_string());
    let mut it = s.split_whitespace().map(|p| p.parse::<u16>().map_err(|_| bad()));
    match (it.next(), it.next(), it.next()) {
        (Some(lo), Some(hi), None) => PortRange::new(lo?, hi?).ok_or_else(bad),
        _ => Err(bad()),
    }
}

/// `ip_local_reserved_ports`: ports and ranges separated by commas; empty when none.
pub fn parse_reserved(s: &str) -> Result<Vec<PortRange>, PortsError> {
    s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()).map(PortRange::from_str).collect()
}

/// Sorted, with overlapping and adjacent ranges merged.
fn normalized(mut v: Vec<PortRange>) -> Vec<PortRange> {
    v.sort();
    let mut out: Vec<PortRange> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if u32::from(r.lo) <= u32::from(last.hi) + 1 => last.hi = last.hi.max(r.hi),
            _ => out.push(r),
        }
    }
    out
}

/// The parts of `want` that the kernel may hand out (`ephemeral`) and that are not reserved.
pub fn unprotected(ephemeral: PortRange, reserved: &[PortRange], want: PortRange) -> Vec<PortRange> {
    let Some(exposed) = want.intersect(ephemeral) else { return Vec::new() };
    let mut out = Vec::new();
    let mut from = u32::from(exposed.lo);
    for r in normalized(reserved.to_vec()) {
        if u32::from(r.hi) < from || r.lo > exposed.hi {
            continue;
        }
        if u32::from(r.lo) > from {
            out.push(PortRange { lo: from as u16, hi: r.lo - 1 });
        }
        from = u32::from(r.hi) + 1;
    }
    if from <= u32::from(exposed.hi) {
        out.push(PortRange { lo: from as u16, hi: exposed.hi });
    }
    out
}

/// `ip_local_reserved_ports` as written: the ranges merged, comma-separated.
pub fn format_reserved(v: &[PortRange]) -> String {
    normalized(v.to_vec()).iter().map(PortRange::to_string).collect::<Vec<_>>().join(",")
}

/// What one check found and did.
#[derive(Debug, PartialEq, Eq)]
pub struct Check {
    /// Ranges added to `ip_local_reserved_ports` now, each with what it protects.
    pub added: Vec<(&'static str, PortRange)>,
    /// The ephemeral range seen.
    pub ephemeral: PortRange,
}

/// Reads the two sysctls under `dir` (`/proc/sys/net/ipv4` of the agent's network namespace:
/// the node's) and reserves the parts of `want` (what, ports) the kernel could hand out,
/// writing through the first of `write` that takes it (see [`SysctlDirs`]).
pub fn protect(dir: &Path, write: &[PathBuf], want: &[(&'static str, PortRange)]) -> Result<Check, PortsError> {
    let io = |p: &Path, e: std::io::Error| PortsError::Io { path: p.display().to_string(), err: e.to_string() };
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(|e| io(&p, e))
    };
    let ephemeral = parse_ephemeral(&read("ip_local_port_range")?)?;
    let reserved = parse_reserved(&read("ip_local_reserved_ports")?)?;
    let added: Vec<(&'static str, PortRange)> =
        want.iter().flat_map(|&(what, r)| unprotected(ephemeral, &reserved, r).into_iter().map(move |r| (what, r))).collect();
    if !added.is_empty() {
        let all: Vec<PortRange> = reserved.iter().copied().chain(added.iter().map(|(_, r)| *r)).collect();
        write_first(write, &format_reserved(&all))?;
    }
    Ok(Check { added, ephemeral })
}

/// Writes `ip_local_reserved_ports` through the first of `dirs` that takes it; else the last
/// failure.
fn write_first(dirs: &[PathBuf], value: &str) -> Result<(), PortsError> {
    let mut last = PortsError::Nowhere(value.to_string());
    for d in dirs {
        let p = d.join("ip_local_reserved_ports");
        match std::fs::write(&p, value) {
            Ok(()) => return Ok(()),
            Err(e) => last = PortsError::Io { path: p.display().to_string(), err: e.to_string() },
        }
    }
    Err(last)
}

/// Ports of `added` (for the log).
pub fn describe(added: &[(&'static str, PortRange)]) -> String {
    added.iter().map(|(what, r)| format!("{r} ({what})")).collect::<Vec<_>>().join(", ")
}

/// Where the sysctls of the agent's network namespace (the node's, with `hostNetwork`) are
/// read and written: `/proc/sys/net/ipv4`, and, for the write, also through the node's root
/// (`<node's /proc>/1/root/proc/sys/net/ipv4`): in a container `/proc/sys` is read-only, but
/// that path is the node's own procfs mount, and a `net` sysctl belongs to the namespace of
/// whoever opens it. (Needs CAP_SYS_PTRACE, as `--host-proc` does for socket termination.)
pub struct SysctlDirs {
    pub read: PathBuf,
    pub write: Vec<PathBuf>,
}

impl SysctlDirs {
    pub fn of_node(host_proc: &Path) -> Self {
        let own = PathBuf::from("/proc/sys/net/ipv4");
        SysctlDirs { read: own.clone(), write: vec![own, host_proc.join("1/root/proc/sys/net/ipv4")] }
    }
}

/// The agent's standing check (every tick): reserves what is missing, says what it did, and
/// says a failure once until it changes.
pub struct Guard {
    dirs: SysctlDirs,
    want: Vec<(&'static str, PortRange)>,
    last_error: Option<PortsError>,
}

impl Guard {
    pub fn new(dirs: SysctlDirs, want: Vec<(&'static str, PortRange)>) -> Self {
        Guard { dirs, want, last_error: None }
    }

    /// What it keeps reserved: (what, ports).
    pub fn wanted(&self) -> &[(&'static str, PortRange)] {
        &self.want
    }

    pub fn check(&mut self) {
        if self.want.is_empty() {
            return;
        }
        match protect(&self.dirs.read, &self.dirs.write, &self.want) {
            Ok(c) => {
                if !c.added.is_empty() {
                    tracing::info!(
                        "reserved local ports {} (net.ipv4.ip_local_reserved_ports): the node's ephemeral ports ({}) include ports TC LB translates",
                        describe(&c.added),
                        c.ephemeral
                    );
                }
                self.last_error = None;
            }
            Err(e) => {
                if self.last_error.as_ref() != Some(&e) {
                    tracing::warn!(
                        "cannot check or reserve local ports {}: {e}; if net.ipv4.ip_local_port_range includes them, reserve them in net.ipv4.ip_local_reserved_ports, or the node's own connections from such a port may be translated",
                        describe(&self.want)
                    );
                }
                self.last_error = Some(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Number of ports in `v`.
    fn count(v: &[(&'static str, PortRange)]) -> u32 {
        v.iter().map(|(_, r)| u32::from(r.hi) - u32::from(r.lo) + 1).sum()
    }

    fn r(lo: u16, hi: u16) -> PortRange {
        PortRange::new(lo, hi).unwrap()
    }

    #[test]
    fn parses_what_the_kernel_writes() {
        assert_eq!(parse_ephemeral("32768\t60999\n"), Ok(r(32768, 60999)));
        assert_eq!(parse_ephemeral("1024 65535"), Ok(r(1024, 65535)));
        assert!(parse_ephemeral("60999 32768").is_err());
        assert!(parse_ephemeral("1024").is_err());
        assert!(parse_ephemeral("1024 65535 7").is_err());
        assert_eq!(parse_reserved("\n"), Ok(vec![]));
        assert_eq!(parse_reserved("8080,9000-9100\n"), Ok(vec![r(8080, 8080), r(9000, 9100)]));
        assert!(parse_reserved("80,x").is_err());
        assert_eq!("30000-32767".parse(), Ok(r(30000, 32767)));
        assert_eq!("8080".parse(), Ok(r(8080, 8080)));
        assert!("32767-30000".parse::<PortRange>().is_err());
        assert!("70000".parse::<PortRange>().is_err());
    }

    #[test]
    fn only_the_ephemeral_part_not_yet_reserved_is_missing() {
        let (np, snat) = (r(30000, 32767), r(61000, 65535));
        // Linux's default range: nothing to do.
        assert_eq!(unprotected(r(32768, 60999), &[], np), vec![]);
        assert_eq!(unprotected(r(32768, 60999), &[], snat), vec![]);
        // Widened at the top: the source-NAT ports only.
        assert_eq!(unprotected(r(32768, 65535), &[], snat), vec![snat]);
        assert_eq!(unprotected(r(32768, 65535), &[], np), vec![]);
        // Partly overlapping, partly reserved already (by the administrator).
        assert_eq!(unprotected(r(31000, 65535), &[r(30500, 31500), r(32000, 32000)], np), vec![r(31501, 31999), r(32001, 32767)]);
        assert_eq!(unprotected(r(1024, 65535), &[r(0, 65535)], np), vec![]);
        assert_eq!(unprotected(r(1024, 65535), &[r(30000, 32767)], np), vec![]);
        assert_eq!(unprotected(r(1024, 62000), &[r(64000, 65000)], snat), vec![r(61000, 62000)]);
    }

    #[test]
    fn writes_merged_ranges() {
        assert_eq!(format_reserved(&[r(9000, 9100), r(8080, 8080), r(9101, 9200), r(9150, 9300)]), "8080,9000-9300");
        assert_eq!(format_reserved(&[]), "");
    }

    #[test]
    fn protect_adds_to_what_is_there_and_only_once() {
        struct Dir(std::path::PathBuf);
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let dir = Dir(std::env::temp_dir().join(format!("gardenet-reserved-ports-{}", std::process::id())));
        let d = dir.0.as_path();
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("ip_local_port_range"), "1024\t65535\n").unwrap();
        std::fs::write(d.join("ip_local_reserved_ports"), "8080\n").unwrap();
        let want = [("NodePorts", r(30000, 32767)), ("source NAT", r(61000, 65535))];
        // The first way to write fails (as a container's read-only /proc/sys): the next is used.
        let c = protect(d, &[d.join("read-only"), d.to_path_buf()], &want).unwrap();
        assert_eq!(c.added, want.to_vec());
        assert_eq!(count(&c.added), 2768 + 4536);
        assert_eq!(describe(&c.added), "30000-32767 (NodePorts), 61000-65535 (source NAT)");
        assert_eq!(std::fs::read_to_string(d.join("ip_local_reserved_ports")).unwrap(), "8080,30000-32767,61000-65535");
        // As the kernel reads it back: nothing more to do.
        assert_eq!(protect(d, &[], &want).unwrap().added, vec![]);
        // A missing sysctl (no IPv4 in this namespace?) is an error, not a panic.
        let e = protect(&d.join("nope"), &[d.to_path_buf()], &want).unwrap_err();
        assert!(matches!(e, PortsError::Io { .. }), "{e}");
        // No way to write: the last failure is told.
        std::fs::write(d.join("ip_local_reserved_ports"), "").unwrap();
        let e = protect(d, &[d.join("read-only")], &want).unwrap_err();
        assert!(e.to_string().contains("read-only/ip_local_reserved_ports"), "{e}");
        assert!(matches!(e, PortsError::Io { .. }), "{e}");
    }
}
