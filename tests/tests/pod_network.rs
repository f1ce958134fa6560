//! The pod network with a real container runtime: podman (`--network-backend cni`, libcni,
//! as containerd and CRI-O call plugins) creates pods through the conflist and bin dir the
//! agent installed. Pods get addresses from the Node's pod CIDRs and reach each other, the
//! node, the outside (as the node) and Services whose backends are pods (socket LB; also a
//! pod reaching its own Service), the node reaches them, `hostPort` answers; pods created
//! and removed leave nothing behind, also while the agent is SIGKILLed. IPv4 and IPv6.
use std::{collections::BTreeMap, process::Stdio, time::Duration};

use gardenet_tests::{
    lab::service_yaml_dual,
    netns::{sibling_binary, Netns, Proc},
    podman::Pod,
    podnode::{PodNode, NODE_IP, NODE_IP6, OUTSIDE_IP, OUTSIDE_IP6},
};
use serde_json::Value;

fn netkit_ns(ns: &Netns, args: &[&str]) -> Value {
    let out = ns.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap().args(args).stderr(Stdio::inherit()).output().unwrap();
    assert!(out.status.success(), "netkit {args:?}: {}", out.status);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Polls `f` (a netkit answer) until `name` answers, for up to 10 s.
fn wait_for(name: &str, f: impl Fn() -> Value) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = f();
        if v["counts"][name].as_u64().unwrap_or(0) > 0 {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "{name} never answered: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn slice(svc: &str, family: &str, addrs: &[String]) -> String {
    let eps: Vec<String> = addrs.iter().map(|a| format!("  - addresses: [\"{a}\"]\n    conditions: {{ready: true}}")).collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-{family}, namespace: lab, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: {family}\nports:\n  - {{name: p-tcp, port: 8080, protocol: TCP}}\n  - {{name: p-udp, port: 8080, protocol: UDP}}\nendpoints:\n{}\n",
        eps.join("\n")
    )
}

#[test]
fn pods_created_by_podman_reach_each_other_the_node_the_outside_and_services() {
    let n = PodNode::new().unwrap();
    let pods: Vec<Pod> = (0..3).map(|i| n.runtime.run_pod(&format!("p{i}"), "gardenet", &[]).unwrap()).collect();
    let addrs: Vec<(String, String)> = pods.iter().map(|p| n.runtime.addresses(&p.name).unwrap()).collect();
    for (v4, v6) in &addrs {
        assert!(v4.starts_with("198.18.100.") && v6.starts_with("fd00:18:100::"), "{v4} {v6} from the Node's pod CIDRs");
    }
    let _servers: Vec<Proc> = pods.iter().map(|p| n.serve(p)).collect();
    let _node_server = {
        let mut cmd = n.node.ns.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap();
        cmd.args(["serve", "--name", "node", "--port", "8080"]);
        Proc::spawn(cmd, "node").unwrap()
    };
    let _outside = {
        let mut cmd = n.wire.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap();
        cmd.args(["serve", "--name", "outside", "--port", "8080"]);
        Proc::spawn(cmd, "outside").unwrap()
    };
    // Pod to pod, pod to node, and the outside, in both families, TCP and UDP; each server
    // tells whom it saw: pods and the node see the pod, the outside host sees the node.
    let (p0, p1) = (&pods[0], &pods[1]);
    for (to, name, seen) in [
        (format!("{}:8080", addrs[1].0), "p1", format!("{}:", addrs[0].0)),
        (format!("[{}]:8080", addrs[1].1), "p1", format!("[{}]:", addrs[0].1)),
        (format!("{NODE_IP}:8080"), "node", format!("{}:", addrs[0].0)),
        (format!("[{NODE_IP6}]:8080"), "node", format!("[{}]:", addrs[0].1)),
        (format!("{OUTSIDE_IP}:8080"), "outside", format!("{NODE_IP}:")),
        (format!("[{OUTSIDE_IP6}]:8080"), "outside", format!("[{NODE_IP6}]:")),
    ] {
        wait_for(name, || n.netkit(p0, &["tcp", "--to", &to, "--count", "1", "--timeout-ms", "300"]));
        assert_eq!(n.netkit(p0, &["tcp", "--to", &to, "--count", "20"])["counts"][name], 20, "TCP p0 -> {to}");
        assert_eq!(n.netkit(p0, &["udp", "--to", &to, "--count", "20", "--fresh-socket"])["counts"][name], 20, "UDP p0 -> {to}");
        let p = n.netkit(p0, &["peername", "--to", &to]);
        assert!(p["seen_as"].as_str().is_some_and(|s| s.starts_with(&seen)), "{to} saw p0 as {p}, expected {seen}...");
    }
    // The node reaches its pods.
    for (i, (v4, v6)) in addrs.iter().enumerate() {
        let name = format!("p{i}");
        for to in [format!("{v4}:8080"), format!("[{v6}]:8080")] {
            wait_for(&name, || netkit_ns(&n.node.ns, &["tcp", "--to", &to, "--count", "1", "--timeout-ms", "300"]));
            assert_eq!(netkit_ns(&n.node.ns, &["udp", "--to", &to, "--count", "10"])["counts"][&name], 10, "node -> {to}");
        }
    }
    // A Service whose backends are p1 and p2, from p0 (socket LB); and one whose only
    // backend is p1, from p1 itself (hairpin).
    n.agent.write("web.yaml", &service_yaml_dual("web", "198.19.0.10", "fd00:19::10", 80, &["TCP", "UDP"])).unwrap();
    n.agent.write("web-v4.yaml", &slice("web", "IPv4", &[addrs[1].0.clone(), addrs[2].0.clone()])).unwrap();
    n.agent.write("web-v6.yaml", &slice("web", "IPv6", &[addrs[1].1.clone(), addrs[2].1.clone()])).unwrap();
    n.agent.write("self.yaml", &service_yaml_dual("self", "198.19.0.11", "fd00:19::11", 80, &["TCP", "UDP"])).unwrap();
    n.agent.write("self-v4.yaml", &slice("self", "IPv4", std::slice::from_ref(&addrs[1].0))).unwrap();
    n.agent.write("self-v6.yaml", &slice("self", "IPv6", std::slice::from_ref(&addrs[1].1))).unwrap();
    for vip in ["198.19.0.10:80", "[fd00:19::10]:80"] {
        wait_for("p2", || n.netkit(p0, &["tcp", "--to", vip, "--count", "20", "--timeout-ms", "300"]));
        let tcp = n.netkit(p0, &["tcp", "--to", vip, "--count", "200"]);
        let counts: BTreeMap<String, u64> = serde_json::from_value(tcp["counts"].clone()).unwrap();
        assert_eq!(counts.values().sum::<u64>(), 200, "{vip}: {tcp}");
        assert!(counts.get("p1").is_some_and(|c| *c >= 40) && counts.get("p2").is_some_and(|c| *c >= 40), "{vip} spreads over p1 and p2: {counts:?}");
        let udp = n.netkit(p0, &["udp", "--to", vip, "--count", "50", "--fresh-socket"]);
        let sum: u64 = udp["counts"].as_object().unwrap().values().filter_map(Value::as_u64).sum();
        assert_eq!(sum, 50, "UDP {vip}: {udp}");
    }
    for vip in ["198.19.0.11:80", "[fd00:19::11]:80"] {
        wait_for("p1", || n.netkit(p1, &["tcp", "--to", vip, "--count", "1", "--timeout-ms", "300"]));
        assert_eq!(n.netkit(p1, &["tcp", "--to", vip, "--count", "20"])["counts"]["p1"], 20, "hairpin {vip}");
        assert_eq!(n.netkit(p1, &["udp", "--to", vip, "--count", "20"])["counts"]["p1"], 20, "hairpin UDP {vip}");
    }
    for p in &pods {
        n.runtime.rm(&p.name).unwrap();
    }
    assert!(n.node.host_sides().unwrap().is_empty(), "{:?}", n.node.host_sides());
    assert!(n.node.pod_routes().unwrap().is_empty(), "{:?}", n.node.pod_routes());
}

/// Kubernetes' HostPort e2e test, as far as one node goes: a pod's port published on the
/// node's addresses answers from outside and from the node, in both families; the same
/// hostPort with another protocol or host address is another mapping (no conflict).
#[test]
fn host_ports_answer_from_outside_and_from_the_node() {
    let n = PodNode::new().unwrap();
    let a = n.runtime.run_pod("hp1", "gardenet", &["-p", "9090:8080/tcp"]).unwrap();
    let b = n.runtime.run_pod("hp2", "gardenet", &["-p", "9090:8080/udp"]).unwrap();
    let _sa = n.serve(&a);
    let _sb = n.serve(&b);
    for to in [format!("{NODE_IP}:9090"), format!("[{NODE_IP6}]:9090")] {
        let v = wait_for("hp1", || netkit_ns(&n.wire, &["tcp", "--to", &to, "--count", "1", "--timeout-ms", "300"]));
        assert_eq!(v["counts"]["hp1"], 1);
        assert_eq!(netkit_ns(&n.wire, &["tcp", "--to", &to, "--count", "10"])["counts"]["hp1"], 10, "outside -> TCP {to}");
        assert_eq!(netkit_ns(&n.wire, &["udp", "--to", &to, "--count", "10", "--fresh-socket"])["counts"]["hp2"], 10, "outside -> UDP {to}");
        assert_eq!(netkit_ns(&n.node.ns, &["tcp", "--to", &to, "--count", "10"])["counts"]["hp1"], 10, "node -> TCP {to}");
    }
    n.runtime.rm("hp1").unwrap();
    n.runtime.rm("hp2").unwrap();
    assert!(n.node.host_sides().unwrap().is_empty());
}

/// 200 pods created and removed by the runtime, while the agent is SIGKILLed and started
/// again: every create and remove succeeds and nothing is left behind (no host side, no
/// route, no reservation).
#[test]
fn two_hundred_pods_of_churn_with_the_agent_killed_leave_nothing_behind() {
    let mut n = PodNode::new().unwrap();
    let count: usize = std::env::var("GARDENET_POD_CHURN").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let mut live: Vec<Pod> = Vec::new();
    for i in 0..count {
        if i % 50 == 25 {
            n.agent.kill9().unwrap();
        }
        if i % 50 == 40 {
            n.agent.restart_in(&n.node.ns, Some(&n.cgroup)).unwrap();
        }
        live.push(n.runtime.run_pod(&format!("c{i}"), "gardenet", &[]).unwrap());
        if live.len() >= 20 {
            let p = live.remove(0);
            n.runtime.rm(&p.name).unwrap();
        }
    }
    // The last pods still work: pod to pod.
    let (a, b) = (&live[live.len() - 1], &live[live.len() - 2]);
    let _s = n.serve(b);
    let to = format!("{}:8080", n.runtime.addresses(&b.name).unwrap().0);
    wait_for(&b.name, || n.netkit(a, &["tcp", "--to", &to, "--count", "1", "--timeout-ms", "300"]));
    for p in live.drain(..) {
        n.runtime.rm(&p.name).unwrap();
    }
    assert!(n.node.host_sides().unwrap().is_empty(), "{:?}", n.node.host_sides());
    assert!(n.node.pod_routes().unwrap().is_empty(), "{:?}", n.node.pod_routes());
    let state = n.node.dir.join("state/ipam/gardenet");
    let held: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.parse::<std::net::IpAddr>().is_ok())
        .collect();
    assert!(held.is_empty(), "reservations left: {held:?}");
}
