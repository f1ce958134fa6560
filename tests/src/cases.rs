//! Checks the IPv4 suite (`dataplane`) and the IPv6 suite (`ipv6`) both make, written once:
//! each takes the frontend (`198.19.0.10:80` or `[fd00:19::10]:80`) and the lab, so both
//! families go through the same assertions; a suite adds only what is its own.
use crate::lab::{counts, refusal_outcome, Lab};

/// Every one of the three backends answered, and about evenly (each at least 15%).
pub fn assert_spread(v: &serde_json::Value, total: u64) {
    let c = counts(v);
    assert_eq!(c.len(), 3, "all three backends must answer: {v}");
    let sum: u64 = c.iter().map(|(_, n)| n).sum();
    assert_eq!(sum, total, "every request answered: {v}");
    for (name, n) in &c {
        assert!(*n as f64 >= 0.15 * total as f64, "{name} got {n} of {total} (< 15%): {v}");
    }
}

/// `count` TCP connections to `vip` (through socket LB or, outside its cgroup, TC LB) spread
/// over the three backends.
pub fn tcp_spreads(lab: &Lab, socket_lb: bool, vip: &str, count: u64) {
    let v = lab.client_json(socket_lb, &["tcp", "--to", vip, "--count", &count.to_string()]).unwrap();
    eprintln!("{vip}, socket_lb={socket_lb}, {count} TCP connections: {v}");
    assert_spread(&v, count);
}

/// `count` unconnected UDP datagrams to `vip`: every reply appears to come from `vip` (reverse
/// translation), and with `spread` the three backends share them.
pub fn udp_replies_come_from_the_vip(lab: &Lab, socket_lb: bool, vip: &str, count: u64, spread: bool) {
    let v = lab.client_json(socket_lb, &["udp", "--to", vip, "--count", &count.to_string()]).unwrap();
    eprintln!("{vip}, socket_lb={socket_lb}, {count} unconnected UDP datagrams: {v}");
    let sources = v["sources"].as_object().unwrap();
    assert_eq!(sources.len(), 1, "replies must all appear to come from the VIP: {v}");
    assert_eq!(sources[vip], count, "{v}");
    if spread {
        assert_spread(&v, count);
    }
}

/// `getpeername()` of a TCP and of a connected UDP socket to `vip` through socket LB says
/// `vip`, not the backend.
pub fn getpeername_returns_the_vip(lab: &Lab, vip: &str) {
    for udp in [false, true] {
        let mut args = vec!["peername", "--to", vip];
        if udp {
            args.push("--udp");
        }
        let v = lab.client_json(true, &args).unwrap();
        assert_eq!(v["peer"], vip, "udp={udp}: {v}");
        assert!(v["name"].as_str().unwrap().starts_with("be"), "{v}");
    }
}

/// One TCP connection carries `bytes` each way through TC LB, to one backend.
pub fn bulk_stays_on_one_backend(lab: &Lab, vip: &str, bytes: u64) {
    let b = lab.client_json(false, &["bulk", "--to", vip, "--bytes", &bytes.to_string()]).unwrap();
    eprintln!("TC LB {vip}, {bytes} bytes each way: {b}");
    assert_eq!(b["uploaded"], bytes, "{b}");
    assert_eq!(b["downloaded"], bytes, "{b}");
    assert_eq!(b["upload_backend"], b["download_backend"], "one connection, one backend: {b}");
}

/// A frontend without backends refuses a connection at once on both paths (socket LB in the
/// cgroup, TC LB outside it), and other traffic to it is dropped: 5 UDP datagrams go
/// unanswered (XDP drops them on the wire side; the caller checks the counters).
pub fn refuses_at_once(lab: &Lab, vip: &str) {
    for socket_lb in [true, false] {
        let v = lab.client_json(socket_lb, &["connect", "--to", vip, "--timeout-ms", "3000"]).unwrap();
        eprintln!("zero backends {vip}, socket_lb={socket_lb}: {v}");
        assert_eq!(v["outcome"], refusal_outcome(socket_lb), "{v}");
        // The first SYN is answered: a retransmitted one would go out only after 1 s. (Not a
        // tighter bound: under emulation, in the kernel-matrix VMs, a refusal took 110 ms.)
        let ms = v["elapsed_ms"].as_f64().unwrap();
        assert!(ms < 900.0, "refusal took {ms} ms (not the first SYN's answer): {v}");
    }
    let u = lab.client_json(false, &["udp", "--to", vip, "--count", "5", "--timeout-ms", "100"]).unwrap();
    assert_eq!(u["errors"]["WouldBlock"], 5, "{u}");
}
