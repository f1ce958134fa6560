//! The pod's cable: a veth pair, the pod side named `CNI_IFNAME` in the pod's namespace with
//! its addresses as /32 and /128, the host side named from the attachment.
//!
//! Gateway: Calico's pattern. Every host side has the same MAC (`ee:ee:ee:ee:ee:ee`) and no
//! IPv4 address; the pod routes through `169.254.1.1` (a link-local address nobody owns,
//! held as a permanent neighbour entry in the pod, with proxy ARP on the host side as well)
//! and through the host side's own link-local `fe80::ecee:eeff:feee:eeee` for IPv6. Why:
//! no pod CIDR address is spent or shared between interfaces (ptp/kindnet put the
//! gateway address on every host veth), the pod's view is the same on every node (a pod's
//! routes never name a node address), and both families take one path.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
    path::Path,
};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags},
    link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo, LinkMessage},
    neighbour::NeighbourState,
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteScope},
    AddressFamily,
};
use rtnetlink::{Handle, LinkMessageBuilder, LinkUnspec, RouteMessageBuilder};
use sha2::{Digest, Sha256};

use crate::netns;
use crate::spec::{CniError, CniResult, Code};

pub const HOST_MAC: [u8; 6] = [0xee; 6];
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The EUI-64 link-local address of `HOST_MAC`.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0xecee, 0xeeff, 0xfeee, 0xeeee);
/// Prefix of host-side names: `gn` and 12 hex digits of SHA-256(container id, ifname).
pub const HOST_PREFIX: &str = "gn";

/// The host side's name for an attachment: the same from every plugin version, so `DEL`
/// and `GC` need no saved state.
pub fn host_ifname(container_id: &str, ifname: &str) -> String {
    let digest = Sha256::digest(format!("{container_id}/{ifname}").as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    format!("{HOST_PREFIX}{hex}")
}

/// Whether `name` is a host side this plugin would create.
pub fn is_host_ifname(name: &str) -> bool {
    name.strip_prefix(HOST_PREFIX).is_some_and(|h| h.len() == 12 && h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
}

pub fn gateway(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => GATEWAY_V4.into(),
        IpAddr::V6(_) => GATEWAY_V6.into(),
    }
}

pub fn format_mac(mac: &[u8]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn nl(what: &str) -> impl FnOnce(rtnetlink::Error) -> CniError + '_ {
    move |e| CniError::new(Code::Internal, format!("{what}: {}", describe(&e)))
}

fn describe(e: &rtnetlink::Error) -> String {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io().to_string(),
        other => other.to_string(),
    }
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
        _ => None,
    }
}

/// A netlink connection in the network namespace of the calling thread (or `netns`).
pub fn connect(netns: Option<&Path>) -> CniResult<Handle> {
    let rt = tokio::runtime::Handle::current();
    let open = move || -> CniResult<_> {
        let _guard = rt.enter();
        rtnetlink::new_connection().map_err(|e| CniError::new(Code::Internal, format!("opening a netlink socket: {e}")))
    };
    let (conn, handle, _) = match netns {
        Some(ns) => netns::run_in(ns, open)?,
        None => open()?,
    };
    tokio::spawn(conn);
    Ok(handle)
}

pub async fn link_by_name(h: &Handle, name: &str) -> CniResult<Option<LinkMessage>> {
    match h.link().get().match_name(name.to_owned()).execute().try_next().await {
        Ok(l) => Ok(l),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(nl(&format!("looking up {name}"))(e)),
    }
}

pub fn link_mac(l: &LinkMessage) -> String {
    l.attributes.iter().find_map(|a| if let LinkAttribute::Address(m) = a { Some(format_mac(m)) } else { None }).unwrap_or_default()
}

fn link_kind(l: &LinkMessage) -> Option<InfoKind> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| if let LinkInfo::Kind(k) = i { Some(k.clone()) } else { None }),
        _ => None,
    })
}

pub fn is_veth(l: &LinkMessage) -> bool {
    link_kind(l) == Some(InfoKind::Veth)
}

/// What ADD built, for the result.
#[derive(Clone, Debug)]
pub struct Wired {
    pub host_mac: String,
    pub pod_mac: String,
}

/// Creates the pair with the pod side already in the pod's namespace, addresses, routes and
/// neighbours on both sides. On error the caller removes the host side (and with it the
/// pair).
pub async fn add(host: &Handle, netns_path: &Path, host_if: &str, pod_if: &str, addrs: &[IpNet], mtu: u32) -> CniResult<Wired> {
    let ns = std::fs::File::open(netns_path).map_err(|e| CniError::new(Code::InvalidEnvironment, format!("CNI_NETNS {}: {e}", netns_path.display())))?;
    let pod = connect(Some(netns_path))?;
    if link_by_name(&pod, pod_if).await?.is_some() {
        return Err(CniError::new(Code::InvalidConfig, format!("{pod_if} already exists in {}", netns_path.display())));
    }
    let peer = LinkMessageBuilder::<LinkUnspec>::new().name(pod_if.to_owned()).mtu(mtu).setns_by_fd(ns.as_raw_fd()).build();
    let msg = LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(InfoKind::Veth)
        .name(host_if.to_owned())
        .mtu(mtu)
        .address(HOST_MAC.to_vec())
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    host.link().add(msg).execute().await.map_err(nl(&format!("creating veth {host_if} (peer {pod_if} in the pod)")))?;
    let host_link = link_by_name(host, host_if).await?.ok_or_else(|| CniError::new(Code::Internal, format!("{host_if} vanished after creation")))?;
    let host_index = host_link.header.index;
    let v6 = addrs.iter().any(|a| a.addr().is_ipv6());
    // Host side: answers ARP for the gateway (proxy ARP), no DAD for its link-local
    // address (the pod would wait a second for its gateway), then up.
    if addrs.iter().any(|a| a.addr().is_ipv4()) {
        netns::if_sysctl("ipv4", host_if, "proxy_arp", "1").map_err(|e| CniError::new(Code::Internal, format!("proxy_arp on {host_if}: {e}")))?;
    }
    if v6 {
        netns::if_sysctl("ipv6", host_if, "accept_dad", "0").map_err(|e| CniError::new(Code::Internal, format!("accept_dad on {host_if}: {e}")))?;
    }
    host.link().set(LinkUnspec::new_with_index(host_index).up().build()).execute().await.map_err(nl(&format!("setting {host_if} up")))?;
    if v6 {
        add_address(host, host_index, IpNet::new(GATEWAY_V6.into(), 64).expect("valid prefix"), true).await.map_err(|e| e.context(host_if))?;
    }

    // Pod side.
    let pod_if_owned = pod_if.to_owned();
    netns::run_in(netns_path, move || {
        if v6 {
            // The pod's own addresses are added without DAD below; its link-local too.
            let _ = netns::if_sysctl("ipv6", &pod_if_owned, "accept_dad", "0");
        }
        Ok(())
    })?;
    let pod_link = link_by_name(&pod, pod_if).await?.ok_or_else(|| CniError::new(Code::Internal, format!("{pod_if} did not appear in the pod")))?;
    let pod_index = pod_link.header.index;
    for a in addrs {
        add_address(&pod, pod_index, *a, false).await.map_err(|e| e.context(pod_if))?;
    }
    pod.link().set(LinkUnspec::new_with_index(pod_index).up().build()).execute().await.map_err(nl(&format!("setting {pod_if} up")))?;
    for a in addrs {
        let gw = gateway(a.addr());
        pod.neighbours()
            .add(pod_index, gw)
            .link_layer_address(&HOST_MAC)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(nl(&format!("neighbour {gw} on {pod_if}")))?;
        if gw.is_ipv4() {
            let r = RouteMessageBuilder::<IpAddr>::new()
                .destination_prefix(gw, 32)
                .map_err(|e| CniError::new(Code::Internal, e.to_string()))?
                .output_interface(pod_index)
                .scope(RouteScope::Link)
                .build();
            add_route(&pod, r, &format!("{gw} dev {pod_if}")).await?;
        }
        let default: IpAddr = if a.addr().is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
        let r = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(default, 0)
            .and_then(|b| b.gateway(gw))
            .map_err(|e| CniError::new(Code::Internal, e.to_string()))?
            .output_interface(pod_index)
            .build();
        add_route(&pod, r, &format!("default via {gw} dev {pod_if}")).await?;
        // Host: the pod's address is on the host side.
        let r = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(a.addr(), if a.addr().is_ipv4() { 32 } else { 128 })
            .map_err(|e| CniError::new(Code::Internal, e.to_string()))?
            .output_interface(host_index)
            .scope(if a.addr().is_ipv4() { RouteScope::Link } else { RouteScope::Universe })
            .build();
        add_route(host, r, &format!("{} dev {host_if}", a.addr())).await?;
    }
    Ok(Wired { host_mac: link_mac(&host_link), pod_mac: link_mac(&pod_link) })
}

async fn add_address(h: &Handle, index: u32, a: IpNet, replace: bool) -> CniResult<()> {
    let mut req = h.address().add(index, a.addr(), a.prefix_len());
    if a.addr().is_ipv6() {
        req.message_mut().attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    let req = if replace { req.replace() } else { req };
    req.execute().await.map_err(nl(&format!("address {a}")))
}

async fn add_route(h: &Handle, r: RouteMessage, what: &str) -> CniResult<()> {
    h.route().add(r).replace().execute().await.map_err(nl(&format!("route {what}")))
}

/// Removes the pair by its host side; `Ok(false)` when there was none.
pub async fn del_host(h: &Handle, host_if: &str) -> CniResult<bool> {
    let Some(l) = link_by_name(h, host_if).await? else { return Ok(false) };
    match h.link().del(l.header.index).execute().await {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
        Err(e) => Err(nl(&format!("deleting {host_if}"))(e)),
    }
}

/// Removes a veth named `pod_if` left in the pod's namespace (its host side already gone).
pub async fn del_pod_side(netns_path: &Path, pod_if: &str) -> CniResult<()> {
    if !netns_path.exists() {
        return Ok(());
    }
    let pod = match connect(Some(netns_path)) {
        Ok(p) => p,
        // Not a namespace (any more): nothing of ours can be in it.
        Err(e) if e.code == Code::InvalidEnvironment as u32 => return Ok(()),
        Err(e) => return Err(e),
    };
    if let Some(l) = link_by_name(&pod, pod_if).await?.filter(is_veth) {
        match pod.link().del(l.header.index).execute().await {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(libc::ENODEV) => {}
            Err(e) => return Err(nl(&format!("deleting {pod_if} in the pod"))(e)),
        }
    }
    Ok(())
}

/// The names of every host side of this plugin on the node.
pub async fn host_sides(h: &Handle) -> CniResult<Vec<String>> {
    let links: Vec<LinkMessage> = h.link().get().execute().try_collect().await.map_err(nl("listing links"))?;
    Ok(links
        .iter()
        .filter(|l| is_veth(l))
        .filter_map(|l| l.attributes.iter().find_map(|a| if let LinkAttribute::IfName(n) = a { Some(n.clone()) } else { None }))
        .filter(|n| is_host_ifname(n))
        .collect())
}

/// What CHECK compares: the pod side's addresses and whether each family has its default
/// route through the gateway.
pub async fn pod_state(netns_path: &Path, pod_if: &str) -> CniResult<Option<(Vec<IpNet>, Vec<IpAddr>)>> {
    let pod = connect(Some(netns_path))?;
    let Some(l) = link_by_name(&pod, pod_if).await? else { return Ok(None) };
    let index = l.header.index;
    let msgs: Vec<_> = pod.address().get().set_link_index_filter(index).execute().try_collect().await.map_err(nl("listing addresses"))?;
    let addrs = msgs
        .iter()
        .filter_map(|m| {
            m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => IpNet::new(*ip, m.header.prefix_len).ok(),
                _ => None,
            })
        })
        .collect();
    let mut gateways = Vec::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut q = RouteMessage::default();
        q.header.address_family = family;
        let routes: Vec<RouteMessage> = pod.route().get(q).execute().try_collect().await.map_err(nl("listing routes"))?;
        for r in routes.iter().filter(|r| r.header.destination_prefix_length == 0) {
            let oif = r.attributes.iter().any(|a| matches!(a, RouteAttribute::Oif(i) if *i == index));
            let gw = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Gateway(RouteAddress::Inet(g)) => Some(IpAddr::V4(*g)),
                RouteAttribute::Gateway(RouteAddress::Inet6(g)) => Some(IpAddr::V6(*g)),
                _ => None,
            });
            if let (true, Some(gw)) = (oif, gw) {
                gateways.push(gw);
            }
        }
    }
    Ok(Some((addrs, gateways)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_stable_short_and_recognised() {
        let n = host_ifname("0123456789abcdef", "eth0");
        assert_eq!(n.len(), 14);
        assert!(is_host_ifname(&n));
        assert_eq!(n, host_ifname("0123456789abcdef", "eth0"));
        assert_ne!(n, host_ifname("0123456789abcdef", "net1"));
        // Pinned: a later version must compute the same name for DEL.
        assert_eq!(host_ifname("abc", "eth0"), format!("gn{}", &sha_hex("abc/eth0")[..12]));
        for other in ["gn", "gn0123456789a", "gn0123456789abc", "gnABCDEF012345", "eth0", "xx0123456789ab"] {
            assert!(!is_host_ifname(other), "{other}");
        }
    }

    fn sha_hex(s: &str) -> String {
        Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn the_v6_gateway_is_the_eui64_address_of_the_host_mac() {
        let eui = [HOST_MAC[0] ^ 0x02, HOST_MAC[1], HOST_MAC[2], 0xff, 0xfe, HOST_MAC[3], HOST_MAC[4], HOST_MAC[5]];
        let seg = |i: usize| u16::from_be_bytes([eui[i], eui[i + 1]]);
        assert_eq!(GATEWAY_V6, Ipv6Addr::new(0xfe80, 0, 0, 0, seg(0), seg(2), seg(4), seg(6)));
        assert_eq!(format_mac(&HOST_MAC), "ee:ee:ee:ee:ee:ee");
    }
}
