//! What a benchmark's figures depend on besides the code: how fast this machine gives a
//! process fresh memory today, and how long a load from memory not in the caches takes. On a
//! VM whose balloon reports free pages to the host, every fresh page can cost the host a fault
//! (`nft -f` 3-7x slower on 2026-11-27 than on earlier days); work that misses the caches at
//! random (the kernel's hash maps in a control-plane sync, conntrack per packet) moves with the
//! latency.

use std::time::Instant;

/// The 1, 5 and 15 minute load averages, "0.65 1.18 1.16": other work on the machine skews
/// the numbers, so the reports show the load around a run.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

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

/// Average time in ns of one dependent load from a random cache line of a `mib` MiB buffer:
/// a pointer chase over one cycle through all its lines in a random order, so neither the
/// prefetcher nor out-of-order execution hides the latency. TLB misses count, as
/// they do for a hash map of that size.
pub fn load_latency_ns(mib: usize, loads: usize) -> f64 {
    // One pointer per 64-byte line, so every load is a line of its own.
    const STRIDE: usize = 64 / std::mem::size_of::<usize>();
    let cycle = random_cycle((mib << 20) / 64);
    let mut next = vec![0usize; cycle.len() * STRIDE];
    for (line, to) in cycle.iter().enumerate() {
        next[line * STRIDE] = to * STRIDE;
    }
    drop(cycle);
    let mut at = 0;
    let t0 = Instant::now();
    for _ in 0..loads {
        at = next[at];
    }
    std::hint::black_box(at);
    t0.elapsed().as_secs_f64() * 1e9 / loads.max(1) as f64
}

/// `next[i]` for one cycle through all `n` indices: shuffled (xorshift, fixed seed: the same
/// walk every run), then each index linked to the one after it, the last to the first.
fn random_cycle(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % i as u64) as usize);
    }
    let mut next = vec![0; n];
    for w in 0..n {
        next[order[w]] = order[(w + 1) % n];
    }
    next
}

/// One line for a benchmark's header: "random load 196 ns (64 MiB buffer)".
pub fn load_latency_line() -> String {
    format!("{:.0} ns per random load from a 64 MiB buffer", load_latency_ns(64, 2_000_000))
}

/// How an idle CPU waits, for a benchmark's header: "haltpoll (governor haltpoll), guest halt
/// polling 0 ns". On this project's VM an idle vCPU halts at once (no polling), so every wakeup
/// of a task on it is a VM exit and entry; with 200 µs of guest halt polling the dataplane
/// bench's connections ran about 1.5x faster, their ratios unchanged (2026-11-29,
/// docs/benchmarks.md). Rates from machines that differ here are not comparable.
pub fn cpu_idle_line() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    cpu_idle_describe(
        read("/sys/devices/system/cpu/cpuidle/current_driver").as_deref(),
        read("/sys/devices/system/cpu/cpuidle/current_governor").as_deref(),
        read("/sys/module/haltpoll/parameters/guest_halt_poll_ns").and_then(|s| s.parse().ok()),
    )
}

fn cpu_idle_describe(driver: Option<&str>, governor: Option<&str>, guest_halt_poll_ns: Option<u64>) -> String {
    let mut s = match (driver, governor) {
        (Some(d), Some(g)) => format!("{d} (governor {g})"),
        (Some(d), None) => d.to_owned(),
        (None, _) => "no cpuidle driver".to_owned(),
    };
    if let Some(ns) = guest_halt_poll_ns {
        s += &format!(", guest halt polling {ns} ns");
        if ns == 0 {
            s += " (an idle vCPU halts at once)";
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn fresh_memory_gives_a_rate() {
        let (gbps, us) = super::fresh_memory(4);
        assert!(gbps > 0.0 && gbps.is_finite() && us > 0.0 && us.is_finite());
    }

    #[test]
    fn the_chase_is_one_cycle_through_every_line() {
        for n in [1, 2, 3, 1000] {
            let next = super::random_cycle(n);
            let (mut at, mut seen) = (0, vec![false; n]);
            for _ in 0..n {
                assert!(!seen[at], "index {at} visited twice in a cycle of {n}");
                seen[at] = true;
                at = next[at];
            }
            assert_eq!(at, 0);
        }
        let ns = super::load_latency_ns(1, 1 << 14);
        assert!(ns > 0.0 && ns.is_finite());
    }

    #[test]
    fn cpu_idle_says_how_an_idle_cpu_waits() {
        assert_eq!(
            super::cpu_idle_describe(Some("haltpoll"), Some("haltpoll"), Some(0)),
            "haltpoll (governor haltpoll), guest halt polling 0 ns (an idle vCPU halts at once)"
        );
        assert_eq!(super::cpu_idle_describe(Some("intel_idle"), Some("menu"), None), "intel_idle (governor menu)");
        assert_eq!(super::cpu_idle_describe(Some("haltpoll"), None, Some(200000)), "haltpoll, guest halt polling 200000 ns");
        assert_eq!(super::cpu_idle_describe(None, None, None), "no cpuidle driver");
        assert!(!super::cpu_idle_line().is_empty());
    }
}
