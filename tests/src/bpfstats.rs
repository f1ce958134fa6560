//! Run time and run count of loaded eBPF programs (`bpf_prog_info.run_time_ns`/`run_cnt`),
//! which the kernel keeps while statistics are enabled (`BPF_ENABLE_STATS`, the same switch as
//! the `kernel.bpf_stats_enabled` sysctl). Used by the dataplane benchmark to say what each
//! gardenet program costs per packet, and for the verifier's instruction counts.
use std::{
    collections::BTreeMap,
    os::fd::{FromRawFd, OwnedFd},
};

use anyhow::{Context, Result};
use aya_obj::generated::bpf_prog_info;

/// One program's counters at one moment.
#[derive(Clone, Debug, Default)]
pub struct ProgStat {
    pub name: String,
    pub run_time_ns: u64,
    pub run_cnt: u64,
    pub verified_insns: u32,
}

/// Keeps run-time statistics on while it lives (the kernel turns them off when the last
/// holder closes its fd, so a crashed bench leaves nothing switched on).
pub struct StatsOn(#[allow(dead_code)] OwnedFd);

pub fn enable() -> Result<StatsOn> {
    let fd = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS")?;
    Ok(StatsOn(fd))
}

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a zeroed 128-byte union as bpf(2) expects; the kernel reads/writes only
    // within the size passed.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), std::mem::size_of_val(attr) as u32) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

fn info(id: u32) -> std::io::Result<bpf_prog_info> {
    let mut attr = [0u64; 16];
    attr[0] = id as u64; // prog_id
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)? as i32;
    // SAFETY: a new fd the kernel just gave us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain old data; the kernel fills what it knows.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut attr = [0u64; 16];
    attr[0] = std::os::fd::AsRawFd::as_raw_fd(&fd) as u64 | ((std::mem::size_of::<bpf_prog_info>() as u64) << 32);
    attr[1] = &mut info as *mut bpf_prog_info as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

/// Every loaded program whose name starts with `prefix`, by program id.
pub fn programs(prefix: &str) -> Result<BTreeMap<u32, ProgStat>> {
    let mut out = BTreeMap::new();
    let mut id = 0u32;
    loop {
        let mut attr = [0u64; 16];
        attr[0] = id as u64; // start_id
        match bpf(BPF_PROG_GET_NEXT_ID, &mut attr) {
            Ok(_) => id = (attr[0] >> 32) as u32, // next_id
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => return Err(e).context("BPF_PROG_GET_NEXT_ID"),
        }
        let Ok(i) = info(id) else { continue }; // unloaded meanwhile
        let name: String = i.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect();
        if name.starts_with(prefix) {
            out.insert(id, ProgStat { name, run_time_ns: i.run_time_ns, run_cnt: i.run_cnt, verified_insns: i.verified_insns });
        }
    }
    Ok(out)
}

/// What each program (by name, summed over its instances) ran between two snapshots:
/// name -> (runs, total ns).
pub fn delta(before: &BTreeMap<u32, ProgStat>, after: &BTreeMap<u32, ProgStat>) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (id, a) in after {
        let (c0, t0) = before.get(id).map(|b| (b.run_cnt, b.run_time_ns)).unwrap_or((0, 0));
        let e = out.entry(a.name.clone()).or_default();
        e.0 += a.run_cnt.saturating_sub(c0);
        e.1 += a.run_time_ns.saturating_sub(t0);
    }
    out
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_LINK_DETACH: libc::c_long = 34;

/// Detaches the pinned bpf_link at `pin` from its hook (BPF_LINK_DETACH: the link stays, its
/// program no longer runs), whoever else holds it. The bench uses it to take one program off
/// the path without the agent's cooperation.
pub fn detach_pinned_link(pin: &std::path::Path) -> Result<()> {
    let c = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())?;
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64; // pathname
    let fd = bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("BPF_OBJ_GET {}", pin.display()))? as i32;
    // SAFETY: a new fd the kernel just gave us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut attr = [0u64; 16];
    attr[0] = std::os::fd::AsRawFd::as_raw_fd(&fd) as u64; // link_fd
    bpf(BPF_LINK_DETACH, &mut attr).with_context(|| format!("BPF_LINK_DETACH {}", pin.display()))?;
    Ok(())
}

/// A new fd of the program with id `id`.
pub fn prog_fd(id: u32) -> std::io::Result<OwnedFd> {
    let mut attr = [0u64; 16];
    attr[0] = id as u64; // prog_id
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)? as i32;
    // SAFETY: a new fd the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The ids of the maps program `fd` uses (`bpf_prog_info.map_ids`).
fn prog_map_ids(fd: &OwnedFd) -> std::io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    // SAFETY: plain old data; the kernel fills what it knows.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = ids.len() as u32;
    info.map_ids = ids.as_mut_ptr() as u64;
    let mut attr = [0u64; 16];
    attr[0] = std::os::fd::AsRawFd::as_raw_fd(fd) as u64 | ((std::mem::size_of::<bpf_prog_info>() as u64) << 32);
    attr[1] = &mut info as *mut bpf_prog_info as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    ids.truncate((info.nr_map_ids as usize).min(64));
    Ok(ids)
}

/// Ids of the loaded programs named `name` that use one of the maps `map_ids`: the instances
/// one agent loaded, told apart from other agents' by the (pinned) maps they share.
pub fn programs_using_maps(name: &str, map_ids: &[u32]) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for (id, p) in programs(name)? {
        if p.name != name {
            continue;
        }
        let Ok(fd) = prog_fd(id) else { continue }; // unloaded meanwhile
        if prog_map_ids(&fd).context("bpf_prog_info.map_ids")?.iter().any(|m| map_ids.contains(m)) {
            out.push(id);
        }
    }
    Ok(out)
}

/// Runs program `fd` once on `data` with `BPF_PROG_TEST_RUN` (nothing is sent anywhere: the
/// kernel builds an skb or xdp_buff, runs the program and copies the packet back into
/// `out`). `ctx` is the program's context to start from (`__sk_buff` for TC), if any.
/// Returns the program's return value and the length of the packet in `out` afterwards.
pub fn test_run(fd: &OwnedFd, data: &[u8], ctx: Option<&[u8]>, out: &mut [u8]) -> std::io::Result<(i32, usize)> {
    test_run_timed(fd, data, ctx, out).map(|r| (r.retval, r.len))
}

/// What one [`test_run_timed`] returned.
pub struct TestRun {
    pub retval: i32,
    /// Length of the packet in `out` afterwards.
    pub len: usize,
    /// How long the program ran, as the kernel measured it (ns, with the resolution of
    /// `ktime_get_ns`).
    pub duration_ns: u32,
}

/// [`test_run`] with the kernel's measure of the program's run time: one run on a fresh
/// skb (or xdp_buff) built from `data`.
pub fn test_run_timed(fd: &OwnedFd, data: &[u8], ctx: Option<&[u8]>, out: &mut [u8]) -> std::io::Result<TestRun> {
    let mut attr = [0u64; 16];
    attr[0] = std::os::fd::AsRawFd::as_raw_fd(fd) as u64; // prog_fd; retval (high half) out
    attr[1] = data.len() as u64 | ((out.len() as u64) << 32); // data_size_in, data_size_out
    attr[2] = data.as_ptr() as u64; // data_in
    attr[3] = out.as_mut_ptr() as u64; // data_out
    attr[4] = 1; // repeat = 1, duration (high half) out
    if let Some(c) = ctx {
        attr[5] = c.len() as u64; // ctx_size_in (ctx_size_out 0: no context copied back)
        attr[6] = c.as_ptr() as u64; // ctx_in
    }
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    let size_out = (attr[1] >> 32) as usize;
    Ok(TestRun { retval: (attr[0] >> 32) as u32 as i32, len: size_out.min(out.len()), duration_ns: (attr[4] >> 32) as u32 })
}

/// The ids of the maps the program with id `id` uses.
pub fn map_ids_of(id: u32) -> Result<Vec<u32>> {
    let fd = prog_fd(id).context("BPF_PROG_GET_FD_BY_ID")?;
    prog_map_ids(&fd).context("bpf_prog_info.map_ids")
}
