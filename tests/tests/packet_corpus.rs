//! Hostile input (issue 14, "Packets"): every TC and XDP program the agent loaded is fed,
//! with `BPF_PROG_TEST_RUN`, a corpus of at least 100,000 generated and mutated packets
//! (`gardenet_tests::corpus`), against the maps a real agent programmed in the lab: a
//! dual-stack Service with three backends (one on another node) as ClusterIP and NodePort,
//! a dual-stack Service without endpoints, and a ServiceCIDR. Each output is judged by the
//! corpus checker (etherparse, conntrack and service maps); the test prints the counts per
//! outcome and program and fails on any packet the checker refuses, or any generated packet
//! whose known outcome did not happen. Nothing is sent anywhere: `BPF_PROG_TEST_RUN` builds
//! the packet in the kernel, runs the program and hands the result back.
//!
//! `GARDENET_CORPUS_PACKETS` (default 120,000) and `GARDENET_CORPUS_SEED` change the corpus.
//! Needs root; fails (does not skip) without it.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    os::fd::OwnedFd,
    time::Instant,
};

use aya::maps::{Map, MapData, MapInfo, PerCpuArray};
use gardenet_common::{CT_DIR_FORWARD, CT_DIR_SNAT_FWD, MAP_CT, MAP_SERVICES, PROTO_TCP, PROTO_UDP, STAT_NAMES};
use gardenet_tests::{
    bpfstats,
    corpus::{
        build::{Spec, TCP_SYN},
        check::{check, Conntrack, CtKey, Kind, Maps, Outcome, Prog, Run},
        gen::{Case, Flow, Gen, Plan, TRACKED_PORTS},
        hexdump, maps_from_dump, PinnedConntrack,
    },
    lab::{node_yaml_dual, Agent, AgentOpts, Lab, NODE_ADDR, NODE_ADDR6, SERVER_PORT},
};

const VIP4: &str = "198.19.0.10";
const VIP6: &str = "fd00:19::10";
const EMPTY4: &str = "198.19.0.20";
const EMPTY6: &str = "fd00:19::20";
const NODE_PORT: u16 = 30080;
/// Frames accepted by the kernel for a test run are probed up to this size.
const PROBE_MAX: usize = 16_384;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn manifests() -> Vec<(&'static str, String)> {
    let svc = |name: &str, ty: &str, v4: &str, v6: &str| {
        let np = |p: &str| if ty == "NodePort" { format!(", nodePort: {NODE_PORT}, protocol: {p}") } else { format!(", protocol: {p}") };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: lab}}\nspec:\n  type: {ty}\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: {v4}\n  clusterIPs: [{v4}, \"{v6}\"]\n{}  ports:\n  - {{name: p-tcp, port: 80, targetPort: {SERVER_PORT}{}}}\n  - {{name: p-udp, port: 80, targetPort: {SERVER_PORT}{}}}\n  - {{name: p-same-tcp, port: {SERVER_PORT}, targetPort: {SERVER_PORT}, protocol: TCP}}\n  - {{name: p-same-udp, port: {SERVER_PORT}, targetPort: {SERVER_PORT}, protocol: UDP}}\n",
            if ty == "NodePort" { "  externalTrafficPolicy: Cluster\n" } else { "" },
            np("TCP"),
            np("UDP")
        )
    };
    // Backends 1 and 2 on this node, 3 on another: NodePort flows to it are source-NATed
    // (where the kernel has BPF_FIB_LOOKUP_SRC).
    let slice = |svc: &str, fam: &str, addrs: &[(String, &str)]| {
        let eps: Vec<String> = addrs.iter().map(|(a, n)| format!("  - addresses: [\"{a}\"]\n    conditions: {{ready: true}}\n    nodeName: {n}")).collect();
        let eps = if eps.is_empty() { "endpoints: []".to_string() } else { format!("endpoints:\n{}", eps.join("\n")) };
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-{}, namespace: lab, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: {fam}\nports:\n  - {{name: p-tcp, port: {SERVER_PORT}, protocol: TCP}}\n  - {{name: p-udp, port: {SERVER_PORT}, protocol: UDP}}\n  - {{name: p-same-tcp, port: {SERVER_PORT}, protocol: TCP}}\n  - {{name: p-same-udp, port: {SERVER_PORT}, protocol: UDP}}\n{eps}\n",
            fam.to_lowercase()
        )
    };
    let nodes = ["lab-node", "lab-node", "lab-node-b"];
    let be4: Vec<(String, &str)> = (0..3).map(|i| (gardenet_tests::lab::backend_ip(i), nodes[i])).collect();
    let be6: Vec<(String, &str)> = (0..3).map(|i| (gardenet_tests::lab::backend_ip6(i), nodes[i])).collect();
    vec![
        ("node.yaml", node_yaml_dual()),
        (
            "cidr.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec:\n  cidrs: [\"198.19.0.0/24\", \"fd00:19::/120\"]\n"
                .into(),
        ),
        ("web.yaml", svc("web", "NodePort", VIP4, VIP6)),
        ("web4.yaml", slice("web", "IPv4", &be4)),
        ("web6.yaml", slice("web", "IPv6", &be6)),
        ("empty.yaml", svc("empty", "ClusterIP", EMPTY4, EMPTY6)),
        ("empty4.yaml", slice("empty", "IPv4", &[])),
        ("empty6.yaml", slice("empty", "IPv6", &[])),
    ]
}

/// The test-run context of the TC programs: an `__sk_buff` saying the packet came in on
/// `ifindex` (kernels that do not take one get none: the packet then comes from `lo`).
fn skb_ctx(ifindex: u32) -> Vec<u8> {
    let mut c = vec![0u8; 44];
    c[40..44].copy_from_slice(&ifindex.to_ne_bytes()); // __sk_buff.ifindex
    c
}

struct Progs {
    fds: BTreeMap<Prog, OwnedFd>,
    /// `__sk_buff` for the TC programs, if this kernel takes one.
    ctx: Option<Vec<u8>>,
    out: Vec<u8>,
}

impl Progs {
    fn run(&mut self, p: Prog, data: &[u8]) -> Run {
        let ctx = if p == Prog::Xdp { None } else { self.ctx.as_deref() };
        match bpfstats::test_run(&self.fds[&p], data, ctx, &mut self.out) {
            Ok((retval, len)) => Run::Ran { retval, data: self.out[..len].to_vec() },
            Err(e) => Run::Rejected(e.raw_os_error().unwrap_or(0)),
        }
    }

    /// The largest frame the kernel takes for a test run of `p` (it refuses larger ones).
    fn max_frame(&mut self, p: Prog, sample: &[u8]) -> usize {
        let (mut ok, mut bad) = (sample.len(), PROBE_MAX + 1);
        while bad - ok > 1 {
            let mid = (ok + bad) / 2;
            let mut f = sample.to_vec();
            f.resize(mid, 0);
            if matches!(self.run(p, &f), Run::Ran { .. }) {
                ok = mid;
            } else {
                bad = mid;
            }
        }
        ok
    }
}

/// Per-CPU datapath counters of the agent's programs, summed, by name.
fn stats(m: &PerCpuArray<MapData, u64>) -> BTreeMap<&'static str, u64> {
    STAT_NAMES.iter().enumerate().map(|(i, n)| (*n, m.get(&(i as u32), 0).map(|v| v.iter().sum()).unwrap_or(0))).collect()
}

struct Failure {
    prog: Prog,
    index: usize,
    case: Case,
    why: String,
    run: Run,
}

/// Runs the flows' first packets through `gn_tc_ingress` so that conntrack knows them.
fn establish(progs: &mut Progs, maps: &Maps, ct: &dyn Conntrack, plan: &Plan) -> Vec<Flow> {
    let mut g = Gen::new(1, plan.clone());
    let mut flows = Vec::new();
    let mut port = TRACKED_PORTS.start;
    for fe in &plan.web {
        for proto in [PROTO_TCP, PROTO_UDP] {
            for client in plan.clients.iter().filter(|c| c.is_ipv6() == fe.is_ipv6()) {
                port += 1;
                let l4 = if proto == PROTO_TCP { g.tcp(port, fe.port(), TCP_SYN, 0) } else { g.udp(port, fe.port()) };
                let b = Spec::new(*client, fe.ip(), l4).build();
                let r = progs.run(Prog::TcIngress, &b);
                let o = check(Prog::TcIngress, maps, ct, &b, &r).unwrap_or_else(|e| panic!("first packet of a flow to {fe}: {e}\n{}", hexdump(&b)));
                assert!(matches!(o.kind, Kind::Dnat | Kind::Snat), "first packet of a flow to {fe}: {o:?}");
                let c = ct.get(&CtKey { src: *client, dst: fe.ip(), sport: port, dport: fe.port(), proto, dir: CT_DIR_FORWARD }).unwrap();
                let backend = SocketAddr::new(c.addr, c.port);
                let snat = (o.kind == Kind::Snat).then(|| {
                    let n = ct.get(&CtKey { src: *client, dst: c.addr, sport: port, dport: c.port, proto, dir: CT_DIR_SNAT_FWD }).unwrap();
                    SocketAddr::new(n.addr, n.port)
                });
                flows.push(Flow { client: SocketAddr::new(*client, port), frontend: *fe, proto, backend, snat });
            }
        }
    }
    flows
}

#[test]
fn every_program_survives_the_packet_corpus() {
    let n: usize = std::env::var("GARDENET_CORPUS_PACKETS").ok().and_then(|v| v.parse().ok()).unwrap_or(120_000);
    let seed: u64 = std::env::var("GARDENET_CORPUS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x6761_7264);
    let lab = Lab::new(3).expect("lab");
    lab.wait_servers6().expect("IPv6 servers");
    // The corpus's FINs and RSTs close its flows; the checker expects their conntrack entries
    // for the whole run (minutes under emulation), so the agent keeps closed flows here.
    let extra = vec!["--conntrack-closed-secs=0".into()];
    let agent = Agent::start(&lab, AgentOpts { tc: true, extra, ..Default::default() }, &manifests()).expect("agent");
    for fe in [format!("{VIP4}:80"), format!("[{VIP6}]:80"), format!("{NODE_ADDR}:{NODE_PORT}"), format!("[{NODE_ADDR6}]:{NODE_PORT}")] {
        for p in ["tcp", "udp"] {
            agent.wait_backends(&format!("{fe}/{p}"), 3).unwrap();
        }
    }
    for fe in [format!("{EMPTY4}:80"), format!("[{EMPTY6}]:80")] {
        agent.wait_backends(&format!("{fe}/tcp"), 0).unwrap();
    }
    let maps = maps_from_dump(&gardenet_agent::dataplane::dump_pinned(&agent.bpffs).unwrap());

    // The programs this agent loaded: the instances that use its pinned maps.
    let pinned: Vec<u32> = [MAP_SERVICES, MAP_CT].iter().map(|m| MapData::from_pin(agent.bpffs.join(m)).unwrap().info().unwrap().id()).collect();
    let mut fds = BTreeMap::new();
    let mut stats_map = None;
    for p in Prog::ALL {
        let ids = bpfstats::programs_using_maps(p.name(), &pinned).unwrap();
        assert_eq!(ids.len(), 1, "{}: one instance of this agent's, found {ids:?}", p.name());
        fds.insert(p, bpfstats::prog_fd(ids[0]).unwrap());
        for m in bpfstats::map_ids_of(ids[0]).unwrap() {
            if stats_map.is_none() && MapInfo::from_id(m).is_ok_and(|i| i.name_as_str() == Some("GN_STATS")) {
                stats_map = Some(PerCpuArray::<MapData, u64>::try_from(Map::PerCpuArray(MapData::from_id(m).unwrap())).unwrap());
            }
        }
    }
    let stats_map = stats_map.expect("GN_STATS among the programs' maps");
    let ct = PinnedConntrack::open(&agent.bpffs).unwrap();

    // In the node's namespace: routes (source NAT's FIB lookups) and sockets are the node's.
    let report = lab
        .node
        .run_in(|| {
            let nc0 = unsafe { libc::if_nametoindex(c"nc0".as_ptr()) };
            let mut progs = Progs { fds, ctx: Some(skb_ctx(nc0)), out: vec![0; PROBE_MAX + 512] };
            let v6s = |s: &[&str]| s.iter().map(|a| ip(a)).collect::<Vec<_>>();
            let mut plan = Plan {
                // The ClusterIPs on port 80 (to the backends' 8080) and on 8080 itself: a
                // translation that keeps the port rewrites only the address.
                web: [
                    format!("{VIP4}:80"),
                    format!("[{VIP6}]:80"),
                    format!("{VIP4}:{SERVER_PORT}"),
                    format!("[{VIP6}]:{SERVER_PORT}"),
                    format!("{NODE_ADDR}:{NODE_PORT}"),
                    format!("[{NODE_ADDR6}]:{NODE_PORT}"),
                ]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
                empty: vec![format!("{EMPTY4}:80").parse().unwrap(), format!("[{EMPTY6}]:80").parse().unwrap()],
                unserved: [format!("{VIP4}:81"), format!("[{VIP6}]:81"), format!("{EMPTY4}:443"), format!("[{EMPTY6}]:443")]
                    .iter()
                    .map(|s| s.parse().unwrap())
                    .collect(),
                unallocated: v6s(&["198.19.0.99", "fd00:19::99"]),
                others: v6s(&[
                    "198.18.1.10",
                    "198.18.1.12",
                    "198.18.0.1",
                    "198.18.0.3",
                    "198.18.3.7",
                    "fd00:18:1::10",
                    "fd00:18:1::12",
                    "fd00:18::1",
                    "fd00:18::3",
                    "fd00:18:3::7",
                ]),
                // Hosts on the client link: the node has a route back to them (source NAT's replies
                // to an unroutable client are dropped, by design).
                clients: v6s(&["198.18.0.2", "198.18.0.3", "198.18.0.77", "fd00:18::2", "fd00:18::3", "fd00:18::77"]),
                routers: v6s(&["198.18.0.254", "fd00:18::fe"]),
                flows: Vec::new(),
                max_frame: 0,
            };
            // Does this kernel take an `__sk_buff` with an ifindex? (Probed on a packet to no one.)
            let probe =
                Spec::new(ip("198.18.0.2"), ip("198.18.3.7"), gardenet_tests::corpus::build::L4::Udp { sport: 9, dport: 9, payload: vec![], no_csum: false })
                    .build();
            if matches!(progs.run(Prog::TcIngress, &probe), Run::Rejected(_)) {
                progs.ctx = None;
            }
            let maxes: Vec<usize> = Prog::ALL.iter().map(|p| progs.max_frame(*p, &probe)).collect();
            plan.max_frame = *maxes.iter().min().unwrap();
            plan.flows = establish(&mut progs, &maps, &ct, &plan);
            // Packets gn_tc_ingress once translated (found by this corpus): untouched now.
            let regressions = Gen::new(seed, plan.clone()).regressions();
            for (what, b) in &regressions {
                let r = progs.run(Prog::TcIngress, b);
                let o = check(Prog::TcIngress, &maps, &ct, b, &r).unwrap_or_else(|e| panic!("{what}: {e}\n{}", hexdump(b)));
                assert_eq!(o.kind, Kind::Passed, "{what}\n{}", hexdump(b));
            }

            let t = Instant::now();
            let mut g = Gen::new(seed, plan.clone());
            let cases: Vec<Case> = (0..n).map(|_| g.case()).collect();
            let gen_s = t.elapsed().as_secs_f64();

            let mut counts: BTreeMap<(Outcome, Prog), u64> = BTreeMap::new();
            let mut failures: Vec<Failure> = Vec::new();
            let mut failed: BTreeMap<Prog, u64> = BTreeMap::new();
            let mut secs = BTreeMap::new();
            let mut stat_delta = BTreeMap::new();
            for p in Prog::ALL {
                let before = stats(&stats_map);
                let t = Instant::now();
                let mut in_kernel = std::time::Duration::ZERO;
                for (i, c) in cases.iter().enumerate() {
                    let t = Instant::now();
                    let r = progs.run(p, &c.bytes);
                    in_kernel += t.elapsed();
                    let verdict = check(p, &maps, &ct, &c.bytes, &r).and_then(|o| {
                        if c.want[p as usize].has(o.kind) {
                            Ok(o)
                        } else {
                            Err(format!("{} where the corpus expects {:?}", o.kind.name(), c.want[p as usize]))
                        }
                    });
                    match verdict {
                        Ok(o) => *counts.entry((o, p)).or_default() += 1,
                        Err(why) => {
                            *failed.entry(p).or_default() += 1;
                            if failures.len() < 2000 {
                                failures.push(Failure { prog: p, index: i, case: c.clone(), why, run: r });
                            }
                        }
                    }
                }
                secs.insert(p, (t.elapsed().as_secs_f64(), in_kernel.as_secs_f64()));
                let after = stats(&stats_map);
                stat_delta.insert(p, after.iter().map(|(k, v)| (*k, v - before[k])).collect::<BTreeMap<_, _>>());
            }
            (plan, maxes, gen_s, counts, failures, failed, secs, stat_delta, progs.ctx.is_some(), regressions.len())
        })
        .unwrap();
    let (plan, maxes, gen_s, counts, failures, failed, secs, stat_delta, with_ctx, regressions) = report;

    // The table.
    let snat = plan.flows.iter().filter(|f| f.snat.is_some()).count();
    eprintln!(
        "\npacket corpus: {n} packets per program (seed {seed}); largest frame the kernel takes: {} bytes (TC ingress/egress/XDP: {maxes:?}, probed up to {PROBE_MAX}); TC context: {}; flows established first: {} ({snat} source-NATed); {regressions} regression packets passed untouched; corpus generated in {gen_s:.1} s",
        plan.max_frame,
        if with_ctx { "__sk_buff with the ingress ifindex of nc0" } else { "none (kernel takes no ifindex)" },
        plan.flows.len()
    );
    let progs = Prog::ALL;
    eprintln!("{:<24} {:<12} {:>14} {:>14} {:>14}", "outcome", "input", progs[0].name(), progs[1].name(), progs[2].name());
    for k in Kind::ALL {
        for malformed in [false, true] {
            let row: Vec<u64> = progs.iter().map(|p| counts.get(&(Outcome { kind: k, malformed }, *p)).copied().unwrap_or(0)).collect();
            if row.iter().any(|c| *c > 0) {
                eprintln!("{:<24} {:<12} {:>14} {:>14} {:>14}", k.name(), if malformed { "malformed" } else { "well-formed" }, row[0], row[1], row[2]);
            }
        }
    }
    let f: Vec<u64> = progs.iter().map(|p| failed.get(p).copied().unwrap_or(0)).collect();
    eprintln!("{:<24} {:<12} {:>14} {:>14} {:>14}", "FAILED", "", f[0], f[1], f[2]);
    let t: Vec<String> = progs.iter().map(|p| format!("{:.1} s", secs[p].0)).collect();
    eprintln!("{:<24} {:<12} {:>14} {:>14} {:>14}", "time: run + check", "", t[0], t[1], t[2]);
    let t: Vec<String> = progs.iter().map(|p| format!("{:.1} s", secs[p].1)).collect();
    eprintln!("{:<24} {:<12} {:>14} {:>14} {:>14}", "  of which test runs", "", t[0], t[1], t[2]);

    // The programs' own counters agree with the checker.
    let count = |p: Prog, ks: &[Kind]| -> u64 { counts.iter().filter(|((o, q), _)| *q == p && ks.contains(&o.kind)).map(|(_, c)| c).sum() };
    let agree = [
        (Prog::TcIngress, "tc_dnat", count(Prog::TcIngress, &[Kind::Dnat, Kind::Snat])),
        (Prog::TcIngress, "tc_revnat", count(Prog::TcIngress, &[Kind::RevNat])),
        (Prog::TcIngress, "tc_icmp_revnat", count(Prog::TcIngress, &[Kind::IcmpRevNat])),
        (Prog::TcIngress, "tc_no_backend_reset", count(Prog::TcIngress, &[Kind::Rst])),
        (Prog::TcIngress, "tc_snat", count(Prog::TcIngress, &[Kind::Snat])),
        (Prog::TcIngress, "tc_snat_revnat", count(Prog::TcIngress, &[Kind::SnatRev])),
        (Prog::TcEgress, "tc_revnat", count(Prog::TcEgress, &[Kind::RevNat])),
        (Prog::Xdp, "xdp_drop_no_backend", count(Prog::Xdp, &[Kind::Dropped])),
    ];
    for p in progs {
        let nz: Vec<String> = stat_delta[&p].iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("  {:<14} counters: {}", p.name(), nz.join(" "));
    }
    let mut disagree = Vec::new();
    for (p, stat, checker) in agree {
        let got = stat_delta[&p][stat];
        eprintln!("  {:<14} {stat:<22} +{got:<8} checker: {checker}", p.name());
        if got != checker && failed.values().sum::<u64>() == 0 {
            disagree.push(format!("{}: {stat} +{got}, checker {checker}", p.name()));
        }
    }
    for fl in failures.iter().take(8) {
        let out = match &fl.run {
            Run::Ran { retval, data } => format!("retval {retval}, out:\n{}", hexdump(data)),
            Run::Rejected(e) => format!("refused: errno {e}"),
        };
        eprintln!(
            "\nFAILED {} packet #{} ({} / {}, {} bytes): {}\n  in:\n{}  {out}",
            fl.prog.name(),
            fl.index,
            fl.case.base,
            fl.case.mutation,
            fl.case.bytes.len(),
            fl.why,
            hexdump(&fl.case.bytes)
        );
    }
    let mut by_what: BTreeMap<(Prog, &str, &str), (usize, &str)> = BTreeMap::new();
    for fl in &failures {
        by_what.entry((fl.prog, fl.case.base, fl.case.mutation)).or_insert((0, &fl.why)).0 += 1;
    }
    for ((p, b, m), (c, why)) in &by_what {
        eprintln!("  failed: {:<14} {b} / {m}: {c}, e.g. {why}", p.name());
    }
    assert!(failures.is_empty(), "{} packets failed the checker (first ones above)", f.iter().sum::<u64>());
    assert!(disagree.is_empty(), "the datapath counters disagree with the checker: {disagree:?}");
    for p in progs {
        let ran: u64 = counts.iter().filter(|((o, q), _)| *q == p && o.kind != Kind::Short).map(|(_, c)| c).sum();
        assert!(ran >= 100_000 || n < 100_000, "{}: only {ran} packets ran", p.name());
    }
    drop(agent);
}
