//! The standard Service lab: a client host, a node, and backend "pods" running netkit
//! servers that answer with their own name, plus a running `gardenet-agent` on the node.
//!
//! ```text
//!  client ns                 node ns                         backend ns (xN)
//!  c0 198.18.0.2/24 ── veth ── nc0 198.18.0.1/24
//!                             br0 198.18.1.1/24 ── veth ── e0 198.18.1.(10+i)/24
//!  node2 ns (another node)
//!  n0 198.18.2.2/24 ── veth ── nn0 198.18.2.1/24 (the node's address for NodePorts)
//!  side client ns (only with `add_side_client`)
//!  c1 198.18.3.2/24 ── veth ── nc1 198.18.3.1/24
//!  198.18.4.1/32 on every backend's lo (only with `add_shared_address`), ECMP on the node
//!  peer client ns            peer node ns (only with `add_peer_node`)
//!  c2 198.18.5.2/24 ── veth ── pc0 198.18.5.1/24
//!                             br1 198.18.1.1/24 ── veth ── e1 198.18.1.(10+i)/32 (the same address)
//! ```
//! The client routes 198.18.1.0/24 (pods) and 198.19.0.0/16 (service VIPs) via the node;
//! backends route the client subnet via the node. No namespace has a default route.
//!
//! Every link is dual stack: IPv6 mirrors the IPv4 plan (`nodad` addresses, forwarding on the
//! node), with fd00:18::/64 client-node, fd00:18:1::/64 pods (gateway ::1 on br0, backend i
//! at ::(10+i)), fd00:18:2::/64 node-node2, and service VIPs in fd00:19::/64.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::netns::{sibling_binary, sweep_leftovers, unique_tag, Netns, Proc, TestCgroup};

pub const CLIENT_IP: &str = "198.18.0.2";
pub const NODE_IP: &str = "198.18.0.1";
pub const NODE_POD_GW: &str = "198.18.1.1";
pub const SERVER_PORT: u16 = 8080;
/// The side client's address and the node's on its link ([`Lab::add_side_client`]).
pub const SIDE_CLIENT_IP: &str = "198.18.3.2";
pub const SIDE_NODE_IP: &str = "198.18.3.1";
/// An address every backend holds ([`Lab::add_shared_address`]).
pub const SHARED_IP: &str = "198.18.4.1";
pub const NODE_NAME: &str = "lab-node";
/// The node's address towards node2, published in its Node object (NodePorts live here).
pub const NODE_ADDR: &str = "198.18.2.1";
pub const NODE2_IP: &str = "198.18.2.2";

pub fn backend_ip(i: usize) -> String {
    format!("198.18.1.{}", 10 + i)
}

pub const CLIENT_IP6: &str = "fd00:18::2";
pub const NODE_IP6: &str = "fd00:18::1";
pub const NODE_POD_GW6: &str = "fd00:18:1::1";
/// The node's IPv6 address towards node2.
pub const NODE_ADDR6: &str = "fd00:18:2::1";
pub const NODE2_IP6: &str = "fd00:18:2::2";

/// IPv6 address of backend `i` (bare, without brackets).
pub fn backend_ip6(i: usize) -> String {
    format!("fd00:18:1::{}", 10 + i)
}

pub fn backend_name(i: usize) -> String {
    format!("be{}", i + 1)
}

/// The peer client's address and the peer node's on its link ([`Lab::add_peer_node`]).
pub const PEER_CLIENT_IP: &str = "198.18.5.2";
pub const PEER_NODE_IP: &str = "198.18.5.1";
const PEER_NET: &str = "198.18.5.0/24";

/// A node of its own for another dataplane, with its own client: see [`Lab::add_peer_node`].
pub struct PeerNode {
    pub client: Netns,
    pub node: Netns,
}

pub struct Lab {
    pub tag: String,
    // Field order is drop order: processes first, then cgroup, then namespaces.
    servers: Vec<Proc>,
    /// cgroup the client runs in when socket LB should apply.
    pub cgroup: TestCgroup,
    pub client: Netns,
    pub node: Netns,
    /// A second node that reaches this one's NodePorts over `nn0`.
    pub node2: Netns,
    pub backends: Vec<Netns>,
    /// A second client host, made by [`Lab::add_side_client`].
    pub side_client: Option<Netns>,
    /// A second node in front of the same backends, made by [`Lab::add_peer_node`].
    pub peer: Option<PeerNode>,
    pub netkit: PathBuf,
}

impl Lab {
    pub fn new(n_backends: usize) -> Result<Self> {
        crate::netns::require_root();
        sweep_leftovers();
        let tag = unique_tag();
        let client = Netns::new(&format!("{tag}-cli"))?;
        let node = Netns::new(&format!("{tag}-node"))?;
        let node2 = Netns::new(&format!("{tag}-n2"))?;
        let mut backends = Vec::new();
        for i in 0..n_backends {
            backends.push(Netns::new(&format!("{tag}-be{}", i + 1))?);
        }
        let cgroup = TestCgroup::new(&tag)?;
        let netkit = sibling_binary("gardenet-netkit")?;
        let lab = Lab { tag, servers: Vec::new(), cgroup, client, node, node2, backends, side_client: None, peer: None, netkit };
        lab.wire()?;
        let mut lab = lab;
        for i in 0..n_backends {
            lab.start_server(i)?;
        }
        lab.wait_servers()?;
        Ok(lab)
    }

    fn wire(&self) -> Result<()> {
        let (c, n) = (&self.client, &self.node);
        veth_pair(n, ("nc0", NODE_IP), c, ("c0", CLIENT_IP))?;
        c.ip(&["route", "add", "198.18.1.0/24", "via", NODE_IP])?;
        c.ip(&["route", "add", "198.19.0.0/16", "via", NODE_IP])?;
        bridge_to_backends(n, "br0", "nb", &self.backends, "e0")?;
        let n2 = &self.node2;
        veth_pair(n, ("nn0", NODE_ADDR), n2, ("n0", NODE2_IP))?;
        n.sysctl("net.ipv4.ip_forward", "1")?;
        n.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        n.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        // IPv6 mirror of the above.
        n.ip(&["-6", "addr", "add", &format!("{NODE_IP6}/64"), "dev", "nc0", "nodad"])?;
        c.ip(&["-6", "addr", "add", &format!("{CLIENT_IP6}/64"), "dev", "c0", "nodad"])?;
        c.ip(&["-6", "route", "add", "fd00:18:1::/64", "via", NODE_IP6])?;
        c.ip(&["-6", "route", "add", "fd00:19::/64", "via", NODE_IP6])?;
        n.ip(&["-6", "addr", "add", &format!("{NODE_POD_GW6}/64"), "dev", "br0", "nodad"])?;
        n.ip(&["-6", "addr", "add", &format!("{NODE_ADDR6}/64"), "dev", "nn0", "nodad"])?;
        n2.ip(&["-6", "addr", "add", &format!("{NODE2_IP6}/64"), "dev", "n0", "nodad"])?;
        for (i, b) in self.backends.iter().enumerate() {
            b.ip(&["addr", "add", &format!("{}/24", backend_ip(i)), "dev", "e0"])?;
            // Client and node2 subnets (the connected pod /24 stays more specific).
            b.ip(&["route", "add", "198.18.0.0/16", "via", NODE_POD_GW])?;
            b.ip(&["-6", "addr", "add", &format!("{}/64", backend_ip6(i)), "dev", "e0", "nodad"])?;
            // Client and node2 subnets (the connected pod /64 stays more specific).
            b.ip(&["-6", "route", "add", "fd00:18::/32", "via", NODE_POD_GW6])?;
        }
        Ok(())
    }

    /// A second client host: `c1` 198.18.3.2/24 ── veth ── `nc1` 198.18.3.1/24 on the node,
    /// routing only the pods via the node. Its connections to the backends cross no interface
    /// the benches attach the agent to (`nc0`, `nn0`), so a bench can measure connections with
    /// no datapath on their path interleaved with TC LB ones, from a client that is the same
    /// in every other way.
    pub fn add_side_client(&mut self) -> Result<()> {
        let c = Netns::new(&format!("{}-cli2", self.tag))?;
        veth_pair(&self.node, ("nc1", SIDE_NODE_IP), &c, ("c1", SIDE_CLIENT_IP))?;
        c.ip(&["route", "add", "198.18.1.0/24", "via", SIDE_NODE_IP])?;
        self.side_client = Some(c);
        Ok(())
    }

    /// [`SHARED_IP`] on every backend's `lo`, and on the node an ECMP route to it over all
    /// backends that hashes each connection's addresses and ports: a client of it has one
    /// destination, as a client of a VIP has, yet its connections spread over every server,
    /// with no translation anywhere. Only the side client routes it (call
    /// [`Lab::add_side_client`] first), so none of it crosses a datapath.
    pub fn add_shared_address(&self) -> Result<()> {
        let c = self.side_client.as_ref().context("the lab has no side client")?;
        let mut route = vec!["route".to_string(), "add".into(), format!("{SHARED_IP}/32")];
        for (i, b) in self.backends.iter().enumerate() {
            b.ip(&["addr", "add", &format!("{SHARED_IP}/32"), "dev", "lo"])?;
            route.extend(["nexthop", "via", &backend_ip(i), "dev", "br0"].map(String::from));
        }
        // Layer 4 hash: connections of one client spread over the nexthops.
        self.node.sysctl("net.ipv4.fib_multipath_hash_policy", "1")?;
        self.node.ip(&route.iter().map(String::as_str).collect::<Vec<_>>())?;
        c.ip(&["route", "add", &format!("{SHARED_IP}/32"), "via", SIDE_NODE_IP])?;
        Ok(())
    }

    /// A second node with its own client and its own bridge to every backend, which answers
    /// there from the same address as on the first node's bridge: rules written for the lab's
    /// node (kube-proxy's DNAT to the backends) work unchanged on the peer node, so another
    /// dataplane can run on a node without the agent, as it would in a cluster, while the agent
    /// keeps the first. Its path (client, node, bridge, backend) has as many hops as the main
    /// client's. IPv4 only; the client routes the pods and the service VIPs via the peer node.
    pub fn add_peer_node(&mut self) -> Result<()> {
        let client = Netns::new(&format!("{}-pcli", self.tag))?;
        let node = Netns::new(&format!("{}-peer", self.tag))?;
        veth_pair(&node, ("pc0", PEER_NODE_IP), &client, ("c2", PEER_CLIENT_IP))?;
        client.ip(&["route", "add", "198.18.1.0/24", "via", PEER_NODE_IP])?;
        client.ip(&["route", "add", "198.19.0.0/16", "via", PEER_NODE_IP])?;
        bridge_to_backends(&node, "br1", "pb", &self.backends, "e1")?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
        for (i, b) in self.backends.iter().enumerate() {
            // A /32: the pod subnet's connected route stays on e0, toward the lab's node.
            b.ip(&["addr", "add", &format!("{}/32", backend_ip(i)), "dev", "e1"])?;
            b.ip(&["route", "add", PEER_NET, "via", NODE_POD_GW, "dev", "e1", "onlink"])?;
        }
        self.peer = Some(PeerNode { client, node });
        self.wait_servers_from(|args| Self::json_of(self.peer_client_cmd(args)?, args), |i| format!("{}:{SERVER_PORT}", backend_ip(i)))
    }

    /// Every client namespace the lab has: the main one, the side client's, the peer node's.
    pub fn clients(&self) -> impl Iterator<Item = &Netns> {
        std::iter::once(&self.client).chain(&self.side_client).chain(self.peer.as_ref().map(|p| &p.client))
    }

    /// A netkit client command on the peer node's client (see [`Lab::add_peer_node`]).
    pub fn peer_client_cmd(&self, args: &[&str]) -> Result<Command> {
        let p = self.peer.as_ref().context("the lab has no peer node")?;
        let mut cmd = p.client.command(&self.netkit, None)?;
        cmd.args(args);
        Ok(cmd)
    }

    /// A netkit client command on the side client (see [`Lab::add_side_client`]).
    pub fn side_client_cmd(&self, args: &[&str]) -> Result<Command> {
        let c = self.side_client.as_ref().context("the lab has no side client")?;
        let mut cmd = c.command(&self.netkit, None)?;
        cmd.args(args);
        Ok(cmd)
    }

    fn start_server(&mut self, i: usize) -> Result<()> {
        let mut cmd = self.backends[i].command(&self.netkit, None)?;
        cmd.args(["serve", "--name", &backend_name(i), "--port", &SERVER_PORT.to_string()]);
        self.servers.push(Proc::spawn(cmd, &format!("server {}", backend_name(i)))?);
        Ok(())
    }

    /// Waits until every server answers directly (from the client, without any LB).
    fn wait_servers(&self) -> Result<()> {
        self.wait_servers_at(|i| format!("{}:{SERVER_PORT}", backend_ip(i)))
    }

    /// Waits until every server answers directly over IPv6 (first neighbour discovery and
    /// the bridge's link-local setup can take a moment).
    pub fn wait_servers6(&self) -> Result<()> {
        self.wait_servers_at(|i| format!("[{}]:{SERVER_PORT}", backend_ip6(i)))
    }

    fn wait_servers_at(&self, to: impl Fn(usize) -> String) -> Result<()> {
        self.wait_servers_from(|args| self.client_json(false, args), to)
    }

    /// Waits until every server answers the client that `client_json` runs, at `to(i)`.
    fn wait_servers_from(&self, client_json: impl Fn(&[&str]) -> Result<serde_json::Value>, to: impl Fn(usize) -> String) -> Result<()> {
        for i in 0..self.backends.len() {
            wait_answer(&client_json, &to(i), &backend_name(i))?;
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
    pub fn client_json(&self, socket_lb: bool, args: &[&str]) -> Result<serde_json::Value> {
        Self::json_of(self.client_cmd(socket_lb, args)?, args)
    }

    /// Runs a netkit client on the second node.
    pub fn node2_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut cmd = self.node2.command(&self.netkit, None)?;
        cmd.args(args);
        Self::json_of(cmd, args)
    }

    fn json_of(cmd: Command, args: &[&str]) -> Result<serde_json::Value> {
        netkit_json(cmd, args)
    }
}

/// A bridge `br` on `node` with the pods' gateway address, and a veth from a port of it
/// (`port`1, `port`2, ...) to `dev` in each backend, both ends up; the backends' addresses and
/// routes are the caller's.
fn bridge_to_backends(node: &Netns, br: &str, port: &str, backends: &[Netns], dev: &str) -> Result<()> {
    node.ip(&["link", "add", br, "type", "bridge"])?;
    node.ip(&["addr", "add", &format!("{NODE_POD_GW}/24"), "dev", br])?;
    node.ip(&["link", "set", br, "up"])?;
    for (i, b) in backends.iter().enumerate() {
        let p = format!("{port}{}", i + 1);
        node.ip(&["link", "add", &p, "type", "veth", "peer", "name", dev, "netns", &b.name])?;
        node.ip(&["link", "set", &p, "master", br])?;
        node.ip(&["link", "set", &p, "up"])?;
        b.ip(&["link", "set", dev, "up"])?;
    }
    Ok(())
}

/// A veth pair from `a` to `b`, each end with its IPv4 address in a /24 and up.
fn veth_pair(a: &Netns, (a_if, a_ip): (&str, &str), b: &Netns, (b_if, b_ip): (&str, &str)) -> Result<()> {
    a.ip(&["link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.name])?;
    a.ip(&["addr", "add", &format!("{a_ip}/24"), "dev", a_if])?;
    a.ip(&["link", "set", a_if, "up"])?;
    b.ip(&["addr", "add", &format!("{b_ip}/24"), "dev", b_if])?;
    b.ip(&["link", "set", b_if, "up"])?;
    Ok(())
}

/// Waits until the server `name` at `to` answers one connection of the netkit client that
/// `client_json` runs (10 s at most: the first neighbour discovery can take a moment).
pub fn wait_answer(client_json: impl Fn(&[&str]) -> Result<serde_json::Value>, to: &str, name: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = client_json(&["tcp", "--to", to, "--count", "1", "--timeout-ms", "300"]);
        if v.as_ref().is_ok_and(|v| v["counts"][name] == 1) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{name} at {to} does not answer the client directly: {v:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs a netkit client command (`args` for messages) to completion and parses its JSON output.
pub fn netkit_json(mut cmd: Command, args: &[&str]) -> Result<serde_json::Value> {
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("netkit {args:?} failed: {}", out.status);
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("netkit output: {}", String::from_utf8_lossy(&out.stdout)))
}

/// YAML for a ClusterIP Service with one port named `p` (TCP and/or UDP).
pub fn service_yaml(name: &str, vip: &str, port: u16, protos: &[&str]) -> String {
    let ports: Vec<String> =
        protos.iter().map(|p| format!("  - {{name: p-{}, port: {port}, targetPort: {SERVER_PORT}, protocol: {p}}}", p.to_lowercase())).collect();
    format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: lab}}\nspec:\n  clusterIP: {vip}\n  ports:\n{}\n", ports.join("\n"))
}

/// YAML for an EndpointSlice of `svc` with the given backend indexes (ready) and protocols.
pub fn slice_yaml(svc: &str, backends: &[usize], protos: &[&str]) -> String {
    let on: Vec<(usize, &str)> = backends.iter().map(|i| (*i, "")).collect();
    slice_yaml_on(svc, &on, protos)
}

/// Like `slice_yaml`, with the node each backend runs on ("" for none).
pub fn slice_yaml_on(svc: &str, backends: &[(usize, &str)], protos: &[&str]) -> String {
    let ports: Vec<String> = protos.iter().map(|p| format!("  - {{name: p-{}, port: {SERVER_PORT}, protocol: {p}}}", p.to_lowercase())).collect();
    let eps: Vec<String> = backends
        .iter()
        .map(|(i, node)| {
            let n = if node.is_empty() { String::new() } else { format!("\n    nodeName: {node}") };
            format!("  - addresses: [{}]\n    conditions: {{ready: true}}{n}", backend_ip(*i))
        })
        .collect();
    let eps = if eps.is_empty() { "endpoints: []".to_string() } else { format!("endpoints:\n{}", eps.join("\n")) };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-1, namespace: lab, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: IPv4\nports:\n{}\n{eps}\n",
        ports.join("\n")
    )
}

/// YAML for a dual-stack ClusterIP Service (`ipFamilies: [IPv4, IPv6]`) with one port named
/// `p-<proto>` per protocol.
pub fn service_yaml_dual(name: &str, vip4: &str, vip6: &str, port: u16, protos: &[&str]) -> String {
    let ports: Vec<String> =
        protos.iter().map(|p| format!("  - {{name: p-{}, port: {port}, targetPort: {SERVER_PORT}, protocol: {p}}}", p.to_lowercase())).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: lab}}\nspec:\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: {vip4}\n  clusterIPs: [{vip4}, \"{vip6}\"]\n  ports:\n{}\n",
        ports.join("\n")
    )
}

/// YAML for the IPv6 EndpointSlice (`addressType: IPv6`, name `<svc>-v6`) of `svc`.
pub fn slice_yaml6(svc: &str, backends: &[usize], protos: &[&str]) -> String {
    let ports: Vec<String> = protos.iter().map(|p| format!("  - {{name: p-{}, port: {SERVER_PORT}, protocol: {p}}}", p.to_lowercase())).collect();
    let eps: Vec<String> = backends.iter().map(|i| format!("  - addresses: [\"{}\"]\n    conditions: {{ready: true}}", backend_ip6(*i))).collect();
    let eps = if eps.is_empty() { "endpoints: []".to_string() } else { format!("endpoints:\n{}", eps.join("\n")) };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-v6, namespace: lab, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: IPv6\nports:\n{}\n{eps}\n",
        ports.join("\n")
    )
}

/// YAML for this lab's Node object: its NodePort address.
pub fn node_yaml() -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}]\n")
}

/// Like `node_yaml`, with the node's IPv6 address too (dual-stack NodePorts).
pub fn node_yaml_dual() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE_NAME}}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_ADDR}}}, {{type: InternalIP, address: \"{NODE_ADDR6}\"}}]\n"
    )
}

/// Options for the agent under test.
#[derive(Clone, Debug, Default)]
pub struct AgentOpts {
    /// Attach socket LB to the lab's client cgroup.
    pub socket_lb: bool,
    /// Attach TC LB to the node's client-facing interface.
    pub tc: bool,
    /// Leave the pinned links in place when the agent stops (as in an upgrade); by default the
    /// agent runs with `--detach-on-exit`.
    pub keep_links: bool,
    /// Listen where the agent does by default (as the DaemonSet runs it) instead of on
    /// 127.0.0.1, port 0.
    pub default_listen: bool,
    pub extra: Vec<String>,
}

/// `gardenet-agent run --source dir:...` in the node namespace.
pub struct Agent {
    proc: Option<Proc>,
    pub bpffs: PathBuf,
    pub dir: PathBuf,
    pub log: Arc<Mutex<Vec<String>>>,
    /// Told when the running agent's log has ended (its stderr closed), so that a stopped
    /// agent's `log` holds every line it wrote.
    log_end: Option<mpsc::Receiver<()>>,
    pub bin: PathBuf,
    opts: AgentOpts,
    /// How long a start may take until the agent reports ready (30 s; a bound, not a
    /// target: the soak suite allows more for a one-vCPU emulated VM under load).
    pub ready_timeout: Duration,
}

impl Agent {
    /// Writes `manifests` (file name, YAML) and starts the agent on the lab's node; returns
    /// once it is ready.
    pub fn start(lab: &Lab, opts: AgentOpts, manifests: &[(&str, String)]) -> Result<Self> {
        Self::start_in(&lab.tag, &lab.node, Some(&lab.cgroup), opts, manifests)
    }

    /// Like `start`, in any namespace (`cgroup`: where socket LB attaches, if enabled).
    pub fn start_in(tag: &str, ns: &Netns, cgroup: Option<&TestCgroup>, opts: AgentOpts, manifests: &[(&str, String)]) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("{tag}-manifests"));
        std::fs::create_dir_all(&dir)?;
        let mut a = Agent {
            proc: None,
            log_end: None,
            bpffs: PathBuf::from("/sys/fs/bpf").join(tag),
            dir,
            log: Default::default(),
            bin: sibling_binary("gardenet-agent")?,
            opts,
            ready_timeout: Duration::from_secs(30),
        };
        for (f, y) in manifests {
            a.write(f, y)?;
        }
        a.launch(ns, cgroup, true)?;
        Ok(a)
    }

    /// The agent process's sockets that listen (TCP) or are bound (UDP), from its fds and its
    /// network namespace's `/proc/<pid>/net/{tcp,tcp6,udp,udp6}`: ("tcp"|"udp", address).
    pub fn listening(&self) -> Result<std::collections::BTreeSet<(&'static str, std::net::SocketAddr)>> {
        let pid = self.proc.as_ref().context("agent not running")?.child.id();
        let inodes: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))?
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
            .collect();
        let mut out = std::collections::BTreeSet::new();
        for (file, proto) in [("tcp", "tcp"), ("tcp6", "tcp"), ("udp", "udp"), ("udp6", "udp")] {
            let text = std::fs::read_to_string(format!("/proc/{pid}/net/{file}"))?;
            for line in text.lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9).and_then(|i| i.parse::<u64>().ok())) else { continue };
                // TCP: LISTEN (0A) only; UDP: every bound socket (unconnected is 07).
                if !inodes.contains(&inode) || (proto == "tcp" && *state != "0A") {
                    continue;
                }
                out.insert((proto, proc_net_addr(local).with_context(|| format!("/proc/net/{file}: {local}"))?));
            }
        }
        Ok(out)
    }

    fn launch(&mut self, ns: &Netns, cgroup: Option<&TestCgroup>, reset: bool) -> Result<()> {
        let ready = self.spawn(ns, cgroup, reset)?;
        if ready.recv_timeout(self.ready_timeout).is_err() {
            bail!("agent did not become ready within {:?}; log:\n{}", self.ready_timeout, self.log.lock().unwrap().join("\n"));
        }
        Ok(())
    }

    /// Starts the agent process; the receiver gets the moment it reported ready.
    fn spawn(&mut self, ns: &Netns, cgroup: Option<&TestCgroup>, reset: bool) -> Result<mpsc::Receiver<Instant>> {
        let mut cmd = ns.command(&self.bin, None)?;
        cmd.arg("run").arg(format!("--source=dir:{}", self.dir.display())).arg(format!("--bpffs={}", self.bpffs.display())).args([
            "--node-name",
            NODE_NAME,
            "--poll-ms",
            "100",
        ]);
        if reset {
            cmd.arg("--reset");
        }
        if let (true, Some(cg)) = (self.opts.socket_lb, cgroup) {
            cmd.arg(format!("--cgroup={}", cg.path.display()));
        } else {
            cmd.arg("--no-socket-lb");
        }
        if self.opts.tc {
            cmd.arg("--tc-interface=nc0,nn0");
        }
        // Each test agent has its own namespace; keep the endpoints off fixed ports anyway.
        if !self.opts.default_listen {
            cmd.args(["--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--proxy-healthz-addr", "127.0.0.1:0"]);
        }
        if !self.opts.keep_links {
            cmd.arg("--detach-on-exit");
        }
        // The pod network is a test's own choice (with its own CNI directories), never the
        // machine's /opt/cni/bin and /etc/cni/net.d.
        if !self.opts.extra.iter().any(|a| a.starts_with("--pod-network")) {
            cmd.arg("--pod-network=off");
        }
        cmd.args(&self.opts.extra).env("RUST_LOG", "info").env("NO_COLOR", "1").stderr(Stdio::piped()).stdout(Stdio::null());
        let mut p = Proc::spawn(cmd, "gardenet-agent")?;
        let stderr = p.child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let (end_tx, end_rx) = mpsc::channel();
        let log = self.log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("ready:") {
                    let _ = tx.send(Instant::now());
                }
                eprintln!("    agent| {line}");
                log.lock().unwrap().push(line);
            }
            let _ = end_tx.send(());
        });
        self.proc = Some(p);
        self.log_end = Some(end_rx);
        Ok(rx)
    }

    /// Replaces the extra arguments the next (re)start passes.
    pub fn set_extra(&mut self, extra: Vec<String>) {
        self.opts.extra = extra;
    }

    /// Stops the agent (as an upgrade would) and starts it again on the same pins; after
    /// `kill9`, only starts it again (as its DaemonSet would).
    pub fn restart(&mut self, lab: &Lab) -> Result<()> {
        self.restart_in(&lab.node, Some(&lab.cgroup))
    }

    pub fn restart_in(&mut self, ns: &Netns, cgroup: Option<&TestCgroup>) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.terminate();
        }
        self.launch(ns, cgroup, false)
    }

    /// Starts the agent again on the same pins without waiting until it is ready (e.g. to
    /// kill it while it starts); the receiver gets the moment it reported ready.
    pub fn start_unready_in(&mut self, ns: &Netns, cgroup: Option<&TestCgroup>) -> Result<mpsc::Receiver<Instant>> {
        self.stop();
        self.spawn(ns, cgroup, false)
    }

    /// SIGKILL, as the OOM killer or a crash would end it: none of the agent's own shutdown
    /// runs (no `--detach-on-exit`, no final writes). Waits until the process is gone.
    pub fn kill9(&mut self) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.child.kill().context("SIGKILL to the agent")?;
            p.child.wait()?;
        }
        Ok(())
    }

    /// Writes a manifest atomically (the dir source must never see half a file).
    pub fn write(&self, file: &str, yaml: &str) -> Result<()> {
        let tmp = self.dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, self.dir.join(file))?;
        Ok(())
    }

    /// CPU time the agent's live threads have used so far, in ns precision (the sum of
    /// `/proc/<pid>/task/*/schedstat`; `/proc/<pid>/stat` counts in 10 ms ticks).
    pub fn cpu_time(&self) -> Result<Duration> {
        let pid = self.proc.as_ref().context("agent not running")?.child.id();
        let mut ns = 0u64;
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
            // A thread may exit between the listing and the read.
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                ns += schedstat_ns(&s).with_context(|| format!("parsing {}", t.path().join("schedstat").display()))?;
            }
        }
        Ok(Duration::from_nanos(ns))
    }

    /// `gardenet-agent lb list --json` from a second process.
    pub fn lb_list(&self) -> Result<serde_json::Value> {
        let out = Command::new(&self.bin).args(["lb", "list", "--json", "--bpffs"]).arg(&self.bpffs).output()?;
        if !out.status.success() {
            bail!("lb list: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// `lb list`'s conntrack line for `family` ("IPv4" or "IPv6"): entries and capacity.
    pub fn conntrack(&self, family: &str) -> Result<(usize, usize)> {
        let out = Command::new(&self.bin).args(["lb", "list", "--bpffs"]).arg(&self.bpffs).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let prefix = format!("conntrack entries ({family}): ");
        // "conntrack entries (IPv4): 36 of 262144 (0.0% full)"
        let line = text.lines().find(|l| l.starts_with(&prefix)).with_context(|| format!("no {family} conntrack line in: {text}"))?;
        let mut words = line[prefix.len()..].split_whitespace();
        let entries = words.next().and_then(|n| n.parse().ok()).with_context(|| line.to_owned())?;
        let capacity = words.nth(1).and_then(|n| n.parse().ok()).with_context(|| line.to_owned())?;
        Ok((entries, capacity))
    }

    /// Waits (at most `within`) until `family`'s conntrack map holds `pred`-many entries;
    /// returns the last count.
    pub fn wait_conntrack(&self, family: &str, within: Duration, pred: impl Fn(usize) -> bool) -> Result<usize> {
        let deadline = Instant::now() + within;
        loop {
            let (n, _) = self.conntrack(family)?;
            if pred(n) {
                return Ok(n);
            }
            if Instant::now() >= deadline {
                bail!("{family} conntrack still holds {n} entries after {within:?}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Backends programmed for `frontend` ("ip:port/proto", "ip:port/proto@this-node" for the
    /// set of clients on this node), sorted.
    pub fn programmed(&self, frontend: &str) -> Result<Option<Vec<String>>> {
        let v = self.lb_list()?;
        for f in v.as_array().into_iter().flatten() {
            let fe = &f["frontend"];
            let scope = if fe["scope"].as_str() == Some("this-node") { "@this-node" } else { "" };
            let s = format!("{}:{}/{}{scope}", bracket(fe["addr"].as_str().unwrap_or("")), fe["port"], fe["proto"].as_str().unwrap_or(""));
            if s == frontend {
                let mut b: Vec<String> =
                    f["backends"].as_array().into_iter().flatten().map(|b| format!("{}:{}", bracket(b["addr"].as_str().unwrap_or("")), b["port"])).collect();
                b.sort();
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    /// The backend slots socket LB uses for an IPv4 frontend (`None`: no entry): the
    /// master entry's, or the `SCOPE_THIS_NODE` set's when the master says there is one, as
    /// the programs pick (`node_scope`). Looked up in the pinned map by this process: two
    /// `bpf(2)` lookups, fine enough to time when the maps change (a whole `lb list` takes
    /// milliseconds). The writer sets a count after the slots it counts.
    pub fn socket_lb_slots_now(&self, addr: std::net::Ipv4Addr, port: u16, proto: u8) -> Result<Option<u16>> {
        use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapError};
        use gardenet_common::{ServiceKey4, ServiceValue, MAP_SERVICES, SCOPE_THIS_NODE, SVC_FLAG_TWO_SCOPES};
        let map: BpfHashMap<MapData, ServiceKey4, ServiceValue> = BpfHashMap::try_from(Map::HashMap(MapData::from_pin(self.bpffs.join(MAP_SERVICES))?))?;
        let get = |k: &ServiceKey4| match map.get(k, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e),
        };
        let key = ServiceKey4::master(u32::from_ne_bytes(addr.octets()), port.to_be(), proto);
        let Some(master) = get(&key)? else { return Ok(None) };
        if master.flags & SVC_FLAG_TWO_SCOPES != 0 {
            if let Some(node) = get(&key.with_scope(SCOPE_THIS_NODE))? {
                return Ok(Some(node.count));
            }
        }
        Ok(Some(master.count))
    }

    /// Polls until `frontend` has exactly `n` backends programmed.
    pub fn wait_backends(&self, frontend: &str, n: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = self.programmed(frontend)?;
            if got.as_ref().is_some_and(|b| b.len() == n) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{frontend}: expected {n} backends, have {got:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the agent; returns once it is gone and its last log line is in `log` (or 5 s
    /// after it is gone).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.terminate();
        }
        if let Some(end) = self.log_end.take() {
            let _ = end.recv_timeout(Duration::from_secs(5));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.bpffs);
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(gardenet_agent::run::default_state_dir(&self.bpffs));
    }
}

/// An address as it appears in `ADDR:PORT`: IPv6 in brackets.
fn bracket(a: &str) -> String {
    if a.contains(':') {
        format!("[{a}]")
    } else {
        a.to_string()
    }
}

/// Parses netkit's `counts` object into (name, count) pairs.
pub fn counts(v: &serde_json::Value) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = v["counts"].as_object().into_iter().flatten().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0))).collect();
    out.sort();
    out
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}

/// A long-lived UDP client (fixed source port `bind_port`) on the TC path to `to` is pinned
/// by conntrack to one of the three backends; that backend then leaves the Service (the
/// manifest `file` is rewritten with `slice(remaining backends)`), and the same flow must
/// reach only the others within 10 s. The departed backend's server keeps running, so only
/// the agent's conntrack cleanup can move the flow.
pub fn assert_udp_flow_leaves_departed_backend(lab: &Lab, agent: &Agent, to: &str, file: &str, slice: impl Fn(&[usize]) -> String, bind_port: u16) {
    let port = bind_port.to_string();
    let send = || lab.client_json(false, &["udp", "--to", to, "--count", "5", "--bind-port", &port]).unwrap();
    let v = send();
    let c = counts(&v);
    assert_eq!(c.len(), 1, "one flow, one backend: {v}");
    let pinned = c[0].0.clone();
    let i: usize = pinned.trim_start_matches("be").parse::<usize>().unwrap() - 1;
    let rest: Vec<usize> = (0..3).filter(|j| *j != i).collect();
    agent.write(file, &slice(&rest)).unwrap();
    agent.wait_backends(&format!("{to}/udp"), 2).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = send();
        let c = counts(&v);
        if c.iter().all(|(n, _)| *n != pinned) {
            assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 5, "{v}");
            return;
        }
        assert!(Instant::now() < deadline, "the flow still reaches {pinned}: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A resolver's connected UDP socket through socket LB talks to its backend directly: no map
/// change moves it. `agent` serves `to` with backend 0 only (manifest `file`, written with
/// `slice(backends)`). The client connects (to be1), two backends arrive (the socket stays),
/// then be1 leaves: the agent must destroy the socket (sock_diag in the client's namespace),
/// the client sees the error and connects again and reaches the remaining backends. be1's
/// server keeps running, so only the termination can move the client. From one second after the agent has programmed the
/// departure on, every query must reach a remaining backend. Prints the timeline and lost
/// queries.
pub fn assert_connected_udp_leaves_departed_backend(lab: &Lab, agent: &Agent, to: &str, file: &str, slice: impl Fn(&[usize]) -> String) {
    let now_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let udp = format!("{to}/udp");
    // 300 queries, one every 20 ms (~6 s plus answers).
    let client = lab
        .client_cmd(true, &["udp", "--to", to, "--connected", "--count", "300", "--interval-ms", "20", "--timeout-ms", "200", "--trace"])
        .unwrap()
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    agent.write(file, &slice(&[0, 1, 2])).unwrap();
    agent.wait_backends(&udp, 3).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let left = now_ms();
    agent.write(file, &slice(&[1, 2])).unwrap();
    agent.wait_backends(&udp, 2).unwrap();
    // After wait_backends: the agent has written the maps (a slow emulated kernel takes seconds
    // to get here; the agent's reaction is measured from this point).
    let programmed = now_ms() - left;
    let out = client.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let trace: Vec<(u128, String)> =
        v["trace"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap() as u128, e[1].as_str().unwrap().to_owned())).collect();
    let remaining = |a: &str| a == "be2" || a == "be3";
    let moved = trace.iter().find(|(t, a)| *t >= left && remaining(a)).map(|(t, _)| t - left);
    let lost: Vec<u128> = trace.iter().filter(|(_, a)| a == "-").map(|(t, _)| *t).collect();
    eprintln!(
        "connected UDP via socket LB to {to}: {} queries {:?}, {} reconnects; be1 left at +0 ms, programmed by +{programmed} ms, first answer from a remaining backend at +{moved:?} ms; lost {} {lost:?}",
        trace.len(),
        counts(&v),
        v["reconnects"],
        lost.len()
    );
    assert!(trace.iter().filter(|(t, _)| *t < left).all(|(_, a)| a == "be1"), "pinned to be1 until it left, also after others arrived: {v}");
    let moved = moved.expect("queries reached a remaining backend");
    assert!(v["reconnects"].as_u64().unwrap() >= 1, "the socket was destroyed: {v}");
    let late: Vec<&String> = trace.iter().filter(|(t, _)| *t > left + programmed + 1000).map(|(_, a)| a).collect();
    assert!(!late.is_empty() && late.iter().all(|a| remaining(a)), "first moved at +{moved} ms: {v}");
    // Only the query in flight when the socket was destroyed may be lost.
    assert!(lost.len() <= 2, "lost queries at {lost:?} (be1 left at {left})");
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("terminated 1 connected UDP sockets to departed backends (0 failed"), "{log}");
}

/// `ADDR:PORT` as `/proc/net/tcp*` prints it: the address as 32-bit words in hex, each the
/// kernel's in-memory (network-order) bytes read as a native integer.
fn proc_net_addr(s: &str) -> Option<std::net::SocketAddr> {
    let (a, p) = s.split_once(':')?;
    let port = u16::from_str_radix(p, 16).ok()?;
    let words: Vec<u32> = (0..a.len() / 8).map(|i| u32::from_str_radix(&a[i * 8..i * 8 + 8], 16)).collect::<Result<_, _>>().ok()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ip: std::net::IpAddr = match bytes.len() {
        4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?).into(),
        16 => std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?).into(),
        _ => return None,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// Waits (bounded) until the agent's log has a line containing `needle`; returns that line.
pub fn wait_log(agent: &Agent, needle: &str, limit: Duration) -> Result<String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(l) = agent.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
            return Ok(l.clone());
        }
        if Instant::now() > deadline {
            bail!("no log line with {needle:?} within {limit:?}; log:\n{}", agent.log.lock().unwrap().join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An EndpointSlice YAML (as `slice_yaml`/`slice_yaml6` write it) with the endpoint at `ip`
/// terminating: not ready, still serving (a pod in its grace period).
pub fn terminating(slice_yaml: &str, ip: &str) -> String {
    let (plain, quoted) = (format!("addresses: [{ip}]\n    conditions: {{ready: true}}"), format!("addresses: [\"{ip}\"]\n    conditions: {{ready: true}}"));
    let cond = "conditions: {ready: false, serving: true, terminating: true}";
    let out = slice_yaml.replace(&plain, &format!("addresses: [{ip}]\n    {cond}")).replace(&quoted, &format!("addresses: [\"{ip}\"]\n    {cond}"));
    assert_ne!(out, slice_yaml, "no endpoint {ip} in {slice_yaml}");
    out
}

/// Idle TCP connections that socket LB sent to a backend are terminated once the backend is in
/// none of the Service's EndpointSlices (not while it is only terminating: those drain), and
/// busy ones (unread data) are left alone. 60 connections over be1..be3, every second one busy.
/// `slice(b)` writes the slice with backends `b`; `ip1` is be1's address.
pub fn assert_idle_tcp_leaves_departed_backend(lab: &Lab, agent: &Agent, to: &str, file: &str, ip1: &str, slice: impl Fn(&[usize]) -> String) {
    let tcp = format!("{to}/tcp");
    let mut hold = lab
        .client_cmd(true, &["hold", "--to", to, "--conns", "60", "--busy-every", "2"])
        .unwrap()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(hold.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let before: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let names: Vec<String> = before["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect();
    let busy: Vec<bool> = before["busy"].as_array().unwrap().iter().map(|b| b.as_bool().unwrap()).collect();
    let on_be1 = |want_busy: bool| names.iter().zip(&busy).filter(|(n, b)| *n == "be1" && **b == want_busy).count();
    let (idle1, busy1) = (on_be1(false), on_be1(true));
    assert!(idle1 > 0 && busy1 > 0, "socket LB spread 60 connections over three backends: {before}");

    // be1 terminating: out of the selection, but its connections drain.
    agent.write(file, &terminating(&slice(&[0, 1, 2]), ip1)).unwrap();
    agent.wait_backends(&tcp, 2).unwrap();
    // Longer than the agent's grace period (2 s) plus a tick: nothing may be terminated.
    std::thread::sleep(Duration::from_millis(3500));
    assert!(!agent.log.lock().unwrap().iter().any(|l| l.contains("idle TCP sockets")), "a terminating backend's connections drain");

    // be1 gone from the slice.
    let t0 = Instant::now();
    agent.write(file, &slice(&[1, 2])).unwrap();
    agent.wait_backends(&tcp, 2).unwrap();
    let done = wait_log(agent, "idle TCP sockets", Duration::from_secs(60)).unwrap();
    eprintln!("socket LB TCP to {to}: {idle1} idle and {busy1} busy connections on be1; after it left the slice: {done:?} at +{} ms", t0.elapsed().as_millis());
    assert!(done.contains(&format!("terminated {idle1} idle TCP sockets to departed backends (0 failed, {busy1} busy left alone")), "{done}");

    hold.stdin.take().unwrap().write_all(b"go\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let after: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let _ = hold.wait();
    for (i, (n, b)) in names.iter().zip(&busy).enumerate() {
        let (a, e) = (after["after"][i].as_str().unwrap(), after["errors"][i].as_str().unwrap());
        if n == "be1" && !b {
            assert_eq!((a, e), ("", "ConnectionAborted"), "idle connection {i} to be1 must be terminated: {after}");
        } else {
            assert_eq!(a, n, "connection {i} to {n} (busy: {b}) must work on: {after}");
        }
    }
}

/// How `connect()` to a frontend without backends fails on this kernel: ECONNREFUSED, but
/// through socket LB on kernels without `bpf_set_retval` (< 5.18) the hook's EPERM.
pub fn refusal_outcome(socket_lb: bool) -> &'static str {
    if socket_lb && !gardenet_agent::dataplane::features::KernelFeatures::probe().set_retval {
        "PermissionDenied"
    } else {
        "ConnectionRefused"
    }
}

/// Time on CPU (ns) from a `schedstat` line: "<on cpu ns> <waiting ns> <timeslices>".
fn schedstat_ns(line: &str) -> Option<u64> {
    line.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_on_cpu_from_schedstat() {
        assert_eq!(schedstat_ns("123456789 5000 42\n"), Some(123_456_789));
        assert_eq!(schedstat_ns(""), None);
        assert_eq!(schedstat_ns("x 1 2"), None);
    }
}
