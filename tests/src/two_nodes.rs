//! Two nodes and a client, for NodePort traffic that TC LB source-NATs toward an endpoint on
//! another node (kube-proxy's masquerade for `externalTrafficPolicy: Cluster`), optionally with
//! pods on this node too (ClusterIP traffic through socket LB and TC LB).
//!
//! ```text
//!  client ns            node ns (agent)                node3 ns                pod ns
//!  c0 198.18.5.2 ── a0 198.18.5.1 (NodePort addr)
//!                       a1 198.18.7.1 ───────────── x1 198.18.7.3
//!                                                   x2 198.18.8.1 ────────── p0 198.18.8.10
//!  c1 198.18.6.2 ───────────────────────────────── x0 198.18.6.1
//!                       l<i> 198.18.(10+i).1 ── local pod i: p0 198.18.(10+i).10
//! ```
//! node3 reaches the client directly (c1/x0, like hosts on one flat underlay): without source
//! NAT the pod's SYN-ACK would go that way, from an address the client never talked to, and
//! the connection would fail. The client routes service VIPs (198.19.0.0/16) and the local
//! pods' networks via the node. IPv6 mirrors the plan: fd00:18:N::host for 198.18.N.host,
//! VIPs in fd00:19::/64. No namespace has a default route.
use std::{path::PathBuf, process::Command};

use anyhow::Result;
use serde_json::Value;

use crate::netns::{sibling_binary, sweep_leftovers, unique_tag, Netns, Proc, TestCgroup};

pub const NODE_NAME: &str = "lab-node";
/// The node's address toward the client: its NodePort address.
pub const NODE_ADDR: &str = "198.18.5.1";
pub const NODE_ADDR6: &str = "fd00:18:5::1";
/// The node's address toward node3: what the remote pod sees after source NAT.
pub const NODE_TO_NODE3: &str = "198.18.7.1";
pub const NODE_TO_NODE3_6: &str = "fd00:18:7::1";
/// The pod on node3.
pub const POD: &str = "198.18.8.10";
pub const POD6: &str = "fd00:18:8::10";
pub const POD_NAME: &str = "remote-pod";
pub const SERVER_PORT: u16 = 8080;

/// Address of local pod `i` (on this node).
pub fn local_pod(i: usize) -> String {
    format!("198.18.{}.10", 10 + i)
}

pub fn local_pod6(i: usize) -> String {
    format!("fd00:18:{}::10", 10 + i)
}

pub fn local_pod_name(i: usize) -> String {
    format!("local{}", i + 1)
}

pub struct TwoNodes {
    // Field order is drop order: servers first, then the cgroup, then namespaces.
    servers: Vec<Proc>,
    /// The client runs here when socket LB should apply.
    pub cgroup: TestCgroup,
    pub client: Netns,
    pub node: Netns,
    pub node3: Netns,
    pub pod: Netns,
    pub local_pods: Vec<Netns>,
    pub tag: String,
    pub netkit: PathBuf,
}

impl TwoNodes {
    /// Builds the namespaces and starts a netkit server (port 8080) in the remote pod and in
    /// `local_pods` pods on the node; returns once each answers the client directly.
    pub fn new(local_pods: usize) -> Result<Self> {
        crate::netns::require_root();
        sweep_leftovers();
        let tag = unique_tag();
        let ns = |s: &str| Netns::new(&format!("{tag}-{s}"));
        let (client, node, node3, pod) = (ns("cli")?, ns("node")?, ns("n3")?, ns("pod")?);
        let mut locals = Vec::new();
        for i in 0..local_pods {
            locals.push(ns(&format!("lp{i}"))?);
        }
        let cgroup = TestCgroup::new(&tag)?;
        let netkit = sibling_binary("gardenet-netkit")?;
        let mut w = TwoNodes { servers: Vec::new(), cgroup, client, node, node3, pod, local_pods: locals, tag, netkit };
        w.wire()?;
        let mut named: Vec<(&Netns, String)> = vec![(&w.pod, POD_NAME.to_string())];
        named.extend(w.local_pods.iter().enumerate().map(|(i, p)| (p, local_pod_name(i))));
        let mut servers = Vec::new();
        for (ns, name) in named {
            let mut cmd = ns.command(&w.netkit, None)?;
            cmd.args(["serve", "--name", &name, "--port", &SERVER_PORT.to_string()]);
            servers.push(Proc::spawn(cmd, &format!("server {name}"))?);
        }
        w.servers = servers;
        w.wait_servers()?;
        Ok(w)
    }

    fn wire(&self) -> Result<()> {
        let (client, node, node3, pod) = (&self.client, &self.node, &self.node3, &self.pod);
        client.veth_dual("c0", node, "a0", (5, 2, 1))?;
        client.veth_dual("c1", node3, "x0", (6, 2, 1))?;
        node.veth_dual("a1", node3, "x1", (7, 1, 3))?;
        node3.veth_dual("x2", pod, "p0", (8, 1, 10))?;
        // No default routes anywhere: only the lab's own prefixes.
        node.route_dual(("198.18.8.0/24", "198.18.7.3"), ("fd00:18:8::/64", "fd00:18:7::3"))?;
        node3.route_dual(("198.18.5.0/24", "198.18.6.2"), ("fd00:18:5::/64", "fd00:18:6::2"))?;
        client.route_dual(("198.18.8.0/24", "198.18.6.1"), ("fd00:18:8::/64", "fd00:18:6::1"))?;
        client.route_dual(("198.19.0.0/16", NODE_ADDR), ("fd00:19::/64", NODE_ADDR6))?;
        pod.route_dual(("198.18.0.0/16", "198.18.8.1"), ("fd00:18::/32", "fd00:18:8::1"))?;
        for (i, lp) in self.local_pods.iter().enumerate() {
            let net = 10 + i as u8;
            node.veth_dual(&format!("l{i}"), lp, "p0", (net, 1, 10))?;
            lp.route_dual(("198.18.0.0/16", &format!("198.18.{net}.1")), ("fd00:18::/32", &format!("fd00:18:{net}::1")))?;
            client.route_dual((&format!("198.18.{net}.0/24"), NODE_ADDR), (&format!("fd00:18:{net}::/64"), NODE_ADDR6))?;
        }
        for n in [node, node3] {
            n.sysctl("net.ipv4.ip_forward", "1")?;
            n.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            n.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        }
        client.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        Ok(())
    }

    /// Waits until every server answers the client directly, in both families (the first
    /// neighbour discovery can take a moment).
    fn wait_servers(&self) -> Result<()> {
        let mut want = vec![(format!("{POD}:{SERVER_PORT}"), POD_NAME.to_string()), (format!("[{POD6}]:{SERVER_PORT}"), POD_NAME.to_string())];
        for i in 0..self.local_pods.len() {
            want.push((format!("{}:{SERVER_PORT}", local_pod(i)), local_pod_name(i)));
            want.push((format!("[{}]:{SERVER_PORT}", local_pod6(i)), local_pod_name(i)));
        }
        for (to, name) in want {
            crate::lab::wait_answer(|args| self.client_json(false, args), &to, &name)?;
        }
        Ok(())
    }

    /// A netkit command in the client namespace; `socket_lb` puts it in the LB cgroup.
    pub fn client_cmd(&self, socket_lb: bool, args: &[&str]) -> Result<Command> {
        let mut cmd = self.client.command(&self.netkit, socket_lb.then_some(&self.cgroup))?;
        cmd.args(args);
        Ok(cmd)
    }

    /// Runs a netkit client to completion and parses its JSON output.
    pub fn client_json(&self, socket_lb: bool, args: &[&str]) -> Result<Value> {
        crate::lab::netkit_json(self.client_cmd(socket_lb, args)?, args)
    }
}

/// This node's Node object (dual-stack NodePort addresses).
pub fn node_yaml() -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}, {{type: InternalIP, address: \"{NODE_ADDR6}\"}}]\n")
}

/// EndpointSlices (IPv4 `<svc>-1`, IPv6 `<svc>-v6`) for `svc` with ports `p-tcp` and `p-udp`
/// on 8080: one ready endpoint per (IPv4 address, IPv6 address, node name).
pub fn slices_yaml(svc: &str, endpoints: &[(String, String, &str)]) -> String {
    let slice = |suffix: &str, family: &str, v6: bool| {
        let eps: Vec<String> = endpoints
            .iter()
            .map(|(a4, a6, node)| format!("  - addresses: [\"{}\"]\n    conditions: {{ready: true}}\n    nodeName: {node}\n", if v6 { a6 } else { a4 }))
            .collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-{suffix}, namespace: lab, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: {family}\nports:\n  - {{name: p-tcp, port: {SERVER_PORT}, protocol: TCP}}\n  - {{name: p-udp, port: {SERVER_PORT}, protocol: UDP}}\nendpoints:\n{}",
            eps.concat()
        )
    };
    format!("{}---\n{}", slice("1", "IPv4", false), slice("v6", "IPv6", true))
}

/// A dual-stack Service `name` of `type` (ClusterIP or NodePort, `externalTrafficPolicy:
/// Cluster`) on port 80 (TCP and UDP, target 8080), with ClusterIPs `vip`/`vip6` and, for
/// NodePort, node port `node_port`.
pub fn service_yaml(name: &str, ty: &str, vip: &str, vip6: &str, node_port: u16) -> String {
    let np = if ty == "NodePort" { format!(", nodePort: {node_port}") } else { String::new() };
    let etp = if ty == "NodePort" { "  externalTrafficPolicy: Cluster\n" } else { "" };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: lab}}\nspec:\n  type: {ty}\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: {vip}\n  clusterIPs: [{vip}, \"{vip6}\"]\n{etp}  ports:\n  - {{name: p-tcp, port: 80, targetPort: {SERVER_PORT}{np}, protocol: TCP}}\n  - {{name: p-udp, port: 80, targetPort: {SERVER_PORT}{np}, protocol: UDP}}\n"
    )
}
