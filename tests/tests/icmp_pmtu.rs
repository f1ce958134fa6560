//! Path MTU discovery through TC LB: a router between the client and the node has a smaller
//! MTU toward the client than the client advertises, so a backend's full-size reply segments
//! provoke ICMP "fragmentation needed" addressed to the NodePort (this node). TC LB rewrites
//! the error for the backend, which lowers its path MTU; without that the download stalls.
//! IPv4 and IPv6 (ICMPv6 "packet too big"; fd00:18:N::H mirrors 198.18.N.H). Needs root;
//! fails (does not skip) without it.
//!
//! ```text
//!  client ns                 router ns                         node ns (agent)        pod ns
//!  c0 198.18.10.2 (1500) ── r0 198.18.10.1 (MTU 1280)
//!                           r1 198.18.11.1 ─────────────────── n0 198.18.11.2 (NodePort)
//!                                                              p0 198.18.12.1 ── e0 198.18.12.10
//! ```
use std::time::{Duration, Instant};

use gardenet_tests::{
    lab::{Agent, AgentOpts},
    netns::{require_root, sibling_binary, sweep_leftovers, unique_tag, Netns, Proc},
};

#[test]
fn icmp_fragmentation_needed_reaches_the_backend() {
    require_root();
    sweep_leftovers();
    let tag = unique_tag();
    let ns = |s: &str| Netns::new(&format!("{tag}-{s}")).unwrap();
    let (client, router, node, pod) = (ns("cli"), ns("rtr"), ns("node"), ns("pod"));
    client.veth_dual("c0", &router, "r0", (10, 2, 1)).unwrap();
    router.veth_dual("r1", &node, "n0", (11, 1, 2)).unwrap();
    node.veth_dual("p0", &pod, "e0", (12, 1, 10)).unwrap();
    // The bottleneck: the router sends at most 1280 bytes toward the client, which itself
    // (MTU 1500) advertises an MSS of 1460.
    router.ip(&["link", "set", "r0", "mtu", "1280"]).unwrap();
    client.route_dual(("198.18.11.0/24", "198.18.10.1"), ("fd00:18:11::/64", "fd00:18:10::1")).unwrap();
    node.route_dual(("198.18.10.0/24", "198.18.11.1"), ("fd00:18:10::/64", "fd00:18:11::1")).unwrap();
    pod.route_dual(("198.18.0.0/16", "198.18.12.1"), ("fd00:18::/32", "fd00:18:12::1")).unwrap();
    for n in [&router, &node] {
        n.sysctl("net.ipv4.ip_forward", "1").unwrap();
        n.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    }
    for n in [&client, &router, &node, &pod] {
        n.sysctl("net.ipv4.conf.all.rp_filter", "0").unwrap();
    }
    let netkit = sibling_binary("gardenet-netkit").unwrap();
    let mut cmd = pod.command(&netkit, None).unwrap();
    cmd.args(["serve", "--name", "pod", "--port", "8080"]);
    let _server = Proc::spawn(cmd, "server pod").unwrap();

    let manifests = vec![
        ("node.yaml", "apiVersion: v1\nkind: Node\nmetadata: {name: lab-node}\nstatus:\n  addresses: [{type: InternalIP, address: 198.18.11.2}, {type: InternalIP, address: \"fd00:18:11::2\"}]\n".to_string()),
        ("svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: lab}\nspec:\n  type: NodePort\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: 198.19.0.50\n  clusterIPs: [198.19.0.50, \"fd00:19::50\"]\n  ports:\n  - {name: p-tcp, port: 80, targetPort: 8080, nodePort: 30100, protocol: TCP}\n".to_string()),
        ("eps.yaml", ["IPv4 198.18.12.10", "IPv6 \"fd00:18:12::10\""].map(|fa| {
            let (family, addr) = fa.split_once(' ').unwrap();
            format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: big-{}, namespace: lab, labels: {{kubernetes.io/service-name: big}}}}\naddressType: {family}\nports: [{{name: p-tcp, port: 8080, protocol: TCP}}]\nendpoints:\n  - addresses: [{addr}]\n    conditions: {{ready: true}}\n    nodeName: lab-node\n", family.to_lowercase())
        }).join("---\n")),
    ];
    let opts = AgentOpts { extra: vec!["--tc-interface=n0".into()], ..Default::default() };
    let mut agent = Agent::start_in(&tag, &node, None, opts, &manifests).unwrap();
    for np in ["198.18.11.2:30100", "[fd00:18:11::2]:30100"] {
        agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
        // 2 MiB down through the NodePort: full-size segments must shrink to fit the router.
        let t0 = Instant::now();
        let out = client.command(&netkit, None).unwrap().args(["bulk", "--to", np, "--bytes", "0", "--download", &(2u64 << 20).to_string()]).output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert!(
            out.status.success() && v["downloaded"] == 2u64 << 20,
            "{np}: download through the bottleneck failed after {:?}: {v} {}",
            t0.elapsed(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(t0.elapsed() < Duration::from_secs(25), "{np}: took {:?}", t0.elapsed());
    }
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    let n: u64 = log.split("tc_icmp_revnat=").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(n >= 2, "the router's ICMP errors (one per family at least) were translated for the backend: {log}");
}
