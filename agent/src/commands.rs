//! The inspection subcommands, `gardenet-agent links` and `gardenet-agent lb list`: they read
//! what a running agent left (pinned maps, its state directory) and what the kernel reports,
//! and print it. Nothing here changes the dataplane.
use std::{
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::Result;

use crate::{
    dataplane,
    run::{default_state_dir, load_config},
};

/// `gardenet-agent links`: every interface, whether it is selected and why, and the hooks the
/// kernel reports on it (gardenet's and foreign ones). Errors come from the running agent.
pub async fn links_report(bpffs: &Path, state_dir: Option<PathBuf>, config: Option<&Path>, args: &crate::links::InterfaceArgs, json: bool) -> Result<()> {
    use crate::links::pinned::{prog_name, prog_query, AttachType};
    let config = load_config(config)?;
    let selector = args.selector(&config.interfaces);
    let mut rows = crate::links::explain(&selector, &crate::links::WatchOptions::default()).await?;
    let state_dir = state_dir.unwrap_or_else(|| default_state_dir(bpffs));
    let agent: Vec<crate::links::LinkStatus> =
        std::fs::read_to_string(state_dir.join("links.json")).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    let xdp = crate::links::watch::xdp_modes().await.unwrap_or_default();
    for r in rows.iter_mut() {
        if let Some(a) = agent.iter().find(|a| a.index == r.index) {
            // The running agent's decision (it may have been started with other flags).
            r.selected = a.selected;
            r.reason = a.reason.clone();
            r.error = a.error.clone();
        }
        let mut hooks = Vec::new();
        for (ty, hook) in [(AttachType::TcxIngress, "tc/ingress"), (AttachType::TcxEgress, "tc/egress")] {
            for id in prog_query(r.index, ty).unwrap_or_default() {
                let name = prog_name(id).unwrap_or_default();
                hooks.push(if name.starts_with("gn_") { hook.to_string() } else { format!("{hook}(foreign:{name})") });
            }
        }
        // Kernels without tcx: gardenet's and other tools' filters on the clsact qdisc.
        hooks.extend(crate::links::watch::clsact_filters(r.index).await.unwrap_or_default());
        if let Some(m) = xdp.get(&r.index) {
            hooks.push(format!("xdp/{m}"));
        }
        r.hooks = hooks;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", crate::links::render_table(&rows));
        println!("\n{}", crate::dataplane::features::KernelFeatures::probe().summary());
    }
    Ok(())
}

/// `gardenet-agent lb list`: the programmed frontends and their backends, from the pinned maps.
pub fn lb_list(bpffs: &Path, json: bool) -> Result<()> {
    let dump = dataplane::dump_pinned(bpffs)?;
    let fes = dump.frontends();
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &fes)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "{:<38} BACKENDS", "FRONTEND")?;
    for f in fes {
        // "*" marks an endpoint on another node.
        let bes: Vec<String> = f.backends.iter().map(|b| if b.remote { format!("{b}*") } else { b.to_string() }).collect();
        // Without backends a frontend rejects (no endpoints at all) or drops (endpoints, none
        // usable here), as kube-proxy's REJECT and DROP rules.
        let mut line = match (bes.is_empty(), f.when_empty) {
            (true, "drop") => "(none here: dropped)".to_string(),
            (true, _) => "(none: connections refused)".to_string(),
            (false, _) => bes.join(" "),
        };
        if f.two_scopes {
            line.push_str("  [clients on this node: @this-node]");
        }
        if f.snat_remote && f.backends.iter().any(|b| b.remote) {
            line.push_str("  [source NAT to * endpoints]");
        }
        if !f.source_ranges.is_empty() {
            let r: Vec<String> = f.source_ranges.iter().map(|c| c.to_string()).collect();
            line.push_str(&format!("  [only from {}]", r.join(", ")));
        }
        if f.affinity_timeout > 0 {
            line.push_str(&format!("  [ClientIP affinity {}s]", f.affinity_timeout));
        }
        writeln!(out, "{:<38} {}", f.frontend.to_string(), line)?;
    }
    let ranges: Vec<String> = dump.service_nets.iter().filter(|(_, k)| *k == crate::dataplane::lbmap::ServiceNet::Range).map(|(c, _)| c.to_string()).collect();
    if !ranges.is_empty() {
        let ips = dump.service_nets.iter().filter(|(_, k)| *k != crate::dataplane::lbmap::ServiceNet::Range).count();
        writeln!(out, "service ranges: {} (unallocated addresses dropped; {ips} ClusterIPs: other ports rejected)", ranges.join(", "))?;
    }
    // Pressure: an LRU map near its capacity evicts live flows first.
    for fill in dataplane::conntrack_fill(bpffs).unwrap_or_default() {
        let family = if fill.map.ends_with("ipv6") { "IPv6" } else { "IPv4" };
        let pct = if fill.capacity > 0 { fill.entries as f64 * 100.0 / fill.capacity as f64 } else { 0.0 };
        writeln!(out, "conntrack entries ({family}): {} of {} ({pct:.1}% full)", fill.entries, fill.capacity)?;
    }
    Ok(())
}
