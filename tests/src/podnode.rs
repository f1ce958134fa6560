//! A node for the pod network with a real runtime: the agent (socket LB on the test's
//! cgroup, pod network on with test-owned CNI directories), an outside host on the node's
//! wire that knows nothing of pods, and podman creating pods through what the agent
//! installed. Used by the `pod_network` suite, the demo and the pod network bench.
use std::process::Stdio;

use serde_json::Value;

use crate::{
    cni::{CniNode, POD_CIDR_V4, POD_CIDR_V6},
    lab::{Agent, AgentOpts},
    netns::{require_root, sibling_binary, sweep_leftovers, unique_tag, Netns, Proc, TestCgroup},
    podman::{Pod, Runtime},
};

pub const NODE_IP: &str = "198.18.1.1";
pub const NODE_IP6: &str = "fd00:18:1::1";
pub const OUTSIDE_IP: &str = "198.18.1.2";
pub const OUTSIDE_IP6: &str = "fd00:18:1::2";

/// A node with the agent (socket LB on the test's cgroup, pod network on with test-owned
/// CNI directories), an outside host on its wire, and podman.
pub struct PodNode {
    pub runtime: Runtime,
    pub agent: Agent,
    pub cgroup: TestCgroup,
    pub wire: Netns,
    pub node: CniNode,
}

pub fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: lab-node}}\nspec: {{podCIDRs: [{POD_CIDR_V4}, \"{POD_CIDR_V6}\"]}}\nstatus:\n  addresses: [{{type: InternalIP, address: {NODE_IP}}}, {{type: InternalIP, address: \"{NODE_IP6}\"}}]\n"
    )
}

impl PodNode {
    pub fn new() -> anyhow::Result<PodNode> {
        require_root();
        sweep_leftovers();
        let node = CniNode::new()?;
        let wire = Netns::new(&unique_tag())?;
        node.ns.ip(&["link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns", &wire.name])?;
        for (ns, dev, v4, v6) in [(&node.ns, "up0", NODE_IP, NODE_IP6), (&wire, "up1", OUTSIDE_IP, OUTSIDE_IP6)] {
            ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", dev])?;
            ns.ip(&["-6", "addr", "add", &format!("{v6}/64"), "dev", dev, "nodad"])?;
            ns.ip(&["link", "set", dev, "up"])?;
        }
        let tag = unique_tag();
        let cgroup = TestCgroup::new(&tag)?;
        let (bin, conf) = (node.dir.join("agent-bin"), node.dir.join("net.d"));
        let target = sibling_binary("gardenet")?.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
        let opts = AgentOpts {
            socket_lb: true,
            extra: vec![
                "--pod-network=on".into(),
                format!("--cni-bin-dir={}", bin.display()),
                format!("--cni-conf-dir={}", conf.display()),
                format!("--cni-state-dir={}", node.dir.join("state").display()),
                format!("--cni-plugins-from={},/usr/lib/cni", target.display()),
            ],
            ..Default::default()
        };
        let agent = Agent::start_in(&tag, &node.ns, Some(&cgroup), opts, &[("node.yaml", node_yaml())])?;
        let runtime = Runtime::new(&node.ns, &node.dir.join("podman"), &conf, &bin, Some(&cgroup))?;
        Ok(PodNode { runtime, agent, cgroup, wire, node })
    }

    pub fn netkit(&self, pod: &Pod, args: &[&str]) -> Value {
        let out = pod.command(sibling_binary("gardenet-netkit").unwrap(), Some(&self.cgroup)).unwrap().args(args).stderr(Stdio::inherit()).output().unwrap();
        assert!(out.status.success(), "netkit {args:?} in {}: {}", pod.name, out.status);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn serve(&self, pod: &Pod) -> Proc {
        let mut cmd = pod.command(sibling_binary("gardenet-netkit").unwrap(), None).unwrap();
        cmd.args(["serve", "--name", &pod.name, "--port", "8080"]);
        Proc::spawn(cmd, &pod.name).unwrap()
    }
}
