//! The CNI configuration the agent writes for the node's container runtime: pure, from
//! what the Node and the NetworkConfig say.
use std::path::Path;

use serde_json::{json, Value};

use crate::desired::Cidr;

/// The file name (runtimes take the first conflist in name order).
pub const CONFLIST: &str = "10-gardenet.conflist";
/// The network's name (host-local keeps its reservations under it).
pub const NETWORK_NAME: &str = "gardenet";
/// The version the conflist is written in: libcni since 1.0 (containerd 1.6+, CRI-O,
/// podman 4) reads it; STATUS and GC need 1.1.0, which only runtimes with libcni 1.2 know.
pub const CNI_VERSION: &str = "1.0.0";

/// What the conflist says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodNetwork {
    /// The Node's `spec.podCIDRs`, one per family.
    pub pod_cidrs: Vec<String>,
    pub mtu: u32,
}

/// The Node's pod CIDRs: each an address with a prefix length, at most one per family.
pub fn parse_pod_cidrs(cidrs: &[String]) -> Result<Vec<Cidr>, String> {
    if cidrs.is_empty() {
        return Err("the Node has no spec.podCIDRs yet".into());
    }
    let mut out: Vec<Cidr> = Vec::new();
    for c in cidrs {
        let cidr: Cidr = c.parse().ok().filter(|_| c.contains('/')).ok_or_else(|| format!("spec.podCIDRs: {c:?} is not a CIDR"))?;
        if out.iter().any(|o| o.addr.is_ipv4() == cidr.addr.is_ipv4()) {
            return Err(format!("spec.podCIDRs: {c:?}: two CIDRs of one family"));
        }
        out.push(cidr);
    }
    Ok(out)
}

/// The conflist: gardenet (addresses from host-local, state under `state_dir`), then the
/// reference `portmap` for `hostPort`s, as Calico chains it.
pub fn render(p: &PodNetwork, state_dir: &Path) -> String {
    let ranges: Vec<Value> = p.pod_cidrs.iter().map(|c| json!([{"subnet": c}])).collect();
    let v = json!({
        "cniVersion": CNI_VERSION,
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "gardenet",
                "mtu": p.mtu,
                "agentReadyFile": state_dir.join("ready"),
                "ipam": {"type": "host-local", "ranges": ranges, "dataDir": state_dir.join("ipam")},
            },
            {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true},
        ],
    });
    let mut s = serde_json::to_string_pretty(&v).expect("a JSON value serialises");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conflist_delegates_to_host_local_over_the_nodes_pod_cidrs() {
        let p = PodNetwork { pod_cidrs: vec!["100.96.1.0/24".into(), "fd00:96:1::/64".into()], mtu: 1450 };
        let v: Value = serde_json::from_str(&render(&p, Path::new("/run/gardenet/cni"))).unwrap();
        assert_eq!(v["cniVersion"], CNI_VERSION);
        assert_eq!(v["name"], "gardenet");
        let g = &v["plugins"][0];
        assert_eq!(g["type"], "gardenet");
        assert_eq!(g["mtu"], 1450);
        assert_eq!(g["agentReadyFile"], "/run/gardenet/cni/ready");
        assert_eq!(
            g["ipam"],
            json!({"type": "host-local", "ranges": [[{"subnet": "100.96.1.0/24"}], [{"subnet": "fd00:96:1::/64"}]], "dataDir": "/run/gardenet/cni/ipam"})
        );
        assert_eq!(v["plugins"][1]["type"], "portmap");
        assert_eq!(v["plugins"][1]["capabilities"]["portMappings"], true);
    }

    #[test]
    fn pod_cidrs_are_checked() {
        assert_eq!(parse_pod_cidrs(&["100.96.1.0/24".into(), "fd00::/64".into()]).unwrap().len(), 2);
        for bad in [vec![], vec!["100.96.1.0".into()], vec!["x/24".into()], vec!["10.0.0.0/33".into()], vec!["10.0.0.0/24".into(), "10.1.0.0/24".into()]] {
            assert!(parse_pod_cidrs(&bad).is_err(), "{bad:?}");
        }
    }
}
