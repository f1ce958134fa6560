//! Links from the kernel: an rtnetlink dump at start, then `RTNLGRP_LINK` notifications.
//!
//! Netlink sockets belong to the network namespace of the thread that creates them, so
//! [`watch`] and [`dump`] observe the netns of the calling thread (the agent runs in the
//! host netns; the privileged test runs them in a thread that entered a test netns).
//!
//! The watcher keeps its own table of links and turns the kernel's `RTM_NEWLINK` /
//! `RTM_DELLINK` stream into [`LinkEvent`]s: the kernel sends `RTM_NEWLINK` for every flag,
//! counter-ish or state change, and we only report the ones that change a [`LinkInfo`].
//! The table also resolves a master's index to its name, and re-reports ports when their
//! master is renamed. When the socket overflows (the kernel drops notifications and says
//! `ENOBUFS`), the table is rebuilt from a fresh dump and the difference reported.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use futures::stream::{StreamExt, TryStreamExt};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo as NlLinkInfo, LinkMessage, State};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::{Handle, MulticastGroup};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::select::LinkInfo;

/// Where the VF/driver probe reads, by default.
pub const DEFAULT_SYSFS_NET: &str = "/sys/class/net";

/// How often a failed dump is retried before giving up (a dump can be interrupted by
/// concurrent link changes).
const DUMP_ATTEMPTS: usize = 3;

/// A change to the set of links. A rename is a `Changed` with the new name (the index
/// stays); so is a new master, an up/down transition and a driver (un)bind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    Added(LinkInfo),
    Removed { index: u32, name: String },
    Changed(LinkInfo),
}

impl LinkEvent {
    pub fn index(&self) -> u32 {
        match self {
            Self::Added(l) | Self::Changed(l) => l.index,
            Self::Removed { index, .. } => *index,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Self::Added(l) | Self::Changed(l) => &l.name,
            Self::Removed { name, .. } => name,
        }
    }
}

#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// `/sys/class/net` of the *same* network namespace, for the VF and driver probe;
    /// `None` disables it (`is_vf` false, `driver` none). sysfs shows the netns of whoever
    /// mounted it, so a process that switched netns must mount its own or pass `None`.
    pub sysfs: Option<PathBuf>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self { sysfs: Some(PathBuf::from(DEFAULT_SYSFS_NET)) }
    }
}

/// What one `RTM_NEWLINK` says about a link, before the master's name is resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RawLink {
    index: u32,
    name: String,
    kind: Option<String>,
    master: Option<u32>,
    is_loopback: bool,
    oper_up: bool,
}

impl RawLink {
    /// `None` for messages that do not describe a whole link: bridge-port notifications
    /// (`AF_BRIDGE`, sent to the same group but carrying only port attributes) and
    /// nameless ones.
    fn parse(msg: &LinkMessage) -> Option<Self> {
        if msg.header.interface_family != AddressFamily::Unspec {
            return None;
        }
        let flags = msg.header.flags;
        let mut name = None;
        let mut kind = None;
        let mut master = None;
        let mut oper = State::Unknown;
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::Controller(m) if *m != 0 => master = Some(*m),
                LinkAttribute::OperState(s) => oper = *s,
                LinkAttribute::LinkInfo(infos) => {
                    kind = infos.iter().find_map(|i| match i {
                        NlLinkInfo::Kind(k) => Some(kind_name(k)),
                        _ => None,
                    })
                }
                _ => {}
            }
        }
        // Drivers without carrier reporting (and loopback) stay UNKNOWN; for them the
        // flags are all there is.
        let oper_up = match oper {
            State::Up => true,
            State::Unknown => flags.contains(LinkFlags::Up | LinkFlags::LowerUp),
            _ => false,
        };
        Some(Self { index: msg.header.index, name: name?, kind, master, is_loopback: flags.contains(LinkFlags::Loopback), oper_up })
    }
}

fn kind_name(kind: &InfoKind) -> String {
    // `Other(..)` displays as its raw string, the known kinds as the kernel's names.
    kind.to_string()
}

/// Reads `is_vf` and the driver of `name` from sysfs. Missing entries (virtual devices,
/// a device gone meanwhile) are simply "not a VF, no driver".
fn probe(sysfs: &Path, name: &str) -> (bool, Option<String>) {
    // Interface names cannot contain '/', but never build a path from one that could.
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return (false, None);
    }
    let device = sysfs.join(name).join("device");
    let is_vf = device.join("physfn").exists();
    let driver = fs::read_link(device.join("driver")).ok().and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
    (is_vf, driver)
}

/// The watcher's view of the links, by index.
struct Table {
    links: BTreeMap<u32, LinkInfo>,
    sysfs: Option<PathBuf>,
}

impl Table {
    fn new(sysfs: Option<PathBuf>) -> Self {
        Self { links: BTreeMap::new(), sysfs }
    }

    fn info(&self, raw: &RawLink, names: &BTreeMap<u32, String>) -> LinkInfo {
        let (is_vf, driver) = match &self.sysfs {
            Some(root) => probe(root, &raw.name),
            None => (false, None),
        };
        LinkInfo {
            index: raw.index,
            name: raw.name.clone(),
            kind: raw.kind.clone(),
            master: raw.master.map(|m| {
                // A master always exists before its ports; the fallback only covers a
                // notification racing with the master's own.
                let name = names.get(&m).cloned().unwrap_or_else(|| format!("ifindex {m}"));
                (m, name)
            }),
            is_loopback: raw.is_loopback,
            oper_up: raw.oper_up,
            is_vf,
            driver,
        }
    }

    fn names(&self) -> BTreeMap<u32, String> {
        self.links.iter().map(|(i, l)| (*i, l.name.clone())).collect()
    }

    /// Replaces the table with a dump and returns what changed against the old table
    /// (everything is `Added` on the first call).
    fn resync(&mut self, raws: Vec<RawLink>) -> Vec<LinkEvent> {
        let names: BTreeMap<u32, String> = raws.iter().map(|r| (r.index, r.name.clone())).collect();
        let fresh: BTreeMap<u32, LinkInfo> = raws.iter().map(|r| (r.index, self.info(r, &names))).collect();
        let mut events = Vec::new();
        for (index, old) in &self.links {
            if !fresh.contains_key(index) {
                events.push(LinkEvent::Removed { index: *index, name: old.name.clone() });
            }
        }
        for (index, new) in &fresh {
            match self.links.get(index) {
                None => events.push(LinkEvent::Added(new.clone())),
                Some(old) if old != new => events.push(LinkEvent::Changed(new.clone())),
                Some(_) => {}
            }
        }
        self.links = fresh;
        events
    }

    /// Applies one `RTM_NEWLINK`.
    fn upsert(&mut self, raw: RawLink) -> Vec<LinkEvent> {
        let mut names = self.names();
        names.insert(raw.index, raw.name.clone());
        let new = self.info(&raw, &names);
        let mut events = Vec::new();
        match self.links.insert(raw.index, new.clone()) {
            None => events.push(LinkEvent::Added(new)),
            Some(old) if old == new => {}
            Some(old) => {
                let renamed = old.name != new.name;
                events.push(LinkEvent::Changed(new.clone()));
                if renamed {
                    // Ports carry their master's name (it is in their decision reason).
                    for port in self.links.values_mut() {
                        if let Some((m, mname)) = &mut port.master {
                            if *m == new.index && *mname != new.name {
                                *mname = new.name.clone();
                                events.push(LinkEvent::Changed(port.clone()));
                            }
                        }
                    }
                }
            }
        }
        events
    }

    /// Applies one `RTM_DELLINK`.
    fn remove(&mut self, index: u32) -> Vec<LinkEvent> {
        match self.links.remove(&index) {
            Some(old) => vec![LinkEvent::Removed { index, name: old.name }],
            None => Vec::new(),
        }
    }

    fn snapshot(&self) -> Vec<LinkInfo> {
        self.links.values().cloned().collect()
    }
}

async fn dump_raw(handle: &Handle) -> Result<Vec<RawLink>> {
    let mut last = None;
    for _ in 0..DUMP_ATTEMPTS {
        let res: Result<Vec<LinkMessage>, rtnetlink::Error> = handle.link().get().execute().try_collect().await;
        match res {
            Ok(msgs) => return Ok(msgs.iter().filter_map(RawLink::parse).collect()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(|| anyhow::anyhow!("no attempt"), anyhow::Error::from)).context("dumping links (RTM_GETLINK)")
}

/// One-shot list of the links in the calling thread's netns (for `gardenet-agent links`).
/// Needs a tokio runtime.
pub async fn dump(opts: &WatchOptions) -> Result<Vec<LinkInfo>> {
    let (conn, handle, _) = rtnetlink::new_connection().context("opening rtnetlink socket")?;
    let conn = tokio::spawn(conn);
    let raws = dump_raw(&handle).await;
    conn.abort();
    let mut table = Table::new(opts.sysfs.clone());
    table.resync(raws?);
    Ok(table.snapshot())
}

/// Live link events; dropping it stops the watch.
pub struct LinkWatcher {
    events: mpsc::UnboundedReceiver<LinkEvent>,
    /// Turns notifications into events.
    follow: JoinHandle<()>,
    /// Drives the netlink socket.
    conn: JoinHandle<()>,
}

impl LinkWatcher {
    /// The next event; `None` when the netlink socket failed (the caller should treat that
    /// as fatal or start a new [`watch`], which reports the current state afresh).
    pub async fn recv(&mut self) -> Option<LinkEvent> {
        self.events.recv().await
    }

    /// An event if one is queued, without waiting (to batch events before acting).
    pub fn try_recv(&mut self) -> Option<LinkEvent> {
        self.events.try_recv().ok()
    }
}

impl Drop for LinkWatcher {
    fn drop(&mut self) {
        // The follower first: once the connection task is gone its stream ends, and a
        // follower still running would take that for a failed socket and log an error.
        self.follow.abort();
        self.conn.abort();
    }
}

/// Subscribes to link notifications, then dumps the links: returns the current links and
/// a watcher for what happens afterwards. Subscribing first means nothing falls between the
/// dump and the first event (notifications that overlap the dump are de-duplicated against
/// the table). Needs a tokio runtime; the socket lives in the calling thread's netns.
pub async fn watch(opts: WatchOptions) -> Result<(Vec<LinkInfo>, LinkWatcher)> {
    let (conn, handle, mut messages) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Link]).context("opening rtnetlink socket bound to RTNLGRP_LINK")?;
    let conn = tokio::spawn(conn);
    let raws = match dump_raw(&handle).await {
        Ok(r) => r,
        Err(e) => {
            conn.abort();
            return Err(e);
        }
    };
    let mut table = Table::new(opts.sysfs);
    table.resync(raws);
    let initial = table.snapshot();

    let (tx, rx) = mpsc::unbounded_channel();
    let follow = tokio::spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let events = apply(&mut table, &handle, msg).await;
            for ev in events {
                if tx.send(ev).is_err() {
                    return; // the LinkWatcher is gone
                }
            }
        }
        tracing::error!("rtnetlink link notifications stopped (socket closed)");
    });
    Ok((initial, LinkWatcher { events: rx, follow, conn }))
}

async fn apply(table: &mut Table, handle: &Handle, msg: NetlinkMessage<RouteNetlinkMessage>) -> Vec<LinkEvent> {
    match msg.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => RawLink::parse(&m).map_or_else(Vec::new, |raw| table.upsert(raw)),
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
            // AF_BRIDGE DELLINKs announce a port leaving a bridge, not a device going away.
            if m.header.interface_family == AddressFamily::Unspec {
                table.remove(m.header.index)
            } else {
                Vec::new()
            }
        }
        NetlinkPayload::Overrun(_) => {
            tracing::warn!("rtnetlink notifications overflowed; re-reading all links");
            match dump_raw(handle).await {
                Ok(raws) => table.resync(raws),
                Err(e) => {
                    // Keep going: the next overflow or event gets another chance, and the
                    // manager's periodic tick retries attaches meanwhile.
                    tracing::error!("re-reading links after overflow failed: {e:#}");
                    Vec::new()
                }
            }
        }
        _ => Vec::new(),
    }
}

/// XDP attachment mode per interface index (`native`, `generic`, `offload`, `multiple`), from
/// the kernel's IFLA_XDP attribute: what is attached, whoever attached it.
pub async fn xdp_modes() -> Result<std::collections::HashMap<u32, &'static str>> {
    use netlink_packet_route::link::{LinkXdp, XdpAttached};
    let (conn, handle, _) = rtnetlink::new_connection().context("opening rtnetlink socket")?;
    let conn = tokio::spawn(conn);
    let res: Result<Vec<LinkMessage>, rtnetlink::Error> = handle.link().get().execute().try_collect().await;
    conn.abort();
    let mut out = std::collections::HashMap::new();
    for m in res.context("dumping links (RTM_GETLINK)")? {
        for a in &m.attributes {
            if let LinkAttribute::Xdp(x) = a {
                for e in x {
                    let mode = match e {
                        LinkXdp::Attached(XdpAttached::Driver) => "native",
                        LinkXdp::Attached(XdpAttached::SocketBuffer) => "generic",
                        LinkXdp::Attached(XdpAttached::Hardware) => "offload",
                        LinkXdp::Attached(XdpAttached::Multiple) => "multiple",
                        _ => continue,
                    };
                    out.insert(m.header.index, mode);
                }
            }
        }
    }
    Ok(out)
}

/// The cls_bpf filters on an interface's clsact qdisc (kernels without tcx): gardenet's own
/// (`tc/ingress`, `tc/egress`, at `CLSACT_PRIORITY`/`CLSACT_HANDLE`) and other tools'
/// (`tc/ingress(foreign:u32 pref 49152)`).
pub async fn clsact_filters(ifindex: u32) -> Result<Vec<String>> {
    use crate::dataplane::{CLSACT_HANDLE, CLSACT_PRIORITY};
    use netlink_packet_route::tc::TcAttribute;
    let (conn, handle, _) = rtnetlink::new_connection().context("opening rtnetlink socket")?;
    let conn = tokio::spawn(conn);
    let mut out = Vec::new();
    for (hook, egress) in [("tc/ingress", false), ("tc/egress", true)] {
        let req = handle.traffic_filter(ifindex as i32).get();
        let req = if egress { req.egress() } else { req.ingress() };
        let msgs: Vec<_> = req.execute().try_collect().await.unwrap_or_default();
        for m in msgs {
            let h = u32::from(m.header.handle.major) << 16 | u32::from(m.header.handle.minor);
            if h == 0 {
                continue; // the priority's head, not a filter
            }
            let prio = (m.header.info >> 16) as u16;
            if prio == CLSACT_PRIORITY && h == CLSACT_HANDLE {
                out.push(hook.to_string());
            } else {
                let kind = m.attributes.iter().find_map(|a| if let TcAttribute::Kind(k) = a { Some(k.clone()) } else { None }).unwrap_or_default();
                // One entry per filter (u32 dumps its hash table and keys as several).
                let f = format!("{hook}(foreign:{kind} pref {prio})");
                if !out.contains(&f) {
                    out.push(f);
                }
            }
        }
    }
    conn.abort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(index: u32, name: &str) -> RawLink {
        RawLink { index, name: name.into(), kind: None, master: None, is_loopback: false, oper_up: true }
    }

    fn table(raws: Vec<RawLink>) -> Table {
        let mut t = Table::new(None);
        t.resync(raws);
        t
    }

    #[test]
    fn parse_reads_name_kind_master_and_state() {
        let mut m = LinkMessage::default();
        m.header.index = 7;
        m.header.flags = LinkFlags::Up | LinkFlags::LowerUp;
        m.attributes = vec![
            LinkAttribute::IfName("enP1s2".into()),
            LinkAttribute::Controller(3),
            LinkAttribute::OperState(State::Up),
            LinkAttribute::LinkInfo(vec![NlLinkInfo::Kind(InfoKind::Veth)]),
        ];
        let r = RawLink::parse(&m).unwrap();
        assert_eq!(r, RawLink { index: 7, name: "enP1s2".into(), kind: Some("veth".into()), master: Some(3), is_loopback: false, oper_up: true });
        // Loopback reports UNKNOWN; the flags decide.
        let mut lo = LinkMessage::default();
        lo.header.index = 1;
        lo.header.flags = LinkFlags::Up | LinkFlags::LowerUp | LinkFlags::Loopback;
        lo.attributes = vec![LinkAttribute::IfName("lo".into())];
        let r = RawLink::parse(&lo).unwrap();
        assert!(r.is_loopback && r.oper_up && r.kind.is_none());
        // Down and lower-layer-down are not up.
        m.attributes[2] = LinkAttribute::OperState(State::LowerLayerDown);
        assert!(!RawLink::parse(&m).unwrap().oper_up);
    }

    #[test]
    fn parse_ignores_bridge_port_messages_and_nameless_links() {
        let mut m = LinkMessage::default();
        m.header.index = 7;
        m.attributes = vec![LinkAttribute::IfName("eth1".into())];
        m.header.interface_family = AddressFamily::Bridge;
        assert!(RawLink::parse(&m).is_none());
        m.header.interface_family = AddressFamily::Unspec;
        m.attributes.clear();
        assert!(RawLink::parse(&m).is_none());
    }

    #[test]
    fn masters_are_resolved_in_any_dump_order() {
        // The bridge has a higher index than its port: resolution must see the whole dump.
        let t = table(vec![RawLink { master: Some(9), ..raw(4, "enP1s2") }, raw(9, "br-acc")]);
        assert_eq!(t.links[&4].master, Some((9, "br-acc".into())));
    }

    #[test]
    fn upsert_reports_only_real_changes() {
        let mut t = table(vec![raw(2, "eth1")]);
        assert!(t.upsert(raw(2, "eth1")).is_empty(), "same state: no event");
        assert_eq!(t.upsert(raw(3, "ens5")), vec![LinkEvent::Added(LinkInfo::named(3, "ens5"))]);
        let down = RawLink { oper_up: false, ..raw(2, "eth1") };
        let ev = t.upsert(down);
        assert!(matches!(&ev[..], [LinkEvent::Changed(l)] if !l.oper_up));
        let ev = t.upsert(raw(2, "eth9"));
        assert!(matches!(&ev[..], [LinkEvent::Changed(l)] if l.name == "eth9" && l.index == 2));
    }

    #[test]
    fn renaming_a_master_re_reports_its_ports() {
        let mut t = table(vec![raw(5, "br0"), RawLink { master: Some(5), ..raw(6, "eth2") }]);
        let ev = t.upsert(raw(5, "br1"));
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(matches!(&ev[1], LinkEvent::Changed(l) if l.master == Some((5, "br1".into()))));
    }

    #[test]
    fn remove_forgets_and_ignores_unknown() {
        let mut t = table(vec![raw(2, "eth1")]);
        assert_eq!(t.remove(2), vec![LinkEvent::Removed { index: 2, name: "eth1".into() }]);
        assert!(t.remove(2).is_empty());
    }

    #[test]
    fn resync_reports_the_difference() {
        let mut t = table(vec![raw(2, "eth1"), raw(3, "ens5")]);
        let ev = t.resync(vec![raw(2, "eth1"), raw(3, "ens6"), raw(4, "eth4")]);
        assert_eq!(ev, vec![LinkEvent::Changed(LinkInfo::named(3, "ens6")), LinkEvent::Added(LinkInfo::named(4, "eth4")),]);
        let ev = t.resync(vec![raw(4, "eth4")]);
        assert_eq!(ev.len(), 2);
        assert!(ev.iter().all(|e| matches!(e, LinkEvent::Removed { .. })));
    }

    #[test]
    fn probe_reads_vf_and_driver_from_sysfs_layout() {
        let root = std::env::temp_dir().join(format!("gardenet-links-probe-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dev = root.join("enP1s2").join("device");
        fs::create_dir_all(dev.join("physfn")).unwrap();
        std::os::unix::fs::symlink("../../bus/pci/drivers/mlx5_core", dev.join("driver")).unwrap();
        fs::create_dir_all(root.join("veth0")).unwrap();
        assert_eq!(probe(&root, "enP1s2"), (true, Some("mlx5_core".into())));
        assert_eq!(probe(&root, "veth0"), (false, None));
        assert_eq!(probe(&root, "missing"), (false, None));
        assert_eq!(probe(&root, ".."), (false, None));
        let _ = fs::remove_dir_all(&root);
    }
}
