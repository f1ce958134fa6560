//! gardenet's CNI plugin (`type: gardenet`): gives a pod its interface, addresses and routes
//! on the node, addresses by delegation to an IPAM plugin (host-local), for runtimes that
//! call plugins through libcni (containerd, CRI-O, podman). CNI 0.3.0 to 1.1.0: `ADD`,
//! `DEL`, `CHECK`, `VERSION`, `STATUS`, `GC`.
pub mod config;
pub mod env;
pub mod ipam;
pub mod netns;
pub mod spec;
pub mod wire;

use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;
use serde_json::Value;

use config::NetConf;
use env::{Attachment, Command, Env};
use spec::{CniError, CniResult, Code, Interface, IpConfig, Outcome, Route, Version};

/// Answers one call; `Ok(None)` prints nothing (DEL, CHECK, STATUS, GC).
pub fn run(env: &Env, stdin: &[u8]) -> CniResult<Option<Value>> {
    if env.command == Command::Version {
        return Ok(Some(spec::version_info(spec::LATEST)));
    }
    let conf = NetConf::parse(stdin, env.command)?;
    let rt =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| CniError::new(Code::Internal, format!("starting the runtime: {e}")))?;
    rt.block_on(async {
        match env.command {
            Command::Add => add(env, &conf).await.map(|r| Some(r.to_json(conf.version))),
            Command::Del => del(env, &conf).await.map(|_| None),
            Command::Check => check(env, &conf).await.map(|_| None),
            Command::Status => status(env, &conf).map(|_| None),
            Command::Gc => gc(env, &conf).await.map(|_| None),
            Command::Version => unreachable!("answered above"),
        }
    })
}

fn attachment(env: &Env) -> CniResult<&Attachment> {
    env.attachment.as_ref().ok_or_else(|| CniError::new(Code::InvalidEnvironment, "CNI_CONTAINERID and CNI_IFNAME are required"))
}

fn ipam_plugin(env: &Env, conf: &NetConf) -> CniResult<std::path::PathBuf> {
    let t = conf.ipam_type.as_deref().ok_or_else(|| CniError::new(Code::InvalidConfig, "ipam: missing"))?;
    ipam::find_plugin(t, &env.path)
}

/// The pod's addresses: what IPAM assigned, as a host address (/32, /128).
fn pod_addresses(ipam: &Outcome) -> Vec<IpNet> {
    ipam.ips.iter().map(|ip| IpNet::from(ip.address.addr())).collect()
}

async fn add(env: &Env, conf: &NetConf) -> CniResult<Outcome> {
    let at = attachment(env)?;
    let netns = env.netns.as_deref().ok_or_else(|| CniError::new(Code::InvalidEnvironment, "CNI_NETNS is required for ADD"))?;
    if !netns.exists() {
        return Err(CniError::new(Code::InvalidEnvironment, format!("CNI_NETNS {}: no such namespace", netns.display())));
    }
    let host_if = wire::host_ifname(&at.container_id, &at.ifname);
    let plugin = ipam_plugin(env, conf)?;
    let assigned = ipam::add(&plugin, env, &conf.raw)?;
    let addrs = pod_addresses(&assigned);
    let wired = async {
        let host = wire::connect(None)?;
        // A host side of this attachment from an ADD that was killed halfway.
        wire::del_host(&host, &host_if).await?;
        match wire::add(&host, netns, &host_if, &at.ifname, &addrs, conf.mtu).await {
            Ok(w) => {
                enable_forwarding(&addrs)?;
                Ok(w)
            }
            Err(e) => {
                // Leave nothing behind: the pair goes with its host side.
                let _ = wire::del_host(&host, &host_if).await;
                Err(e)
            }
        }
    }
    .await;
    let wired = match wired {
        Ok(w) => w,
        Err(e) => {
            let _ = ipam::exec(&plugin, env, Command::Del, Some(at), &conf.raw);
            return Err(e);
        }
    };
    let families: BTreeSet<bool> = addrs.iter().map(|a| a.addr().is_ipv4()).collect();
    Ok(Outcome {
        interfaces: vec![
            Interface { name: host_if, mac: wired.host_mac, mtu: Some(conf.mtu), sandbox: None },
            Interface { name: at.ifname.clone(), mac: wired.pod_mac, mtu: Some(conf.mtu), sandbox: Some(netns.display().to_string()) },
        ],
        ips: addrs.iter().map(|a| IpConfig { address: *a, gateway: Some(wire::gateway(a.addr())), interface: Some(1) }).collect(),
        routes: families
            .iter()
            .rev()
            .map(|v4| {
                let (dst, gw): (IpNet, IpAddr) = if *v4 {
                    ("0.0.0.0/0".parse().expect("valid"), wire::GATEWAY_V4.into())
                } else {
                    ("::/0".parse().expect("valid"), wire::GATEWAY_V6.into())
                };
                Route { dst, gw: Some(gw) }
            })
            .collect(),
        dns: assigned.dns,
    })
}

/// Pods' traffic is routed by the node (as the reference ptp plugin ensures on ADD).
fn enable_forwarding(addrs: &[IpNet]) -> CniResult<()> {
    let fail = |k: &str, e: std::io::Error| CniError::new(Code::Internal, format!("enabling forwarding ({k}): {e}"));
    if addrs.iter().any(|a| a.addr().is_ipv4()) {
        netns::ensure_sysctl("net/ipv4/ip_forward", "1").map_err(|e| fail("net.ipv4.ip_forward", e))?;
    }
    if addrs.iter().any(|a| a.addr().is_ipv6()) {
        netns::ensure_sysctl("net/ipv6/conf/all/forwarding", "1").map_err(|e| fail("net.ipv6.conf.all.forwarding", e))?;
    }
    Ok(())
}

/// Idempotent: the interfaces first (an address is not handed out again while its old
/// interface exists), then the addresses; a missing namespace, interface or reservation is
/// no error.
async fn del(env: &Env, conf: &NetConf) -> CniResult<()> {
    let at = attachment(env)?;
    let host = wire::connect(None)?;
    wire::del_host(&host, &wire::host_ifname(&at.container_id, &at.ifname)).await?;
    if let Some(ns) = &env.netns {
        wire::del_pod_side(ns, &at.ifname).await?;
    }
    let plugin = ipam_plugin(env, conf)?;
    ipam::exec(&plugin, env, Command::Del, Some(at), &conf.raw)?;
    Ok(())
}

async fn check(env: &Env, conf: &NetConf) -> CniResult<()> {
    if conf.version < Version(0, 4, 0) {
        return Err(CniError::new(Code::IncompatibleVersion, format!("CHECK needs cniVersion 0.4.0 or later, the configuration has {}", conf.version)));
    }
    let at = attachment(env)?;
    let netns = env.netns.as_deref().ok_or_else(|| CniError::new(Code::InvalidEnvironment, "CNI_NETNS is required for CHECK"))?;
    let prev = conf.prev_result.as_ref().ok_or_else(|| CniError::new(Code::InvalidConfig, "prevResult: missing"))?;
    let host_if = wire::host_ifname(&at.container_id, &at.ifname);
    let host = wire::connect(None)?;
    let failed = |msg: String| CniError::new(Code::Internal, msg);
    if !wire::link_by_name(&host, &host_if).await?.is_some_and(|l| wire::is_veth(&l)) {
        return Err(failed(format!("the host side {host_if} of {}/{} is missing", at.container_id, at.ifname)));
    }
    let (addrs, gateways) = wire::pod_state(netns, &at.ifname).await?.ok_or_else(|| failed(format!("{} is missing in {}", at.ifname, netns.display())))?;
    let sandbox: BTreeSet<usize> = prev.interfaces.iter().enumerate().filter(|(_, i)| i.name == at.ifname && i.sandbox.is_some()).map(|(n, _)| n).collect();
    for ip in prev.ips.iter().filter(|ip| ip.interface.is_none_or(|i| sandbox.contains(&i))) {
        if !addrs.iter().any(|a| a.addr() == ip.address.addr()) {
            return Err(failed(format!("{} has lost its address {}", at.ifname, ip.address)));
        }
        let gw = wire::gateway(ip.address.addr());
        if !gateways.contains(&gw) {
            return Err(failed(format!("{} has no default route via {gw}", at.ifname)));
        }
    }
    let plugin = ipam_plugin(env, conf)?;
    ipam::exec(&plugin, env, Command::Check, Some(at), &conf.raw)?;
    Ok(())
}

/// Ready when the node's agent has programmed the node (it creates `agentReadyFile` then)
/// and the IPAM plugin is installed.
fn status(env: &Env, conf: &NetConf) -> CniResult<()> {
    if let Some(f) = &conf.agent_ready_file {
        if !f.exists() {
            return Err(CniError::new(Code::NotAvailable, "the gardenet agent has not programmed this node yet")
                .with_details(format!("{} does not exist", f.display())));
        }
    }
    if let Some(t) = &conf.ipam_type {
        ipam::find_plugin(t, &env.path).map_err(|e| CniError::new(Code::NotAvailable, e.msg))?;
    }
    Ok(())
}

/// Releases everything of attachments the runtime no longer has: host sides and
/// host-local's reservations (through host-local's DEL, which frees by container id and
/// ifname). Every stale attachment is tried; the first failure is reported.
async fn gc(env: &Env, conf: &NetConf) -> CniResult<()> {
    let valid: BTreeSet<&Attachment> = conf.valid_attachments.iter().flatten().collect();
    let keep: BTreeSet<String> = valid.iter().map(|a| wire::host_ifname(&a.container_id, &a.ifname)).collect();
    let mut first_error = None;
    let host = wire::connect(None)?;
    for name in wire::host_sides(&host).await? {
        if !keep.contains(&name) {
            if let Err(e) = wire::del_host(&host, &name).await {
                first_error.get_or_insert(e);
            }
        }
    }
    let plugin = ipam_plugin(env, conf)?;
    if conf.ipam_type.as_deref() == Some("host-local") {
        let dir = conf.ipam_data_dir.clone().unwrap_or_else(|| ipam::HOST_LOCAL_DEFAULT_DATA_DIR.into());
        let held = ipam::host_local_reservations(&dir, &conf.name)
            .map_err(|e| CniError::new(Code::Io, format!("reading host-local's state in {}: {e}", dir.display())))?;
        let stale: BTreeSet<Attachment> = held.into_iter().map(|(_, a)| a).filter(|a| !valid.contains(a)).collect();
        for a in &stale {
            if let Err(e) = ipam::exec(&plugin, env, Command::Del, Some(a), &conf.raw) {
                first_error.get_or_insert(e);
            }
        }
    } else {
        ipam::exec(&plugin, env, Command::Gc, None, &conf.raw)?;
    }
    first_error.map_or(Ok(()), Err)
}
