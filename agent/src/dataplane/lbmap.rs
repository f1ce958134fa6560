//! Programs frontends into the service/backend maps, make-before-break.
//!
//! Order of writes for an upsert: source ranges the frontend does not have yet, new backends,
//! then backend slots and affinity matches, then the master entry (which publishes the new
//! count), then surplus matches and slots are deleted, then backends nobody uses any more. A
//! datapath reader therefore always finds a backend for every slot it can pick, at every
//! instant. Backend ids are never reused while the agent runs, so a reader that raced with a
//! delete cannot land on another service's backend.
//!
//! An upsert or delete is planned once (`plan_upsert`, `plan_delete`) as that sequence of
//! writes, for either family; the plan either writes them at once ([`LbState::upsert`], with
//! an undo log replayed on error) or files them into a batch ([`LbState::apply`], `batch.rs`).
//!
//! Everything here is pure (maps behind the [`LbMaps`] trait) and unit-tested with an
//! in-memory map that checks that invariant after every single write.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    hash::{BuildHasher, BuildHasherDefault},
};

use std::net::{IpAddr, Ipv6Addr};

use gardenet_common::{
    ip6_from_octets, ip6_octets, Backend as BackendValue, Backend4, Backend6, Ip6, ServiceKey, ServiceKey4, ServiceKey6, ServiceValue, SourceRange,
    BE_FLAG_REMOTE, SOURCE_RANGE_FE_BITS4, SOURCE_RANGE_FE_BITS6, SVCNET_CLUSTER_IP, SVCNET_FOREIGN, SVCNET_RANGE, SVC_FLAG_DROP, SVC_FLAG_NONE,
    SVC_FLAG_SNAT_REMOTE, SVC_FLAG_SOURCE_RANGES, SVC_FLAG_TWO_SCOPES,
};

use crate::desired::{Backend, Cidr, Frontend, FrontendSpec, Proto, Scope};

mod batch;
mod maps;
mod mem;
mod undo;
use batch::Lists;
pub use batch::Op;
pub use maps::{one_by_one, Addr, Batch, BatchError, Elems, Entry, Key, LbMaps, MapKind, MapNames, MapWrite, Write};
pub use mem::{MemFamily, MemMaps};
use undo::{Sink, Undo};

/// Errors from the map backend (a full map, a vanished pin, ...).
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("map {map} is full ({op})")]
    Full { map: &'static str, op: String },
    #[error("map {map}: {op}: {source}")]
    Io { map: &'static str, op: String, source: std::io::Error },
    #[error("{0}")]
    Other(String),
}

/// What an entry of `GN_SVCNET` says about the addresses it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServiceNet {
    /// A ServiceCIDR: unallocated addresses are dropped.
    Range,
    /// A ClusterIP gardenet serves: ports it does not serve are rejected.
    ClusterIp,
    /// A ClusterIP of another proxy's Service: left alone.
    Foreign,
}

impl ServiceNet {
    pub fn value(self) -> u8 {
        match self {
            ServiceNet::Range => SVCNET_RANGE,
            ServiceNet::ClusterIp => SVCNET_CLUSTER_IP,
            ServiceNet::Foreign => SVCNET_FOREIGN,
        }
    }

    pub fn from_value(v: u8) -> Option<Self> {
        match v {
            SVCNET_RANGE => Some(ServiceNet::Range),
            SVCNET_CLUSTER_IP => Some(ServiceNet::ClusterIp),
            SVCNET_FOREIGN => Some(ServiceNet::Foreign),
            _ => None,
        }
    }
}

/// The `GN_SVCNET` trie key of a prefix of either family: IPv4 as `::ffff:a.b.c.d/(96+len)`.
pub fn service_net_key(net: &Cidr) -> (u32, Ip6) {
    match net.addr {
        IpAddr::V4(a) => (96 + u32::from(net.len), ip6_from_octets(a.to_ipv6_mapped().octets())),
        IpAddr::V6(a) => (u32::from(net.len), ip6_from_octets(a.octets())),
    }
}

/// Inverse of [`service_net_key`].
pub fn service_net_of_key(len: u32, data: Ip6) -> Option<Cidr> {
    let a = Ipv6Addr::from(ip6_octets(data));
    match a.to_ipv4_mapped() {
        Some(v4) if len >= 96 => Cidr::new(v4.into(), u8::try_from(len - 96).ok()?),
        _ => Cidr::new(a.into(), u8::try_from(len).ok()?),
    }
}

/// The writer of `GN_SVCNET`: service ranges and the ClusterIPs inside them.
#[derive(Debug, Default)]
pub struct ServiceNets {
    programmed: BTreeMap<Cidr, ServiceNet>,
}

impl ServiceNets {
    /// What a previous agent left in the map.
    pub fn adopt(entries: &[(Cidr, ServiceNet)]) -> Self {
        ServiceNets { programmed: entries.iter().copied().collect() }
    }

    pub fn programmed(&self) -> &BTreeMap<Cidr, ServiceNet> {
        &self.programmed
    }

    /// Makes the map hold exactly `want`: new and changed entries first, then removals, so a
    /// ClusterIP that stays never passes through "unallocated". Stops at the first failed
    /// write (what was written is remembered; the next sync retries the rest).
    pub fn sync(&mut self, maps: &mut impl LbMaps, want: &BTreeMap<Cidr, ServiceNet>) -> Result<Writes, MapError> {
        let mut w = Writes::default();
        for (net, kind) in want {
            if self.programmed.get(net) != Some(kind) {
                maps.put_service_net(net, *kind)?;
                self.programmed.insert(*net, *kind);
                w.puts += 1;
            }
        }
        let gone: Vec<Cidr> = self.programmed.keys().filter(|n| !want.contains_key(n)).copied().collect();
        for net in gone {
            maps.del_service_net(&net)?;
            self.programmed.remove(&net);
            w.deletes += 1;
        }
        Ok(w)
    }
}

/// An entry of the source-range LPM tries: (prefix length, data), as the kernel keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RangeKey {
    V4(u32, SourceRange<u32>),
    V6(u32, SourceRange<Ip6>),
}

impl RangeKey {
    /// The entry admitting `client` to `fe` (families must match; the caller filters).
    pub fn of(fe: &Frontend, client: &Cidr) -> Option<RangeKey> {
        match (svc_key(fe), client.addr) {
            (SvcKey::V4(k), IpAddr::V4(_)) => Some(RangeKey::V4(SOURCE_RANGE_FE_BITS4 + u32::from(client.len), range_data(&k, client))),
            (SvcKey::V6(k), IpAddr::V6(_)) => Some(RangeKey::V6(SOURCE_RANGE_FE_BITS6 + u32::from(client.len), range_data(&k, client))),
            _ => None,
        }
    }

    /// The frontend and client prefix of an entry read back from the maps.
    pub fn decode(&self) -> Option<(Frontend, Cidr)> {
        match self {
            RangeKey::V4(len, d) => decode_range(d, len.checked_sub(SOURCE_RANGE_FE_BITS4)?),
            RangeKey::V6(len, d) => decode_range(d, len.checked_sub(SOURCE_RANGE_FE_BITS6)?),
        }
    }
}

fn range_data<A: Addr>(k: &ServiceKey<A>, client: &Cidr) -> SourceRange<A> {
    SourceRange { fe_addr: k.addr, fe_port: k.port, proto: k.proto, _pad: 0, client: A::of_ip(client.addr) }
}

fn decode_range<A: Addr>(d: &SourceRange<A>, client_len: u32) -> Option<(Frontend, Cidr)> {
    let fe = Frontend::new(d.fe_addr.ip(), u16::from_be(d.fe_port), Proto::from_number(d.proto)?);
    Some((fe, Cidr::new(d.client.ip(), u8::try_from(client_len).ok()?)?))
}

/// The affinity-match key saying that backend `backend_id` belongs to frontend entry `fe`.
pub fn match_key<A: Copy>(fe: &ServiceKey<A>, backend_id: u32) -> gardenet_common::AffinityMatchKey<A> {
    gardenet_common::AffinityMatchKey { backend_id, addr: fe.addr, port: fe.port, proto: fe.proto, scope: fe.scope }
}

/// A service-map key of either family: what the writer addresses a frontend's entries by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SvcKey {
    V4(ServiceKey4),
    V6(ServiceKey6),
}

impl SvcKey {
    pub fn with_slot(self, slot: u16) -> Self {
        match self {
            SvcKey::V4(k) => SvcKey::V4(k.with_slot(slot)),
            SvcKey::V6(k) => SvcKey::V6(k.with_slot(slot)),
        }
    }

    /// `val` under this key.
    fn put(self, val: ServiceValue) -> MapWrite {
        match self {
            SvcKey::V4(k) => Entry::Service(k, val).into(),
            SvcKey::V6(k) => Entry::Service(k, val).into(),
        }
    }

    fn del(self) -> MapWrite {
        match self {
            SvcKey::V4(k) => Key::Service(k).into(),
            SvcKey::V6(k) => Key::Service(k).into(),
        }
    }

    /// Backend `id` is eligible for this frontend's affinity (`put`) or no longer.
    fn affinity_match(self, id: u32, put: bool) -> MapWrite {
        match (self, put) {
            (SvcKey::V4(k), true) => Entry::Match(match_key(&k, id)).into(),
            (SvcKey::V4(k), false) => Key::Match(match_key(&k, id)).into(),
            (SvcKey::V6(k), true) => Entry::Match(match_key(&k, id)).into(),
            (SvcKey::V6(k), false) => Key::Match(match_key(&k, id)).into(),
        }
    }
}

/// Service-map key of a frontend, in the map of its family.
pub fn svc_key(fe: &Frontend) -> SvcKey {
    let scope = fe.scope.number();
    match fe.addr {
        IpAddr::V4(a) => SvcKey::V4(ServiceKey4::master(u32::from(a).to_be(), fe.port.to_be(), fe.proto.number()).with_scope(scope)),
        IpAddr::V6(a) => SvcKey::V6(ServiceKey6::master(ip6_from_octets(a.octets()), fe.port.to_be(), fe.proto.number()).with_scope(scope)),
    }
}

/// Backend `b` under `id`, in the map of its family.
fn backend_put(id: u32, b: &Backend, proto: Proto) -> MapWrite {
    match b.addr {
        IpAddr::V4(_) => Entry::Backend(id, backend_value::<u32>(b, proto)).into(),
        IpAddr::V6(_) => Entry::Backend(id, backend_value::<Ip6>(b, proto)).into(),
    }
}

fn backend_del(id: u32, b: &Backend) -> MapWrite {
    match b.addr {
        IpAddr::V4(_) => Key::<u32>::Backend(id).into(),
        IpAddr::V6(_) => Key::<Ip6>::Backend(id).into(),
    }
}

/// Counts of map writes done by one operation (for metrics and the O(change) target).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writes {
    pub puts: u32,
    pub deletes: u32,
}

impl Writes {
    pub fn total(&self) -> u32 {
        self.puts + self.deletes
    }
}

impl std::ops::AddAssign for Writes {
    fn add_assign(&mut self, o: Self) {
        self.puts += o.puts;
        self.deletes += o.deletes;
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    /// Backend id per slot (slot i+1 holds slots[i]).
    slots: Vec<u32>,
    affinity_timeout: u32,
    /// Master-entry flags (`SVC_FLAG_*`).
    flags: u16,
}

type BeKey = (Backend, Proto);

/// The backends in the maps: id -> (backend, number of frontends using it), and the way back.
/// The way back is a table of ids hashed by their backend (5 bytes a backend, where a
/// `HashMap<BeKey, u32>` took 29: ~13 MiB at 300,000 backends).
#[derive(Default)]
struct Backends {
    by_id: HashMap<u32, (BeKey, u32), BuildHasherDefault<IdHasher>>,
    ids: hashbrown::HashTable<u32>,
    /// Seeded at random per process (foldhash, as the pipeline's tables): backend addresses
    /// come from the cluster's EndpointSlices, so collisions must not be precomputable, but
    /// SipHash was a quarter of planning a full sync.
    hasher: foldhash::fast::RandomState,
}

/// Hashes the writer's own backend ids (sequential, never chosen by anyone else): one
/// multiplication instead of SipHash on the sync's hottest lookups.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u32(&mut self, i: u32) {
        // The id itself in the low bits (hashbrown's bucket index): ids allocated one after
        // the other land in neighbouring buckets, which keeps a full sync in cache. The top
        // bits (its 7-bit tag) come from a multiplication, so tags still tell ids apart.
        let i = u64::from(i);
        self.0 = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & 0xfe00_0000_0000_0000) | i;
    }
}

impl std::fmt::Debug for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.by_id.iter()).finish()
    }
}

impl Backends {
    fn hash(&self, k: &BeKey) -> u64 {
        self.hasher.hash_one(k)
    }

    /// The id of a backend (the first one adopted, if a previous agent left two).
    fn id_of(&self, k: &BeKey) -> Option<u32> {
        self.id_of_hashed(self.hash(k), k)
    }

    /// [`Backends::id_of`] with `k`'s [`Backends::hash`] at hand.
    fn id_of_hashed(&self, h: u64, k: &BeKey) -> Option<u32> {
        let by_id = &self.by_id;
        self.ids.find(h, |id| by_id.get(id).is_some_and(|(b, _)| b == k)).copied()
    }

    /// A backend that has no id yet, used by nobody yet.
    fn insert(&mut self, k: BeKey, id: u32) {
        self.insert_hashed(self.hash(&k), k, id);
    }

    /// [`Backends::insert`] with `k`'s [`Backends::hash`] at hand.
    fn insert_hashed(&mut self, h: u64, k: BeKey, id: u32) {
        self.by_id.insert(id, (k, 0));
        let Backends { by_id, ids, hasher } = self;
        ids.insert_unique(h, id, |i| hasher.hash_one(by_id[i].0));
    }

    /// Room for `additional` more backends. Growing the table of ids rehashes every backend
    /// it holds (a SipHash and an id lookup each): a full sync reserves once instead.
    fn reserve(&mut self, additional: usize) {
        self.by_id.reserve(additional);
        let Backends { by_id, ids, hasher } = self;
        ids.reserve(additional, |i| hasher.hash_one(by_id[i].0));
    }

    /// A backend found in the maps; a second id for the same backend is counted but not found
    /// by [`Backends::id_of`].
    fn adopt(&mut self, k: BeKey, id: u32) {
        if self.id_of(&k).is_some() {
            self.by_id.insert(id, (k, 0));
        } else {
            self.insert(k, id);
        }
    }

    fn remove(&mut self, id: u32) {
        let Some((k, _)) = self.by_id.get(&id) else { return };
        if let Ok(e) = self.ids.find_entry(self.hasher.hash_one(k), |i| *i == id) {
            e.remove();
        }
        self.by_id.remove(&id);
    }

    fn get(&self, id: &u32) -> Option<&(BeKey, u32)> {
        self.by_id.get(id)
    }

    fn get_mut(&mut self, id: &u32) -> Option<&mut (BeKey, u32)> {
        self.by_id.get_mut(id)
    }

    fn contains_id(&self, id: &u32) -> bool {
        self.by_id.contains_key(id)
    }

    fn len(&self) -> usize {
        self.ids.len()
    }
}

/// What is programmed in the maps, as the writer knows it.
#[derive(Debug, Default)]
pub struct LbState {
    frontends: BTreeMap<Frontend, Programmed>,
    backends: Backends,
    next_id: u32,
    /// Source ranges in the maps, by frontend (also ones whose master is gone: an upsert of
    /// that frontend then removes what it does not want).
    ranges: HashMap<Frontend, BTreeSet<Cidr>, foldhash::fast::RandomState>,
}

/// `GN_SVC4` key of an IPv4 frontend (for an IPv6 one, use [`svc_key`]; this one then panics).
pub fn service_key(fe: &Frontend) -> ServiceKey4 {
    match svc_key(fe) {
        SvcKey::V4(k) => k,
        SvcKey::V6(_) => panic!("service_key({fe}): IPv6 frontend, use svc_key"),
    }
}

/// `GN_SVC6` key of an IPv6 frontend (panics for IPv4).
pub fn service_key_v6(fe: &Frontend) -> ServiceKey6 {
    match svc_key(fe) {
        SvcKey::V6(k) => k,
        SvcKey::V4(_) => panic!("service_key_v6({fe}): IPv4 frontend, use service_key"),
    }
}

fn backend_flags(be: &Backend) -> u8 {
    if be.remote {
        BE_FLAG_REMOTE
    } else {
        0
    }
}

/// The master entry's `SVC_FLAG_*` for a frontend spec.
fn master_flags(spec: &FrontendSpec) -> u16 {
    let mut f = SVC_FLAG_NONE;
    if spec.snat_remote {
        f |= SVC_FLAG_SNAT_REMOTE;
    }
    if !spec.source_ranges.is_empty() {
        f |= SVC_FLAG_SOURCE_RANGES;
    }
    if spec.two_scopes {
        f |= SVC_FLAG_TWO_SCOPES;
    }
    if spec.drop {
        f |= SVC_FLAG_DROP;
    }
    f
}

/// `GN_BE4`/`GN_BE6` value of a backend.
pub fn backend_value<A: Addr>(be: &Backend, proto: Proto) -> BackendValue<A> {
    BackendValue { addr: A::of_ip(be.addr), port: be.port.to_be(), proto: proto.number(), flags: backend_flags(be) }
}

pub fn backend_from_value<A: Addr>(v: &BackendValue<A>) -> Backend {
    Backend { addr: v.addr.ip(), port: u16::from_be(v.port), remote: v.flags & BE_FLAG_REMOTE != 0 }
}

fn master_value(p: &Programmed) -> ServiceValue {
    ServiceValue { backend_id: 0, count: p.slots.len() as u16, flags: p.flags, affinity_timeout: p.affinity_timeout }
}

/// A dump of the maps as the kernel has them (for adoption after a restart, and `lb list`).
#[derive(Clone, Debug, Default)]
pub struct MapDump {
    /// `GN_SVCNET` entries.
    pub service_nets: Vec<(Cidr, ServiceNet)>,
    pub services: Vec<(ServiceKey4, ServiceValue)>,
    pub backends: Vec<(u32, Backend4)>,
    pub services6: Vec<(ServiceKey6, ServiceValue)>,
    pub backends6: Vec<(u32, Backend6)>,
    pub ranges: Vec<RangeKey>,
}

/// A frontend's identity in the maps, either family (addr as IpAddr, port host order,
/// protocol and scope numbers).
type FeId = (IpAddr, u16, u8, u8);

fn fe_id<A: Addr>(k: &ServiceKey<A>) -> FeId {
    (k.addr.ip(), u16::from_be(k.port), k.proto, k.scope)
}

/// Both families' service entries and backends in one family-neutral shape.
struct Flat {
    masters: BTreeMap<FeId, ServiceValue>,
    slots: HashMap<FeId, BTreeMap<u16, u32>>,
    be4: HashMap<u32, Backend>,
    be6: HashMap<u32, Backend>,
}

impl Flat {
    fn of(d: &MapDump) -> Flat {
        let mut masters = BTreeMap::new();
        let mut slots: HashMap<FeId, BTreeMap<u16, u32>> = HashMap::new();
        let mut add = |id: FeId, slot: u16, v: &ServiceValue| {
            if slot == 0 {
                masters.insert(id, *v);
            } else {
                slots.entry(id).or_default().insert(slot, v.backend_id);
            }
        };
        d.services.iter().for_each(|(k, v)| add(fe_id(k), k.slot, v));
        d.services6.iter().for_each(|(k, v)| add(fe_id(k), k.slot, v));
        Flat {
            masters,
            slots,
            be4: d.backends.iter().map(|(id, b)| (*id, backend_from_value(b))).collect(),
            be6: d.backends6.iter().map(|(id, b)| (*id, backend_from_value(b))).collect(),
        }
    }

    fn backends_of(&self, addr: &IpAddr) -> &HashMap<u32, Backend> {
        if addr.is_ipv4() {
            &self.be4
        } else {
            &self.be6
        }
    }

    fn slot(&self, id: &FeId, slot: u16) -> Option<u32> {
        self.slots.get(id).and_then(|s| s.get(&slot)).copied()
    }
}

/// One frontend as found in the maps.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DumpedFrontend {
    pub frontend: Frontend,
    pub backends: Vec<Backend>,
    pub affinity_timeout: u32,
    /// External traffic to remote backends is source-NATed (`SVC_FLAG_SNAT_REMOTE`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub snat_remote: bool,
    /// What happens without backends: `reject` (no endpoints at all) or `drop` (endpoints,
    /// none usable here; `SVC_FLAG_DROP`).
    pub when_empty: &'static str,
    /// Clients on this node use the frontend's `@this-node` set (`SVC_FLAG_TWO_SCOPES`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub two_scopes: bool,
    /// `loadBalancerSourceRanges` in force (the master's flag is set and these are in the trie).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<Cidr>,
    /// Slots whose backend id is missing from the backend map (should never happen).
    pub dangling_slots: u32,
}

impl MapDump {
    /// Groups the raw entries per frontend, in frontend order (IPv4 first).
    pub fn frontends(&self) -> Vec<DumpedFrontend> {
        let flat = Flat::of(self);
        let ranges = self.ranges_by_frontend();
        let mut out = Vec::new();
        for (id, m) in &flat.masters {
            let (addr, port, proto, scope) = *id;
            let (Some(proto_e), Some(scope)) = (Proto::from_number(proto), Scope::from_number(scope)) else { continue };
            let frontend = Frontend { addr, port, proto: proto_e, scope };
            let bes = flat.backends_of(&addr);
            let mut backends = Vec::new();
            let mut dangling = 0;
            for s in 1..=m.count {
                match flat.slot(id, s).and_then(|bid| bes.get(&bid)) {
                    Some(b) => backends.push(*b),
                    None => dangling += 1,
                }
            }
            let source_ranges =
                if m.flags & SVC_FLAG_SOURCE_RANGES != 0 { ranges.get(&frontend).map(|r| r.iter().copied().collect()).unwrap_or_default() } else { Vec::new() };
            out.push(DumpedFrontend {
                frontend,
                backends,
                affinity_timeout: m.affinity_timeout,
                snat_remote: m.flags & SVC_FLAG_SNAT_REMOTE != 0,
                when_empty: if m.flags & SVC_FLAG_DROP != 0 { "drop" } else { "reject" },
                two_scopes: m.flags & SVC_FLAG_TWO_SCOPES != 0,
                source_ranges,
                dangling_slots: dangling,
            });
        }
        out
    }

    /// The source-range entries, by frontend.
    pub fn ranges_by_frontend(&self) -> HashMap<Frontend, BTreeSet<Cidr>> {
        let mut out: HashMap<Frontend, BTreeSet<Cidr>> = HashMap::new();
        for (fe, c) in self.ranges.iter().filter_map(RangeKey::decode) {
            out.entry(fe).or_default().insert(c);
        }
        out
    }
}

impl LbState {
    pub fn new() -> Self {
        LbState { next_id: 1, ..Default::default() }
    }

    /// Rebuilds the writer's view from maps left by a previous agent, so a restart rewrites
    /// only what changed. Entries that do not form a consistent frontend are ignored here and
    /// cleaned up by the first full sync (a frontend not in the desired state is deleted).
    pub fn adopt(dump: &MapDump) -> Self {
        let mut st = LbState::new();
        let flat = Flat::of(dump);
        let max_id = dump.backends.iter().map(|(id, _)| *id).chain(dump.backends6.iter().map(|(id, _)| *id)).max().unwrap_or(0);
        st.next_id = max_id.wrapping_add(1).max(1);
        for (fid, v) in &flat.masters {
            let (addr, port, proto, scope) = *fid;
            let (Some(proto), Some(scope)) = (Proto::from_number(proto), Scope::from_number(scope)) else { continue };
            let fe = Frontend { addr, port, proto, scope };
            let bes = flat.backends_of(&addr);
            let mut ids = Vec::new();
            for s in 1..=v.count {
                let Some(id) = flat.slot(fid, s) else { break };
                if !bes.contains_key(&id) {
                    break;
                }
                ids.push(id);
            }
            if ids.len() != v.count as usize {
                // Inconsistent: forget the frontend; the sync reprograms it from scratch
                // (upsert writes every slot) or deletes it.
                continue;
            }
            for id in &ids {
                let k = (bes[id], proto);
                if !st.backends.contains_id(id) {
                    st.backends.adopt(k, *id);
                }
                if let Some(e) = st.backends.get_mut(id) {
                    e.1 += 1;
                }
            }
            st.frontends.insert(fe, Programmed { slots: ids, affinity_timeout: v.affinity_timeout, flags: v.flags });
        }
        st.ranges = dump.ranges_by_frontend().into_iter().collect();
        st
    }

    pub fn frontends(&self) -> impl Iterator<Item = &Frontend> {
        self.frontends.keys()
    }

    pub fn contains(&self, fe: &Frontend) -> bool {
        self.frontends.contains_key(fe)
    }

    /// The backends `fe` is programmed with (empty if it is not).
    pub fn backends_of(&self, fe: &Frontend) -> Vec<Backend> {
        self.frontends.get(fe).map_or_else(Vec::new, |p| p.slots.iter().filter_map(|id| self.backends.get(id)).map(|((b, _), _)| *b).collect())
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    /// Entries this state occupies in the services map: a master per frontend and one
    /// per backend slot (for `gardenet_map_entries{map="services"}`).
    pub fn service_entries(&self) -> usize {
        self.frontends.values().map(|p| 1 + p.slots.len()).sum()
    }

    /// Room for `n` backends in all (a hint: a full sync passes what its Services list).
    pub fn reserve_backends(&mut self, n: usize) {
        self.backends.reserve(n.saturating_sub(self.backends.len()));
    }

    /// Monotonic ids; after a u32 wrap, ids still in use are skipped.
    fn alloc_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1).max(1);
            if !self.backends.contains_id(&id) {
                return id;
            }
        }
    }

    /// The spec's backends, sorted and without duplicates; `None` when the frontend is
    /// programmed exactly so already (nothing to write).
    fn wanted_backends<'s>(&self, fe: &Frontend, spec: &'s FrontendSpec) -> Result<Option<std::borrow::Cow<'s, [Backend]>>, MapError> {
        // Translation hands them over sorted and distinct already: no copy then.
        let wanted: std::borrow::Cow<'s, [Backend]> = if spec.backends.windows(2).all(|w| w[0] < w[1]) {
            std::borrow::Cow::Borrowed(&spec.backends)
        } else {
            let mut v = spec.backends.clone();
            v.sort();
            v.dedup();
            std::borrow::Cow::Owned(v)
        };
        if wanted.len() > u16::MAX as usize {
            return Err(MapError::Other(format!("{fe}: {} backends, at most {} per frontend", wanted.len(), u16::MAX)));
        }
        if let Some(o) = self.frontends.get(fe) {
            if o.affinity_timeout == spec.affinity_timeout
                && o.flags == master_flags(spec)
                && self.same_backends(o, &wanted, fe.proto)
                && self.same_ranges(fe, spec)
            {
                return Ok(None);
            }
        }
        Ok(Some(wanted))
    }

    /// Writes the source ranges the frontend does not have yet (single writes: LPM tries have
    /// Programs `fe` to `spec`. On error the maps and this state are left as they were
    /// before the call (best effort: the undo log is replayed).
    pub fn upsert(&mut self, maps: &mut impl LbMaps, fe: &Frontend, spec: &FrontendSpec) -> Result<Writes, MapError> {
        self.at_once(maps, |st, sink| st.plan_upsert(sink, fe, spec))
    }

    /// Removes `fe`: master first (no new selections), then its slots and orphaned backends.
    pub fn delete(&mut self, maps: &mut impl LbMaps, fe: &Frontend) -> Result<Writes, MapError> {
        self.at_once(maps, |st, sink| st.plan_delete(sink, fe))
    }

    /// Makes a change straight on the maps: its writes as `plan` makes them, then the backends
    /// it no longer references are deleted and the state brought up to date. A failed make
    /// step undoes what the change wrote.
    fn at_once<M: LbMaps>(
        &mut self,
        maps: &mut M,
        plan: impl FnOnce(&mut Self, &mut Sink<'_, M>) -> Result<Option<Planned>, MapError>,
    ) -> Result<Writes, MapError> {
        let mut sink = Sink::now(maps);
        let p = match plan(self, &mut sink) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(Writes::default()),
            Err(e) => {
                sink.undo.replay(sink.maps, &mut self.backends);
                return Err(e);
            }
        };
        let mut w = p.w;
        self.hold(&p.commit);
        self.release(&mut sink, p.commit.old_slots(), &mut w);
        self.commit(sink.maps, &p.fe, p.commit, &mut w);
        Ok(w)
    }

    /// Plans `upsert(fe, spec)` into `sink`, step by step in make-before-break order.
    /// `None`: nothing to write.
    fn plan_upsert<M: LbMaps>(&mut self, sink: &mut Sink<'_, M>, fe: &Frontend, spec: &FrontendSpec) -> Result<Option<Planned>, MapError> {
        let mut w = Writes::default();
        let Some(wanted) = self.wanted_backends(fe, spec)? else { return Ok(None) };
        let old = self.frontends.get(fe).cloned();

        // 0. Source ranges the frontend does not have yet, before the master's flag makes the
        //    datapath consult them.
        let old_ranges = self.ranges.get(fe).cloned().unwrap_or_default();
        let new_ranges: BTreeSet<Cidr> = spec.source_ranges.iter().copied().filter(|c| c.addr.is_ipv4() == fe.addr.is_ipv4()).collect();
        for k in new_ranges.difference(&old_ranges).filter_map(|c| RangeKey::of(fe, c)) {
            sink.make(MapWrite::PutRange(k), None)?;
            w.puts += 1;
        }

        // 1. Backends that do not exist yet.
        let mut ids = Vec::with_capacity(wanted.len());
        if old.is_none() {
            sink.undo.reserve_created(wanted.len());
        }
        for b in wanted.iter() {
            let k = (*b, fe.proto);
            let h = self.backends.hash(&k);
            let id = match self.backends.id_of_hashed(h, &k) {
                Some(id) => id,
                None => {
                    let id = self.alloc_id();
                    sink.make(backend_put(id, b, fe.proto), None)?;
                    w.puts += 1;
                    self.backends.insert_hashed(h, k, id);
                    sink.undo.created(id);
                    id
                }
            };
            ids.push(id);
        }

        // 2. Slots. Keep surviving backends in their slots, fill holes with new ones, then
        //    close remaining holes from the tail: one backend change costs O(1) slot writes.
        let old_slots = old.as_ref().map(|o| o.slots.clone()).unwrap_or_default();
        let new_slots = plan_slots(&old_slots, &ids);
        let key = svc_key(fe);
        let slot = |id: u32| ServiceValue { backend_id: id, ..Default::default() };
        for (i, id) in new_slots.iter().enumerate() {
            if old_slots.get(i) != Some(id) {
                sink.make(key.with_slot(i as u16 + 1).put(slot(*id)), old_slots.get(i).map(|b| slot(*b)))?;
                w.puts += 1;
            }
        }

        // 2b. Affinity: new members become eligible before the master publishes them.
        let old_matched: BTreeSet<u32> = match &old {
            Some(o) if o.affinity_timeout > 0 => o.slots.iter().copied().collect(),
            _ => BTreeSet::new(),
        };
        if spec.affinity_timeout > 0 {
            for id in new_slots.iter().filter(|id| !old_matched.contains(id)) {
                sink.make(key.affinity_match(*id, true), None)?;
                w.puts += 1;
            }
        }

        // 3. Publish.
        let flags = master_flags(spec);
        let master = ServiceValue { backend_id: 0, count: new_slots.len() as u16, flags, affinity_timeout: spec.affinity_timeout };
        sink.make(key.put(master), old.as_ref().map(master_value))?;
        w.puts += 1;

        // 4. Retire affinity matches of members that left and surplus slots (backends once the
        //    references are counted, source ranges last: `commit`).
        let keep: BTreeSet<u32> = if spec.affinity_timeout > 0 { new_slots.iter().copied().collect() } else { BTreeSet::new() };
        for id in old_matched.difference(&keep) {
            sink.retire(key.affinity_match(*id, false), &mut w);
        }
        for slot in new_slots.len() + 1..=old_slots.len() {
            sink.retire(key.with_slot(slot as u16).del(), &mut w);
        }
        let commit = Commit::Upsert { slots: new_slots, affinity_timeout: spec.affinity_timeout, flags, old_slots, old_ranges, new_ranges };
        Ok(Some(Planned { fe: *fe, commit, w, undo: std::mem::take(&mut sink.undo) }))
    }

    /// Plans `delete(fe)` into `sink`. `None`: not programmed.
    fn plan_delete<M: LbMaps>(&mut self, sink: &mut Sink<'_, M>, fe: &Frontend) -> Result<Option<Planned>, MapError> {
        let Some(old) = self.frontends.get(fe).cloned() else { return Ok(None) };
        let mut w = Writes::default();
        let key = svc_key(fe);
        sink.make(key.del(), Some(master_value(&old)))?;
        w.deletes += 1;
        if old.affinity_timeout > 0 {
            for id in &old.slots {
                sink.retire(key.affinity_match(*id, false), &mut w);
            }
        }
        for slot in 1..=old.slots.len() {
            sink.retire(key.with_slot(slot as u16).del(), &mut w);
        }
        Ok(Some(Planned { fe: *fe, commit: Commit::Delete { old }, w, undo: std::mem::take(&mut sink.undo) }))
    }

    /// Counts the references a planned upsert adds (all of them before any old one is
    /// dropped, so a backend that one frontend leaves and another joins stays).
    fn hold(&mut self, c: &Commit) {
        if let Commit::Upsert { slots, .. } = c {
            for id in slots {
                if let Some(e) = self.backends.get_mut(id) {
                    e.1 += 1;
                }
            }
        }
    }

    /// Drops one reference per id; backends that reach zero are retired.
    fn release<M: LbMaps>(&mut self, sink: &mut Sink<'_, M>, ids: &[u32], w: &mut Writes) {
        for id in ids {
            let Some((k, refs)) = self.backends.get_mut(id) else { continue };
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                let b = k.0;
                sink.retire(backend_del(*id, &b), w);
                self.backends.remove(*id);
            }
        }
    }

    /// Brings the state up to a change whose writes are done, and deletes the source ranges
    /// the frontend no longer has: after the master (a client they admitted may be admitted a
    /// moment longer, never one refused that should not be).
    fn commit(&mut self, maps: &mut impl LbMaps, fe: &Frontend, c: Commit, w: &mut Writes) {
        match c {
            Commit::Upsert { slots, affinity_timeout, flags, old_ranges, new_ranges, .. } => {
                // A range that could not be deleted is still in the map: try again next time.
                let kept = self.del_ranges(maps, fe, &old_ranges, new_ranges, w);
                if kept.is_empty() {
                    self.ranges.remove(fe);
                } else {
                    self.ranges.insert(*fe, kept);
                }
                self.frontends.insert(*fe, Programmed { slots, affinity_timeout, flags });
            }
            Commit::Delete { .. } => {
                self.frontends.remove(fe);
                let old = self.ranges.remove(fe).unwrap_or_default();
                self.del_ranges(maps, fe, &old, BTreeSet::new(), w);
            }
        }
    }

    /// Deletes the ranges of `old` not in `keep`; returns `keep` and those that failed.
    fn del_ranges(&self, maps: &mut impl LbMaps, fe: &Frontend, old: &BTreeSet<Cidr>, mut keep: BTreeSet<Cidr>, w: &mut Writes) -> BTreeSet<Cidr> {
        for c in old.difference(&keep.clone()) {
            match RangeKey::of(fe, c).map(|k| maps.write(MapWrite::DelRange(k))) {
                Some(Err(e)) => {
                    tracing::warn!("{fe}: deleting source range {c}: {e}");
                    keep.insert(*c);
                }
                Some(Ok(())) => w.deletes += 1,
                None => {}
            }
        }
        keep
    }

    fn same_ranges(&self, fe: &Frontend, spec: &FrontendSpec) -> bool {
        let have = self.ranges.get(fe);
        let want: BTreeSet<Cidr> = spec.source_ranges.iter().copied().filter(|c| c.addr.is_ipv4() == fe.addr.is_ipv4()).collect();
        have.map_or(want.is_empty(), |h| *h == want)
    }

    fn same_backends(&self, o: &Programmed, wanted: &[Backend], proto: Proto) -> bool {
        if o.slots.len() != wanted.len() {
            return false;
        }
        let have: BTreeSet<u32> = o.slots.iter().copied().collect();
        wanted.iter().all(|b| self.backends.id_of(&(*b, proto)).is_some_and(|id| have.contains(&id)))
    }
}

/// A change planned (its make writes written or filed into a batch): what the state
/// becomes once its writes are done.
struct Planned {
    fe: Frontend,
    commit: Commit,
    w: Writes,
    /// What undoes the writes made at once while planning (for a batch: the source ranges).
    undo: Undo,
}

enum Commit {
    Upsert { slots: Vec<u32>, affinity_timeout: u32, flags: u16, old_slots: Vec<u32>, old_ranges: BTreeSet<Cidr>, new_ranges: BTreeSet<Cidr> },
    Delete { old: Programmed },
}

impl Commit {
    /// The backends the frontend referenced before.
    fn old_slots(&self) -> &[u32] {
        match self {
            Commit::Upsert { old_slots, .. } => old_slots,
            Commit::Delete { old } => &old.slots,
        }
    }
}

/// New slot order: survivors stay where they are, newcomers fill the holes, and leftover
/// holes are closed by moving entries from the tail.
pub fn plan_slots(old: &[u32], wanted: &[u32]) -> Vec<u32> {
    if old.is_empty() {
        // A new frontend (the whole full sync): nothing to keep in place.
        return wanted.to_vec();
    }
    let want: BTreeSet<u32> = wanted.iter().copied().collect();
    let kept: BTreeSet<u32> = old.iter().copied().filter(|id| want.contains(id)).collect();
    let mut adds: Vec<u32> = wanted.iter().copied().filter(|id| !kept.contains(id)).collect();
    adds.reverse(); // pop() in wanted order
    let mut slots: Vec<Option<u32>> = old.iter().map(|id| want.contains(id).then_some(*id)).collect();
    for s in slots.iter_mut().filter(|s| s.is_none()) {
        match adds.pop() {
            Some(a) => *s = Some(a),
            None => break,
        }
    }
    while let Some(a) = adds.pop() {
        slots.push(Some(a));
    }
    // Close holes from the tail.
    let mut i = 0;
    while i < slots.len() {
        if slots[i].is_none() {
            while slots.last() == Some(&None) {
                slots.pop();
            }
            if i < slots.len() {
                slots.swap_remove(i);
            }
        }
        i += 1;
    }
    while slots.last() == Some(&None) {
        slots.pop();
    }
    slots.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn service_net_keys_of_both_families_round_trip() {
        for c in ["10.96.0.0/12", "10.96.0.10/32", "0.0.0.0/0", "fd00:96::/108", "fd00:96::a/128"] {
            let c: Cidr = c.parse().unwrap();
            let (len, data) = service_net_key(&c);
            assert_eq!(service_net_of_key(len, data), Some(c));
        }
        assert_eq!(service_net_key(&"10.96.0.0/12".parse().unwrap()).0, 108, "IPv4 as ::ffff:a.b.c.d");
    }

    use super::*;
    use std::net::Ipv4Addr;

    fn fe(port: u16) -> Frontend {
        Frontend::new("10.96.0.10".parse().unwrap(), port, Proto::Tcp)
    }
    fn be(last: u8) -> Backend {
        Backend::new(format!("10.0.0.{last}").parse().unwrap(), 8080)
    }
    fn fe6(port: u16) -> Frontend {
        Frontend::new("fd00:19::10".parse().unwrap(), port, Proto::Tcp)
    }
    fn be6(last: u8) -> Backend {
        Backend::new(format!("fd00:18:1::{last:x}").parse().unwrap(), 8080)
    }
    fn spec(bs: &[u8]) -> FrontendSpec {
        V4.spec(bs)
    }
    fn spec6(bs: &[u8]) -> FrontendSpec {
        V6.spec(bs)
    }
    fn programmed(maps: &MemMaps, f: &Frontend) -> Vec<Backend> {
        let d = maps.dump().frontends();
        let mut v = d.into_iter().find(|d| d.frontend == *f).map(|d| d.backends).unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn upsert_programs_master_slots_and_backends() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let w = st.upsert(&mut m, &fe(80), &spec(&[1, 2, 3])).unwrap();
        assert_eq!(w, Writes { puts: 3 + 3 + 1, deletes: 0 });
        assert_eq!(programmed(&m, &fe(80)), vec![be(1), be(2), be(3)]);
        let master = m.v4.services[&service_key(&fe(80))];
        assert_eq!(master.count, 3);
        // Keys are in network byte order, as the datapath reads them.
        assert_eq!(service_key(&fe(80)).port, 80u16.to_be());
        assert_eq!(service_key(&fe(80)).addr.to_ne_bytes(), [10, 96, 0, 10]);
    }

    #[test]
    fn unchanged_upsert_writes_nothing() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2, 3])).unwrap();
        let w = st.upsert(&mut m, &fe(80), &spec(&[3, 2, 1, 1])).unwrap();
        assert_eq!(w.total(), 0);
    }

    #[test]
    fn removing_one_backend_costs_constant_writes() {
        for f in FAMILIES {
            let mut m = MemMaps::checked();
            let mut st = LbState::new();
            let all: Vec<u8> = (1..=100).collect();
            st.upsert(&mut m, &f.fe(80), &f.spec(&all)).unwrap();
            let fewer: Vec<u8> = (1..=100).filter(|b| *b != 7).collect();
            let w = st.upsert(&mut m, &f.fe(80), &f.spec(&fewer)).unwrap();
            // slot of 7 gets the tail's backend, master, tail slot delete, backend delete.
            assert!(w.total() <= 4, "{w:?}");
            assert_eq!(programmed(&m, &f.fe(80)).len(), 99);
            assert!(!programmed(&m, &f.fe(80)).contains(&f.be(7)));
            assert!(!backends_in_maps(&m).contains(&f.be(7)));
        }
    }

    /// One family's test frontends and backends, for tests that run the same scenario for
    /// both.
    #[derive(Clone, Copy)]
    struct Family {
        fe: fn(u16) -> Frontend,
        be: fn(u8) -> Backend,
        /// A client range of the family.
        range: &'static str,
    }

    const V4: Family = Family { fe, be, range: "10.0.0.0/8" };
    const V6: Family = Family { fe: fe6, be: be6, range: "fd00:18::/32" };
    const FAMILIES: [Family; 2] = [V4, V6];

    impl Family {
        fn fe(&self, port: u16) -> Frontend {
            (self.fe)(port)
        }
        fn be(&self, last: u8) -> Backend {
            (self.be)(last)
        }
        fn spec(&self, bs: &[u8]) -> FrontendSpec {
            FrontendSpec { backends: bs.iter().map(|b| self.be(*b)).collect(), ..Default::default() }
        }
    }

    /// The backends in the maps of both families.
    fn backends_in_maps(m: &MemMaps) -> Vec<Backend> {
        let d = m.dump();
        d.backends.iter().map(|(_, b)| backend_from_value(b)).chain(d.backends6.iter().map(|(_, b)| backend_from_value(b))).collect()
    }

    #[test]
    fn make_before_break_holds_for_both_families_through_the_same_code() {
        // The same scenario for an IPv4 and an IPv6 frontend. MemMaps::checked() asserts after
        // every write, single or batched, that every slot and affinity match resolves to a
        // backend and that a master restricting sources finds its ranges.
        for f in FAMILIES {
            let mut m = MemMaps::checked();
            let mut st = LbState::new();
            for (i, s) in SHAPES.iter().enumerate() {
                let ranges = if i % 3 == 0 { vec![f.range.parse().unwrap()] } else { Vec::new() };
                let full = FrontendSpec { affinity_timeout: if i % 2 == 0 { 60 } else { 0 }, source_ranges: ranges, ..f.spec(s) };
                st.upsert(&mut m, &f.fe(80), &full).unwrap();
                let r = st.apply(&mut m, &[Op::Upsert(f.fe(81), f.spec(s)), Op::Upsert(f.fe(82), full.clone())]);
                assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
                for port in [80, 81, 82] {
                    assert_eq!(programmed(&m, &f.fe(port)), f.spec(s).backends);
                }
            }
            // A services map with room for one more entry: the failed changes, single and
            // batched, leave the previous programming.
            m.max_services = Some(m.v4.services.len().max(m.v6.services.len()) + 1);
            let big = f.spec(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
            assert!(matches!(st.upsert(&mut m, &f.fe(80), &big), Err(MapError::Full { .. })));
            let r = st.apply(&mut m, &[Op::Upsert(f.fe(81), big.clone()), Op::Upsert(f.fe(82), big.clone())]);
            assert!(r.iter().all(|r| matches!(r, Err(MapError::Full { .. }))), "{r:?}");
            for port in [80, 81, 82] {
                assert_eq!(programmed(&m, &f.fe(port)), f.spec(SHAPES[6]).backends);
            }
            let (maps, state) = both(&m, &st);
            assert_eq!(maps, state, "the state knows what the maps hold");
            m.max_services = None;
            let r = st.apply(&mut m, &[Op::Delete(f.fe(80)), Op::Delete(f.fe(81))]);
            assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
            st.delete(&mut m, &f.fe(82)).unwrap();
            assert!(m.dump().frontends().is_empty() && backends_in_maps(&m).is_empty());
            assert!(m.ranges.is_empty() && m.v4.matches.is_empty() && m.v6.matches.is_empty());
        }
    }

    /// Backend sets a frontend goes through: growing, shrinking, empty, replaced.
    const SHAPES: [&[u8]; 7] = [&[1], &[1, 2, 3], &[3], &[], &[4, 5, 6, 7], &[1, 7], &[2, 3, 4, 5, 6, 7, 8, 9]];

    #[test]
    fn every_intermediate_state_is_consistent() {
        // MemMaps::checked() asserts the invariant after each write; walk through many shapes.
        for f in FAMILIES {
            let mut m = MemMaps::checked();
            let mut st = LbState::new();
            for s in SHAPES {
                st.upsert(&mut m, &f.fe(80), &f.spec(s)).unwrap();
                st.upsert(&mut m, &f.fe(81), &f.spec(s)).unwrap();
                assert_eq!(programmed(&m, &f.fe(80)), f.spec(s).backends);
            }
            st.delete(&mut m, &f.fe(80)).unwrap();
            st.delete(&mut m, &f.fe(81)).unwrap();
            assert!(m.v4.services.is_empty() && m.v4.backends.is_empty() && m.v6.services.is_empty() && m.v6.backends.is_empty());
        }
    }

    #[test]
    fn zero_backends_is_a_master_with_count_zero() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[])).unwrap();
        assert_eq!(m.v4.services[&service_key(&fe(80))].count, 0);
        assert_eq!(m.v4.services.len(), 1);
    }

    #[test]
    fn backends_are_shared_and_refcounted() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        st.upsert(&mut m, &fe(81), &spec(&[2, 3])).unwrap();
        assert_eq!(m.v4.backends.len(), 3);
        st.delete(&mut m, &fe(80)).unwrap();
        assert_eq!(m.v4.backends.len(), 2, "backend 2 is still used by :81");
        assert_eq!(programmed(&m, &fe(81)), vec![be(2), be(3)]);
    }

    #[test]
    fn ids_are_not_reused_while_running() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1])).unwrap();
        let first: Vec<u32> = m.v4.backends.keys().copied().collect();
        st.upsert(&mut m, &fe(80), &spec(&[2])).unwrap();
        assert!(!m.v4.backends.keys().any(|k| first.contains(k)));
    }

    #[test]
    fn full_map_leaves_previous_programming_intact() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        m.max_services = Some(m.v4.services.len() + 1);
        let err = st.upsert(&mut m, &fe(80), &spec(&[1, 2, 3, 4])).unwrap_err();
        assert!(matches!(err, MapError::Full { .. }), "{err}");
        assert_eq!(programmed(&m, &fe(80)), vec![be(1), be(2)]);
        assert_eq!(m.v4.backends.len(), 2, "backends created for the failed upsert are removed");
        // And the state still matches the maps: a later, smaller change works.
        m.max_services = None;
        st.upsert(&mut m, &fe(80), &spec(&[2, 3])).unwrap();
        assert_eq!(programmed(&m, &fe(80)), vec![be(2), be(3)]);
        m.max_backends = Some(0);
        assert!(st.upsert(&mut m, &fe(90), &spec(&[9])).is_err());
        assert!(!m.v4.services.contains_key(&service_key(&fe(90))));
    }

    #[test]
    fn adopt_restores_state_and_next_sync_writes_only_the_difference() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2, 3])).unwrap();
        st.upsert(&mut m, &fe(81), &spec(&[3, 4])).unwrap();
        let mut adopted = LbState::adopt(&m.dump());
        assert_eq!(adopted.frontend_count(), 2);
        assert_eq!(adopted.backend_count(), 4);
        let w = adopted.upsert(&mut m, &fe(80), &spec(&[1, 2, 3])).unwrap();
        assert_eq!(w.total(), 0);
        let w = adopted.upsert(&mut m, &fe(81), &spec(&[4])).unwrap();
        assert!(w.total() <= 3);
        assert!(m.v4.backends.values().any(|b| backend_from_value(b) == be(3)), "still used by :80");
        let ids: BTreeSet<u32> = m.v4.backends.keys().copied().collect();
        adopted.upsert(&mut m, &fe(82), &spec(&[9])).unwrap();
        let new_id = *m.v4.backends.keys().find(|k| !ids.contains(k)).unwrap();
        assert!(new_id > *ids.iter().max().unwrap());
    }

    #[test]
    fn snat_and_remote_flags_reach_the_maps_and_survive_adoption() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let remote = Backend { remote: true, ..be(2) };
        let s = FrontendSpec { backends: vec![be(1), remote], snat_remote: true, ..Default::default() };
        st.upsert(&mut m, &fe(80), &s).unwrap();
        assert_eq!(m.v4.services[&service_key(&fe(80))].flags, SVC_FLAG_SNAT_REMOTE);
        let flags: BTreeSet<u8> = m.v4.backends.values().map(|b| b.flags).collect();
        assert_eq!(flags, BTreeSet::from([0, BE_FLAG_REMOTE]));
        let d = m.dump().frontends();
        assert!(d[0].snat_remote && d[0].backends.contains(&remote));
        // A restart rewrites nothing; a change of the flag alone rewrites the master only.
        let mut adopted = LbState::adopt(&m.dump());
        assert_eq!(adopted.upsert(&mut m, &fe(80), &s).unwrap().total(), 0);
        let w = adopted.upsert(&mut m, &fe(80), &FrontendSpec { snat_remote: false, ..s.clone() }).unwrap();
        assert_eq!(w.total(), 1, "{w:?}");
        assert_eq!(m.v4.services[&service_key(&fe(80))].flags, SVC_FLAG_NONE);
        // The same address moving to another node is another backend (its flag differs).
        let w = adopted.upsert(&mut m, &fe(80), &FrontendSpec { backends: vec![be(1), be(2)], ..Default::default() }).unwrap();
        assert!(w.total() >= 3, "{w:?}");
        assert!(m.v4.backends.values().all(|b| b.flags == 0));
    }

    #[test]
    fn source_ranges_are_in_place_before_the_master_restricts_and_gone_after() {
        // MemMaps::checked() asserts after every write that a restricting master has ranges.
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let cidrs = |v: &[&str]| v.iter().map(|c| c.parse().unwrap()).collect::<Vec<Cidr>>();
        let with = |r: &[&str]| FrontendSpec { source_ranges: cidrs(r), ..spec(&[1, 2]) };
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        let w = st.upsert(&mut m, &fe(80), &with(&["198.51.100.0/24", "10.0.0.0/8"])).unwrap();
        assert_eq!(w, Writes { puts: 3, deletes: 0 }, "two ranges, then the master");
        assert_eq!(m.v4.services[&service_key(&fe(80))].flags, SVC_FLAG_SOURCE_RANGES);
        let d = m.dump().frontends();
        assert_eq!(d[0].source_ranges, cidrs(&["10.0.0.0/8", "198.51.100.0/24"]));
        // One range replaced: put it, rewrite the master, delete the old one.
        let w = st.upsert(&mut m, &fe(80), &with(&["198.51.100.0/24", "192.0.2.0/24"])).unwrap();
        assert_eq!((w.puts, w.deletes), (2, 1), "{w:?}");
        // A restart adopts them: nothing to write.
        let mut adopted = LbState::adopt(&m.dump());
        assert_eq!(adopted.upsert(&mut m, &fe(80), &with(&["198.51.100.0/24", "192.0.2.0/24"])).unwrap().total(), 0);
        // Restriction lifted: master first, then the ranges go.
        adopted.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        assert!(m.ranges.is_empty());
        assert_eq!(m.v4.services[&service_key(&fe(80))].flags, SVC_FLAG_NONE);
        // Deleting a restricted frontend removes its ranges too.
        adopted.upsert(&mut m, &fe(81), &FrontendSpec { source_ranges: cidrs(&["10.0.0.0/8"]), ..spec(&[3]) }).unwrap();
        adopted.delete(&mut m, &fe(81)).unwrap();
        assert!(m.ranges.is_empty());
    }

    #[test]
    fn source_ranges_left_without_a_master_are_cleaned_up_by_the_next_upsert() {
        let mut m = MemMaps::checked();
        let stray: Cidr = "203.0.113.0/24".parse().unwrap();
        m.ranges.insert(RangeKey::of(&fe(80), &stray).unwrap());
        let mut st = LbState::adopt(&m.dump());
        st.upsert(&mut m, &fe(80), &FrontendSpec { source_ranges: vec!["10.0.0.0/8".parse().unwrap()], ..spec(&[1]) }).unwrap();
        let left: Vec<String> = m.dump().ranges_by_frontend()[&fe(80)].iter().map(|c| c.to_string()).collect();
        assert_eq!(left, ["10.0.0.0/8"], "the stray range must not admit anyone");
    }

    #[test]
    fn adopt_drops_inconsistent_frontends() {
        let mut m = MemMaps::default();
        let key = service_key(&fe(80));
        m.v4.services.insert(key, ServiceValue { count: 2, ..Default::default() });
        m.v4.services.insert(key.with_slot(1), ServiceValue { backend_id: 5, ..Default::default() });
        m.v4.backends.insert(5, backend_value(&be(1), Proto::Tcp));
        let st = LbState::adopt(&m.dump());
        assert!(!st.contains(&fe(80)));
        assert_eq!(st.backend_count(), 0);
    }

    #[test]
    fn affinity_match_entries_follow_membership() {
        // Backend ids of the affinity matches and of the backends, both families.
        let matched = |m: &MemMaps| -> BTreeSet<u32> { m.v4.matches.iter().map(|k| k.backend_id).chain(m.v6.matches.iter().map(|k| k.backend_id)).collect() };
        let live = |m: &MemMaps| -> BTreeSet<u32> { m.v4.backends.keys().chain(m.v6.backends.keys()).copied().collect() };
        for f in FAMILIES {
            let mut m = MemMaps::checked();
            let mut st = LbState::new();
            let aff = |bs: &[u8]| FrontendSpec { affinity_timeout: 60, ..f.spec(bs) };
            st.upsert(&mut m, &f.fe(80), &aff(&[1, 2, 3])).unwrap();
            assert_eq!(m.v4.matches.len() + m.v6.matches.len(), 3);
            st.upsert(&mut m, &f.fe(80), &aff(&[1, 3])).unwrap();
            assert_eq!(matched(&m), live(&m), "exactly the current members are eligible for affinity");
            st.upsert(&mut m, &f.fe(80), &f.spec(&[1, 3])).unwrap();
            assert!(matched(&m).is_empty(), "affinity switched off");
            st.upsert(&mut m, &f.fe(80), &aff(&[1])).unwrap();
            st.delete(&mut m, &f.fe(80)).unwrap();
            assert!(matched(&m).is_empty() && live(&m).is_empty());
        }
    }

    #[test]
    fn plan_slots_keeps_survivors_in_place() {
        assert_eq!(plan_slots(&[1, 2, 3], &[1, 3]), vec![1, 3]);
        assert_eq!(plan_slots(&[1, 2, 3, 4], &[1, 3, 4]), vec![1, 4, 3]);
        assert_eq!(plan_slots(&[1, 2, 3], &[1, 2, 3, 9]), vec![1, 2, 3, 9]);
        assert_eq!(plan_slots(&[1, 2, 3], &[9, 1, 3]), vec![1, 9, 3]);
        assert_eq!(plan_slots(&[], &[5, 6]), vec![5, 6]);
        assert_eq!(plan_slots(&[5, 6], &[]), Vec::<u32>::new());
        assert_eq!(plan_slots(&[1, 2, 3, 4, 5], &[5]), vec![5]);
    }

    #[test]
    fn v6_keys_and_backends_are_in_network_order() {
        let k = service_key_v6(&fe6(80));
        let mut bytes = Vec::new();
        for w in k.addr {
            bytes.extend_from_slice(&w.to_ne_bytes());
        }
        assert_eq!(bytes, "fd00:19::10".parse::<std::net::Ipv6Addr>().unwrap().octets());
        assert_eq!(k.port, 80u16.to_be());
        assert_eq!((k.proto, k.slot), (6, 0));
        assert_eq!(svc_key(&fe6(80)), SvcKey::V6(k));
        assert!(matches!(svc_key(&fe(80)), SvcKey::V4(_)));
        let b = backend_value::<Ip6>(&be6(0x10), Proto::Udp);
        assert_eq!(b.addr[0].to_ne_bytes(), [0xfd, 0x00, 0x00, 0x18]);
        assert_eq!(b.addr[3].to_ne_bytes(), [0, 0, 0, 0x10]);
        assert_eq!((b.port, b.proto), (8080u16.to_be(), 17));
        assert_eq!(backend_from_value(&b), be6(0x10));
    }

    #[test]
    fn v6_frontends_go_to_the_v6_maps_make_before_break() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        for s in SHAPES {
            st.upsert(&mut m, &fe6(80), &spec6(s)).unwrap();
            st.upsert(&mut m, &fe(80), &spec(s)).unwrap();
            assert_eq!(programmed(&m, &fe6(80)), spec6(s).backends);
            assert_eq!(programmed(&m, &fe(80)), spec(s).backends);
            assert_eq!(m.v6.services[&service_key_v6(&fe6(80))].count as usize, s.len());
        }
        // Separate maps, one id space.
        assert!(m.v4.backends.keys().all(|id| !m.v6.backends.contains_key(id)));
        assert_eq!(m.v4.services.len(), m.v6.services.len());
        st.delete(&mut m, &fe6(80)).unwrap();
        assert!(m.v6.services.is_empty() && m.v6.backends.is_empty());
        assert_eq!(programmed(&m, &fe(80)).len(), 8, "IPv4 untouched");
        st.delete(&mut m, &fe(80)).unwrap();
        assert!(m.v4.services.is_empty() && m.v4.backends.is_empty());
    }

    #[test]
    fn v6_full_map_rolls_back_and_adopt_restores_both_families() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe6(80), &spec6(&[1, 2])).unwrap();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        m.max_services = Some(m.v6.services.len() + 1);
        assert!(matches!(st.upsert(&mut m, &fe6(80), &spec6(&[1, 2, 3, 4])), Err(MapError::Full { .. })));
        assert_eq!(programmed(&m, &fe6(80)), vec![be6(1), be6(2)]);
        assert_eq!(m.v6.backends.len(), 2);
        m.max_services = None;
        let mut adopted = LbState::adopt(&m.dump());
        assert_eq!(adopted.frontend_count(), 2);
        assert_eq!(adopted.backend_count(), 4);
        assert_eq!(adopted.upsert(&mut m, &fe6(80), &spec6(&[1, 2])).unwrap().total(), 0);
        let ids: BTreeSet<u32> = m.v4.backends.keys().chain(m.v6.backends.keys()).copied().collect();
        adopted.upsert(&mut m, &fe6(81), &spec6(&[9])).unwrap();
        let new_id = *m.v6.backends.keys().find(|k| !ids.contains(k)).unwrap();
        assert!(new_id > *ids.iter().max().unwrap(), "ids continue after both families' maxima");
        let d = m.dump().frontends();
        assert_eq!(d.iter().map(|d| d.frontend.to_string()).collect::<Vec<_>>(), ["10.96.0.10:80/tcp", "[fd00:19::10]:80/tcp", "[fd00:19::10]:81/tcp"]);
    }

    /// Frontends with their backends (sorted) and dangling slots.
    type Seen = Vec<(String, Vec<Backend>, u32)>;

    /// The frontends as the maps have them, and as the state knows them.
    fn both(m: &MemMaps, st: &LbState) -> (Seen, Seen) {
        let maps = m.dump().frontends().into_iter().map(|d| (d.frontend.to_string(), sorted(d.backends), d.dangling_slots)).collect();
        let state = st.frontends().map(|f| (f.to_string(), sorted(st.backends_of(f)), 0)).collect();
        (maps, state)
    }

    fn sorted(mut v: Vec<Backend>) -> Vec<Backend> {
        v.sort();
        v
    }

    #[test]
    fn apply_in_batches_ends_where_one_by_one_does() {
        // Same ops through apply (batched, MemMaps checks after every element) and through
        // upsert/delete one at a time: same maps, same state.
        let cidr = |c: &str| -> Cidr { c.parse().unwrap() };
        let rounds: Vec<Vec<Op>> = vec![
            vec![
                Op::Upsert(fe(80), spec(&[1, 2, 3])),
                Op::Upsert(fe(81), FrontendSpec { affinity_timeout: 30, ..spec(&[3, 4]) }),
                Op::Upsert(fe6(80), spec6(&[1, 2])),
                Op::Upsert(fe(82), FrontendSpec { source_ranges: vec![cidr("10.0.0.0/8")], ..spec(&[5]) }),
                Op::Upsert(fe(83), spec(&[])),
                Op::Upsert(fe(86), spec(&[7, 11])),
            ],
            vec![
                // A slot readers reach now gets a backend new to the maps: only after it.
                Op::Upsert(fe(86), spec(&[10, 11])),
                // Backend 3 leaves :80 and stays with :81; 1 moves from :80 to :84.
                Op::Upsert(fe(80), spec(&[2])),
                Op::Upsert(fe(84), spec(&[1, 9])),
                Op::Upsert(fe(81), spec(&[3, 4, 6])),
                Op::Delete(fe6(80)),
                Op::Upsert(fe(82), FrontendSpec { source_ranges: vec![cidr("192.0.2.0/24")], ..spec(&[5, 6]) }),
                Op::Upsert(fe(83), spec(&[])),
            ],
            vec![
                Op::Delete(fe(80)),
                Op::Upsert(fe(85), spec(&[2])),
                Op::Upsert(fe(81), FrontendSpec { affinity_timeout: 30, ..spec(&[4]) }),
                Op::Delete(fe(82)),
                Op::Upsert(fe6(81), spec6(&[7])),
                // The same frontend twice: the second change comes after the first.
                Op::Upsert(fe(84), spec(&[1])),
                Op::Upsert(fe(84), spec(&[8])),
            ],
        ];
        let (mut bm, mut bs) = (MemMaps::checked(), LbState::new());
        let (mut sm, mut ss) = (MemMaps::checked(), LbState::new());
        for ops in &rounds {
            let batched: Vec<Writes> = bs.apply(&mut bm, ops).into_iter().map(|r| r.unwrap()).collect();
            let single: Vec<Writes> = ops
                .iter()
                .map(|op| match op {
                    Op::Upsert(f, s) => ss.upsert(&mut sm, f, s).unwrap(),
                    Op::Delete(f) => ss.delete(&mut sm, f).unwrap(),
                })
                .collect();
            // A backend leaving one frontend and joining another in the same batch is kept,
            // not deleted and created again: never more writes than one by one.
            let total = |v: &[Writes]| v.iter().map(|w| w.total()).sum::<u32>();
            assert!(total(&batched) <= total(&single), "{batched:?} vs {single:?}");
            assert_eq!(batched.len(), single.len());
            let (b, s) = (both(&bm, &bs), both(&sm, &ss));
            assert_eq!(b, s);
            assert_eq!(b.0, b.1, "the state knows what the maps hold");
            assert_eq!(bm.ranges, sm.ranges);
            assert_eq!(bm.v4.matches.len(), sm.v4.matches.len());
            assert_eq!(bm.v4.backends.len(), sm.v4.backends.len());
            assert_eq!(bs.backend_count(), bm.v4.backends.len() + bm.v6.backends.len());
        }
        assert!(bm.batches > 0);
        assert!(bm.writes <= sm.writes, "no extra writes: {} vs {}", bm.writes, sm.writes);
    }

    #[test]
    fn a_backend_moving_between_frontends_in_one_batch_keeps_its_id() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        let id2 = *m.v4.backends.iter().find(|(_, b)| backend_from_value(b) == be(2)).unwrap().0;
        let r = st.apply(&mut m, &[Op::Delete(fe(80)), Op::Upsert(fe(81), spec(&[2, 3]))]);
        assert!(r.iter().all(|r| r.is_ok()));
        assert!(m.v4.backends.contains_key(&id2), "never deleted: :81 uses it");
        assert_eq!(m.v4.backends.len(), 2);
        assert_eq!(programmed(&m, &fe(81)), vec![be(2), be(3)]);
        assert!(!m.v4.services.contains_key(&service_key(&fe(80))));
    }

    #[test]
    fn a_map_filling_up_mid_batch_fails_only_the_frontends_that_do_not_fit() {
        // Five frontends with two backends each, then all grow to four in one batch: the
        // services map has room for two of them. The batch fails in its slot step, is undone,
        // and the frontends are redone one by one: the first two grow, the others report the
        // full map and keep their two backends. MemMaps checks every element of every step.
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let fes: Vec<Frontend> = (80..85).map(fe).collect();
        let ops: Vec<Op> = fes.iter().map(|f| Op::Upsert(*f, spec(&[1, 2]))).collect();
        assert!(st.apply(&mut m, &ops).iter().all(|r| r.is_ok()));
        m.max_services = Some(m.v4.services.len() + 4);
        let ops: Vec<Op> = fes.iter().map(|f| Op::Upsert(*f, spec(&[1, 2, 3, 4]))).collect();
        let batches = m.batches;
        let r = st.apply(&mut m, &ops);
        assert!(m.batches > batches);
        assert!(r[0].is_ok() && r[1].is_ok(), "{r:?}");
        for r in &r[2..] {
            assert!(matches!(r, Err(MapError::Full { .. })), "{r:?}");
        }
        for f in &fes[..2] {
            assert_eq!(programmed(&m, f), vec![be(1), be(2), be(3), be(4)]);
        }
        for f in &fes[2..] {
            assert_eq!(programmed(&m, f), vec![be(1), be(2)]);
        }
        // The state matches the maps: what a restart would adopt, and later changes work.
        let (maps, state) = both(&m, &st);
        assert_eq!(maps, state, "no dangling slots, and the state knows what the maps hold");
        assert_eq!(st.backend_count(), m.v4.backends.len());
        m.max_services = None;
        assert!(st.apply(&mut m, &ops).iter().all(|r| r.is_ok()));
        for f in &fes {
            assert_eq!(programmed(&m, f), vec![be(1), be(2), be(3), be(4)]);
        }
    }

    #[test]
    fn a_map_filling_up_in_the_master_step_unpublishes_and_redoes_one_by_one() {
        // New frontends, one backend each: all slots fit, the services map fills after two
        // masters. Those two are put back (deleted), everything else undone, then redone one
        // by one: the first frontends that fit are programmed, the rest report the full map.
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let n = 6;
        m.max_services = Some(n + 2);
        let ops: Vec<Op> = (0..n as u16).map(|i| Op::Upsert(fe(80 + i), spec(&[i as u8 + 1]))).collect();
        let r = st.apply(&mut m, &ops);
        let ok = r.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, (n + 2) / 2, "{r:?}");
        assert!(r[ok..].iter().all(|r| matches!(r, Err(MapError::Full { .. }))));
        assert_eq!(m.v4.services.len(), 2 * ok);
        assert_eq!(m.v4.backends.len(), ok, "backends of failed frontends are gone");
        assert_eq!(st.backend_count(), ok);
        for (i, f) in (0..n as u16).map(|i| fe(80 + i)).enumerate() {
            assert_eq!(st.contains(&f), i < ok);
        }
    }

    #[test]
    fn a_full_backend_map_mid_batch_is_reported_for_the_frontends_concerned() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1])).unwrap();
        m.max_backends = Some(3);
        let ops = vec![Op::Upsert(fe(80), spec(&[1, 2])), Op::Upsert(fe(81), spec(&[3, 4])), Op::Upsert(fe(82), spec(&[1]))];
        let r = st.apply(&mut m, &ops);
        assert!(r[0].is_ok() && r[2].is_ok(), "{r:?}");
        assert!(matches!(r[1], Err(MapError::Full { .. })), "{r:?}");
        assert_eq!(programmed(&m, &fe(80)), vec![be(1), be(2)]);
        assert_eq!(programmed(&m, &fe(82)), vec![be(1)]);
        assert!(!m.v4.services.contains_key(&service_key(&fe(81))));
        assert_eq!(m.v4.backends.len(), 2);
    }

    #[test]
    fn backend_index_finds_ids_through_growth_and_removal() {
        let mut b = Backends::default();
        let key = |i: u32| (Backend::new(Ipv4Addr::from(0x0a00_0000 + i).into(), 8080), Proto::Tcp);
        for i in 1..=5000 {
            b.insert(key(i), i);
        }
        for i in (1..=5000).step_by(2) {
            b.remove(i);
        }
        assert_eq!(b.len(), 2500);
        for i in 1..=5000 {
            assert_eq!(b.id_of(&key(i)), (i % 2 == 0).then_some(i), "{i}");
        }
        // A backend a previous agent left under two ids: found by the first, both counted.
        b.adopt(key(2), 9000);
        assert_eq!(b.id_of(&key(2)), Some(2));
        assert!(b.contains_id(&9000));
        b.remove(9000);
        assert_eq!(b.id_of(&key(2)), Some(2), "removing the second id keeps the first");
        b.remove(2);
        assert_eq!(b.id_of(&key(2)), None);
    }

    #[test]
    fn dump_reports_dangling_slots() {
        let mut m = MemMaps::default();
        let key = service_key(&fe(80));
        m.v4.services.insert(key, ServiceValue { count: 1, ..Default::default() });
        let d = m.dump().frontends();
        assert_eq!(d[0].dangling_slots, 1);
    }
}
