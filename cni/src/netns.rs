//! Acting inside the pod's network namespace without moving the plugin there: a short-lived
//! thread joins it (`setns` changes only the calling thread) and opens what is needed; a
//! netlink socket and a `/proc/sys/net` file keep the namespace they were opened in.
use std::{fs::File, os::fd::AsRawFd, path::Path};

use crate::spec::{CniError, CniResult, Code};

/// Runs `f` on a thread inside the network namespace at `netns`.
pub fn run_in<T: Send>(netns: &Path, f: impl FnOnce() -> CniResult<T> + Send) -> CniResult<T> {
    let ns = File::open(netns).map_err(|e| CniError::new(Code::InvalidEnvironment, format!("CNI_NETNS {}: {e}", netns.display())))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on a valid fd; it affects only this thread, which ends here.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(CniError::new(Code::InvalidEnvironment, format!("CNI_NETNS {} is not a network namespace: {e}", netns.display())));
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(CniError::new(Code::Internal, "a thread in the pod's network namespace failed")))
    })
}

/// Writes `net/<family>/conf/<ifname>/<key>` (ifnames may hold dots, so no dotted form).
pub fn if_sysctl(family: &str, ifname: &str, key: &str, value: &str) -> std::io::Result<()> {
    std::fs::write(Path::new("/proc/sys/net").join(family).join("conf").join(ifname).join(key), value)
}

/// Reads a sysctl of the calling thread's network namespace.
pub fn sysctl_value(path: &str) -> Option<String> {
    std::fs::read_to_string(Path::new("/proc/sys").join(path)).ok().map(|s| s.trim().to_owned())
}

/// Sets a sysctl unless it already has the value (a write can fail where reading works).
pub fn ensure_sysctl(path: &str, value: &str) -> std::io::Result<()> {
    if sysctl_value(path).as_deref() == Some(value) {
        return Ok(());
    }
    std::fs::write(Path::new("/proc/sys").join(path), value)
}
