//! Masquerade of pods' traffic that leaves the pod network, with nftables: one table,
//! `inet gardenet_masq`, replaced whole in one transaction whenever what it says changes.
//!
//! Why nftables and not the TC programs' source NAT: that machinery has 4,536 ports per
//! node (61000-65535) and holds a closed flow's port for 10 s, made for NodePort traffic to
//! remote endpoints; pods' egress to the world needs every port, every protocol (ICMP,
//! fragments) and the kernel's conntrack, as kindnet (nftables), Calico (`natOutgoing`) and
//! Cilium's default (iptables) do it. Only traffic leaving the node through something other
//! than a pod's interface is looked at; pod to pod and pod to node never is.
//! The cost: a nat hook turns the node's netfilter conntrack on for all its traffic (the
//! dataplane bench's tracked pass measures it).
use std::{io::Write, process::Stdio};

use anyhow::{bail, Context, Result};

use crate::desired::Cidr;

pub const TABLE: &str = "gardenet_masq";

/// The table for pods in `pod_cidrs` that keep their address toward `keep` (pod CIDRs are
/// always kept).
pub fn ruleset(pod_cidrs: &[Cidr], keep: &[Cidr]) -> String {
    let mut s = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    let mut rules = Vec::new();
    for (fam, v4) in [("ip", true), ("ip6", false)] {
        let pods: Vec<String> = pod_cidrs.iter().filter(|c| c.addr.is_ipv4() == v4).map(|c| c.to_string()).collect();
        if pods.is_empty() {
            continue;
        }
        let mut kept: Vec<String> = pod_cidrs.iter().chain(keep).filter(|c| c.addr.is_ipv4() == v4).map(|c| c.to_string()).collect();
        kept.sort();
        kept.dedup();
        let ty = if v4 { "ipv4_addr" } else { "ipv6_addr" };
        let set = |name: &str, elems: &[String]| {
            format!("  set {name} {{\n    type {ty}\n    flags interval\n    auto-merge\n    elements = {{ {} }}\n  }}\n", elems.join(", "))
        };
        s.push_str(&set(&format!("pods_{fam}"), &pods));
        s.push_str(&set(&format!("keep_{fam}"), &kept));
        rules.push(format!("    {fam} saddr @pods_{fam} {fam} daddr != @keep_{fam} oifname != \"gn*\" masquerade"));
    }
    s.push_str("  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n");
    for r in rules {
        s.push_str(&r);
        s.push('\n');
    }
    s.push_str("  }\n}\n");
    s
}

/// Loads `ruleset` in one transaction.
pub fn apply(ruleset: &str) -> Result<()> {
    nft(ruleset)
}

/// Removes the table (nothing to do when there is none).
pub fn remove() -> Result<()> {
    nft(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"))
}

fn nft(script: &str) -> Result<()> {
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (install nftables)")?;
    child.stdin.take().context("nft's stdin")?.write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("nft: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(v: &[&str]) -> Vec<Cidr> {
        v.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn each_family_with_pods_gets_its_rule_and_the_pod_cidrs_are_always_kept() {
        let r = ruleset(&cidrs(&["100.96.1.0/24", "fd00:96:1::/64"]), &cidrs(&["100.64.0.0/10", "10.250.0.5/32"]));
        assert!(r.starts_with("table inet gardenet_masq\ndelete table inet gardenet_masq\n"), "{r}");
        assert!(r.contains("elements = { 10.250.0.5/32, 100.64.0.0/10, 100.96.1.0/24 }"), "{r}");
        assert!(r.contains("elements = { fd00:96:1::/64 }"), "{r}");
        assert!(r.contains("ip saddr @pods_ip ip daddr != @keep_ip oifname != \"gn*\" masquerade"), "{r}");
        assert!(r.contains("ip6 saddr @pods_ip6 ip6 daddr != @keep_ip6 oifname != \"gn*\" masquerade"), "{r}");
        let v4only = ruleset(&cidrs(&["100.96.1.0/24"]), &cidrs(&["fd00::/8"]));
        assert!(!v4only.contains("ip6 saddr"), "{v4only}");
    }
}
