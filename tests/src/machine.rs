//! What a benchmark's figures depend on besides the code: how fast this machine gives a
//! process fresh memory today. On a VM whose balloon reports free pages to the host, every
//! fresh page can cost the host a fault; on 2026-11-27 that made memory-heavy work (the
//! control-plane sync, `nft -f`) 3-7x slower than on earlier days with the same code.

use std::time::Instant;

/// Allocates and writes `mib` MiB of fresh memory (each page faulted in once) and returns the
/// rate in GB/s, with the time per 4 KiB page in µs.
pub fn fresh_memory(mib: usize) -> (f64, f64) {
    let n = mib << 20;
    let t0 = Instant::now();
    // Non-zero: calloc's zero pages would be mapped without being touched.
    let v = vec![1u8; n];
    std::hint::black_box(&v);
    let s = t0.elapsed().as_secs_f64().max(1e-9);
    drop(v);
    (n as f64 / s / 1e9, s * 1e6 / (n / 4096) as f64)
}

/// One line for a benchmark's header: "1.2 GB/s (3.4 µs per 4 KiB page; 256 MiB allocated and
/// written)".
pub fn fresh_memory_line() -> String {
    let (gbps, us) = fresh_memory(256);
    format!("{gbps:.1} GB/s ({us:.2} µs per 4 KiB page; 256 MiB allocated and written)")
}

#[cfg(test)]
mod tests {
    #[test]
    fn fresh_memory_gives_a_rate() {
        let (gbps, us) = super::fresh_memory(4);
        assert!(gbps > 0.0 && gbps.is_finite() && us > 0.0 && us.is_finite());
    }
}
