//! Ctrl-C and SIGTERM for the demo and the bench binaries. The handler only records the
//! signal; the binaries ask `check()` between steps, so they stop where their cleanup
//! (namespaces, programs, pins, cgroups) still runs instead of dying half-way.
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Result};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to the flag `requested()` reads.
pub fn install() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
}

/// Whether a signal asked the process to stop.
pub fn requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// `Err("interrupted")` once a signal asked the process to stop.
pub fn check() -> Result<()> {
    if requested() {
        bail!("interrupted");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handler_makes_check_fail() {
        assert!(check().is_ok());
        // As the kernel would call it (installing it here would take Ctrl-C from the test
        // harness).
        on_signal(libc::SIGTERM);
        assert!(requested());
        assert_eq!(check().unwrap_err().to_string(), "interrupted");
    }
}
