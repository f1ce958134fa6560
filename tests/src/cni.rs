//! A node for the CNI plugin: a network namespace, and test-owned bin, conf and state
//! directories (never the machine's `/opt/cni/bin` or `/etc/cni/net.d`). The plugin is
//! invoked as libcni invokes it: `CNI_*` environment, the network configuration on stdin,
//! the answer on stdout; it runs inside the node's namespace, as the runtime runs it on a
//! node.
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::netns::{sibling_binary, unique_tag, Netns};

/// Where the reference plugins are installed (Debian's `containernetworking-plugins`).
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// The pod CIDRs of the test node.
pub const POD_CIDR_V4: &str = "198.18.100.0/24";
pub const POD_CIDR_V6: &str = "fd00:18:100::/64";
/// The node's own addresses (on its loopback: the node has no other interface here).
pub const NODE_V4: &str = "198.18.0.1";
pub const NODE_V6: &str = "fd00:18::1";

pub struct CniNode {
    pub ns: Netns,
    pub dir: PathBuf,
    pub plugin: PathBuf,
}

/// One answer of the plugin: whether it exited 0, and what it printed (JSON, or Null).
#[derive(Debug)]
pub struct Answer {
    pub ok: bool,
    pub json: Value,
}

impl CniNode {
    pub fn new() -> Result<CniNode> {
        let tag = unique_tag();
        let ns = Netns::new(&tag)?;
        ns.ip(&["addr", "add", &format!("{NODE_V4}/32"), "dev", "lo"])?;
        ns.ip(&["-6", "addr", "add", &format!("{NODE_V6}/128"), "dev", "lo"])?;
        let dir = std::env::temp_dir().join(format!("{tag}-cni"));
        let node = CniNode { ns, dir, plugin: sibling_binary("gardenet")? };
        std::fs::create_dir_all(node.bin_dir())?;
        std::fs::create_dir_all(node.dir.join("ipam"))?;
        for p in ["host-local", "portmap", "ptp"] {
            let from = Path::new(REFERENCE_PLUGINS).join(p);
            std::os::unix::fs::symlink(&from, node.bin_dir().join(p))
                .with_context(|| format!("{} (apt-get install containernetworking-plugins)", from.display()))?;
        }
        Ok(node)
    }

    pub fn bin_dir(&self) -> PathBuf {
        self.dir.join("bin")
    }

    pub fn ipam_dir(&self) -> PathBuf {
        self.dir.join("ipam")
    }

    /// The plugin's configuration as the agent writes it into the conflist.
    pub fn conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version,
            "name": "gardenet",
            "type": "gardenet",
            "mtu": 1400,
            "agentReadyFile": self.dir.join("ready"),
            "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR_V4}], [{"subnet": POD_CIDR_V6}]], "dataDir": self.ipam_dir()},
        })
    }

    /// Runs the plugin once inside the node's namespace.
    pub fn invoke(&self, command: &str, attachment: Option<(&str, &str)>, netns: Option<&Path>, stdin: &[u8]) -> Result<Answer> {
        self.invoke_from(&self.plugin, &self.bin_dir(), command, attachment, netns, stdin)
    }

    /// Runs `plugin` (e.g. one the agent installed) with `cni_path` as `CNI_PATH`.
    pub fn invoke_from(
        &self,
        plugin: &Path,
        cni_path: &Path,
        command: &str,
        attachment: Option<(&str, &str)>,
        netns: Option<&Path>,
        stdin: &[u8],
    ) -> Result<Answer> {
        let mut cmd = self.ns.command(plugin, None)?;
        cmd.env_clear().env("CNI_COMMAND", command).env("CNI_PATH", cni_path);
        if let Some((id, ifname)) = attachment {
            cmd.env("CNI_CONTAINERID", id).env("CNI_IFNAME", ifname);
        }
        if let Some(ns) = netns {
            cmd.env("CNI_NETNS", ns);
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        // A plugin that answers without reading (VERSION) may close its stdin first.
        let _ = child.stdin.take().context("stdin")?.write_all(stdin);
        let out = child.wait_with_output()?;
        let json = if out.stdout.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&out.stdout).with_context(|| format!("the plugin's stdout is not JSON: {:?}", String::from_utf8_lossy(&out.stdout)))?
        };
        Ok(Answer { ok: out.status.success(), json })
    }

    /// The names of the plugin's host-side interfaces in the node.
    pub fn host_sides(&self) -> Result<Vec<String>> {
        let out = self.ns.command("ip", None)?.args(["-o", "link", "show"]).output()?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1).map(|n| n.split('@').next().unwrap_or(n).to_owned()))
            .filter(|n| n.starts_with("gn"))
            .collect())
    }

    /// Routes of the node that point into the pod CIDRs.
    pub fn pod_routes(&self) -> Result<Vec<String>> {
        let mut v = Vec::new();
        for fam in ["-4", "-6"] {
            let out = self.ns.command("ip", None)?.args([fam, "route", "show"]).output()?;
            v.extend(String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("198.18.100.") || l.starts_with("fd00:18:100:")).map(str::to_owned));
        }
        Ok(v)
    }

    /// The addresses host-local holds in its state.
    pub fn reservations(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.ipam_dir().join("gardenet"))
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.parse::<std::net::IpAddr>().is_ok()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for CniNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
