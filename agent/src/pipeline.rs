//! Source events -> per-Service translation -> make-before-break map writes.
//!
//! Only the Services touched by an event are re-translated and re-programmed, so one
//! EndpointSlice change costs map writes proportional to its own endpoints.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    ops::Range,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    dataplane::lbmap::{LbMaps, LbState, MapError, Op, ServiceNet, ServiceNets, Writes},
    desired::{Backend, Cidr, Frontend, Proto},
    gardener::config::NodePortAddress,
    source::objects::{ServiceCidrView, ServiceView, SliceView},
    source::SourceEvent,
    translate::{self, NodeInfo, Problem, ProblemKind},
};

/// The pipeline's bookkeeping of every object, keyed by names and frontends: foldhash instead
/// of std's SipHash (a full sync at 10,000 Services hashes a few hundred thousand keys; about
/// 5-9% of it in `cargo xtask bench control-plane`). Still seeded at random per process, so
/// names chosen to collide cannot be precomputed.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Frontend changes collected before they are written in one [`LbState::apply`] (bounds the
/// memory of one batch; a full sync of 30,000 Services is ~30 batches).
const PENDING_MAX: usize = 1024;

/// How long a slice may wait for its Service before it is reported.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(5);

/// Counters the agent reports (logs, metrics).
#[derive(Clone, Debug, Default)]
pub struct PipelineStats {
    pub problems: u64,
    pub conflicts: u64,
    pub map_errors: u64,
    pub writes: Writes,
    pub flushes: u64,
}

/// What one flush did.
#[derive(Clone, Debug, Default)]
pub struct FlushReport {
    pub services: usize,
    pub writes: Writes,
    pub problems: Vec<Problem>,
    /// UDP frontends and the backends they lost: conntrack entries of such flows must go,
    /// or a long-lived client socket keeps sending to the old backend (kube-proxy clears
    /// them too). TCP flows end by themselves.
    pub stale_udp: Vec<(Frontend, Backend)>,
    /// TCP backends that left their Service altogether (see [`Departure`]).
    pub departed_tcp: Vec<Departure>,
}

/// An endpoint address that a Service's EndpointSlices listed and list no more, under any
/// condition (a terminating or not-ready endpoint is still listed: its connections drain),
/// with one of the Service's TCP frontends. Idle sockets that socket LB sent from the
/// frontend to that address are terminated (`sockterm`), after [`Pipeline::still_departed`]
/// confirms it a moment later: an endpoint that moves from one slice to another can be
/// missing from both for one flush.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Departure {
    pub service: String,
    pub frontend: Frontend,
    pub addr: IpAddr,
}

pub struct Pipeline<M: LbMaps> {
    maps: M,
    lb: LbState,
    node: NodeInfo,
    /// Which of the Node's addresses serve NodePorts (NetworkConfig `nodePortAddresses`).
    node_port_addresses: Vec<NodePortAddress>,
    services: HashMap<String, Arc<ServiceView>>,
    slices: HashMap<String, Arc<SliceView>>,
    slices_by_svc: HashMap<String, BTreeSet<String>>,
    /// Frontends each Service currently owns in the maps.
    owned: HashMap<String, BTreeSet<Frontend>>,
    owner: HashMap<Frontend, String>,
    /// Services that wanted a frontend someone else owns; retried when it is released.
    contenders: HashMap<Frontend, BTreeSet<String>>,
    /// Services to translate again (the flush orders them by age).
    dirty: HashSet<String>,
    /// Per Service, endpoint addresses of slices changed or deleted since the last flush.
    unlisted: HashMap<String, BTreeSet<IpAddr>>,
    synced: bool,
    pruned: bool,
    resync: Option<(HashSet<String>, HashSet<String>)>,
    health: HashMap<String, translate::HealthCheck>,
    /// Slices applied recently, with when: checked for a Service to belong to once
    /// `ORPHAN_GRACE` has passed (see [`Pipeline::orphan_slices`]).
    applied_slices: HashMap<String, Instant>,
    /// ServiceCIDRs by name, and the writer of the ranges and ClusterIPs they imply.
    service_cidrs: BTreeMap<String, Arc<ServiceCidrView>>,
    nets: ServiceNets,
    /// Ranges or ClusterIPs may have changed since the last flush.
    nets_dirty: bool,
    /// ServiceCIDRs seen since a `Resync` began.
    resync_cidrs: Option<HashSet<String>>,
    /// Frontend changes decided in this flush and not written yet.
    pending: Pending,
    pub stats: PipelineStats,
}

/// Frontend changes of Services applied in a flush, written together by
/// [`Pipeline::write_pending`]; ownership is settled from their results.
#[derive(Default)]
struct Pending {
    ops: Vec<Op>,
    /// Per op: the frontend's UDP backends before the change (for conntrack cleanup).
    before: Vec<Vec<Backend>>,
    services: Vec<PendingService>,
    fes: HashSet<Frontend>,
}

struct PendingService {
    key: String,
    /// Frontends it owned before.
    old: BTreeSet<Frontend>,
    /// Its ops: upserts, then deletes.
    ops: Range<usize>,
}

impl Pending {
    fn push(&mut self, op: Op, before: Vec<Backend>) {
        self.fes.insert(*op.frontend());
        self.ops.push(op);
        self.before.push(before);
    }
}

impl<M: LbMaps> Pipeline<M> {
    /// `lb` is the writer's view of the maps: empty, or adopted from a previous agent.
    pub fn new(maps: M, lb: LbState, node: NodeInfo) -> Self {
        Pipeline {
            maps,
            lb,
            node,
            node_port_addresses: vec![NodePortAddress::Primary],
            services: HashMap::default(),
            slices: HashMap::default(),
            slices_by_svc: HashMap::default(),
            owned: HashMap::default(),
            owner: HashMap::default(),
            contenders: HashMap::default(),
            dirty: HashSet::default(),
            unlisted: HashMap::default(),
            synced: false,
            pruned: false,
            resync: None,
            health: HashMap::default(),
            applied_slices: HashMap::default(),
            service_cidrs: BTreeMap::new(),
            nets: ServiceNets::default(),
            nets_dirty: true,
            resync_cidrs: None,
            pending: Pending::default(),
            stats: PipelineStats::default(),
        }
    }

    /// Starts from the service ranges and ClusterIPs a previous agent left in the maps.
    pub fn with_service_nets(mut self, adopted: &[(Cidr, ServiceNet)]) -> Self {
        self.nets = ServiceNets::adopt(adopted);
        self
    }

    /// Service ranges and ClusterIPs as programmed.
    pub fn service_nets(&self) -> &BTreeMap<Cidr, ServiceNet> {
        self.nets.programmed()
    }

    /// Which of the Node's addresses NodePorts are served on (default `[primary]`); applies
    /// from the next `NodeApplied`.
    pub fn with_node_port_addresses(mut self, select: Vec<NodePortAddress>) -> Self {
        self.node_port_addresses = select;
        self
    }

    /// What translation currently knows about this node.
    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Services that currently own at least one programmed frontend.
    pub fn service_count(&self) -> usize {
        self.owned.len()
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    pub fn lb(&self) -> &LbState {
        &self.lb
    }

    /// healthCheckNodePorts to serve, by port (first Service wins a port).
    pub fn health_checks(&self) -> std::collections::BTreeMap<u16, translate::HealthCheck> {
        let mut out = std::collections::BTreeMap::new();
        let mut keys: Vec<&String> = self.health.keys().collect();
        keys.sort();
        for k in keys {
            let h = &self.health[k];
            out.entry(h.port).or_insert_with(|| h.clone());
        }
        out
    }

    pub fn handle(&mut self, ev: SourceEvent) {
        match ev {
            SourceEvent::ServiceApplied(s) => {
                let k = s.key();
                self.seen(Some(&k), None);
                self.dirty.insert(k.clone());
                if self.services.get(&k).is_none_or(|o| o.cluster_ips != s.cluster_ips || o.foreign_cluster_ips != s.foreign_cluster_ips) {
                    self.nets_dirty = true;
                }
                self.services.insert(k, s);
            }
            SourceEvent::ServiceDeleted(s) => {
                let k = s.key();
                self.services.remove(&k);
                self.dirty.insert(k);
                self.nets_dirty = true;
            }
            SourceEvent::ServiceCidrApplied(c) => {
                if let Some(seen) = &mut self.resync_cidrs {
                    seen.insert(c.name.clone());
                }
                for p in &c.problems {
                    tracing::warn!(object = "ServiceCIDR", name = %c.name, "{p}");
                }
                self.service_cidrs.insert(c.name.clone(), c);
                self.nets_dirty = true;
            }
            SourceEvent::ServiceCidrDeleted(c) => {
                self.service_cidrs.remove(&c.name);
                self.nets_dirty = true;
            }
            SourceEvent::SliceApplied(sl) => {
                let k = sl.key();
                self.seen(None, Some(&k));
                self.remove_slice(&k);
                if let Some(svc) = sl.service_key() {
                    self.slices_by_svc.entry(svc.clone()).or_default().insert(k.clone());
                    self.dirty.insert(svc);
                }
                self.applied_slices.insert(k.clone(), Instant::now());
                self.slices.insert(k, sl);
            }
            SourceEvent::SliceDeleted(sl) => {
                let k = sl.key();
                self.remove_slice(&k);
            }
            SourceEvent::NodeApplied(n) => {
                // Only addresses and zone come from the Node; the rest is the agent's.
                let node = node_info(&n, &self.node_port_addresses);
                if node.addresses != self.node.addresses || node.zone != self.node.zone {
                    self.node.addresses = node.addresses;
                    self.node.zone = node.zone;
                    self.dirty.extend(self.services.keys().cloned());
                }
            }
            SourceEvent::LocalRedirectChanged(r) => {
                let svc = r.service.clone();
                match self.node.local_redirects.iter_mut().find(|o| o.service == r.service) {
                    Some(o) if *o == r => return,
                    Some(o) => *o = r,
                    None => self.node.local_redirects.push(r),
                }
                // A Service that is not there yet is translated with the new rule on arrival.
                if self.services.contains_key(&svc) {
                    self.dirty.insert(svc);
                }
            }
            SourceEvent::Resync => {
                self.resync = Some(Default::default());
                self.resync_cidrs = Some(Default::default());
            }
            SourceEvent::Synced => {
                if let Some(seen) = self.resync_cidrs.take() {
                    let before = self.service_cidrs.len();
                    self.service_cidrs.retain(|k, _| seen.contains(k));
                    self.nets_dirty |= self.service_cidrs.len() != before;
                }
                if let Some((svcs, slices)) = self.resync.take() {
                    let gone: Vec<String> = self.services.keys().filter(|k| !svcs.contains(*k)).cloned().collect();
                    for k in gone {
                        self.services.remove(&k);
                        self.dirty.insert(k);
                        self.nets_dirty = true;
                    }
                    let gone: Vec<String> = self.slices.keys().filter(|k| !slices.contains(*k)).cloned().collect();
                    for k in gone {
                        self.remove_slice(&k);
                    }
                }
                self.synced = true;
            }
        }
    }

    fn seen(&mut self, svc: Option<&String>, slice: Option<&String>) {
        if let Some((svcs, slices)) = &mut self.resync {
            svcs.extend(svc.cloned());
            slices.extend(slice.cloned());
        }
    }

    fn remove_slice(&mut self, k: &str) {
        if let Some(old) = self.slices.remove(k) {
            if let Some(svc) = old.service_key() {
                // Candidates for departure; the flush keeps those no slice lists any more.
                if !old.endpoints.is_empty() {
                    self.unlisted.entry(svc.clone()).or_default().extend(old.endpoints.iter().map(|e| e.addr));
                }
                if let Some(set) = self.slices_by_svc.get_mut(&svc) {
                    set.remove(k);
                    if set.is_empty() {
                        self.slices_by_svc.remove(&svc);
                    }
                }
                self.dirty.insert(svc);
            }
        }
    }

    /// Whether any EndpointSlice of Service `key` has an endpoint at `addr`.
    fn lists(&self, key: &str, addr: std::net::IpAddr) -> bool {
        self.slices_by_svc.get(key).is_some_and(|names| names.iter().filter_map(|n| self.slices.get(n)).any(|s| s.endpoints.iter().any(|e| e.addr == addr)))
    }

    /// Whether `d` still holds now: the Service still lists its address nowhere.
    pub fn still_departed(&self, d: &Departure) -> bool {
        !self.lists(&d.service, d.addr)
    }

    /// Programs every Service touched since the last flush. Does nothing before the source's
    /// first full sync, so a restarted agent never deletes what it has not seen yet.
    pub fn flush(&mut self) -> FlushReport {
        let mut rep = FlushReport::default();
        if !self.synced {
            return rep;
        }
        self.stats.flushes += 1;
        if self.dirty.len() > PENDING_MAX {
            // A sync: room for the backends its Services list, before the writer's tables grow.
            let listed = |k: &String| -> usize {
                let ports = self.services.get(k).map_or(0, |s| s.ports.len());
                let endpoints: usize = self.slices_by_svc.get(k).into_iter().flatten().filter_map(|n| self.slices.get(n)).map(|s| s.endpoints.len()).sum();
                ports * endpoints
            };
            let n = self.dirty.iter().map(listed).sum();
            self.lb.reserve_backends(n);
        }
        while !self.dirty.is_empty() {
            // Oldest Services first, so a contested frontend goes straight to the one that
            // keeps it (no brief detour through a newer claimant's backends after a restart).
            // The key is the Service's `rank()` tie-breaker already.
            let mut batch: Vec<(i64, String)> =
                std::mem::take(&mut self.dirty).into_iter().map(|k| (self.services.get(&k).and_then(|s| s.created).unwrap_or(i64::MAX), k)).collect();
            batch.sort_unstable();
            for (_, k) in batch {
                rep.services += 1;
                self.apply_service(&k, &mut rep);
            }
            self.write_pending(&mut rep);
        }
        if !self.pruned {
            // Frontends adopted from a previous run that no Service claims any more.
            self.pruned = true;
            let stale: Vec<Op> = self.lb.frontends().filter(|f| !self.owner.contains_key(f)).map(|f| Op::Delete(*f)).collect();
            let results = self.lb.apply(&mut self.maps, &stale);
            for (op, r) in stale.iter().zip(results) {
                match r {
                    Ok(w) => rep.writes += w,
                    Err(e) => self.map_error(&mut rep, "-", &e, format!("deleting stale frontend {}", op.frontend())),
                }
            }
        }
        if self.nets_dirty {
            // After the frontends: a new Service's ports exist before its ClusterIP rejects
            // the others.
            let want = self.wanted_service_nets();
            match self.nets.sync(&mut self.maps, &want) {
                Ok(w) => {
                    rep.writes += w;
                    self.nets_dirty = false;
                }
                Err(e) => self.map_error(&mut rep, "-", &e, "writing service ranges".into()),
            }
        }
        for p in &rep.problems {
            tracing::warn!(object = ?p.object, name = %p.service, kind = ?p.kind, "{}", p.message);
        }
        self.stats.writes += rep.writes;
        rep
    }

    /// Slices nobody can use: no `kubernetes.io/service-name` label, or no Service of that
    /// name. Each slice is checked once, `ORPHAN_GRACE` after it arrived: Services and
    /// slices come through separate watches, so a new Service's slice may arrive first. A
    /// Service deleted before its slices is not reported either (only arrivals are checked).
    /// Call it now and then (the run loop does on its tick); nothing before the first sync.
    pub fn orphan_slices(&mut self, now: Instant) -> Vec<Problem> {
        let mut out = Vec::new();
        if !self.synced {
            return out;
        }
        let mut due: Vec<String> =
            self.applied_slices.iter().filter(|(_, t)| now.saturating_duration_since(**t) >= ORPHAN_GRACE).map(|(k, _)| k.clone()).collect();
        due.sort_unstable();
        for k in due {
            self.applied_slices.remove(&k);
            let Some(sl) = self.slices.get(&k) else { continue };
            let message = match sl.service_key() {
                None => format!("EndpointSlice {k} has no {} label; ignored", translate::SERVICE_NAME_LABEL),
                Some(svc) if !self.services.contains_key(&svc) => format!("EndpointSlice {k} belongs to Service {svc}, which does not exist; ignored"),
                Some(_) => continue,
            };
            tracing::warn!(object = "EndpointSlice", name = %k, "{message}");
            self.stats.problems += 1;
            out.push(Problem::slice(k, message));
        }
        out
    }

    /// The service ranges and, inside them, every ClusterIP (kube-proxy's nftables
    /// `cluster-ips` set): a ClusterIP of ours rejects the ports it does not serve, one of
    /// another proxy's passes. Without ServiceCIDRs nothing (traffic to the ranges is left
    /// alone, as before).
    fn wanted_service_nets(&self) -> BTreeMap<Cidr, ServiceNet> {
        let mut want = BTreeMap::new();
        let ranges: Vec<Cidr> = self.service_cidrs.values().flat_map(|c| c.cidrs.iter().copied()).collect();
        if ranges.is_empty() {
            return want;
        }
        for r in ranges {
            want.insert(r, ServiceNet::Range);
        }
        for svc in self.services.values() {
            for ip in &svc.cluster_ips {
                want.insert(Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 }).expect("host prefix"), ServiceNet::ClusterIp);
            }
            for ip in &svc.foreign_cluster_ips {
                want.entry(Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 }).expect("host prefix")).or_insert(ServiceNet::Foreign);
            }
        }
        want
    }

    fn map_error(&mut self, rep: &mut FlushReport, svc: &str, e: &MapError, doing: String) {
        self.stats.map_errors += 1;
        let kind = if matches!(e, MapError::Full { .. }) { ProblemKind::MapFull } else { ProblemKind::MapIo };
        rep.problems.push(Problem::service(svc, kind, format!("{doing}: {e}")));
    }

    fn apply_service(&mut self, key: &str, rep: &mut FlushReport) {
        let t = match self.services.get(key) {
            Some(svc) => {
                let slices: Vec<&SliceView> = self.slices_by_svc.get(key).into_iter().flatten().filter_map(|k| self.slices.get(k).map(|s| &**s)).collect();
                translate::translate(svc, &slices, &self.node)
            }
            None => Default::default(),
        };
        self.stats.problems += t.problems.len() as u64;
        rep.problems.extend(t.problems);
        match &t.health_check {
            Some(h) => {
                self.health.insert(key.into(), h.clone());
            }
            None => {
                self.health.remove(key);
            }
        }
        if let Some(why) = &t.skipped {
            tracing::debug!(service = key, "not handled by gardenet: {why}");
        }

        // Who owns a frontend is settled when its change is written: a Service touching a
        // frontend whose change is still pending waits for it.
        if t.frontends.iter().map(|(fe, _)| fe).chain(self.owned.get(key).into_iter().flatten()).any(|fe| self.pending.fes.contains(fe)) {
            self.write_pending(rep);
        }
        let old = self.owned.remove(key).unwrap_or_default();
        let mut attempted = BTreeSet::new();
        let start = self.pending.ops.len();
        for (fe, spec) in t.frontends {
            if let Some(o) = self.owner.get(&fe).cloned() {
                if o != key {
                    self.stats.conflicts += 1;
                    let my_rank = self.services.get(key).map(|s| s.rank());
                    // An owner whose Service is already gone (its deletion is still queued)
                    // always yields.
                    let theirs = self.services.get(&o).map(|s| s.rank());
                    if theirs.is_some() && theirs <= my_rank {
                        rep.problems.push(Problem::service(
                            key,
                            ProblemKind::Conflict,
                            format!("frontend {fe} is already used by service {o} (older); not programmed"),
                        ));
                        self.contenders.entry(fe).or_default().insert(key.into());
                        continue;
                    }
                    // This Service is older: it takes the frontend over (the upsert below
                    // rewrites it in place) and the newer one waits as a contender.
                    if theirs.is_some() {
                        rep.problems.push(Problem::service(
                            o.clone(),
                            ProblemKind::Conflict,
                            format!("frontend {fe} is taken over by older service {key}; not programmed"),
                        ));
                    }
                    if let Some(set) = self.owned.get_mut(&o) {
                        set.remove(&fe);
                        if set.is_empty() {
                            self.owned.remove(&o);
                        }
                    }
                    self.contenders.entry(fe).or_default().insert(o);
                }
            }
            let before = if fe.proto == Proto::Udp { self.lb.backends_of(&fe) } else { Vec::new() };
            attempted.insert(fe);
            self.pending.push(Op::Upsert(fe, spec), before);
        }
        for fe in old.difference(&attempted) {
            let before = if fe.proto == Proto::Udp { self.lb.backends_of(fe) } else { Vec::new() };
            self.pending.push(Op::Delete(*fe), before);
        }
        let ops = start..self.pending.ops.len();
        self.pending.services.push(PendingService { key: key.into(), old, ops });
        if self.pending.ops.len() >= PENDING_MAX {
            self.write_pending(rep);
        }
    }

    /// Writes the pending frontend changes (batched) and settles ownership from the results.
    fn write_pending(&mut self, rep: &mut FlushReport) {
        let p = std::mem::take(&mut self.pending);
        let results = self.lb.apply(&mut self.maps, &p.ops);
        let mut results: Vec<Option<Result<Writes, MapError>>> = results.into_iter().map(Some).collect();
        let mut before = p.before;
        for s in p.services {
            let key = s.key.as_str();
            let mut now_owned = BTreeSet::new();
            for i in s.ops {
                let r = results[i].take().expect("one result per op");
                let before = std::mem::take(&mut before[i]);
                match (&p.ops[i], r) {
                    (Op::Upsert(fe, spec), Ok(w)) => {
                        rep.writes += w;
                        if !before.is_empty() {
                            let now: HashSet<&Backend> = spec.backends.iter().collect();
                            rep.stale_udp.extend(before.into_iter().filter(|b| !now.contains(b)).map(|b| (*fe, b)));
                        }
                        self.owner.insert(*fe, key.into());
                        now_owned.insert(*fe);
                        if let Some(c) = self.contenders.get_mut(fe) {
                            c.remove(key);
                        }
                    }
                    (Op::Upsert(fe, _), Err(e)) => {
                        // The previous programming (if any) is intact: keep owning it.
                        if s.old.contains(fe) {
                            now_owned.insert(*fe);
                        }
                        self.map_error(rep, key, &e, format!("frontend {fe}"));
                    }
                    (Op::Delete(fe), Ok(w)) => {
                        rep.writes += w;
                        rep.stale_udp.extend(before.into_iter().map(|b| (*fe, b)));
                        self.owner.remove(fe);
                        if let Some(c) = self.contenders.remove(fe) {
                            self.dirty.extend(c);
                        }
                    }
                    (Op::Delete(fe), Err(e)) => self.map_error(rep, key, &e, format!("deleting frontend {fe}")),
                }
            }
            // Endpoints the Service lists no more: idle sockets of its TCP frontends to them go.
            if let Some(candidates) = self.unlisted.remove(key) {
                // One pass over the Service's endpoints, not one per candidate.
                let listed: HashSet<IpAddr> = self
                    .slices_by_svc
                    .get(key)
                    .into_iter()
                    .flatten()
                    .filter_map(|n| self.slices.get(n))
                    .flat_map(|s| s.endpoints.iter().map(|e| e.addr))
                    .collect();
                for addr in candidates.into_iter().filter(|a| !listed.contains(a)) {
                    for fe in s.old.union(&now_owned).filter(|f| f.proto == Proto::Tcp) {
                        rep.departed_tcp.push(Departure { service: key.into(), frontend: *fe, addr });
                    }
                }
            }
            if !now_owned.is_empty() {
                self.owned.insert(s.key, now_owned);
            }
        }
    }
}

/// This node's NodePort addresses and zone label, from its Node object. `select` is the
/// NetworkConfig's `nodePortAddresses` (kube-proxy's `--nodeport-addresses`): `primary` takes
/// the first `InternalIP` of each family in `status.addresses` (the first `ExternalIP` of a
/// family without one), a CIDR every `InternalIP`/`ExternalIP` inside it. Loopback
/// addresses are never taken, whatever a CIDR covers (a NodePort on 127.0.0.1 exposes it to
/// every local process and through route_localnet). Addresses keep the Node's order.
pub fn node_info(n: &k8s_openapi::api::core::v1::Node, select: &[NodePortAddress]) -> NodeInfo {
    let listed: Vec<(bool, IpAddr)> = n
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| {
            let internal = match a.type_.as_str() {
                "InternalIP" => true,
                "ExternalIP" => false,
                _ => return None,
            };
            let ip: IpAddr = a.address.parse().ok()?;
            (!ip.is_loopback()).then_some((internal, ip))
        })
        .collect();
    let primary = |v4: bool| {
        let of_family = || listed.iter().filter(move |(_, ip)| ip.is_ipv4() == v4);
        of_family().find(|(internal, _)| *internal).or_else(|| of_family().next()).map(|(_, ip)| *ip)
    };
    let mut chosen: BTreeSet<IpAddr> = BTreeSet::new();
    for sel in select {
        match sel {
            NodePortAddress::Primary => chosen.extend([primary(true), primary(false)].into_iter().flatten()),
            cidr => chosen.extend(listed.iter().map(|(_, ip)| *ip).filter(|ip| cidr.cidr_contains(*ip))),
        }
    }
    let mut addresses = Vec::new();
    for (_, ip) in &listed {
        if chosen.contains(ip) && !addresses.contains(ip) {
            addresses.push(*ip);
        }
    }
    let zone = n.metadata.labels.as_ref().and_then(|l| l.get("topology.kubernetes.io/zone")).cloned();
    NodeInfo { name: n.metadata.name.clone().unwrap_or_default(), addresses, zone, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::lbmap::MemMaps,
        translate::{
            tests::{slice, svc},
            LocalRedirect, ProblemObject,
        },
    };

    fn web(ip: &str, name: &str) -> ServiceView {
        svc(&format!("metadata: {{name: {name}, namespace: d}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}"))
    }
    fn eps(svc_name: &str, name: &str, ips: &[&str]) -> SliceView {
        let e: Vec<String> = ips.iter().map(|i| format!("{{addresses: [{i}]}}")).collect();
        slice(&format!("metadata: {{name: {name}, namespace: d, labels: {{kubernetes.io/service-name: {svc_name}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{}]", e.join(",")))
    }
    fn pipeline() -> Pipeline<MemMaps> {
        Pipeline::new(MemMaps::checked(), LbState::new(), NodeInfo::default())
    }
    fn service_cidr(name: &str, cidrs: &[&str]) -> Arc<ServiceCidrView> {
        let o: k8s_openapi::api::networking::v1::ServiceCIDR = serde_yaml::from_str(&format!(
            "metadata: {{name: {name}}}\nspec: {{cidrs: [{}]}}",
            cidrs.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ")
        ))
        .unwrap();
        Arc::new(ServiceCidrView::from(&o))
    }
    fn nets(p: &Pipeline<MemMaps>) -> Vec<String> {
        p.maps().service_nets.iter().map(|(c, k)| format!("{c} {k:?}")).collect()
    }

    #[test]
    fn service_ranges_and_cluster_ips_follow_service_cidrs_and_services() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.10", "a"))));
        let foreign = svc(
            "metadata: {name: f, namespace: d, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.96.0.77, ports: [{port: 80}]}",
        );
        p.handle(SourceEvent::ServiceApplied(Arc::new(foreign)));
        p.handle(SourceEvent::Synced);
        p.flush();
        assert!(nets(&p).is_empty(), "no ServiceCIDRs: nothing enforced");
        p.handle(SourceEvent::ServiceCidrApplied(service_cidr("kubernetes", &["10.96.0.0/16", "fd00:96::/112"])));
        let r = p.flush();
        assert_eq!(nets(&p), ["10.96.0.0/16 Range", "10.96.0.10/32 ClusterIp", "10.96.0.77/32 Foreign", "fd00:96::/112 Range"]);
        assert_eq!(r.writes.puts, 4);
        // A new Service adds its ClusterIP, a deleted one takes it away; endpoints do not matter.
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.11", "b"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-1", &["10.0.0.1"]))));
        p.flush();
        assert!(nets(&p).contains(&"10.96.0.11/32 ClusterIp".to_string()));
        p.handle(SourceEvent::ServiceDeleted(Arc::new(web("10.96.0.11", "b"))));
        p.handle(SourceEvent::ServiceCidrApplied(service_cidr("extra", &["10.97.0.0/24"])));
        p.flush();
        assert_eq!(nets(&p), ["10.96.0.0/16 Range", "10.96.0.10/32 ClusterIp", "10.96.0.77/32 Foreign", "10.97.0.0/24 Range", "fd00:96::/112 Range"]);
        // A relist without the extra ServiceCIDR removes it; the last one gone, nothing stays.
        p.handle(SourceEvent::Resync);
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.10", "a"))));
        p.handle(SourceEvent::ServiceCidrApplied(service_cidr("kubernetes", &["10.96.0.0/16"])));
        p.handle(SourceEvent::Synced);
        p.flush();
        assert_eq!(nets(&p), ["10.96.0.0/16 Range", "10.96.0.10/32 ClusterIp"]);
        p.handle(SourceEvent::ServiceCidrDeleted(service_cidr("kubernetes", &[])));
        p.flush();
        assert!(nets(&p).is_empty());
        // A restarted agent adopts what is there and writes nothing when nothing changed.
        p.handle(SourceEvent::ServiceCidrApplied(service_cidr("kubernetes", &["10.96.0.0/16"])));
        p.flush();
        let adopted: Vec<_> = p.maps().dump().service_nets;
        let left = MemMaps { service_nets: adopted.iter().copied().collect(), ..MemMaps::checked() };
        let mut p2 = Pipeline::new(left, LbState::new(), NodeInfo::default()).with_service_nets(&adopted);
        p2.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.10", "a"))));
        p2.handle(SourceEvent::ServiceCidrApplied(service_cidr("kubernetes", &["10.96.0.0/16"])));
        p2.handle(SourceEvent::Synced);
        p2.flush();
        assert_eq!(p2.maps().writes, 1, "the frontend's master, no service-net writes: {:?}", p2.maps().service_nets);
        assert_eq!(p2.service_nets().len(), 2);
    }

    fn backends(p: &Pipeline<MemMaps>, fe: &str) -> Vec<String> {
        let fe: Frontend = fe.parse().unwrap();
        p.maps()
            .dump()
            .frontends()
            .into_iter()
            .find(|d| d.frontend == fe)
            .map(|d| {
                let mut v: Vec<String> = d.backends.iter().map(|b| b.to_string()).collect();
                v.sort();
                v
            })
            .unwrap_or_default()
    }

    #[test]
    fn nothing_is_programmed_before_the_first_sync() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        assert_eq!(p.flush().services, 0);
        p.handle(SourceEvent::Synced);
        assert_eq!(p.flush().services, 1);
        assert_eq!(p.lb().frontend_count(), 1);
    }

    #[test]
    fn slice_change_touches_only_its_service() {
        let mut p = pipeline();
        for i in 0..10 {
            p.handle(SourceEvent::ServiceApplied(Arc::new(web(&format!("10.96.0.{i}"), &format!("s{i}")))));
            p.handle(SourceEvent::SliceApplied(Arc::new(eps(&format!("s{i}"), &format!("s{i}-x"), &["10.0.0.1", "10.0.0.2"]))));
        }
        p.handle(SourceEvent::Synced);
        p.flush();
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("s3", "s3-x", &["10.0.0.1", "10.0.0.2", "10.0.0.9"]))));
        let r = p.flush();
        assert_eq!(r.services, 1);
        assert!(r.writes.total() <= 3, "{:?}", r.writes);
        assert_eq!(backends(&p, "10.96.0.3:80"), ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.9:8080"]);
    }

    #[test]
    fn a_sync_larger_than_a_map_batch_programs_every_service_in_order() {
        // More Services than one map batch holds (and a reservation of the writer's tables):
        // every Service ends with its own backends, and a contested ClusterIP goes to the
        // Service first in order.
        let mut p = Pipeline::new(MemMaps::default(), LbState::new(), NodeInfo::default());
        let n = 1300;
        let ip = |i: usize| format!("10.96.{}.{}", i / 250, i % 250 + 1);
        for i in 0..n {
            p.handle(SourceEvent::ServiceApplied(Arc::new(web(&ip(i), &format!("s{i:04}")))));
            p.handle(SourceEvent::SliceApplied(Arc::new(eps(
                &format!("s{i:04}"),
                &format!("s{i:04}-x"),
                &[&format!("10.1.{}.{}", i / 250, i % 250 + 1), "10.2.0.1"],
            ))));
        }
        // "d/a-first" sorts before "d/s0005" (neither has a creation time): it keeps the frontend.
        p.handle(SourceEvent::ServiceApplied(Arc::new(web(&ip(5), "a-first"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a-first", "a-first-x", &["10.3.0.1"]))));
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert_eq!(r.services, n + 1);
        assert_eq!(r.problems.iter().filter(|p| p.kind == ProblemKind::Conflict).count(), 1, "{:?}", r.problems);
        let programmed: HashMap<Frontend, Vec<String>> = p
            .maps()
            .dump()
            .frontends()
            .into_iter()
            .map(|d| {
                let mut v: Vec<String> = d.backends.iter().map(|b| b.to_string()).collect();
                v.sort();
                (d.frontend, v)
            })
            .collect();
        let fe = |i: usize| -> Frontend { format!("{}:80", ip(i)).parse().unwrap() };
        for i in (0..n).filter(|i| *i != 5) {
            assert_eq!(programmed[&fe(i)], [format!("10.1.{}.{}:8080", i / 250, i % 250 + 1), "10.2.0.1:8080".to_string()], "service {i}");
        }
        assert_eq!(programmed[&fe(5)], ["10.3.0.1:8080"]);
        assert!(p.maps().violations().is_empty());
        assert_eq!(p.lb().frontend_count(), n);
    }

    #[test]
    fn conflicting_frontend_goes_to_the_first_and_moves_when_released() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.1"]))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "b"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("b", "b-x", &["10.0.0.2"]))));
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert!(r.problems.iter().any(|pr| pr.service == "d/b" && pr.kind == ProblemKind::Conflict && pr.message.contains("already used by service d/a")));
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.1:8080"]);
        p.handle(SourceEvent::ServiceDeleted(Arc::new(web("10.96.0.1", "a"))));
        p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.2:8080"]);
    }

    fn web_created(ip: &str, name: &str, created: &str) -> ServiceView {
        svc(&format!("metadata: {{name: {name}, namespace: d, creationTimestamp: \"{created}\"}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}"))
    }

    #[test]
    fn contested_frontend_goes_to_the_oldest_service_also_across_restarts() {
        // "z" is older than "a": name order must not decide.
        let old = web_created("10.96.0.1", "z", "2020-01-01T00:00:00Z");
        let new = web_created("10.96.0.1", "a", "2024-01-01T00:00:00Z");
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(new.clone())));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.2"]))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(old.clone())));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("z", "z-x", &["10.0.0.1"]))));
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.1:8080"]);
        assert!(r.problems.iter().any(|pr| pr.service == "d/a" && pr.message.contains("already used by service d/z")), "{:?}", r.problems);

        // Live: a newer Service never takes it; an older one arriving later does, in place.
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(new.clone())));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.2"]))));
        p.handle(SourceEvent::Synced);
        p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.2:8080"]);
        p.handle(SourceEvent::ServiceApplied(Arc::new(old.clone())));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("z", "z-x", &["10.0.0.1"]))));
        let r = p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.1:8080"]);
        assert!(r.problems.iter().any(|pr| pr.service == "d/a" && pr.message.contains("taken over by older service d/z")), "{:?}", r.problems);
        assert_eq!(p.lb().frontend_count(), 1);
        // The newer one gets it back once the older one is gone.
        p.handle(SourceEvent::ServiceDeleted(Arc::new(old)));
        p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.2:8080"]);

        // Restart with the older owner's state in the maps: not one write for the frontend.
        let mut p = pipeline();
        let older = web_created("10.96.0.1", "z", "2020-01-01T00:00:00Z");
        p.handle(SourceEvent::ServiceApplied(Arc::new(older.clone())));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("z", "z-x", &["10.0.0.1"]))));
        p.handle(SourceEvent::Synced);
        p.flush();
        let maps = std::mem::take(&mut p.maps);
        let lb = LbState::adopt(&maps.dump());
        let mut p2 = Pipeline::new(MemMaps { check_invariant: true, ..maps }, lb, NodeInfo::default());
        p2.handle(SourceEvent::ServiceApplied(Arc::new(new)));
        p2.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.2"]))));
        p2.handle(SourceEvent::ServiceApplied(Arc::new(older)));
        p2.handle(SourceEvent::SliceApplied(Arc::new(eps("z", "z-x", &["10.0.0.1"]))));
        p2.handle(SourceEvent::Synced);
        let r = p2.flush();
        assert_eq!(r.writes.total(), 0, "{:?}", r.writes);
        assert_eq!(backends(&p2, "10.96.0.1:80"), ["10.0.0.1:8080"]);
    }

    #[test]
    fn slices_without_a_service_are_reported_once() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.1"]))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("ghost", "ghost-x", &["10.0.0.2"]))));
        p.handle(SourceEvent::SliceApplied(Arc::new(slice("metadata: {name: loose, namespace: d}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.3]}]"))));
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert!(p.orphan_slices(Instant::now()).is_empty(), "a slice may arrive before its Service");
        let later = Instant::now() + ORPHAN_GRACE;
        let orphans = p.orphan_slices(later);
        let msgs: Vec<(ProblemObject, &str, &str)> = orphans.iter().map(|p| (p.object, p.service.as_str(), p.message.as_str())).collect();
        assert_eq!(
            msgs,
            [
                (ProblemObject::EndpointSlice, "d/ghost-x", "EndpointSlice d/ghost-x belongs to Service d/ghost, which does not exist; ignored"),
                (ProblemObject::EndpointSlice, "d/loose", "EndpointSlice d/loose has no kubernetes.io/service-name label; ignored"),
            ]
        );
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.1:8080"], "the rest is programmed");
        assert!(p.orphan_slices(later).is_empty(), "reported once");
        // A slice that arrives before its Service is not reported once the Service is there.
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("b", "b-x", &["10.0.0.4"]))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.2", "b"))));
        p.flush();
        assert!(p.orphan_slices(Instant::now() + ORPHAN_GRACE).is_empty());
        // Deleting a Service before its slices is the normal order of things: not reported.
        p.handle(SourceEvent::ServiceDeleted(Arc::new(web("10.96.0.1", "a"))));
        p.flush();
        assert!(p.orphan_slices(Instant::now() + ORPHAN_GRACE).is_empty());
    }

    #[test]
    fn udp_backends_that_leave_are_reported_for_conntrack_cleanup() {
        let mut p = pipeline();
        let udp = |ip: &str, name: &str| {
            svc(&format!("metadata: {{name: {name}, namespace: d}}\nspec: {{clusterIP: {ip}, ports: [{{port: 53, protocol: UDP}}, {{port: 80}}]}}"))
        };
        let eps2 = |svc_name: &str, ips: &[&str]| {
            let e: Vec<String> = ips.iter().map(|i| format!("{{addresses: [{i}]}}")).collect();
            slice(&format!("metadata: {{name: {svc_name}-x, namespace: d, labels: {{kubernetes.io/service-name: {svc_name}}}}}\naddressType: IPv4\nports: [{{port: 5353, protocol: UDP}}, {{port: 8080}}]\nendpoints: [{}]", e.join(",")))
        };
        p.handle(SourceEvent::ServiceApplied(Arc::new(udp("10.96.0.1", "dns"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps2("dns", &["10.0.0.1", "10.0.0.2"]))));
        p.handle(SourceEvent::Synced);
        assert!(p.flush().stale_udp.is_empty());
        p.handle(SourceEvent::SliceApplied(Arc::new(eps2("dns", &["10.0.0.2", "10.0.0.3"]))));
        let r = p.flush();
        let stale: Vec<String> = r.stale_udp.iter().map(|(f, b)| format!("{f} {b}")).collect();
        assert_eq!(stale, ["10.96.0.1:53/udp 10.0.0.1:5353"], "UDP only; TCP flows end by themselves");
        p.handle(SourceEvent::ServiceDeleted(Arc::new(udp("10.96.0.1", "dns"))));
        let r = p.flush();
        assert_eq!(r.stale_udp.len(), 2, "{:?}", r.stale_udp);
    }

    #[test]
    fn tcp_backends_are_departed_only_once_no_slice_lists_them() {
        let mut p = pipeline();
        // Endpoints as (address, condition): "ready", "terminating" (serving, not ready).
        let eps3 = |name: &str, eps: &[(&str, &str)]| {
            let e: Vec<String> = eps
                .iter()
                .map(|(i, c)| match *c {
                    "terminating" => format!("{{addresses: [{i}], conditions: {{ready: false, serving: true, terminating: true}}}}"),
                    _ => format!("{{addresses: [{i}]}}"),
                })
                .collect();
            slice(&format!("metadata: {{name: {name}, namespace: d, labels: {{kubernetes.io/service-name: a}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{}]", e.join(",")))
        };
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps3("a-x", &[("10.0.0.1", "ready"), ("10.0.0.2", "ready"), ("10.0.0.3", "ready")]))));
        p.handle(SourceEvent::Synced);
        assert!(p.flush().departed_tcp.is_empty());
        // Terminating: out of the selection, still listed: it drains, nothing departs.
        p.handle(SourceEvent::SliceApplied(Arc::new(eps3("a-x", &[("10.0.0.1", "terminating"), ("10.0.0.2", "ready"), ("10.0.0.3", "ready")]))));
        let r = p.flush();
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.2:8080", "10.0.0.3:8080"]);
        assert!(r.departed_tcp.is_empty(), "{:?}", r.departed_tcp);
        // Gone from every slice: departed.
        let departed = |r: &FlushReport| -> Vec<String> { r.departed_tcp.iter().map(|d| format!("{} {} {}", d.service, d.frontend, d.addr)).collect() };
        p.handle(SourceEvent::SliceApplied(Arc::new(eps3("a-x", &[("10.0.0.2", "ready"), ("10.0.0.3", "ready")]))));
        let r = p.flush();
        assert_eq!(departed(&r), ["d/a 10.96.0.1:80/tcp 10.0.0.1"]);
        assert!(p.still_departed(&r.departed_tcp[0]));
        // An endpoint moving to another slice: missing from both for one flush, back in the next.
        p.handle(SourceEvent::SliceApplied(Arc::new(eps3("a-x", &[("10.0.0.2", "ready")]))));
        let r = p.flush();
        assert_eq!(departed(&r), ["d/a 10.96.0.1:80/tcp 10.0.0.3"]);
        let d = r.departed_tcp[0].clone();
        assert!(p.still_departed(&d));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps3("a-y", &[("10.0.0.3", "ready")]))));
        assert!(p.flush().departed_tcp.is_empty(), "an address that arrives departs nothing");
        assert!(!p.still_departed(&d), "back (through another slice) before the grace ended");
        p.handle(SourceEvent::SliceDeleted(Arc::new(eps3("a-y", &[]))));
        assert_eq!(departed(&p.flush()), ["d/a 10.96.0.1:80/tcp 10.0.0.3"], "a deleted slice's endpoints depart");
        // A Service that goes away while its slices are still there: their endpoints are
        // listed (pods alive, the Service deleted): nothing departs.
        p.handle(SourceEvent::ServiceDeleted(Arc::new(web("10.96.0.1", "a"))));
        assert!(p.flush().departed_tcp.is_empty());
    }

    #[test]
    fn resync_drops_objects_that_vanished() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.2", "b"))));
        p.handle(SourceEvent::Synced);
        p.flush();
        p.handle(SourceEvent::Resync);
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.2", "b"))));
        p.handle(SourceEvent::Synced);
        p.flush();
        assert_eq!(p.lb().frontend_count(), 1);
        assert!(p.lb().contains(&"10.96.0.2:80".parse().unwrap()));
    }

    #[test]
    fn restart_adopts_and_prunes_only_what_is_gone() {
        let mut p = pipeline();
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.1"]))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.2", "b"))));
        p.handle(SourceEvent::Synced);
        p.flush();
        let maps = std::mem::take(&mut p.maps);
        let lb = LbState::adopt(&maps.dump());
        let mut p2 = Pipeline::new(MemMaps { check_invariant: true, ..maps }, lb, NodeInfo::default());
        p2.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p2.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.1"]))));
        p2.handle(SourceEvent::Synced);
        let r = p2.flush();
        // a unchanged: no writes for it; b gone: master + nothing else.
        assert_eq!(r.writes.puts, 0, "{:?}", r.writes);
        assert_eq!(p2.lb().frontend_count(), 1);
        assert_eq!(backends(&p2, "10.96.0.1:80"), ["10.0.0.1:8080"]);
    }

    #[test]
    fn full_map_is_reported_and_others_keep_working() {
        let mut p = Pipeline::new(MemMaps { check_invariant: true, max_backends: Some(2), ..Default::default() }, LbState::new(), NodeInfo::default());
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("a", "a-x", &["10.0.0.1", "10.0.0.2"]))));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.2", "b"))));
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("b", "b-x", &["10.0.0.3"]))));
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert!(r.problems.iter().any(|pr| pr.kind == ProblemKind::MapFull && pr.message.contains("full")), "{:?}", r.problems);
        assert_eq!(backends(&p, "10.96.0.1:80"), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(p.stats.map_errors, 1);
    }

    #[test]
    fn a_full_map_in_a_batched_flush_is_reported_on_the_service_concerned() {
        // Ten Services in one flush (one batch); the backend map holds 25 of their 30
        // backends: the batch fails, is redone one frontend at a time, and exactly the
        // Services that did not fit report it. MemMaps checks make-before-break throughout.
        let mut p = Pipeline::new(MemMaps { check_invariant: true, max_backends: Some(25), ..Default::default() }, LbState::new(), NodeInfo::default());
        for i in 0..10 {
            let ips: Vec<String> = (0..3).map(|j| format!("10.0.{i}.{j}")).collect();
            let ips: Vec<&str> = ips.iter().map(|s| s.as_str()).collect();
            p.handle(SourceEvent::ServiceApplied(Arc::new(web(&format!("10.96.0.{}", i + 1), &format!("s{i}")))));
            p.handle(SourceEvent::SliceApplied(Arc::new(eps(&format!("s{i}"), &format!("s{i}-x"), &ips))));
        }
        p.handle(SourceEvent::Synced);
        let r = p.flush();
        assert!(p.maps().batches > 0);
        let full: BTreeSet<&str> = r.problems.iter().filter(|pr| pr.kind == ProblemKind::MapFull).map(|pr| pr.service.as_str()).collect();
        assert_eq!(full, BTreeSet::from(["d/s8", "d/s9"]), "{:?}", r.problems);
        for i in 0..8 {
            assert_eq!(backends(&p, &format!("10.96.0.{}:80", i + 1)).len(), 3);
        }
        assert!(backends(&p, "10.96.0.9:80").is_empty());
        assert_eq!(p.service_count(), 8);
        // Room again: the next change of a failed Service programs it.
        p.maps.max_backends = None;
        p.handle(SourceEvent::SliceApplied(Arc::new(eps("s9", "s9-x", &["10.0.9.0"]))));
        p.flush();
        assert_eq!(backends(&p, "10.96.0.10:80"), ["10.0.9.0:8080"]);
    }

    fn node(addresses: &str) -> k8s_openapi::api::core::v1::Node {
        serde_yaml::from_str(&format!("metadata: {{name: n1, labels: {{topology.kubernetes.io/zone: z1}}}}\nstatus: {{addresses: [{addresses}]}}")).unwrap()
    }
    fn select(s: &[&str]) -> Vec<NodePortAddress> {
        s.iter().map(|a| a.parse().unwrap()).collect()
    }
    fn addrs(n: &NodeInfo) -> Vec<String> {
        n.addresses.iter().map(|a| a.to_string()).collect()
    }
    const MIXED: &str = "{type: Hostname, address: n1}, {type: ExternalIP, address: 203.0.113.7}, {type: InternalIP, address: 10.250.0.5}, \
        {type: InternalIP, address: 10.250.0.6}, {type: ExternalIP, address: \"2001:db8::7\"}, {type: InternalIP, address: \"fd00::5\"}, \
        {type: InternalIP, address: \"fd00::6\"}";

    #[test]
    fn primary_is_the_first_internal_ip_of_each_family() {
        let n = node_info(&node(MIXED), &select(&["primary"]));
        assert_eq!(addrs(&n), ["10.250.0.5", "fd00::5"]);
        assert_eq!((n.name.as_str(), n.zone.as_deref()), ("n1", Some("z1")));
    }

    #[test]
    fn primary_falls_back_to_the_first_external_ip_of_a_family_without_internal_ones() {
        let n = node(
            "{type: ExternalIP, address: 203.0.113.7}, {type: ExternalIP, address: 203.0.113.8}, {type: ExternalIP, address: \"2001:db8::7\"}, {type: InternalIP, address: \"fd00::5\"}",
        );
        assert_eq!(addrs(&node_info(&n, &select(&["primary"]))), ["203.0.113.7", "fd00::5"]);
        // A single-stack node has one primary address.
        assert_eq!(addrs(&node_info(&node("{type: InternalIP, address: 10.250.0.5}"), &select(&["primary"]))), ["10.250.0.5"]);
    }

    #[test]
    fn a_cidr_takes_every_internal_and_external_ip_inside_it() {
        assert_eq!(addrs(&node_info(&node(MIXED), &select(&["10.250.0.0/16"]))), ["10.250.0.5", "10.250.0.6"]);
        assert_eq!(addrs(&node_info(&node(MIXED), &select(&["0.0.0.0/0"]))), ["203.0.113.7", "10.250.0.5", "10.250.0.6"]);
        assert_eq!(addrs(&node_info(&node(MIXED), &select(&["::/0"]))), ["2001:db8::7", "fd00::5", "fd00::6"]);
        assert!(node_info(&node(MIXED), &select(&["192.168.0.0/16"])).addresses.is_empty());
    }

    #[test]
    fn primary_and_cidrs_combine_in_node_order_without_duplicates() {
        let n = node_info(&node(MIXED), &select(&["fd00::/64", "primary", "10.250.0.5/32"]));
        assert_eq!(addrs(&n), ["10.250.0.5", "fd00::5", "fd00::6"]);
    }

    #[test]
    fn loopback_is_never_a_node_port_address() {
        let n = node("{type: InternalIP, address: 127.0.0.1}, {type: InternalIP, address: 10.250.0.5}, {type: ExternalIP, address: \"::1\"}, {type: InternalIP, address: 127.0.1.1}");
        assert_eq!(addrs(&node_info(&n, &select(&["0.0.0.0/0", "::/0"]))), ["10.250.0.5"]);
        // Not even as the primary one.
        assert_eq!(addrs(&node_info(&n, &select(&["primary"]))), ["10.250.0.5"]);
        assert!(node_info(&n, &select(&["127.0.0.0/8"])).addresses.is_empty());
    }

    #[test]
    fn node_updates_keep_the_agents_own_settings() {
        let rule = LocalRedirect { service: "kube-system/kube-dns".into(), to: "169.254.20.10".parse().unwrap(), listening: BTreeSet::new() };
        let info = NodeInfo { name: "n1".into(), no_source_nat: true, no_external_ips: true, local_redirects: vec![rule.clone()], ..Default::default() };
        let mut p = Pipeline::new(MemMaps::checked(), LbState::new(), info).with_node_port_addresses(select(&["10.250.0.0/16"]));
        p.handle(SourceEvent::ServiceApplied(Arc::new(web("10.96.0.1", "a"))));
        p.handle(SourceEvent::Synced);
        p.flush();
        p.handle(SourceEvent::NodeApplied(Arc::new(node(MIXED))));
        assert_eq!(p.flush().services, 1, "new addresses: every Service again");
        let n = p.node();
        assert_eq!(addrs(n), ["10.250.0.5", "10.250.0.6"]);
        assert!(n.no_source_nat && n.no_external_ips);
        assert_eq!(n.local_redirects, [rule]);
        p.handle(SourceEvent::NodeApplied(Arc::new(node(MIXED))));
        assert_eq!(p.flush().services, 0, "same addresses: nothing to do");
    }

    #[test]
    fn a_listener_change_translates_only_the_redirected_service_again() {
        let dns = |listening: &[(Proto, u16)]| LocalRedirect {
            service: "d/dns".into(),
            to: "169.254.20.10".parse().unwrap(),
            listening: listening.iter().copied().collect(),
        };
        let info = NodeInfo { local_redirects: vec![dns(&[])], ..Default::default() };
        let mut p = Pipeline::new(MemMaps::checked(), LbState::new(), info);
        for name in ["dns", "web"] {
            p.handle(SourceEvent::ServiceApplied(Arc::new(web(if name == "dns" { "10.96.0.10" } else { "10.96.0.1" }, name))));
        }
        p.handle(SourceEvent::Synced);
        p.flush();
        p.handle(SourceEvent::LocalRedirectChanged(dns(&[(Proto::Udp, 53)])));
        assert_eq!(p.flush().services, 1);
        assert_eq!(p.node().local_redirects, [dns(&[(Proto::Udp, 53)])]);
        p.handle(SourceEvent::LocalRedirectChanged(dns(&[(Proto::Udp, 53)])));
        assert_eq!(p.flush().services, 0, "unchanged");
        // A rule for a Service that does not exist (yet) is kept for its arrival.
        let other = LocalRedirect { service: "d/later".into(), to: "169.254.20.11".parse().unwrap(), listening: [(Proto::Tcp, 80)].into() };
        p.handle(SourceEvent::LocalRedirectChanged(other.clone()));
        assert_eq!(p.flush().services, 0);
        assert_eq!(p.node().local_redirects, [dns(&[(Proto::Udp, 53)]), other]);
    }
}
