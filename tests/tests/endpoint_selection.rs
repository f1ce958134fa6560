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

use gardenet_tests::lab::{counts, refusal_outcome, Agent, AgentOpts, Lab, NODE_ADDR, NODE_NAME, SERVER_PORT};
use serde_json::Value;

const VIP: &str = "198.19.0.40";
const NODE_PORT: u16 = 30040;

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
    format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}, labels: {{topology.kubernetes.io/zone: zone-a}}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}]\n")
}

/// A NodePort Service (ClusterIP `VIP`, NodePort `NODE_PORT`) with the given policies.
fn service(etp_local: bool, itp_local: bool) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: sel, namespace: lab}}\nspec:\n  type: NodePort\n  clusterIP: {VIP}\n  externalTrafficPolicy: {}\n  internalTrafficPolicy: {}\n  ports:\n  - {{name: p-tcp, port: 80, targetPort: {SERVER_PORT}, nodePort: {NODE_PORT}, protocol: TCP}}\n",
        if etp_local { "Local" } else { "Cluster" },
        if itp_local { "Local" } else { "Cluster" },
    )
}

fn slice(eps: &[Ep]) -> String {
    let mut out = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: sel-1, namespace: lab, labels: {{kubernetes.io/service-name: sel}}}}\naddressType: IPv4\nports: [{{name: p-tcp, port: {SERVER_PORT}, protocol: TCP}}]\nendpoints:"
    );
    if eps.is_empty() {
        out.push_str(" []\n");
    }
    for e in eps {
        out.push_str(&format!("\n- addresses: [{}]\n  conditions: {}\n  nodeName: {}", gardenet_tests::lab::backend_ip(e.be), e.cond, e.node));
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

fn probe(lab: &Lab, path: Path, want: Want) -> Value {
    let to = match path {
        Path::SocketClusterIp | Path::TcClusterIp => format!("{VIP}:80"),
        Path::SocketNodePort | Path::OutsideNodePort => format!("{NODE_ADDR}:{NODE_PORT}"),
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
        eps: &[
            Ep { zones: &["zone-a"], ..ep(0, NODE_NAME) },
            ep(1, "n2"),
            Ep { zones: &["zone-b"], cond: "{ready: false, serving: false}", ..ep(2, "n3") },
        ],
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
        eps: &[Ep { cond: TERMINATING, ..ep(0, NODE_NAME) }, Ep { cond: TERMINATING, ..ep(1, "n2") }, Ep { cond: "{ready: false, serving: false}", ..ep(2, "n3") }],
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
        eps: &[ep(1, "n2"), Ep { cond: "{ready: false, serving: false}", ..ep(0, NODE_NAME) }, Ep { cond: TERMINATING, ..ep(2, NODE_NAME) }, Ep { cond: TERMINATING, ..ep(3, "n4") }],
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
        checks: &[(Path::SocketClusterIp, Want::Answer(&[0, 2])), (Path::OutsideNodePort, Want::Answer(&[0, 1])), (Path::SocketNodePort, Want::Answer(&[0, 2]))],
    },
    Case {
        name: "internal and external Local, all endpoints remote",
        etp_local: true,
        itp_local: true,
        eps: &[ep(1, "n2"), ep(2, "n3")],
        checks: &[(Path::SocketClusterIp, Want::Dropped), (Path::OutsideNodePort, Want::Dropped), (Path::SocketNodePort, Want::Answer(&[1, 2]))],
    },
];

#[test]
fn endpoints_answer_as_kube_proxy_chooses_them() {
    let lab = Lab::new(4).expect("lab");
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", service(false, false)), ("eps.yaml", slice(&[ep(0, NODE_NAME)]))],
    )
    .expect("agent");
    agent.wait_backends(&format!("{VIP}:80/tcp"), 1).unwrap();
    let mut report = Vec::new();
    for case in CASES {
        agent.write("svc.yaml", &service(case.etp_local, case.itp_local)).unwrap();
        agent.write("eps.yaml", &slice(case.eps)).unwrap();
        for (path, want) in case.checks {
            // Each check retries until the agent has programmed the case (it polls its
            // directory every 100 ms) or 10 s pass.
            let deadline = Instant::now() + Duration::from_secs(10);
            let v = loop {
                let v = probe(&lab, *path, *want);
                if matches(&v, *path, *want) || Instant::now() > deadline {
                    break v;
                }
                std::thread::sleep(Duration::from_millis(200));
            };
            assert!(matches(&v, *path, *want), "{}: {path:?} should be {want:?}, got {v}\nlb list: {}", case.name, agent.lb_list().unwrap());
            report.push(format!("{:<100} {path:?}: {want:?}", case.name));
        }
    }
    // `lb list` says which frontends drop and which reject.
    agent.write("svc.yaml", &service(true, true)).unwrap();
    agent.write("eps.yaml", &slice(&[ep(1, "n2")])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = agent.lb_list().unwrap();
        let of = |fe: &str| list.as_array().unwrap().iter().find(|f| format!("{}:{}{}", f["frontend"]["addr"].as_str().unwrap(), f["frontend"]["port"], f["frontend"]["scope"].as_str().map(|s| format!("@{s}")).unwrap_or_default()) == fe).cloned();
        let (cip, np, np_node) = (of(&format!("{VIP}:80")), of(&format!("{NODE_ADDR}:{NODE_PORT}")), of(&format!("{NODE_ADDR}:{NODE_PORT}@this-node")));
        if let (Some(cip), Some(np), Some(np_node)) = (&cip, &np, &np_node) {
            if cip["when_empty"] == "drop" && np["when_empty"] == "drop" && np["two_scopes"] == true && np_node["backends"].as_array().unwrap().len() == 1 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "lb list: {list}");
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.write("eps.yaml", &slice(&[])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent.lb_list().unwrap().as_array().unwrap().iter().all(|f| f["when_empty"] == "reject") {
        assert!(Instant::now() < deadline, "no endpoints at all: every frontend rejects: {}", agent.lb_list().unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("endpoint selection, {} checks passed:\n{}", report.len(), report.join("\n"));
}
