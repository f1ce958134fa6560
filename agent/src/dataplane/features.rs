//! What the running kernel offers the datapath, probed once at start.
//!
//! Every optional facility the datapath or the loader can use is asked of the kernel itself
//! (a tiny program loaded, a helper called through `BPF_PROG_TEST_RUN`, a query the kernel
//! either knows or rejects), not inferred from the release string: distributions backport.
//! The loader then picks the path that works (tcx or clsact, how to refuse a connection,
//! source NAT or DNAT only), logs each choice once and reports it through `links` and
//! `/metrics`; nothing is tried blindly at packet time.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use crate::links::pinned::{put_u32, put_u64, sys_bpf};

/// One probed facility: its name (metric label and `links` key), whether the kernel has it,
/// and what gardenet does without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Feature {
    pub name: &'static str,
    pub present: bool,
    /// What the datapath does in its absence (empty for facilities with no fallback).
    pub fallback: &'static str,
}

/// The probe's result.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelFeatures {
    pub release: String,
    /// `/sys/kernel/btf/vmlinux` (required).
    pub btf: bool,
    /// tcx attachment (bpf_link based TC, Linux 6.6).
    pub tcx: bool,
    /// `BPF_LINK_CREATE` for cgroup programs (5.7; required: socket LB attaches that way).
    pub cgroup_link: bool,
    /// `bpf_set_retval` in cgroup programs (5.18): `connect()` fails with ECONNREFUSED.
    pub set_retval: bool,
    /// `cgroup/getpeername4|6` (5.8; required: getpeername() must show the frontend).
    pub getpeername_hooks: bool,
    /// `BPF_FIB_LOOKUP_SRC` (6.7): the FIB yields the node's source address for source NAT.
    pub fib_lookup_src: bool,
    /// sock_diag's `SOCK_DESTROY` for UDP sockets (`CONFIG_INET_DIAG_DESTROY`), tried on a
    /// socket of the agent's own: how connected UDP sockets leave a departed backend.
    pub sock_destroy: bool,
}

impl KernelFeatures {
    /// Asks the running kernel. Never fails: a question the kernel cannot answer counts as
    /// "absent".
    pub fn probe() -> KernelFeatures {
        raise_memlock_limit();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default();
        let btf_blob = std::fs::read("/sys/kernel/btf/vmlinux").ok();
        KernelFeatures {
            release,
            btf: btf_blob.is_some(),
            tcx: probe_tcx(),
            cgroup_link: probe_cgroup_link(),
            set_retval: probe_helper(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, ATTACH_CGROUP_INET4_CONNECT, HELPER_SET_RETVAL),
            getpeername_hooks: load_trivial(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, ATTACH_CGROUP_INET4_GETPEERNAME).is_ok(),
            fib_lookup_src: probe_fib_lookup_src(),
            sock_destroy: crate::dataplane::sockterm::probe().is_ok(),
        }
    }

    /// Every facility with what its absence means, for logs, `links` and metrics.
    pub fn list(&self) -> Vec<Feature> {
        let f = |name, present, fallback| Feature { name, present, fallback };
        vec![
            f("btf", self.btf, ""),
            f("cgroup_link", self.cgroup_link, ""),
            f("getpeername_hooks", self.getpeername_hooks, ""),
            f("tcx", self.tcx, "TC LB attaches as a clsact cls_bpf filter (priority 1, handle 0x6e00)"),
            f("set_retval", self.set_retval, "connect() to a frontend without backends fails at once with EPERM instead of ECONNREFUSED"),
            f("fib_lookup_src", self.fib_lookup_src, "no source NAT to endpoints on other nodes: external traffic is only DNATed"),
            f("sock_destroy", self.sock_destroy, "connected UDP sockets are not moved off a departed backend (no CONFIG_INET_DIAG_DESTROY)"),
        ]
    }

    /// What the datapath cannot run without: `Some(reason)` when this kernel lacks it.
    pub fn missing_required(&self) -> Option<String> {
        let missing: Vec<&str> = self.list().into_iter().filter(|f| f.fallback.is_empty() && !f.present).map(|f| f.name).collect();
        (!missing.is_empty()).then(|| format!("kernel {} lacks {}", self.release, missing.join(", ")))
    }

    /// One log line: what this kernel has and what gardenet does instead of what it lacks.
    pub fn summary(&self) -> String {
        let (have, lack): (Vec<Feature>, Vec<Feature>) = self.list().into_iter().partition(|f| f.present);
        let mut s = format!("kernel {}: has {}", self.release, have.iter().map(|f| f.name).collect::<Vec<_>>().join(", "));
        for f in lack {
            s += &format!("; no {}: {}", f.name, if f.fallback.is_empty() { "required" } else { f.fallback });
        }
        s
    }
}

/// Kernels before 5.11 charge BPF maps and programs to `RLIMIT_MEMLOCK` (per user, so all of
/// root's pinned maps count): without this a second agent, or the probes above, fail with
/// EPERM once a few maps exist. Later kernels use memory cgroups and ignore it.
pub fn raise_memlock_limit() {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain setrlimit with a valid struct; failure (no CAP_SYS_RESOURCE) is left to
    // surface as the load error that follows.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
}

const BPF_PROG_LOAD: i64 = 5;
const BPF_PROG_TEST_RUN: i64 = 10;
const BPF_PROG_QUERY: i64 = 16;
const BPF_LINK_CREATE: i64 = 28;

const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const ATTACH_CGROUP_INET4_CONNECT: u32 = 10;
const ATTACH_CGROUP_INET4_GETPEERNAME: u32 = 29;
const ATTACH_TCX_INGRESS: u32 = 46;
const HELPER_FIB_LOOKUP: i32 = 69;
const HELPER_SET_RETVAL: i32 = 187;
const BPF_FIB_LOOKUP_SRC: i32 = 1 << 4;

/// One BPF instruction (`struct bpf_insn`).
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | dst;
    b[2..4].copy_from_slice(&off.to_ne_bytes());
    b[4..8].copy_from_slice(&imm.to_ne_bytes());
    u64::from_ne_bytes(b)
}
const MOV64_IMM: u8 = 0xb7;
const MOV64_REG: u8 = 0xbf;
const ADD64_IMM: u8 = 0x07;
const ST_DW: u8 = 0x7a;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;

fn load(prog_type: u32, attach_type: u32, insns: &[u64]) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut a = [0u8; 128];
    put_u32(&mut a, 0, prog_type);
    put_u32(&mut a, 4, insns.len() as u32);
    put_u64(&mut a, 8, insns.as_ptr() as u64);
    put_u64(&mut a, 16, license.as_ptr() as u64);
    put_u32(&mut a, 68, attach_type); // expected_attach_type
    let fd = sys_bpf(BPF_PROG_LOAD, &mut a)?;
    // SAFETY: a new fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `return 1`.
fn load_trivial(prog_type: u32, attach_type: u32) -> io::Result<OwnedFd> {
    load(prog_type, attach_type, &[insn(MOV64_IMM, 0, 0, 0, 1), insn(EXIT, 0, 0, 0, 0)])
}

/// Whether the verifier lets a program of this type call `helper` (with argument 0).
fn probe_helper(prog_type: u32, attach_type: u32, helper: i32) -> bool {
    let prog = [insn(MOV64_IMM, 1, 0, 0, 0), insn(CALL, 0, 0, 0, helper), insn(MOV64_IMM, 0, 0, 0, 1), insn(EXIT, 0, 0, 0, 0)];
    load(prog_type, attach_type, &prog).is_ok()
}

/// tcx: a query for the tcx ingress hook of `lo` is an unknown attach type before 6.6.
fn probe_tcx() -> bool {
    let mut a = [0u8; 128];
    put_u32(&mut a, 0, 1); // ifindex of lo, in every network namespace
    put_u32(&mut a, 4, ATTACH_TCX_INGRESS);
    sys_bpf(BPF_PROG_QUERY, &mut a).is_ok()
}

/// cgroup links: `BPF_LINK_CREATE` with a bad cgroup fd fails with EBADF where the command
/// exists for cgroup programs, EINVAL where it does not.
fn probe_cgroup_link() -> bool {
    let Ok(prog) = load_trivial(BPF_PROG_TYPE_CGROUP_SOCK_ADDR, ATTACH_CGROUP_INET4_CONNECT) else { return false };
    let mut a = [0u8; 128];
    put_u32(&mut a, 0, prog.as_raw_fd() as u32);
    put_u32(&mut a, 4, u32::MAX); // target fd -1
    put_u32(&mut a, 8, ATTACH_CGROUP_INET4_CONNECT);
    match sys_bpf(BPF_LINK_CREATE, &mut a) {
        Ok(fd) => {
            // SAFETY: an fd the kernel returned (cannot happen with fd -1); close it.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            true
        }
        Err(e) => e.raw_os_error() == Some(libc::EBADF),
    }
}

/// `BPF_FIB_LOOKUP_SRC`: `bpf_fib_lookup` rejects unknown flags with -EINVAL before it looks
/// at anything else, so a test run with zeroed parameters tells.
fn probe_fib_lookup_src() -> bool {
    let mut prog = vec![insn(MOV64_REG, 6, 1, 0, 0)];
    for i in 1..=8 {
        prog.push(insn(ST_DW, 10, 0, -8 * i, 0)); // 64 zeroed bytes of parameters
    }
    prog.extend([
        insn(MOV64_REG, 2, 10, 0, 0),
        insn(ADD64_IMM, 2, 0, 0, -64),
        insn(MOV64_REG, 1, 6, 0, 0),
        insn(MOV64_IMM, 3, 0, 0, 64),
        insn(MOV64_IMM, 4, 0, 0, BPF_FIB_LOOKUP_SRC),
        insn(CALL, 0, 0, 0, HELPER_FIB_LOOKUP),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    let Ok(fd) = load(BPF_PROG_TYPE_SCHED_CLS, 0, &prog) else { return false };
    // An Ethernet + IPv4 header's worth of packet.
    let mut pkt = [0u8; 64];
    pkt[12] = 0x08;
    pkt[14] = 0x45;
    let mut a = [0u8; 128];
    put_u32(&mut a, 0, fd.as_raw_fd() as u32);
    put_u32(&mut a, 8, pkt.len() as u32);
    put_u64(&mut a, 16, pkt.as_ptr() as u64);
    put_u32(&mut a, 32, 1); // repeat
    if sys_bpf(BPF_PROG_TEST_RUN, &mut a).is_err() {
        return false;
    }
    let retval = i32::from_ne_bytes(a[4..8].try_into().unwrap());
    retval != -libc::EINVAL
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(present: bool) -> KernelFeatures {
        KernelFeatures {
            release: "5.10.0-32-amd64".into(),
            btf: present,
            tcx: present,
            cgroup_link: present,
            set_retval: present,
            getpeername_hooks: present,
            fib_lookup_src: present,
            sock_destroy: present,
        }
    }

    #[test]
    fn required_and_optional_features_are_told_apart() {
        assert_eq!(all(true).missing_required(), None);
        let mut old = all(true);
        old.tcx = false;
        old.set_retval = false;
        assert_eq!(old.missing_required(), None, "tcx and set_retval have fallbacks");
        assert!(old.summary().contains("no tcx: TC LB attaches as a clsact"), "{}", old.summary());
        old.btf = false;
        assert_eq!(old.missing_required().as_deref(), Some("kernel 5.10.0-32-amd64 lacks btf"));
        assert_eq!(all(false).missing_required().as_deref(), Some("kernel 5.10.0-32-amd64 lacks btf, cgroup_link, getpeername_hooks"));
    }

    #[test]
    fn instructions_encode_like_the_kernel_expects() {
        // r2 = r10 (BPF_ALU64|BPF_MOV|BPF_X): dst 2, src 10.
        assert_eq!(insn(MOV64_REG, 2, 10, 0, 0).to_ne_bytes(), [0xbf, 0xa2, 0, 0, 0, 0, 0, 0]);
        assert_eq!(insn(ST_DW, 10, 0, -8, 0).to_ne_bytes(), [0x7a, 0x0a, 0xf8, 0xff, 0, 0, 0, 0]);
        assert_eq!(insn(CALL, 0, 0, 0, 187).to_ne_bytes(), [0x85, 0, 0, 0, 187, 0, 0, 0]);
    }
}
