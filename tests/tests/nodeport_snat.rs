//! NodePort to a backend on another node: TC LB source-NATs the flow so the backend's reply
//! comes back through this node (kube-proxy's masquerade for `externalTrafficPolicy: Cluster`).
//! The namespaces are `gardenet_tests::two_nodes` (plan there). Needs root; fails (does not
//! skip) without it.
use std::time::{Duration, Instant};

use gardenet_tests::{
    lab::{counts, Agent, AgentOpts},
    two_nodes::{node_yaml, service_yaml, slices_yaml, TwoNodes, NODE_ADDR, NODE_ADDR6, NODE_NAME, NODE_TO_NODE3, NODE_TO_NODE3_6, POD, POD6},
};
use serde_json::Value;

fn netkit(w: &TwoNodes, args: &[&str]) -> Value {
    w.client_json(false, args).unwrap()
}

fn manifests(pod_node: &str) -> Vec<(&'static str, String)> {
    let eps = slices_yaml("np", &[(POD.to_string(), POD6.to_string(), pod_node)]);
    vec![("node.yaml", node_yaml()), ("svc.yaml", service_yaml("np", "NodePort", "198.19.0.30", "fd00:19::30", 30080)), ("eps.yaml", eps)]
}

/// Connections through the NodePort at `np` ("ADDR:PORT" or "[ADDR6]:PORT") reach the remote
/// pod, which sees them coming from `node_side` (the node's address toward node3).
fn check_source_natted(w: &TwoNodes, np: &str, node_side: &str) {
    // TCP: every connection completes, and the pod sees the node's address, not the client's.
    let v = netkit(w, &["tcp", "--to", np, "--count", "100"]);
    assert_eq!(counts(&v), [("remote-pod".to_string(), 100)], "{v}");
    let who = netkit(w, &["peername", "--to", np]);
    assert_eq!(who["peer"], np, "{who}");
    let seen = who["seen_as"].as_str().unwrap_or_default();
    assert!(seen.starts_with(&format!("{node_side}:")), "the pod saw {seen}, want the node's address {node_side}: {who}");
    let port: u16 = seen.rsplit(':').next().unwrap().parse().unwrap();
    assert!((61_000..=65_535).contains(&port), "source-NAT port {port}");
    // Data both ways over one source-NATed connection.
    let b = netkit(w, &["bulk", "--to", np, "--bytes", &(4u64 << 20).to_string()]);
    assert_eq!((&b["upload_backend"], &b["download_backend"]), (&"remote-pod".into(), &"remote-pod".into()), "{b}");
    // Redirected packets skip the stack's forwarding, so the node decrements the TTL itself:
    // client -> node -> node3 -> pod is two forwarding hops.
    // The TTL-2 attempt lasts long enough for the client to send its SYN again (after 1 s):
    // each SYN is balanced afresh and takes a source-NAT port, and the first port must not stay
    // reserved (the conntrack count below).
    for (ttl, ok, wait) in [("2", false, "2500"), ("3", true, "1000")] {
        let c = netkit(w, &["connect", "--to", np, "--timeout-ms", wait, "--ttl", ttl]);
        assert_eq!(c["outcome"] == "Connected", ok, "TTL {ttl}: {c}");
    }
    // UDP: answers come back from the NodePort.
    let u = netkit(w, &["udp", "--to", np, "--count", "20", "--fresh-socket"]);
    assert_eq!(u["counts"]["remote-pod"], 20, "{u}");
    assert_eq!(u["sources"][np], 20, "{u}");
}

#[test]
fn node_port_to_a_backend_on_another_node_is_source_natted() {
    // The pod answers directly (and its replies to the client go the short way via node3).
    let w = TwoNodes::new(0).unwrap();

    let extra = ["--tc-interface=a0,a1", "--conntrack-scan-secs=1", "--conntrack-closed-secs=1"].map(String::from).to_vec();
    let opts = AgentOpts { extra, ..Default::default() };
    let mut agent = Agent::start_in(&w.tag, &w.node, None, opts, &manifests("node3")).unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
    let listed = agent.lb_list().unwrap();
    let fe = listed.as_array().unwrap().iter().find(|f| f["frontend"]["port"] == 30080 && f["frontend"]["proto"] == "tcp").unwrap();
    if !gardenet_agent::dataplane::features::KernelFeatures::probe().fib_lookup_src {
        // Kernels before 6.7 cannot look up the node's source address: DNAT only, said at
        // start, and here the reply then bypasses the node, as without any source NAT.
        assert_ne!(fe["snat_remote"], true, "{fe}");
        assert_eq!(fe["backends"][0]["remote"], true, "{fe}");
        let log = agent.log.lock().unwrap().join("\n");
        assert!(log.contains("no fib_lookup_src: no source NAT to endpoints on other nodes"), "{log}");
        let c = netkit(&w, &["connect", "--to", &np, "--timeout-ms", "1000"]);
        assert_ne!(c["outcome"], "Connected", "{c}");
        agent.stop();
        return;
    }
    assert_eq!(fe["snat_remote"], true, "{fe}");
    assert_eq!(fe["backends"][0]["remote"], true, "{fe}");

    check_source_natted(&w, &np, NODE_TO_NODE3);
    // The closed TCP flows (over 100, four entries each) leave conntrack with their
    // source-NAT ports: what stays is the UDP flows' (20, four entries each, idle for less
    // than two minutes) and the SYN that ran out of TTL (never closed; its first port gone).
    let (after, _) = agent.conntrack("IPv4").unwrap();
    let left = agent.wait_conntrack("IPv4", Duration::from_secs(20), |n| n <= 4 * 20 + 4).unwrap();
    eprintln!("conntrack (IPv4): {after} entries after the flows, {left} once the closed ones were removed");
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
        let c = netkit(&w, &["connect", "--to", to, "--timeout-ms", "1000"]);
        assert_ne!(c["outcome"], "Connected", "without source NAT the reply bypasses the node: {c}");
    }
    let log = agent.log.lock().unwrap().join("\n");
    assert!(!log.contains("panicked"), "{log}");
    agent.stop();
}

/// A closed source-NATed flow whose port the programs give to a new flow (closing and idle for
/// 10 s) before the agent's scan removed it: nothing leads to its other entries from the port
/// any more, and the scan still finds and removes them (by the close marks on them).
#[test]
fn closed_source_natted_flows_leave_conntrack_also_when_their_port_was_reused() {
    let w = TwoNodes::new(0).unwrap();
    if !gardenet_agent::dataplane::features::KernelFeatures::probe().fib_lookup_src {
        eprintln!("no fib_lookup_src on this kernel: no source NAT (the test above checks that)");
        return;
    }
    // First the closed flows stay (left to the LRU), so their ports can be reused.
    let opts = AgentOpts { extra: ["--tc-interface=a0,a1", "--conntrack-closed-secs=0"].map(String::from).to_vec(), ..Default::default() };
    let mut agent = Agent::start_in(&w.tag, &w.node, None, opts, &manifests("node3")).unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
    let flows = 400u64;
    let v = netkit(&w, &["tcp", "--to", &np, "--count", &flows.to_string()]);
    assert_eq!(counts(&v), [("remote-pod".to_string(), flows)], "{v}");
    // Past the ports' hold: a new flow whose random first port is one of these takes it (400
    // of 4,536 ports: ~35 of 400 new flows).
    std::thread::sleep(Duration::from_secs(11));
    let v = netkit(&w, &["tcp", "--to", &np, "--count", &flows.to_string()]);
    assert_eq!(counts(&v), [("remote-pod".to_string(), flows)], "{v}");
    // Four entries per flow, less one for each port entry a new flow took over (and three for
    // each client port the client used twice).
    let (before, _) = agent.conntrack("IPv4").unwrap();
    assert!((before as u64) < 4 * 2 * flows, "no port went to a new flow: {before} entries");
    // Now the scan removes closed flows: all of them go, those that lost their port too.
    agent.set_extra(["--tc-interface=a0,a1", "--conntrack-scan-secs=1", "--conntrack-closed-secs=1"].map(String::from).to_vec());
    agent.restart_in(&w.node, None).unwrap();
    let left = agent.wait_conntrack("IPv4", Duration::from_secs(20), |n| n == 0);
    eprintln!("conntrack (IPv4): {before} entries after {} closed flows, then {left:?}", 2 * flows);
    left.unwrap();
    agent.stop();
}
