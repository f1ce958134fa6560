//! NodePort to a backend on another node: TC LB source-NATs the flow so the backend's reply
//! comes back through this node (kube-proxy's masquerade for `externalTrafficPolicy: Cluster`).
//! Needs root; fails (does not skip) without it.
//!
//! ```text
//!  client ns            node ns (agent)                node3 ns                pod ns
//!  c0 198.18.5.2 ── a0 198.18.5.1 (NodePort addr)
//!                       a1 198.18.7.1 ───────────── x1 198.18.7.3
//!                                                   x2 198.18.8.1 ────────── p0 198.18.8.10
//!  c1 198.18.6.2 ───────────────────────────────── x0 198.18.6.1
//! ```
//! node3 reaches the client directly (c1/x0, like hosts on one flat underlay): without source
//! NAT the pod's SYN-ACK would go that way, from an address the client never talked to, and
//! the connection would fail. IPv6 mirrors the plan: fd00:18:N::host for 198.18.N.host.
use std::time::{Duration, Instant};

use gardenet_tests::{
    lab::{counts, Agent, AgentOpts},
    netns::{require_root, sibling_binary, sweep_leftovers, unique_tag, Netns, Proc},
};
use serde_json::Value;

const NODE_NAME: &str = "lab-node";
const NODE_ADDR: &str = "198.18.5.1";
const NODE_TO_NODE3: &str = "198.18.7.1";
const POD: &str = "198.18.8.10";
const NODE_ADDR6: &str = "fd00:18:5::1";
const NODE_TO_NODE3_6: &str = "fd00:18:7::1";
const POD6: &str = "fd00:18:8::10";

struct World {
    // Drop order: server first, then namespaces.
    _server: Proc,
    client: Netns,
    node: Netns,
    _node3: Netns,
    _pod: Netns,
    tag: String,
}

fn world() -> World {
    require_root();
    sweep_leftovers();
    let tag = unique_tag();
    let ns = |s: &str| Netns::new(&format!("{tag}-{s}")).unwrap();
    let (client, node, node3, pod) = (ns("cli"), ns("node"), ns("n3"), ns("pod"));
    client.veth_dual("c0", &node, "a0", (5, 2, 1)).unwrap();
    client.veth_dual("c1", &node3, "x0", (6, 2, 1)).unwrap();
    node.veth_dual("a1", &node3, "x1", (7, 1, 3)).unwrap();
    node3.veth_dual("x2", &pod, "p0", (8, 1, 10)).unwrap();
    // No default routes anywhere: only the lab's own prefixes.
    node.route_dual(("198.18.8.0/24", "198.18.7.3"), ("fd00:18:8::/64", "fd00:18:7::3")).unwrap();
    node3.route_dual(("198.18.5.0/24", "198.18.6.2"), ("fd00:18:5::/64", "fd00:18:6::2")).unwrap();
    client.route_dual(("198.18.8.0/24", "198.18.6.1"), ("fd00:18:8::/64", "fd00:18:6::1")).unwrap();
    pod.route_dual(("198.18.0.0/16", "198.18.8.1"), ("fd00:18::/32", "fd00:18:8::1")).unwrap();
    for n in [&node, &node3] {
        n.sysctl("net.ipv4.ip_forward", "1").unwrap();
        n.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
        n.sysctl("net.ipv4.conf.all.rp_filter", "0").unwrap();
    }
    client.sysctl("net.ipv4.conf.all.rp_filter", "0").unwrap();
    let mut cmd = pod.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap();
    cmd.args(["serve", "--name", "remote-pod", "--port", "8080"]);
    let server = Proc::spawn(cmd, "server remote-pod").unwrap();
    World { _server: server, client, node, _node3: node3, _pod: pod, tag }
}

impl World {
    fn netkit(&self, args: &[&str]) -> Value {
        let out = self.client.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap().args(args).output().unwrap();
        assert!(out.status.success(), "netkit {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn manifests(pod_node: &str) -> Vec<(&'static str, String)> {
    let node = format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}, {{type: InternalIP, address: \"{NODE_ADDR6}\"}}]\n");
    let svc = "apiVersion: v1\nkind: Service\nmetadata: {name: np, namespace: lab}\nspec:\n  type: NodePort\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: 198.19.0.30\n  clusterIPs: [198.19.0.30, \"fd00:19::30\"]\n  externalTrafficPolicy: Cluster\n  ports:\n  - {name: p-tcp, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n  - {name: p-udp, port: 80, targetPort: 8080, nodePort: 30080, protocol: UDP}\n".to_string();
    let slice = |name: &str, family: &str, addr: &str| {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: lab, labels: {{kubernetes.io/service-name: np}}}}\naddressType: {family}\nports:\n  - {{name: p-tcp, port: 8080, protocol: TCP}}\n  - {{name: p-udp, port: 8080, protocol: UDP}}\nendpoints:\n  - addresses: [\"{addr}\"]\n    conditions: {{ready: true}}\n    nodeName: {pod_node}\n"
        )
    };
    let eps = format!("{}---\n{}", slice("np-1", "IPv4", POD), slice("np-v6", "IPv6", POD6));
    vec![("node.yaml", node), ("svc.yaml", svc), ("eps.yaml", eps)]
}

/// Connections through the NodePort at `np` ("ADDR:PORT" or "[ADDR6]:PORT") reach the remote
/// pod, which sees them coming from `node_side` (the node's address toward node3).
fn check_source_natted(w: &World, np: &str, node_side: &str) {
    // TCP: every connection completes, and the pod sees the node's address, not the client's.
    let v = w.netkit(&["tcp", "--to", np, "--count", "100"]);
    assert_eq!(counts(&v), [("remote-pod".to_string(), 100)], "{v}");
    let who = w.netkit(&["peername", "--to", np]);
    assert_eq!(who["peer"], np, "{who}");
    let seen = who["seen_as"].as_str().unwrap_or_default();
    assert!(seen.starts_with(&format!("{node_side}:")), "the pod saw {seen}, want the node's address {node_side}: {who}");
    let port: u16 = seen.rsplit(':').next().unwrap().parse().unwrap();
    assert!((61_000..=65_535).contains(&port), "source-NAT port {port}");
    // Data both ways over one source-NATed connection.
    let b = w.netkit(&["bulk", "--to", np, "--bytes", &(4u64 << 20).to_string()]);
    assert_eq!((&b["upload_backend"], &b["download_backend"]), (&"remote-pod".into(), &"remote-pod".into()), "{b}");
    // Redirected packets skip the stack's forwarding, so the node decrements the TTL itself:
    // client -> node -> node3 -> pod is two forwarding hops.
    for (ttl, ok) in [("2", false), ("3", true)] {
        let c = w.netkit(&["connect", "--to", np, "--timeout-ms", "1000", "--ttl", ttl]);
        assert_eq!(c["outcome"] == "Connected", ok, "TTL {ttl}: {c}");
    }
    // UDP: answers come back from the NodePort.
    let u = w.netkit(&["udp", "--to", np, "--count", "20", "--fresh-socket"]);
    assert_eq!(u["counts"]["remote-pod"], 20, "{u}");
    assert_eq!(u["sources"][np], 20, "{u}");
}

#[test]
fn node_port_to_a_backend_on_another_node_is_source_natted() {
    let w = world();
    // The pod answers directly (and its replies to the client go the short way via node3).
    for to in [format!("{POD}:8080"), format!("[{POD6}]:8080")] {
        let deadline = Instant::now() + Duration::from_secs(10);
        while w.netkit(&["tcp", "--to", &to, "--count", "1", "--timeout-ms", "300"])["counts"]["remote-pod"] != 1 {
            assert!(Instant::now() < deadline, "the pod does not answer directly at {to}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    let opts = AgentOpts { extra: vec!["--tc-interface=a0,a1".into()], ..Default::default() };
    let mut agent = Agent::start_in(&w.tag, &w.node, None, opts, &manifests("node3")).unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
    let listed = agent.lb_list().unwrap();
    let fe = listed.as_array().unwrap().iter().find(|f| f["frontend"]["port"] == 30080 && f["frontend"]["proto"] == "tcp").unwrap();
    if !gardenet_agent::features::KernelFeatures::probe().fib_lookup_src {
        // Kernels before 6.7 cannot look up the node's source address: DNAT only, said at
        // start, and here the reply then bypasses the node, as without any source NAT.
        assert_ne!(fe["snat_remote"], true, "{fe}");
        assert_eq!(fe["backends"][0]["remote"], true, "{fe}");
        let log = agent.log.lock().unwrap().join("\n");
        assert!(log.contains("no fib_lookup_src: no source NAT to endpoints on other nodes"), "{log}");
        let c = w.netkit(&["connect", "--to", &np, "--timeout-ms", "1000"]);
        assert_ne!(c["outcome"], "Connected", "{c}");
        agent.stop();
        return;
    }
    assert_eq!(fe["snat_remote"], true, "{fe}");
    assert_eq!(fe["backends"][0]["remote"], true, "{fe}");

    check_source_natted(&w, &np, NODE_TO_NODE3);
    let np6 = format!("[{NODE_ADDR6}]:30080");
    agent.wait_backends(&format!("{np6}/tcp"), 1).unwrap();
    check_source_natted(&w, &np6, &format!("[{NODE_TO_NODE3_6}]"));

    // The same endpoint on this node: no source NAT (the client address is kept), and it
    // fails here precisely because the reply takes the short way round.
    agent.write("eps.yaml", &manifests(NODE_NAME)[2].1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lb_list().unwrap().as_array().unwrap().iter().any(|f| f["frontend"]["port"] == 30080 && f["backends"][0]["remote"] == true) {
        assert!(Instant::now() < deadline, "the endpoint did not move to this node");
        std::thread::sleep(Duration::from_millis(100));
    }
    for to in [&np, &np6] {
        let c = w.netkit(&["connect", "--to", to, "--timeout-ms", "1000"]);
        assert_ne!(c["outcome"], "Connected", "without source NAT the reply bypasses the node: {c}");
    }
    let log = agent.log.lock().unwrap().join("\n");
    assert!(!log.contains("panicked"), "{log}");
    agent.stop();
}
