//! Issue 14, "kill -9 under load": the agent is SIGKILLed and started again, over and over,
//! while a client opens new connections without pause and keeps long two-way transfers
//! running, through socket LB, TC LB and a NodePort that TC LB source-NATs to a pod on a
//! second node, in both families. Every new connection must succeed and no transfer may
//! break: the pinned maps and links carry the traffic while no agent runs, and a starting
//! agent swaps its programs into the links (`BPF_LINK_UPDATE`, or the clsact filter in
//! place) and adopts the maps. Every fourth SIGKILL is aimed at an agent that is still
//! starting. Without `BPF_FIB_LOOKUP_SRC` (5.10) the NodePort is DNAT-only to a pod here.
//!
//! The namespaces are `gardenet_tests::two_nodes` with three pods on this node (two behind
//! the ClusterIP, one for the DNAT-only NodePort). On one CPU the load is lighter (see
//! `Params::slow`). Parameters
//! (environment; `cargo xtask soak` sets them): `GARDENET_SOAK_RESTARTS` (default 20),
//! `GARDENET_SOAK_SECONDS` (the kill/restart phase lasts at least this long; default 0: as
//! fast as the restarts go), `GARDENET_SOAK_STREAMS` (long transfers per path, default 2),
//! `GARDENET_SOAK_SEED` (pauses; printed, so a run can be repeated). Needs root; fails (does
//! not skip) without it.
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    process::{Child, ChildStdin, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use gardenet_agent::links::pinned::AttachType;
use gardenet_tests::{
    lab::{Agent, AgentOpts},
    two_nodes::{local_pod, local_pod6, node_yaml, service_yaml, slices_yaml, TwoNodes, NODE_ADDR, NODE_ADDR6, NODE_NAME, POD, POD6},
};
use serde_json::Value;

const VIP: &str = "198.19.0.10";
const VIP6: &str = "fd00:19::10";
const NODE_PORT: u16 = 30080;

struct Params {
    restarts: u32,
    min_seconds: u64,
    streams: u32,
    seed: u64,
    /// Multiplies the pauses of the load (new connections, stream rounds): 4 on a machine
    /// with one CPU (the kernel matrix's emulated VM), where the load would otherwise starve
    /// the agent's start (its verifier runs) for minutes.
    slow: u64,
}

fn env_or<T: std::str::FromStr>(k: &str, default: T) -> T {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

impl Params {
    fn from_env() -> Params {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
        let one_cpu = std::thread::available_parallelism().map_or(true, |n| n.get() < 2);
        Params {
            restarts: env_or("GARDENET_SOAK_RESTARTS", 20u32).clamp(1, 10_000),
            min_seconds: env_or("GARDENET_SOAK_SECONDS", 0u64).min(24 * 3600),
            streams: env_or("GARDENET_SOAK_STREAMS", if one_cpu { 1 } else { 2 }).clamp(1, 16),
            seed: env_or("GARDENET_SOAK_SEED", now | 1),
            slow: if one_cpu { 4 } else { 1 },
        }
    }
}

/// xorshift64*: pauses that differ from run to run, repeatable through the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// The client host's addresses: the TC-LB client's (the ones `two_nodes` gives it) and the
/// socket-LB client's own (see `Path::from`).
const TC_CLIENT: &str = "198.18.5.2";
const TC_CLIENT6: &str = "fd00:18:5::2";
const SOCK_CLIENT: &str = "198.18.5.3";
const SOCK_CLIENT6: &str = "fd00:18:5::3";

/// One way into the Service: who connects (inside the socket-LB cgroup or not) and where to.
struct Path {
    name: String,
    socket_lb: bool,
    to: String,
    /// Source address. Socket LB connects straight to the pod, TC LB keeps the client's port
    /// through DNAT: from one address, a new socket-LB connection to a pod could take the
    /// 4-tuple of a live TC-LB stream to that pod (the kernel sees VIP and pod as different
    /// destinations), and TC LB would then rightly treat it as a new flow that reuses the
    /// old one's tuple. Real clients are either in the socket-LB cgroup or another host,
    /// so the socket-LB client has addresses of its own. Every path names its source: IPv6
    /// source selection would pick the newer address for the TC-LB client too.
    from: &'static str,
    /// Pause between new connections. The source-NAT paths go slower: TC LB's source-NAT
    /// ports (61000-65535) stay taken 10 s after a flow closes, and a client that churns
    /// faster than ~450 connections/s toward one endpoint would exhaust them; at these
    /// rates they are never more than a tenth full.
    interval_ms: u64,
}

/// A running `gardenet-netkit soak`, killed on drop (a failing test leaves nothing behind).
struct Load {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Load {
    fn start(w: &TwoNodes, p: &Path, o: &Params, max_seconds: u64) -> Load {
        let (streams, interval, pace, max) = (o.streams.to_string(), (p.interval_ms * o.slow).to_string(), (20 * o.slow).to_string(), max_seconds.to_string());
        let args = ["soak", "--to", &p.to, "--from", p.from, "--streams", &streams, "--interval-ms", &interval, "--pace-ms", &pace, "--max-seconds", &max];
        let mut cmd = w.client_cmd(p.socket_lb, &args).unwrap();
        // The load yields to the agent (nice 10), as workloads do to a node's critical agents.
        // SAFETY: setpriority(2) on the child itself, between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
                Ok(())
            });
        }
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Load { stdin: child.stdin.take(), child, lines }
    }

    fn next_json(&self, within: Duration, what: &str) -> Value {
        let line = self.lines.recv_timeout(within).unwrap_or_else(|e| panic!("{what}: no output from netkit soak within {within:?} ({e})"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{what}: {e}: {line}"))
    }

    /// Ends the load (EOF on its stdin) and returns its figures.
    fn finish(&mut self, what: &str) -> Value {
        drop(self.stdin.take());
        // Each stream finishes its round first (bounded by its I/O limits).
        let v = self.next_json(Duration::from_secs(90), what);
        let _ = self.child.wait();
        v
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One agent outage: from the SIGKILL of a ready agent until the next agent was ready.
struct Outage {
    killed_ms: u64,
    ready_ms: u64,
}

/// New connections that succeeded while no ready agent ran: the 100-ms buckets of `conns`
/// that lie entirely inside an outage.
fn served_during(conns: &Value, outages: &[Outage]) -> u64 {
    let start = conns["start_unix_ms"].as_u64().unwrap_or(0);
    let buckets = conns["ok_per_100ms"].as_array().cloned().unwrap_or_default();
    let mut n = 0;
    for (i, c) in buckets.iter().enumerate() {
        let (b0, b1) = (start + 100 * i as u64, start + 100 * (i as u64 + 1));
        if outages.iter().any(|o| o.killed_ms <= b0 && b1 <= o.ready_ms) {
            n += c.as_u64().unwrap_or(0);
        }
    }
    n
}

fn manifests(np_endpoint: (String, String, &str)) -> Vec<(&'static str, String)> {
    let locals: Vec<(String, String, &str)> = (0..2).map(|i| (local_pod(i), local_pod6(i), NODE_NAME)).collect();
    vec![
        ("node.yaml", node_yaml()),
        ("web.yaml", format!("{}---\n{}", service_yaml("web", "ClusterIP", VIP, VIP6, 0), slices_yaml("web", &locals))),
        ("np.yaml", format!("{}---\n{}", service_yaml("np", "NodePort", "198.19.0.30", "fd00:19::30", NODE_PORT), slices_yaml("np", &[np_endpoint]))),
    ]
}

/// Exactly one gardenet program on each hook the agent uses: SIGKILLed agents stacked nothing.
fn one_program_per_hook(w: &TwoNodes) {
    for iface in ["a0", "a1"] {
        assert_eq!(w.node.tc_programs(iface, AttachType::TcxIngress).unwrap(), ["gn_tc_ingress"], "{iface}");
        assert_eq!(w.node.tc_programs(iface, AttachType::TcxEgress).unwrap(), ["gn_tc_egress"], "{iface}");
    }
    let nr = if gardenet_agent::dataplane::features::KernelFeatures::probe().set_retval { "" } else { "_nr" };
    for (ty, prog) in [
        (AttachType::Connect4, format!("gn_connect4{nr}")),
        (AttachType::Sendmsg4, format!("gn_sendmsg4{nr}")),
        (AttachType::Connect6, format!("gn_connect6{nr}")),
        (AttachType::Getpeername4, "gn_getpeername4".into()),
        (AttachType::Getpeername6, "gn_getpeername6".into()),
    ] {
        assert_eq!(w.cgroup.programs(ty).unwrap(), [prog], "{ty:?}");
    }
}

#[test]
fn kill9_under_load_loses_no_connection() {
    let p = Params::from_env();
    let t_run = Instant::now();
    let w = TwoNodes::new(3).unwrap();
    w.client.ip(&["addr", "add", &format!("{SOCK_CLIENT}/24"), "dev", "c0"]).unwrap();
    w.client.ip(&["-6", "addr", "add", &format!("{SOCK_CLIENT6}/64"), "dev", "c0", "nodad"]).unwrap();
    let snat = gardenet_agent::dataplane::features::KernelFeatures::probe().fib_lookup_src;
    // Without BPF_FIB_LOOKUP_SRC (kernels before 6.7 unless backported) there is no source NAT
    // to other nodes: the NodePort then goes to a pod on this node (DNAT only), one that the
    // ClusterIP does not use (TC LB keeps client ports: the client's flows to the ClusterIP
    // and to the NodePort must not meet at one pod with one tuple).
    let (np_endpoint, np_kind) = if snat {
        ((POD.to_string(), POD6.to_string(), "node3"), "NodePort, source NAT to node3")
    } else {
        ((local_pod(2), local_pod6(2), NODE_NAME), "NodePort, DNAT only (no fib_lookup_src)")
    };
    let opts = AgentOpts { socket_lb: true, keep_links: true, extra: vec!["--tc-interface=a0,a1".into()], ..Default::default() };
    let mut agent = Agent::start_in(&w.tag, &w.node, Some(&w.cgroup), opts, &manifests(np_endpoint)).unwrap();
    // A bound for each start, not a target: under this load a one-vCPU emulated VM needs
    // far longer than the lab's default.
    agent.ready_timeout = Duration::from_secs(180);
    for (fe, n) in [
        (format!("{VIP}:80/tcp"), 2),
        (format!("[{VIP6}]:80/tcp"), 2),
        (format!("{NODE_ADDR}:{NODE_PORT}/tcp"), 1),
        (format!("[{NODE_ADDR6}]:{NODE_PORT}/tcp"), 1),
    ] {
        agent.wait_backends(&fe, n).unwrap();
    }

    let np_ms = if snat { 25 } else { 10 };
    let paths = [
        Path { name: "socket LB, IPv4".into(), socket_lb: true, to: format!("{VIP}:80"), from: SOCK_CLIENT, interval_ms: 10 },
        Path { name: "socket LB, IPv6".into(), socket_lb: true, to: format!("[{VIP6}]:80"), from: SOCK_CLIENT6, interval_ms: 10 },
        Path { name: "TC LB, IPv4".into(), socket_lb: false, to: format!("{VIP}:80"), from: TC_CLIENT, interval_ms: 10 },
        Path { name: "TC LB, IPv6".into(), socket_lb: false, to: format!("[{VIP6}]:80"), from: TC_CLIENT6, interval_ms: 10 },
        Path { name: format!("{np_kind}, IPv4"), socket_lb: false, to: format!("{NODE_ADDR}:{NODE_PORT}"), from: TC_CLIENT, interval_ms: np_ms },
        Path { name: format!("{np_kind}, IPv6"), socket_lb: false, to: format!("[{NODE_ADDR6}]:{NODE_PORT}"), from: TC_CLIENT6, interval_ms: np_ms },
    ];
    // A bound for the load generators of their own, should this test hang: generous.
    let max_seconds = 600 + p.min_seconds * 2 + u64::from(p.restarts) * 60;
    let mut loads: Vec<Load> = paths.iter().map(|path| Load::start(&w, path, &p, max_seconds)).collect();
    for (l, path) in loads.iter().zip(&paths) {
        let up = l.next_json(Duration::from_secs(30), &path.name);
        assert_eq!(up["up"], p.streams, "{}: {up}", path.name);
    }
    eprintln!("soak: seed {}, {} restarts, load running on {} paths", p.seed, p.restarts, paths.len());

    // The kill/restart phase. Every fourth SIGKILL hits an agent that is still starting
    // (loading, swapping programs into the links, or syncing): the one after it then comes
    // without a pause.
    let mut rng = Rng(p.seed);
    let phase = Instant::now();
    let mut outages: Vec<Outage> = Vec::new();
    let mut start_ms: Vec<u64> = Vec::new();
    let (mut hit_starting, mut last_start_ms) = (0, 500u64);
    let mut starting: Option<mpsc::Receiver<Instant>> = None;
    let mut outage_from: Option<u64> = None;
    for i in 0..p.restarts {
        match starting.take() {
            Some(ready) => {
                // Somewhere in the start-up, as far as the last start took.
                std::thread::sleep(Duration::from_millis(rng.below(last_start_ms.max(2))));
                match ready.try_recv() {
                    Err(_) => hit_starting += 1,
                    // Ready before the kill after all: an ordinary outage, ended back then.
                    Ok(at) => outages.push(Outage { killed_ms: outage_from.take().unwrap(), ready_ms: unix_ms() - at.elapsed().as_millis() as u64 }),
                }
            }
            None => {
                let left = p.min_seconds.saturating_mul(1000).saturating_sub(phase.elapsed().as_millis() as u64);
                let spread = left / u64::from(p.restarts - i);
                std::thread::sleep(Duration::from_millis(300 + rng.below(1200).max(spread)));
            }
        }
        let killed = unix_ms();
        agent.kill9().unwrap();
        outage_from.get_or_insert(killed);
        std::thread::sleep(Duration::from_millis(rng.below(500)));
        let t = Instant::now();
        if i % 4 == 2 && i + 1 < p.restarts {
            starting = Some(agent.start_unready_in(&w.node, Some(&w.cgroup)).unwrap());
        } else {
            agent.restart_in(&w.node, Some(&w.cgroup)).unwrap();
            last_start_ms = t.elapsed().as_millis() as u64;
            start_ms.push(last_start_ms);
            outages.push(Outage { killed_ms: outage_from.take().unwrap(), ready_ms: unix_ms() });
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let phase_secs = phase.elapsed().as_secs_f64();
    let results: Vec<Value> = loads.iter_mut().zip(&paths).map(|(l, path)| l.finish(&path.name)).collect();

    let down_ms: u64 = outages.iter().map(|o| o.ready_ms - o.killed_ms).sum();
    start_ms.sort_unstable();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut table = format!(
        "\nkill -9 under load: {} SIGKILLs and restarts ({hit_starting} of the kills hit an agent that was still starting) in {phase_secs:.0} s, \
         agent down {:.1} s in all, start to ready {}-{} ms (median {}); {} streams per path, load pauses x{}; Linux {}; seed {}\n",
        p.restarts,
        down_ms as f64 / 1000.0,
        start_ms.first().unwrap_or(&0),
        start_ms.last().unwrap_or(&0),
        start_ms.get(start_ms.len() / 2).unwrap_or(&0),
        p.streams,
        p.slow,
        kernel.trim(),
        p.seed
    );
    table += &format!(
        "  {:<68} {:>9} {:>7} {:>12} {:>8} {:>7} {:>11} {:>10}\n",
        "path", "new conns", "failed", "agent down", "streams", "broken", "MiB up/down", "max round"
    );
    let mut failures = Vec::new();
    for (v, path) in results.iter().zip(&paths) {
        let c = &v["conns"];
        let streams = v["streams"].as_array().cloned().unwrap_or_default();
        let broken: Vec<&Value> = streams.iter().filter(|s| s["broken"] == true).collect();
        let (up, down) = streams.iter().fold((0, 0), |(u, d), s| (u + s["up"].as_u64().unwrap_or(0), d + s["down"].as_u64().unwrap_or(0)));
        let max_round = streams.iter().filter_map(|s| s["max_round_ms"].as_f64()).fold(0f64, f64::max);
        table += &format!(
            "  {:<68} {:>9} {:>7} {:>12} {:>8} {:>7} {:>11} {:>7.0} ms\n",
            format!("{} -> {}", path.name, path.to),
            c["attempted"].as_u64().unwrap_or(0),
            c["failed"].as_u64().unwrap_or(0),
            served_during(c, &outages),
            streams.len(),
            broken.len(),
            format!("{}/{}", up >> 20, down >> 20),
            max_round
        );
        if c["failed"] != 0 || !broken.is_empty() || c["attempted"].as_u64().unwrap_or(0) == 0 {
            failures.push(format!("{}: {v}", path.name));
        }
    }
    table += "  (agent down: new connections that succeeded while no ready agent ran; max round: the slowest round of a stream, 2 x 32 KiB)\n";
    // Past the test harness's capture: the figures are the point of this suite.
    let _ = std::io::stderr().write_all(table.as_bytes());
    let outage_list: Vec<(u64, u64)> = outages.iter().map(|o| (o.killed_ms, o.ready_ms)).collect();
    assert!(failures.is_empty(), "failed connections or broken transfers (outages, unix ms: {outage_list:?}):\n{}", failures.join("\n"));
    for (v, path) in results.iter().zip(&paths) {
        assert!(served_during(&v["conns"], &outages) > 0, "{}: no new connection while the agent was down: {v}", path.name);
    }
    one_program_per_hook(&w);
    let log = agent.log.lock().unwrap().join("\n");
    assert!(!log.contains("panicked"), "{log}");
    agent.stop();
    eprintln!("soak: done in {:.0} s", t_run.elapsed().as_secs_f64());
}
