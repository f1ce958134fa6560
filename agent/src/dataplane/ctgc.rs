//! Removal of flows from the conntrack maps: closed TCP flows ([`scan`]) and flows to
//! backends that left their Service ([`purge_departed`]), both through one walk (`walk`).
//!
//! The TC programs mark a translated flow's forward and reply entries (source-NATed flows'
//! too) when a FIN or RST passes in their direction (`CT_FLAG_FIN`, `CT_FLAG_RST`, with the
//! time of the close in `last_seen_ns`), and a source-NAT port's reply entry as closing
//! (`CT_FLAG_SNAT` there). The agent's periodic conntrack scan ([`scan`]) removes flows
//! closed for longer than the hold time: a FIN both ways or a RST either way (as Cilium's
//! close timeout); a source-NATed flow goes with its closing port, or alone if the programs
//! gave its port to a new flow first. Half-closed and idle flows stay. Without this, closed
//! flows stayed until the LRU evicted them: the map filled with dead flows, its pressure
//! report became a false alarm, and the LRU evicted long-idle live flows before recently
//! closed ones.
//!
//! The decision ([`closed_flows`]) is pure; [`scan`] reads the maps, decides, and deletes a
//! flow only if its entries still hold the values it was judged by (a new SYN on the same
//! 4-tuple rewrites them). Between that re-read and the delete there is no compare-and-delete
//! for hash maps: a SYN on exactly that 4-tuple in those microseconds loses its entries and is
//! balanced afresh on its next packet.
use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    os::fd::{AsFd, OwnedFd},
    path::Path,
    time::Duration,
};

use anyhow::Result;
use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData},
    Pod,
};
use gardenet_common::*;

use crate::dataplane::{lbmap::Addr, mapfill::Fill, walk_hash_batched};

/// A conntrack value of either family.
pub(crate) trait CtValue: Pod {
    type Addr: Addr;
    /// Address, port and flags: the backend of a forward entry, the frontend of a reply one,
    /// the source-NAT address of a source-NAT forward one, the client of a source-NAT reply.
    fn parts(&self) -> (Self::Addr, u16, u16);
    fn last_seen_ns(&self) -> u64;
}

impl CtValue for CtValue4 {
    type Addr = u32;
    fn parts(&self) -> (u32, u16, u16) {
        (self.addr, self.port, self.flags)
    }
    fn last_seen_ns(&self) -> u64 {
        self.last_seen_ns
    }
}

impl CtValue for CtValue6 {
    type Addr = Ip6;
    fn parts(&self) -> (Ip6, u16, u16) {
        (self.addr, self.port, self.flags)
    }
    fn last_seen_ns(&self) -> u64 {
        self.last_seen_ns
    }
}

/// A conntrack entry's value, whichever family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ct<A> {
    pub addr: A,
    pub port: u16,
    pub flags: u16,
    pub last_seen_ns: u64,
}

impl<A> Ct<A> {
    fn closed(&self) -> bool {
        self.flags & (CT_FLAG_FIN | CT_FLAG_RST) != 0
    }
}

fn ct_of<V: CtValue>(v: &V) -> Ct<V::Addr> {
    let (addr, port, flags) = v.parts();
    Ct { addr, port, flags, last_seen_ns: v.last_seen_ns() }
}

fn key<A>(saddr: A, daddr: A, sport: u16, dport: u16, proto: u8, dir: u8) -> CtKey<A> {
    CtKey { saddr, daddr, sport, dport, proto, dir, _pad: 0 }
}

// How the programs link a flow's entries, each key named by an entry and the value it holds:
// the forward entry (client -> frontend) names the backend, the reply entry (backend ->
// client) the frontend; a source-NATed flow's forward source-NAT entry (client -> backend)
// names the node's address and port, whose port entry (backend -> node:port) names the client.

/// The reply key of the flow whose forward entry this is.
fn reply_key<A: Copy>(fkey: &CtKey<A>, f: &Ct<A>) -> CtKey<A> {
    key(f.addr, fkey.saddr, f.port, fkey.sport, fkey.proto, CT_DIR_REPLY)
}

/// The forward key of the flow whose reply entry this is.
fn forward_key<A: Copy>(rkey: &CtKey<A>, r: &Ct<A>) -> CtKey<A> {
    key(rkey.daddr, r.addr, rkey.dport, r.port, rkey.proto, CT_DIR_FORWARD)
}

/// The forward source-NAT key of the flow with this reply key (client -> backend).
fn snat_fwd_key<A: Copy>(rkey: &CtKey<A>) -> CtKey<A> {
    key(rkey.daddr, rkey.saddr, rkey.dport, rkey.sport, rkey.proto, CT_DIR_SNAT_FWD)
}

/// The port key a forward source-NAT entry names (backend -> node:port).
fn port_key<A: Copy>(skey: &CtKey<A>, s: &Ct<A>) -> CtKey<A> {
    key(skey.daddr, s.addr, skey.dport, s.port, skey.proto, CT_DIR_SNAT_REPLY)
}

/// The reply key of the flow a port entry names (backend -> client).
fn port_flow_reply_key<A: Copy>(pkey: &CtKey<A>, p: &Ct<A>) -> CtKey<A> {
    key(pkey.saddr, p.addr, pkey.sport, p.port, pkey.proto, CT_DIR_REPLY)
}

/// Conntrack entries with their values.
pub type Entries<A> = Vec<(CtKey<A>, Ct<A>)>;

/// The entries of one flow that may be removed, with the values they were judged by.
pub type Flow<A> = Entries<A>;

/// Whether an entry may take part in the scan's decision at `now_ns`: a forward or reply
/// entry with a FIN or RST (source-NATed flows' too), a closing source-NAT port, or a
/// source-NAT port unused for `hold` (its flow may have taken another port). Only these are
/// kept from the walk.
pub fn marked<A>(k: &CtKey<A>, v: &Ct<A>, now_ns: u64, hold: Duration) -> bool {
    match k.dir {
        CT_DIR_FORWARD | CT_DIR_REPLY => v.closed(),
        CT_DIR_SNAT_REPLY => v.flags & CT_FLAG_SNAT != 0 || now_ns.saturating_sub(v.last_seen_ns) >= hold.as_nanos() as u64,
        _ => false,
    }
}

/// The flows among the `marked` entries that are closed and have been for at least `hold`
/// at `now_ns` (`bpf_ktime_get_ns`'s clock); `lookup` reads entries that were not marked.
pub fn closed_flows<A: Copy + Eq + std::hash::Hash>(
    marked: &[(CtKey<A>, Ct<A>)],
    lookup: impl Fn(&CtKey<A>) -> Option<Ct<A>>,
    now_ns: u64,
    hold: Duration,
) -> Vec<Flow<A>> {
    let hold_ns = hold.as_nanos() as u64;
    let known: HashMap<CtKey<A>, Ct<A>> = marked.iter().copied().collect();
    let get = |k: &CtKey<A>| known.get(k).copied().or_else(|| lookup(k));
    let old = |t: u64| now_ns.saturating_sub(t) >= hold_ns;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for &(k, v) in marked {
        match k.dir {
            CT_DIR_FORWARD | CT_DIR_REPLY => {
                // The pair, named by its forward key: a forward entry points at the backend
                // (whose reply entry points back at the frontend), a reply entry the other way.
                let (fkey, rkey) = if k.dir == CT_DIR_FORWARD { (k, reply_key(&k, &v)) } else { (forward_key(&k, &v), k) };
                if !seen.insert(fkey) {
                    continue;
                }
                let fwd = get(&fkey);
                if let Some(f) = fwd.filter(|f| f.flags & CT_FLAG_SNAT != 0) {
                    // A source-NATed flow: its port's entry decides (below), unless the
                    // programs gave the port to another flow before the scan came by.
                    out.extend(orphaned_snat_flow((fkey, f), rkey, &get, &old));
                    continue;
                }
                // A partner that points elsewhere belongs to another flow.
                let fwd = fwd.filter(|f| reply_key(&fkey, f) == rkey);
                let rep = get(&rkey).filter(|r| forward_key(&rkey, r) == fkey);
                let rst = fwd.is_some_and(|f| f.flags & CT_FLAG_RST != 0) || rep.is_some_and(|r| r.flags & CT_FLAG_RST != 0);
                // Each direction's FIN; a direction whose entry is gone cannot carry the flow.
                let fin = |e: Option<Ct<A>>| e.is_none_or(|e| e.flags & CT_FLAG_FIN != 0);
                let closed_at = fwd.iter().chain(rep.iter()).map(|e| e.last_seen_ns).max().unwrap_or(0);
                if (rst || (fin(fwd) && fin(rep))) && old(closed_at) {
                    out.push(fwd.map(|f| (fkey, f)).into_iter().chain(rep.map(|r| (rkey, r))).collect());
                }
            }
            CT_DIR_SNAT_REPLY if v.flags & CT_FLAG_SNAT == 0 && old(v.last_seen_ns) => {
                // An open port unused for `hold` whose flow has another port now: a SYN sent
                // again is balanced afresh and takes a new port; the old one would stay
                // reserved for hours.
                let skey = snat_fwd_key(&port_flow_reply_key(&k, &v));
                if get(&skey).is_some_and(|s| port_key(&skey, &s) != k) {
                    out.push(vec![(k, v)]);
                }
            }
            CT_DIR_SNAT_REPLY if old(v.last_seen_ns) => {
                // A closing source-NAT port idle for `hold` (the programs would give it to a
                // new flow by now), and the flow it belongs to: reply, forward, forward source
                // NAT, each only if it still points along the chain.
                let mut flow = vec![(k, v)];
                let rkey = port_flow_reply_key(&k, &v);
                if let Some(r) = get(&rkey) {
                    let (fkey, skey) = (forward_key(&rkey, &r), snat_fwd_key(&rkey));
                    let s = get(&skey).filter(|s| port_key(&skey, s) == k);
                    let f = get(&fkey).filter(|f| f.flags & CT_FLAG_SNAT != 0 && reply_key(&fkey, f) == rkey);
                    if let (Some(s), Some(f)) = (s, f) {
                        flow.extend([(rkey, r), (fkey, f), (skey, s)]);
                    }
                }
                out.push(flow);
            }
            _ => {}
        }
    }
    out
}

/// A closed source-NATed flow whose port the programs gave to another flow (closing and idle
/// for 10 s, so free) before the scan removed it with the port's entry: nothing leads to its
/// forward, reply and forward source-NAT entries any more. They go once unused for the hold.
/// While the port is its own, the port's entry decides (the `CT_DIR_SNAT_REPLY` case).
fn orphaned_snat_flow<A: Copy + Eq>(
    (fkey, f): (CtKey<A>, Ct<A>),
    rkey: CtKey<A>,
    get: &impl Fn(&CtKey<A>) -> Option<Ct<A>>,
    old: &impl Fn(u64) -> bool,
) -> Option<Flow<A>> {
    let skey = snat_fwd_key(&rkey);
    let s = get(&skey);
    let port_ours = s.is_some_and(|s| {
        let pkey = port_key(&skey, &s);
        get(&pkey).is_some_and(|p| port_flow_reply_key(&pkey, &p) == rkey)
    });
    // A reply entry that points elsewhere belongs to another flow.
    let rep = get(&rkey).filter(|r| forward_key(&rkey, r) == fkey);
    let unused = old(f.last_seen_ns) && rep.is_none_or(|r| old(r.last_seen_ns));
    if port_ours || !unused || reply_key(&fkey, &f) != rkey {
        return None;
    }
    Some([(fkey, f)].into_iter().chain(rep.map(|r| (rkey, r))).chain(s.map(|s| (skey, s))).collect())
}

/// One walk of the conntrack maps: their fill, and the closed flows removed.
#[derive(Debug, Default)]
pub struct Scan {
    pub fills: Vec<Fill>,
    pub removed_flows: usize,
}

/// Counts each family's conntrack map and, with `hold`, removes the flows closed for longer.
/// Walks the maps: call it off the run loop.
pub fn scan(pin_dir: &Path, hold: Option<Duration>) -> Result<Scan> {
    let mut out = Scan::default();
    let now = monotonic_ns();
    let (fill, removed) = scan_family::<CtValue4>(&pin_dir.join(MAP_CT), "conntrack_ipv4", hold, now)?;
    out.fills.push(fill);
    out.removed_flows += removed;
    if pin_dir.join(MAP_CT6).exists() {
        let (fill, removed) = scan_family::<CtValue6>(&pin_dir.join(MAP_CT6), "conntrack_ipv6", hold, now)?;
        out.fills.push(fill);
        out.removed_flows += removed;
    }
    Ok(out)
}

fn scan_family<V: CtValue>(pin: &Path, name: &'static str, hold: Option<Duration>, now: u64) -> Result<(Fill, usize)>
where
    CtKey<V::Addr>: Pod + std::hash::Hash,
{
    let ct = open::<V>(pin)?;
    // Only the marked entries are kept.
    let (entries, found) = walk(&ct, |k, v| hold.is_some_and(|h| marked(k, v, now, h)));
    let CtMap { map: mut ct, capacity, .. } = ct;
    let Some(hold) = hold else {
        return Ok((Fill { map: name, entries, capacity }, 0));
    };
    let flows = closed_flows(&found, |k| ct.get(k, 0).ok().map(|v| ct_of(&v)), now, hold);
    let (mut removed, mut removed_entries) = (0, 0);
    for flow in flows {
        // Only as judged: a new flow on the same 4-tuple has rewritten its entries.
        if flow.iter().all(|(k, v)| ct.get(k, 0).ok().map(|x| ct_of(&x)) == Some(*v)) {
            removed_entries += flow.iter().filter(|(k, _)| ct.remove(k).is_ok()).count();
            removed += 1;
        }
    }
    Ok((Fill { map: name, entries: entries.saturating_sub(removed_entries), capacity }, removed))
}

/// One family's pinned conntrack map.
struct CtMap<V: CtValue> {
    map: BpfHashMap<MapData, CtKey<V::Addr>, V>,
    /// A second descriptor, for the batch lookups aya does not wrap.
    fd: OwnedFd,
    capacity: usize,
}

fn open<V: CtValue>(pin: &Path) -> Result<CtMap<V>>
where
    CtKey<V::Addr>: Pod,
{
    let data = MapData::from_pin(pin)?;
    let capacity = data.info()?.max_entries() as usize;
    let fd = data.fd().as_fd().try_clone_to_owned()?;
    Ok(CtMap { map: BpfHashMap::try_from(Map::LruHashMap(data))?, fd, capacity })
}

/// Walks a conntrack map: the number of entries, and those `keep` wants. Batched where the
/// kernel can (5.6+; only the kept entries are held, not the map's), aya's iterator (two
/// calls per entry) otherwise.
fn walk<V: CtValue>(ct: &CtMap<V>, keep: impl Fn(&CtKey<V::Addr>, &Ct<V::Addr>) -> bool) -> (usize, Entries<V::Addr>)
where
    CtKey<V::Addr>: Pod,
{
    let each = |found: &mut Entries<V::Addr>, k, v: &V| {
        let v = ct_of(v);
        if keep(&k, &v) {
            found.push((k, v));
        }
    };
    let mut found = Vec::new();
    let entries = match walk_hash_batched(ct.fd.as_fd(), |k, v: V| each(&mut found, k, &v)) {
        Ok(n) => n,
        Err(_) => {
            found.clear();
            ct.map.iter().filter_map(|r| r.ok()).map(|(k, v)| each(&mut found, k, &v)).count()
        }
    };
    (entries, found)
}

/// (frontend address, port, protocol, backend address, port): a frontend's flows to a
/// backend that left it.
pub type Departed = (IpAddr, u16, u8, IpAddr, u16);

/// Removes the flows from frontends to backends that left them (UDP: without this, a
/// client that keeps sending stays on the departed backend). Returns the flows removed.
/// Walks the maps: call it off the run loop.
pub fn purge_departed(pin_dir: &Path, stale: &[(crate::desired::Frontend, crate::desired::Backend)]) -> Result<usize> {
    let wanted: HashSet<Departed> =
        stale.iter().filter(|(f, b)| f.addr.is_ipv4() == b.addr.is_ipv4()).map(|(f, b)| (f.addr, f.port, f.proto.number(), b.addr, b.port)).collect();
    let mut purged = 0;
    if wanted.iter().any(|k| k.0.is_ipv4()) {
        purged += purge_family::<CtValue4>(&pin_dir.join(MAP_CT), &wanted)?;
    }
    if wanted.iter().any(|k| k.0.is_ipv6()) {
        purged += purge_family::<CtValue6>(&pin_dir.join(MAP_CT6), &wanted)?;
    }
    Ok(purged)
}

fn purge_family<V: CtValue>(pin: &Path, wanted: &HashSet<Departed>) -> Result<usize>
where
    CtKey<V::Addr>: Pod,
{
    let ct = open::<V>(pin)?;
    let (_, forward) = walk(&ct, |k, v| k.dir == CT_DIR_FORWARD && wanted.contains(&departed(k, v)));
    let CtMap { map: mut ct, .. } = ct;
    for k in flow_keys(&forward, |k| ct.get(k, 0).ok().map(|v| ct_of(&v))) {
        let _ = ct.remove(&k);
    }
    Ok(forward.len())
}

/// The (frontend, backend) pair of a forward entry, host byte order.
fn departed<A: Addr>(k: &CtKey<A>, v: &Ct<A>) -> Departed {
    (k.daddr.ip(), u16::from_be(k.dport), k.proto, v.addr.ip(), u16::from_be(v.port))
}

/// Every entry of the flows whose forward entries are given: forward and reply, and for a
/// source-NATed flow its forward and reply source-NAT entries (`lookup` reads the former).
pub fn flow_keys<A: Copy>(forward: &[(CtKey<A>, Ct<A>)], lookup: impl Fn(&CtKey<A>) -> Option<Ct<A>>) -> Vec<CtKey<A>> {
    let mut out = Vec::new();
    for &(k, v) in forward {
        let rkey = reply_key(&k, &v);
        out.extend([k, rkey]);
        if v.flags & CT_FLAG_SNAT != 0 {
            let skey = snat_fwd_key(&rkey);
            if let Some(s) = lookup(&skey) {
                out.push(port_key(&skey, &s));
            }
            out.push(skey);
        }
    }
    out
}

/// `bpf_ktime_get_ns()`'s clock (CLOCK_MONOTONIC) in nanoseconds.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_secs(10);
    const S: u64 = 1_000_000_000;
    // Client 10.0.0.1:40000 -> frontend 10.96.0.10:80 -> backend 10.1.0.5:8080.
    const CLIENT: u32 = 0x0a00_0001;
    const FE: u32 = 0x0a60_000a;
    const BE: u32 = 0x0a01_0005;
    const NODE: u32 = 0x0a00_00fe;

    fn fwd() -> CtKey<u32> {
        key(CLIENT, FE, 40000, 80, PROTO_TCP, CT_DIR_FORWARD)
    }
    fn rep() -> CtKey<u32> {
        key(BE, CLIENT, 8080, 40000, PROTO_TCP, CT_DIR_REPLY)
    }
    fn ct(addr: u32, port: u16, flags: u16, at: u64) -> Ct<u32> {
        Ct { addr, port, flags, last_seen_ns: at }
    }

    /// The decision over a whole map, as `scan` makes it: marked entries found by the walk,
    /// the others read on demand.
    fn judge(map: &[(CtKey<u32>, Ct<u32>)], now: u64) -> Vec<Vec<CtKey<u32>>> {
        let all: HashMap<_, _> = map.iter().copied().collect();
        let found: Vec<_> = map.iter().copied().filter(|(k, v)| marked(k, v, now, HOLD)).collect();
        closed_flows(&found, |k| all.get(k).copied(), now, HOLD).into_iter().map(|f| f.into_iter().map(|(k, _)| k).collect()).collect()
    }

    fn pair(fwd_flags: u16, fwd_at: u64, rep_flags: u16, rep_at: u64) -> Vec<(CtKey<u32>, Ct<u32>)> {
        vec![(fwd(), ct(BE, 8080, fwd_flags, fwd_at)), (rep(), ct(FE, 80, rep_flags, rep_at))]
    }

    #[test]
    fn the_key_helpers_follow_a_source_nated_flow_both_ways() {
        let (f, r) = (ct(BE, 8080, CT_FLAG_SNAT, 0), ct(FE, 80, 0, 0));
        let (s, port) = (ct(NODE, 61_500, 0, 0), ct(CLIENT, 40000, 0, 0));
        let skey = key(CLIENT, BE, 40000, 8080, PROTO_TCP, CT_DIR_SNAT_FWD);
        let pkey = key(BE, NODE, 8080, 61_500, PROTO_TCP, CT_DIR_SNAT_REPLY);
        assert_eq!(reply_key(&fwd(), &f), rep());
        assert_eq!(forward_key(&rep(), &r), fwd());
        assert_eq!(snat_fwd_key(&rep()), skey);
        assert_eq!(port_key(&skey, &s), pkey);
        assert_eq!(port_flow_reply_key(&pkey, &port), rep(), "and from the port back to the flow");
    }

    #[test]
    fn a_flow_closed_both_ways_goes_after_the_hold() {
        let map = pair(CT_FLAG_FIN, 100 * S, CT_FLAG_FIN, 101 * S);
        assert!(judge(&map, 110 * S).is_empty(), "the last FIN is 9 s old");
        assert_eq!(judge(&map, 111 * S), vec![vec![fwd(), rep()]], "one flow, both entries, found once");
    }

    #[test]
    fn half_closed_and_idle_flows_stay() {
        assert!(judge(&pair(CT_FLAG_FIN, 100 * S, 0, 1), 1_000 * S).is_empty(), "client closed, backend still sending");
        assert!(judge(&pair(0, 1, CT_FLAG_FIN, 100 * S), 1_000 * S).is_empty(), "backend closed, client still sending");
        assert!(judge(&pair(0, 1, 0, 1), 1_000 * S).is_empty(), "idle");
    }

    #[test]
    fn a_reset_either_way_closes() {
        assert_eq!(judge(&pair(0, 1, CT_FLAG_RST, 100 * S), 110 * S), vec![vec![fwd(), rep()]]);
        assert_eq!(judge(&pair(CT_FLAG_RST, 100 * S, 0, 1), 110 * S), vec![vec![fwd(), rep()]]);
        assert!(judge(&pair(CT_FLAG_RST, 100 * S, 0, 1), 109 * S).is_empty());
    }

    #[test]
    fn an_entry_whose_partner_is_gone_or_another_flows_goes_alone() {
        // The reply entry was evicted: the forward one cannot carry a flow any more.
        let map = vec![(fwd(), ct(BE, 8080, CT_FLAG_FIN, 100 * S))];
        assert_eq!(judge(&map, 110 * S), vec![vec![fwd()]]);
        // The reply key belongs to a flow through another frontend (the client reused its
        // port): that entry is not touched.
        let map = vec![(fwd(), ct(BE, 8080, CT_FLAG_FIN, 100 * S)), (rep(), ct(FE + 1, 80, 0, 105 * S))];
        assert_eq!(judge(&map, 110 * S), vec![vec![fwd()]]);
    }

    #[test]
    fn source_nat_flows_go_with_their_closing_port() {
        let (nat_port, proto) = (61_500u16, PROTO_TCP);
        let snat_reply = key(BE, NODE, 8080, nat_port, proto, CT_DIR_SNAT_REPLY);
        let snat_fwd = key(CLIENT, BE, 40000, 8080, proto, CT_DIR_SNAT_FWD);
        let map = |closing: u16, at: u64| {
            vec![
                (fwd(), ct(BE, 8080, CT_FLAG_SNAT, at)),
                (rep(), ct(FE, 80, 0, at)),
                (snat_fwd, ct(NODE, nat_port, 0, at)),
                (snat_reply, ct(CLIENT, 40000, closing, at)),
            ]
        };
        assert!(judge(&map(0, 100 * S), 1_000 * S).is_empty(), "an open source-NAT flow stays");
        assert!(judge(&map(CT_FLAG_SNAT, 100 * S), 109 * S).is_empty(), "closing, used 9 s ago");
        assert_eq!(judge(&map(CT_FLAG_SNAT, 100 * S), 110 * S), vec![vec![snat_reply, rep(), fwd(), snat_fwd]]);
        // The client's flow has moved on to another port (open): only the old port's entry
        // goes.
        let mut moved = map(CT_FLAG_SNAT, 100 * S);
        moved[2].1.port = nat_port + 1;
        moved.push((key(BE, NODE, 8080, nat_port + 1, proto, CT_DIR_SNAT_REPLY), ct(CLIENT, 40000, 0, 100 * S)));
        assert_eq!(judge(&moved, 110 * S), vec![vec![snat_reply]]);
    }

    #[test]
    fn departed_backends_flows_go_with_their_reply_and_source_nat_entries() {
        let ip = |s: &str| u32::of_ip(s.parse().unwrap());
        let (client, fe, be, node) = (ip("10.0.0.1"), ip("10.96.0.10"), ip("10.1.0.5"), ip("10.0.0.254"));
        let p = u16::to_be;
        let fwd = key(client, fe, p(40000), p(53), PROTO_UDP, CT_DIR_FORWARD);
        let rep = key(be, client, p(5353), p(40000), PROTO_UDP, CT_DIR_REPLY);
        let plain = ct(be, p(5353), 0, 0);
        assert_eq!(departed(&fwd, &plain), ("10.96.0.10".parse().unwrap(), 53, PROTO_UDP, "10.1.0.5".parse().unwrap(), 5353));
        assert_eq!(flow_keys(&[(fwd, plain)], |_| None), vec![fwd, rep]);
        // Source-NATed: the port's reply entry is found through the forward source-NAT one.
        let snat = ct(be, p(5353), CT_FLAG_SNAT, 0);
        let snat_fwd = key(client, be, p(40000), p(5353), PROTO_UDP, CT_DIR_SNAT_FWD);
        let snat_rep = key(be, node, p(5353), p(61500), PROTO_UDP, CT_DIR_SNAT_REPLY);
        let lookup = |k: &CtKey<u32>| (*k == snat_fwd).then(|| ct(node, p(61500), 0, 0));
        assert_eq!(flow_keys(&[(fwd, snat)], lookup), vec![fwd, rep, snat_rep, snat_fwd]);
        assert_eq!(flow_keys(&[(fwd, snat)], |_| None), vec![fwd, rep, snat_fwd], "its source-NAT forward entry already gone");
    }

    #[test]
    fn a_source_nat_flow_whose_port_went_to_another_flow_goes() {
        let (nat_port, proto) = (61_500u16, PROTO_TCP);
        let snat_reply = key(BE, NODE, 8080, nat_port, proto, CT_DIR_SNAT_REPLY);
        let snat_fwd = key(CLIENT, BE, 40000, 8080, proto, CT_DIR_SNAT_FWD);
        // The old flow closed at 100 s (the client's FIN marked its forward entry); its port
        // serves another client since 115 s, or still this one.
        let map = |(port_client, port_client_port): (u32, u16), fwd_at: u64| {
            vec![
                (fwd(), ct(BE, 8080, CT_FLAG_SNAT | CT_FLAG_FIN, fwd_at)),
                (rep(), ct(FE, 80, 0, 100 * S)),
                (snat_fwd, ct(NODE, nat_port, 0, fwd_at)),
                (snat_reply, ct(port_client, port_client_port, 0, 115 * S)),
            ]
        };
        let other = (CLIENT + 1, 41000);
        assert_eq!(judge(&map(other, 100 * S), 110 * S), vec![vec![fwd(), rep(), snat_fwd]]);
        assert!(judge(&map(other, 100 * S), 109 * S).is_empty(), "used 9 s ago");
        assert!(judge(&map(other, 105 * S), 110 * S).is_empty(), "its forward entry used 5 s ago");
        // The port still its own: the port's rule decides (open here: nothing goes).
        assert!(judge(&map((CLIENT, 40000), 100 * S), 100_000 * S).is_empty());
        // Its forward source-NAT entry gone, or its port's entry gone: orphaned as well.
        let mut gone = map(other, 100 * S);
        gone.remove(2);
        assert_eq!(judge(&gone, 110 * S), vec![vec![fwd(), rep()]]);
        let mut gone = map(other, 100 * S);
        gone.remove(3);
        assert_eq!(judge(&gone, 110 * S), vec![vec![fwd(), rep(), snat_fwd]]);
        // Not marked closed: not looked at (an idle flow; the port's rule decides). Closed by the
        // backend's RST (its reply entry marked): goes the same.
        let mut open = map(other, 100 * S);
        open[0].1.flags = CT_FLAG_SNAT;
        assert!(judge(&open, 110 * S).is_empty());
        open[1].1.flags = CT_FLAG_RST;
        assert_eq!(judge(&open, 110 * S), vec![vec![fwd(), rep(), snat_fwd]]);
        // A reply entry now another flow's stays.
        let mut taken = map(other, 100 * S);
        taken[1].1.addr = FE + 1;
        assert_eq!(judge(&taken, 110 * S), vec![vec![fwd(), snat_fwd]]);
    }

    #[test]
    fn an_open_port_whose_flow_took_another_port_goes() {
        // A SYN sent twice: each was balanced afresh and took a port; the flow's entries point
        // at the second port, the first port's entry still at the client.
        let (p1, p2, proto) = (61_500u16, 62_000u16, PROTO_TCP);
        let port = |p: u16, at: u64| (key(BE, NODE, 8080, p, proto, CT_DIR_SNAT_REPLY), ct(CLIENT, 40000, 0, at));
        let map = |at: u64| {
            vec![
                (fwd(), ct(BE, 8080, CT_FLAG_SNAT, at)),
                (rep(), ct(FE, 80, 0, at)),
                (key(CLIENT, BE, 40000, 8080, proto, CT_DIR_SNAT_FWD), ct(NODE, p2, 0, at)),
                port(p1, at),
                port(p2, at),
            ]
        };
        assert_eq!(judge(&map(100 * S), 110 * S), vec![vec![port(p1, 0).0]]);
        assert!(judge(&map(100 * S), 109 * S).is_empty(), "used 9 s ago");
        // Idle open flows on their own ports stay, however long.
        let mut one = map(100 * S);
        one.remove(3);
        assert!(judge(&one, 100_000 * S).is_empty());
    }

    #[test]
    fn source_nat_flows_are_not_judged_by_their_fin_marks() {
        // A source-NATed flow's forward entry is flagged SNAT; its FIN marks and its reply
        // entry's do not close it while its port is its own: the port's entry decides.
        let nat_port = 61_500u16;
        let map = vec![
            (fwd(), ct(BE, 8080, CT_FLAG_SNAT | CT_FLAG_FIN, 100 * S)),
            (rep(), ct(FE, 80, CT_FLAG_FIN, 100 * S)),
            (key(CLIENT, BE, 40000, 8080, PROTO_TCP, CT_DIR_SNAT_FWD), ct(NODE, nat_port, 0, 100 * S)),
            (key(BE, NODE, 8080, nat_port, PROTO_TCP, CT_DIR_SNAT_REPLY), ct(CLIENT, 40000, 0, 100 * S)),
        ];
        assert!(judge(&map, 1_000 * S).is_empty());
    }

    #[test]
    fn ipv6_flows_are_judged_the_same() {
        let (c, f, b) = ([0x2001_0db8, 0, 0, 1], [0xfd00_0000, 0, 0, 0x10], [0x2001_0db8, 0, 1, 5]);
        let map: Vec<(CtKey<Ip6>, Ct<Ip6>)> = vec![
            (key(c, f, 40000, 80, PROTO_TCP, CT_DIR_FORWARD), Ct { addr: b, port: 8080, flags: CT_FLAG_FIN, last_seen_ns: 100 * S }),
            (key(b, c, 8080, 40000, PROTO_TCP, CT_DIR_REPLY), Ct { addr: f, port: 80, flags: CT_FLAG_FIN, last_seen_ns: 100 * S }),
        ];
        let found: Vec<_> = map.iter().copied().filter(|(k, v)| marked(k, v, 110 * S, HOLD)).collect();
        assert_eq!(closed_flows(&found, |_| None, 110 * S, HOLD).len(), 1);
    }
}
