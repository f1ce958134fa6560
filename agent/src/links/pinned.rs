//! bpf_links that outlive the agent.
//!
//! Each attachment is a bpf_link pinned in `<bpffs>/links/`. A restarted agent opens the pin
//! and swaps its freshly loaded program into the existing link with `BPF_LINK_UPDATE`: the
//! hook is never empty (no window where traffic bypasses the LB) and never carries two
//! gardenet programs (no stacking). Only when the pinned link points elsewhere (another
//! cgroup, a vanished interface) is it replaced by a new one.
//!
//! aya 0.14 cannot pin cgroup sock_addr links, hence these few raw `bpf(2)` calls.
use std::{
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

const BPF_OBJ_PIN: i64 = 6;
const BPF_OBJ_GET: i64 = 7;
const BPF_OBJ_GET_INFO_BY_FD: i64 = 15;
const BPF_LINK_CREATE: i64 = 28;
const BPF_LINK_UPDATE: i64 = 29;

/// Attach types (uapi `enum bpf_attach_type`, stable ABI).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum AttachType {
    Connect4 = 10,
    Sendmsg4 = 14,
    Recvmsg4 = 19,
    Getpeername4 = 29,
    Connect6 = 11,
    Sendmsg6 = 15,
    Recvmsg6 = 20,
    Getpeername6 = 30,
    Xdp = 37,
    TcxIngress = 46,
    TcxEgress = 47,
}

/// What a link is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A cgroup2 directory (fd) with its cgroup id (the directory's inode number).
    Cgroup {
        id: u64,
    },
    Ifindex(u32),
}

/// `bpf(2)` with a zero-padded `union bpf_attr` of `N` bytes (the kernel reads at most that).
pub(crate) fn sys_bpf<const N: usize>(cmd: i64, attr: &mut [u8; N]) -> io::Result<i64> {
    // SAFETY: attr is N valid bytes; the kernel is told its size.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), N as u32) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(crate) fn put_u32<const N: usize>(a: &mut [u8; N], off: usize, v: u32) {
    a[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}
pub(crate) fn put_u64<const N: usize>(a: &mut [u8; N], off: usize, v: u64) {
    a[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// Opens a pinned object. `Ok(None)` when nothing is pinned there.
pub fn obj_get(path: &Path) -> io::Result<Option<OwnedFd>> {
    let p = cpath(path)?;
    let mut a = [0u8; 64];
    put_u64(&mut a, 0, p.as_ptr() as u64);
    match sys_bpf(BPF_OBJ_GET, &mut a) {
        // SAFETY: the kernel returned a new fd that we now own.
        Ok(fd) => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let p = cpath(path)?;
    let mut a = [0u8; 64];
    put_u64(&mut a, 0, p.as_ptr() as u64);
    put_u32(&mut a, 8, fd.as_raw_fd() as u32);
    sys_bpf(BPF_OBJ_PIN, &mut a).map(|_| ())
}

/// Creates a link; the new program runs after the ones already there. `flags` are the
/// attach-type specific link flags (XDP mode for XDP, 0 otherwise).
pub fn link_create(prog: BorrowedFd<'_>, target_fd_or_ifindex: u32, ty: AttachType, flags: u32) -> io::Result<OwnedFd> {
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, prog.as_raw_fd() as u32);
    put_u32(&mut a, 4, target_fd_or_ifindex);
    put_u32(&mut a, 8, ty as u32);
    put_u32(&mut a, 12, flags);
    let fd = sys_bpf(BPF_LINK_CREATE, &mut a)?;
    // SAFETY: new fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Atomically replaces the program of an existing link.
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, link.as_raw_fd() as u32);
    put_u32(&mut a, 4, prog.as_raw_fd() as u32);
    sys_bpf(BPF_LINK_UPDATE, &mut a).map(|_| ())
}

/// (prog_id, target) of a link, from `struct bpf_link_info`.
pub fn link_info(link: BorrowedFd<'_>) -> io::Result<(u32, Option<Target>)> {
    let mut info = [0u8; 64];
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, link.as_raw_fd() as u32);
    put_u32(&mut a, 4, info.len() as u32);
    put_u64(&mut a, 8, info.as_mut_ptr() as u64);
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    let u32_at = |o: usize| u32::from_ne_bytes(info[o..o + 4].try_into().unwrap());
    let ty = u32_at(0);
    let prog_id = u32_at(8);
    // BPF_LINK_TYPE_CGROUP = 3, BPF_LINK_TYPE_XDP = 6, BPF_LINK_TYPE_TCX = 11.
    let target = match ty {
        3 => Some(Target::Cgroup { id: u64::from_ne_bytes(info[16..24].try_into().unwrap()) }),
        6 | 11 => Some(Target::Ifindex(u32_at(16))),
        _ => None,
    };
    Ok((prog_id, target))
}

/// The cgroup id of a cgroup2 directory: its inode number.
pub fn cgroup_id(dir: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata(dir)?.ino())
}

/// How an attachment was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new link was created and pinned.
    Created,
    /// The pinned link of a previous agent now runs this program.
    Updated,
}

/// Attaches `prog` at `target`, reusing the link pinned at `pin` when it points at the same
/// target. Returns the link fd (kept open by the caller while it runs).
pub fn attach_pinned(prog: BorrowedFd<'_>, target_fd_or_ifindex: u32, want: Target, ty: AttachType, flags: u32, pin: &Path) -> io::Result<(OwnedFd, Attached)> {
    if let Some(old) = obj_get(pin)? {
        let same_target = matches!(link_info(old.as_fd()), Ok((_, Some(t))) if t == want);
        if same_target && link_update(old.as_fd(), prog).is_ok() {
            return Ok((old, Attached::Updated));
        }
        // Points elsewhere or is defunct: the new link goes in before the old one goes.
        let new = link_create(prog, target_fd_or_ifindex, ty, flags)?;
        std::fs::remove_file(pin)?;
        obj_pin(new.as_fd(), pin)?;
        return Ok((new, Attached::Created));
    }
    let new = link_create(prog, target_fd_or_ifindex, ty, flags)?;
    obj_pin(new.as_fd(), pin)?;
    Ok((new, Attached::Created))
}

/// Pin file name for a hook.
pub fn pin_name(dir: &Path, hook: &str) -> PathBuf {
    dir.join(hook.replace('/', "_"))
}

const BPF_PROG_QUERY: i64 = 16;

/// Ids of the programs attached at a hook, as the kernel sees them (BPF_PROG_QUERY). For
/// interfaces the ifindex is resolved in the calling thread's network namespace.
pub fn prog_query(target_fd_or_ifindex: u32, ty: AttachType) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, target_fd_or_ifindex);
    put_u32(&mut a, 4, ty as u32);
    put_u64(&mut a, 16, ids.as_mut_ptr() as u64);
    put_u32(&mut a, 24, ids.len() as u32);
    sys_bpf(BPF_PROG_QUERY, &mut a)?;
    let n = u32::from_ne_bytes(a[24..28].try_into().unwrap()) as usize;
    Ok(ids[..n.min(ids.len())].to_vec())
}

/// Name of a loaded program by id (from `struct bpf_prog_info`).
pub fn prog_name(id: u32) -> io::Result<String> {
    const BPF_PROG_GET_FD_BY_ID: i64 = 13;
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, id);
    // SAFETY: new fd from the kernel.
    let fd = unsafe { OwnedFd::from_raw_fd(sys_bpf(BPF_PROG_GET_FD_BY_ID, &mut a)? as i32) };
    let mut info = [0u8; 256];
    let mut a = [0u8; 64];
    put_u32(&mut a, 0, fd.as_raw_fd() as u32);
    put_u32(&mut a, 4, info.len() as u32);
    put_u64(&mut a, 8, info.as_mut_ptr() as u64);
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    // struct bpf_prog_info: name[16] sits at offset 64.
    let name = &info[64..80];
    let end = name.iter().position(|b| *b == 0).unwrap_or(16);
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}
