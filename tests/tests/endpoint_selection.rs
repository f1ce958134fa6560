//! Endpoint selection as kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology_test.go),
//! checked by which backends actually answer: every case a Service, EndpointSlices and a Node
//! can express, on each path the case concerns: socket LB (a client on this node), TC LB (the
//! same client without socket LB) and NodePort traffic from another node.
//! Needs root; fails (does not skip) without it.
//!
//! All four backends sit on the lab node's bridge; `nodeName` in the EndpointSlice decides
//! which of them count as local (`lab-node`) and which as remote. Traffic from outside is
//! checked only where no source NAT is involved (`externalTrafficPolicy: Local`): a
//! source-NATed reply from a "remote" endpoint on the bridge would not pass TC LB (source NAT
//! has its own suite, nodeport_snat).
use std::time::{Duration, Instant};

use gardenet_tests::lab::{backend_ip, backend_ip6, counts, refusal_outcome, Agent, AgentOpts, Lab, NODE_ADDR, NODE_ADDR6, NODE_NAME, SERVER_PORT};
use serde_json::Value;

const NODE_PORT: u16 = 30040;

/// The address family a run of the table uses (the same cases, the same code path).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn vip(self) -> &'static str {
        if self == Family::V4 {
            "198.19.0.40"
        } else {
            "fd00:19::40"
        }
    }
    fn node_addr(self) -> &'static str {
        if self == Family::V4 {
            NODE_ADDR
        } else {
            NODE_ADDR6
        }
    }
    fn backend(self, i: usize) -> String {
        if self == Family::V4 {
            backend_ip(i)
        } else {
            format!("\"{}\"", backend_ip6(i))
        }
    }
    /// `ADDR:PORT` as a socket address (IPv6 in brackets).
    fn sock(self, addr: &str, port: u16) -> String {
        if self == Family::V4 {
            format!("{addr}:{port}")
        } else {
            format!("[{addr}]:{port}")
        }
    }
    fn name(self) -> &'static str {
        if self == Family::V4 {
            "IPv4"
        } else {
            "IPv6"
        }
    }
}

/// One endpoint: backend index, node name, ready/serving/terminating, zone and node hints.
struct Ep {
    be: usize,
    node: &'static str,
    cond: &'static str,
    zones: &'static [&'static str],
    nodes: &'static [&'static str],
}
const READY: &str = "{ready: true}";
const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";
const fn ep(be: usize, node: &'static str) -> Ep {
    Ep { be, node, cond: READY, zones: &[], nodes: &[] }
}

fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}, labels: {{topology.kubernetes.io/zone: zone-a}}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}, {{type: InternalIP, address: \"{NODE_ADDR6}\"}}]\n"
    )
}

/// A single-stack NodePort Service (NodePort `NODE_PORT`) with the given policies.
fn service(fam: Family, etp_local: bool, itp_local: bool) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: sel, namespace: lab}}\nspec:\n  type: NodePort\n  ipFamilies: [{}]\n  clusterIP: \"{}\"\n  externalTrafficPolicy: {}\n  internalTrafficPolicy: {}\n  ports:\n  - {{name: p-tcp, port: 80, targetPort: {SERVER_PORT}, nodePort: {NODE_PORT}, protocol: TCP}}\n",
        fam.name(),
        fam.vip(),
        if etp_local { "Local" } else { "Cluster" },
        if itp_local { "Local" } else { "Cluster" },
    )
}

fn slice(fam: Family, eps: &[Ep]) -> String {
    let mut out = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: sel-1, namespace: lab, labels: {{kubernetes.io/service-name: sel}}}}\naddressType: {}\nports: [{{name: p-tcp, port: {SERVER_PORT}, protocol: TCP}}]\nendpoints:",
        fam.name()
    );
    if eps.is_empty() {
        out.push_str(" []\n");
    }
    for e in eps {
        out.push_str(&format!("\n- addresses: [{}]\n  conditions: {}\n  nodeName: {}", fam.backend(e.be), e.cond, e.node));
        let mut hints = Vec::new();
        if !e.zones.is_empty() {
            hints.push(format!("forZones: [{}]", e.zones.iter().map(|z| format!("{{name: {z}}}")).collect::<Vec<_>>().join(", ")));
        }
        if !e.nodes.is_empty() {
            hints.push(format!("forNodes: [{}]", e.nodes.iter().map(|n| format!("{{name: {n}}}")).collect::<Vec<_>>().join(", ")));
        }
        if !hints.is_empty() {
            out.push_str(&format!("\n  hints: {{{}}}", hints.join(", ")));
        }
    }
    out.push('\n');
    out
}

/// What a path should see: these backends answer, or connections fail this way.
#[derive(Debug, Clone, Copy)]
enum Want {
    Answer(&'static [usize]),
    Refused,
    Dropped,
}

/// The paths a case is checked on.
#[derive(Debug, Clone, Copy)]
enum Path {
    /// The client in the socket-LB cgroup dials the ClusterIP.
    SocketClusterIp,
    /// The same client outside the cgroup: TC LB on the node translates.
    TcClusterIp,
    /// The socket-LB client dials the NodePort (a pod of this node to an external address).
    SocketNodePort,
    /// Another node dials the NodePort (traffic from outside).
    OutsideNodePort,
}

fn probe(lab: &Lab, fam: Family, path: Path, want: Want) -> Value {
    let to = match path {
        Path::SocketClusterIp | Path::TcClusterIp => fam.sock(fam.vip(), 80),
        Path::SocketNodePort | Path::OutsideNodePort => fam.sock(fam.node_addr(), NODE_PORT),
    };
    let socket = matches!(path, Path::SocketClusterIp | Path::SocketNodePort);
    match want {
        Want::Answer(_) => {
            let args = ["tcp", "--to", &to, "--count", "40", "--timeout-ms", "2000"];
            match path {
                Path::OutsideNodePort => lab.node2_json(&args),
                _ => lab.client_json(socket, &args),
            }
        }
        Want::Refused | Want::Dropped => {
            let args = ["connect", "--to", &to, "--timeout-ms", "700"];
            match path {
                Path::OutsideNodePort => lab.node2_json(&args),
                _ => lab.client_json(socket, &args),
            }
        }
    }
    .unwrap()
}

/// Whether `v` (netkit output) is what `want` says for `path`.
fn matches(v: &Value, path: Path, want: Want) -> bool {
    let socket = matches!(path, Path::SocketClusterIp | Path::SocketNodePort);
    match want {
        Want::Answer(bes) => {
            let got: Vec<String> = counts(v).into_iter().map(|(n, _)| n).collect();
            let want: Vec<String> = bes.iter().map(|i| gardenet_tests::lab::backend_name(*i)).collect();
            got == want && v["errors"].as_object().is_some_and(|e| e.is_empty())
        }
        Want::Refused => v["outcome"] == refusal_outcome(socket),
        // Socket LB fails a dropping frontend's connect at once (EHOSTUNREACH; EPERM where
        // the kernel cannot set the error); packets are dropped silently: a timeout.
        Want::Dropped if socket => v["outcome"] == if refusal_outcome(true) == "PermissionDenied" { "PermissionDenied" } else { "HostUnreachable" },
        Want::Dropped => v["outcome"] == "TimedOut",
    }
}

struct Case {
    name: &'static str,
    etp_local: bool,
    itp_local: bool,
    eps: &'static [Ep],
    checks: &'static [(Path, Want)],
}

const CASES: &[Case] = &[
    Case {
        name: "zone hints, no annotation: this zone's endpoints",
        etp_local: false,
        itp_local: false,
        eps: &[
            Ep { zones: &["zone-a"], ..ep(0, NODE_NAME) },
            Ep { zones: &["zone-b"], ..ep(1, "n2") },
            Ep { zones: &["zone-c"], ..ep(2, "n3") },
            Ep { zones: &["zone-a"], ..ep(3, "n4") },
        ],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0, 3])), (Path::TcClusterIp, Want::Answer(&[0, 3])), (Path::SocketNodePort, Want::Answer(&[0, 3]))],
    },
    Case {
        name: "a ready endpoint without hints: no filtering; unready ones take no part",
        etp_local: false,
        itp_local: false,
        eps: &[Ep { zones: &["zone-a"], ..ep(0, NODE_NAME) }, ep(1, "n2"), Ep { zones: &["zone-b"], cond: "{ready: false, serving: false}", ..ep(2, "n3") }],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0, 1])), (Path::TcClusterIp, Want::Answer(&[0, 1]))],
    },
    Case {
        name: "PreferSameNode: this node's endpoint",
        etp_local: false,
        itp_local: false,
        eps: &[
            Ep { zones: &["zone-a"], nodes: &[NODE_NAME], ..ep(0, NODE_NAME) },
            Ep { zones: &["zone-a"], nodes: &["n2"], ..ep(1, "n2") },
            Ep { zones: &["zone-b"], nodes: &["n3"], ..ep(2, "n3") },
        ],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0])), (Path::TcClusterIp, Want::Answer(&[0]))],
    },
    Case {
        name: "PreferSameNode without an endpoint for this node: same zone",
        etp_local: false,
        itp_local: false,
        eps: &[Ep { zones: &["zone-a"], nodes: &["n2"], ..ep(1, "n2") }, Ep { zones: &["zone-b"], nodes: &["n3"], ..ep(2, "n3") }],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[1])), (Path::TcClusterIp, Want::Answer(&[1]))],
    },
    Case {
        name: "nothing ready: serving terminating endpoints",
        etp_local: false,
        itp_local: false,
        eps: &[
            Ep { cond: TERMINATING, ..ep(0, NODE_NAME) },
            Ep { cond: TERMINATING, ..ep(1, "n2") },
            Ep { cond: "{ready: false, serving: false}", ..ep(2, "n3") },
        ],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0, 1])), (Path::TcClusterIp, Want::Answer(&[0, 1]))],
    },
    Case {
        name: "no endpoints at all: rejected",
        etp_local: false,
        itp_local: false,
        eps: &[],
        checks: &[(Path::SocketClusterIp, Want::Refused), (Path::TcClusterIp, Want::Refused)],
    },
    Case {
        name: "internalTrafficPolicy Local: local endpoints",
        etp_local: false,
        itp_local: true,
        eps: &[ep(0, NODE_NAME), ep(1, "n2")],
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0])), (Path::TcClusterIp, Want::Answer(&[0])), (Path::SocketNodePort, Want::Answer(&[0, 1]))],
    },
    Case {
        name: "internalTrafficPolicy Local, all endpoints remote: dropped",
        etp_local: false,
        itp_local: true,
        eps: &[ep(1, "n2"), ep(2, "n3")],
        checks: &[(Path::SocketClusterIp, Want::Dropped), (Path::TcClusterIp, Want::Dropped), (Path::SocketNodePort, Want::Answer(&[1, 2]))],
    },
    Case {
        name: "externalTrafficPolicy Local: outside gets local endpoints, this node's clients the cluster's",
        etp_local: true,
        itp_local: false,
        eps: &[ep(0, NODE_NAME), ep(1, "n2")],
        checks: &[(Path::OutsideNodePort, Want::Answer(&[0])), (Path::SocketNodePort, Want::Answer(&[0, 1])), (Path::SocketClusterIp, Want::Answer(&[0, 1]))],
    },
    Case {
        name: "externalTrafficPolicy Local, no local endpoints: outside dropped, this node's clients still served",
        etp_local: true,
        itp_local: false,
        eps: &[ep(1, "n2"), ep(2, "n3")],
        checks: &[(Path::OutsideNodePort, Want::Dropped), (Path::SocketNodePort, Want::Answer(&[1, 2])), (Path::TcClusterIp, Want::Answer(&[1, 2]))],
    },
    Case {
        name: "externalTrafficPolicy Local with terminating endpoints",
        etp_local: true,
        itp_local: false,
        eps: &[
            ep(1, "n2"),
            Ep { cond: "{ready: false, serving: false}", ..ep(0, NODE_NAME) },
            Ep { cond: TERMINATING, ..ep(2, NODE_NAME) },
            Ep { cond: TERMINATING, ..ep(3, "n4") },
        ],
        checks: &[(Path::OutsideNodePort, Want::Answer(&[2])), (Path::SocketClusterIp, Want::Answer(&[1])), (Path::SocketNodePort, Want::Answer(&[1]))],
    },
    Case {
        name: "conflicting topology and localness",
        etp_local: true,
        itp_local: false,
        eps: &[
            Ep { zones: &["zone-a"], ..ep(0, NODE_NAME) },
            Ep { zones: &["zone-b"], ..ep(1, NODE_NAME) },
            Ep { zones: &["zone-a"], ..ep(2, "n3") },
            Ep { zones: &["zone-b"], ..ep(3, "n4") },
        ],
        checks: &[
            (Path::SocketClusterIp, Want::Answer(&[0, 2])),
            (Path::OutsideNodePort, Want::Answer(&[0, 1])),
            (Path::SocketNodePort, Want::Answer(&[0, 2])),
        ],
    },
    Case {
        name: "internal and external Local, all endpoints remote",
        etp_local: true,
        itp_local: true,
        eps: &[ep(1, "n2"), ep(2, "n3")],
        checks: &[(Path::SocketClusterIp, Want::Dropped), (Path::OutsideNodePort, Want::Dropped), (Path::SocketNodePort, Want::Answer(&[1, 2]))],
    },
];

/// One lab at a time: the tests share the machine's two cores.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn endpoints_answer_as_kube_proxy_chooses_them() {
    let _serial = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let lab = Lab::new(4).expect("lab");
    lab.wait_servers6().expect("IPv6 servers");
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", service(Family::V4, false, false)), ("eps.yaml", slice(Family::V4, &[ep(0, NODE_NAME)]))],
    )
    .expect("agent");
    agent.wait_backends(&format!("{}:80/tcp", Family::V4.vip()), 1).unwrap();
    let mut report = Vec::new();
    for fam in [Family::V4, Family::V6] {
        for case in CASES {
            agent.write("svc.yaml", &service(fam, case.etp_local, case.itp_local)).unwrap();
            agent.write("eps.yaml", &slice(fam, case.eps)).unwrap();
            for (path, want) in case.checks {
                // Each check retries until the agent has programmed the case (it polls its
                // directory every 100 ms) or 10 s pass.
                let deadline = Instant::now() + Duration::from_secs(10);
                let v = loop {
                    let v = probe(&lab, fam, *path, *want);
                    if matches(&v, *path, *want) || Instant::now() > deadline {
                        break v;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                };
                assert!(matches(&v, *path, *want), "{} ({fam:?}): {path:?} should be {want:?}, got {v}\nlb list: {}", case.name, agent.lb_list().unwrap());
                report.push(format!("{:<100} {fam:?} {path:?}: {want:?}", case.name));
            }
        }
        assert_lb_list_says_drop_or_reject(&agent, fam);
    }
    eprintln!("endpoint selection, {} checks passed:\n{}", report.len(), report.join("\n"));
}

/// `lb list` says which frontends drop and which reject.
fn assert_lb_list_says_drop_or_reject(agent: &Agent, fam: Family) {
    agent.write("svc.yaml", &service(fam, true, true)).unwrap();
    agent.write("eps.yaml", &slice(fam, &[ep(1, "n2")])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = agent.lb_list().unwrap();
        let of = |addr: &str, port: u16, scope: &str| {
            list.as_array()
                .unwrap()
                .iter()
                .find(|f| f["frontend"]["addr"] == addr && f["frontend"]["port"] == port && f["frontend"]["scope"].as_str().unwrap_or("") == scope)
                .cloned()
        };
        let (cip, np, np_node) = (of(fam.vip(), 80, ""), of(fam.node_addr(), NODE_PORT, ""), of(fam.node_addr(), NODE_PORT, "this-node"));
        if let (Some(cip), Some(np), Some(np_node)) = (&cip, &np, &np_node) {
            if cip["when_empty"] == "drop" && np["when_empty"] == "drop" && np["two_scopes"] == true && np_node["backends"].as_array().unwrap().len() == 1 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "lb list: {list}");
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.write("eps.yaml", &slice(fam, &[])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent.lb_list().unwrap().as_array().unwrap().iter().all(|f| f["when_empty"] == "reject") {
        assert!(Instant::now() < deadline, "no endpoints at all: every frontend rejects: {}", agent.lb_list().unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn service_cidr(cidrs: &[&str]) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\nspec:\n  cidrs: [{}]\n",
        cidrs.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ")
    )
}

/// Like kube-proxy's nftables proxier: with ServiceCIDRs, a new connection to an unallocated
/// address of a service range is dropped, to a ClusterIP on a port it does not serve
/// rejected; another proxy's ClusterIPs are left alone.
#[test]
fn service_ranges_drop_unallocated_addresses_and_reject_unknown_ports() {
    let _serial = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let lab = Lab::new(1).expect("lab");
    lab.wait_servers6().expect("IPv6 servers");
    let foreign = "apiVersion: v1\nkind: Service\nmetadata: {name: other, namespace: lab, labels: {service.kubernetes.io/service-proxy-name: someone-else}}\nspec:\n  clusterIP: 198.19.0.77\n  ports: [{port: 80}]\n";
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[
            ("node.yaml", node_yaml()),
            ("svc.yaml", service(Family::V4, false, false)),
            ("svc6.yaml", service(Family::V6, false, false).replace("name: sel,", "name: sel6,")),
            ("eps.yaml", slice(Family::V4, &[ep(0, NODE_NAME)])),
            ("eps6.yaml", slice(Family::V6, &[ep(0, NODE_NAME)]).replace("name: sel-1", "name: sel6-1").replace("service-name: sel}", "service-name: sel6}")),
            ("other.yaml", foreign.to_string()),
            ("cidr.yaml", service_cidr(&["198.19.0.0/16", "fd00:19::/112"])),
        ],
    )
    .expect("agent");
    agent.wait_backends("198.19.0.40:80/tcp", 1).unwrap();
    agent.wait_backends("[fd00:19::40]:80/tcp", 1).unwrap();
    let connect =
        |socket: bool, to: &str| lab.client_json(socket, &["connect", "--to", to, "--timeout-ms", "700"]).unwrap()["outcome"].as_str().unwrap().to_owned();
    let dropped_socket = if refusal_outcome(true) == "PermissionDenied" { "PermissionDenied" } else { "HostUnreachable" };
    let eventually = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    for (vip, other) in [("198.19.0.40", "198.19.0.99"), ("[fd00:19::40]", "[fd00:19::99]")] {
        for socket in [true, false] {
            let served = lab.client_json(socket, &["tcp", "--to", &format!("{vip}:80"), "--count", "3"]).unwrap();
            assert_eq!(counts(&served), [("be1".to_string(), 3)], "{vip}:80 socket LB {socket}: {served}");
            eventually(&format!("{vip}:81 (a port the ClusterIP does not serve) refused, socket LB {socket}"), &|| {
                connect(socket, &format!("{vip}:81")) == refusal_outcome(socket)
            });
            let want = if socket { dropped_socket } else { "TimedOut" };
            eventually(&format!("{other}:80 (unallocated) dropped, socket LB {socket}"), &|| connect(socket, &format!("{other}:80")) == want);
        }
    }
    // Another proxy's ClusterIP: not ours to drop; the node has no route for it, so the
    // client hears that at once instead of timing out.
    let foreign_outcome = connect(false, "198.19.0.77:80");
    assert!(foreign_outcome.ends_with("Unreachable"), "198.19.0.77 is another proxy's: {foreign_outcome}");
    // Without ServiceCIDRs the ranges are not enforced any more.
    agent.write("cidr.yaml", "").unwrap();
    eventually("ServiceCIDR gone: 198.19.0.99 no longer dropped", &|| connect(false, "198.19.0.99:80").ends_with("Unreachable"));
}
