//! In-memory maps for tests and benchmarks.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use gardenet_common::{AffinityMatchKey, Backend as BackendValue, Ip6, ServiceKey, ServiceValue, SVC_FLAG_SOURCE_RANGES};

use super::{svc_key, Addr, Batch, BatchError, Entry, Key, LbMaps, MapDump, MapError, MapWrite, RangeKey, ServiceNet, SvcKey, Write};
use crate::desired::{Cidr, Frontend};

/// One family's hash maps.
#[derive(Debug, Default)]
pub struct MemFamily<A> {
    pub services: HashMap<ServiceKey<A>, ServiceValue>,
    pub backends: HashMap<u32, BackendValue<A>>,
    pub matches: BTreeSet<AffinityMatchKey<A>>,
}

impl<A: Addr> MemFamily<A> {
    fn write(&mut self, w: Write<A>, max_services: Option<usize>, max_backends: Option<usize>) -> Result<(), MapError> {
        match w {
            Write::Put(Entry::Backend(id, b)) => {
                if !self.backends.contains_key(&id) && max_backends.is_some_and(|m| self.backends.len() >= m) {
                    return Err(MapError::Full { map: A::MAPS.backends, op: format!("put {id}") });
                }
                self.backends.insert(id, b);
            }
            Write::Put(Entry::Service(k, v)) => {
                if !self.services.contains_key(&k) && max_services.is_some_and(|m| self.services.len() >= m) {
                    return Err(MapError::Full { map: A::MAPS.services, op: format!("put {k:?}") });
                }
                self.services.insert(k, v);
            }
            Write::Put(Entry::Match(k)) => {
                self.matches.insert(k);
            }
            Write::Del(Key::Backend(id)) => {
                self.backends.remove(&id);
            }
            Write::Del(Key::Service(k)) => {
                self.services.remove(&k);
            }
            Write::Del(Key::Match(k)) => {
                self.matches.remove(&k);
            }
        }
        Ok(())
    }

    /// Every slot and affinity match a reader may pick resolves to a backend.
    fn violations(&self, v: &mut Vec<String>) {
        for (k, m) in self.services.iter().filter(|(k, _)| k.slot == 0) {
            for s in 1..=m.count {
                match self.services.get(&k.with_slot(s)) {
                    None => v.push(format!("{k:?}: slot {s} missing")),
                    Some(sv) if !self.backends.contains_key(&sv.backend_id) => v.push(format!("{k:?}: slot {s} -> missing backend {}", sv.backend_id)),
                    _ => {}
                }
            }
        }
        for k in &self.matches {
            if !self.backends.contains_key(&k.backend_id) {
                v.push(format!("affinity match {k:?} -> missing backend {}", k.backend_id));
            }
        }
    }

    fn restricts_sources(&self, k: &ServiceKey<A>) -> bool {
        self.services.get(k).is_some_and(|m| m.flags & SVC_FLAG_SOURCE_RANGES != 0)
    }
}

/// In-memory maps for tests and benchmarks: checks after every write that each master's
/// slots resolve to existing backends, and can be told to fail when "full".
#[derive(Debug, Default)]
pub struct MemMaps {
    pub v4: MemFamily<u32>,
    pub v6: MemFamily<Ip6>,
    pub ranges: BTreeSet<RangeKey>,
    pub service_nets: BTreeMap<Cidr, ServiceNet>,
    /// Capacity of each family's services (backends) map.
    pub max_services: Option<usize>,
    pub max_backends: Option<usize>,
    pub check_invariant: bool,
    pub writes: u64,
    /// `write_batch` calls (each applied element by element, checked after each).
    pub batches: u64,
}

impl MemMaps {
    pub fn checked() -> Self {
        MemMaps { check_invariant: true, ..Default::default() }
    }

    pub fn dump(&self) -> MapDump {
        MapDump {
            services: self.v4.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: self.v4.backends.iter().map(|(k, v)| (*k, *v)).collect(),
            services6: self.v6.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends6: self.v6.backends.iter().map(|(k, v)| (*k, *v)).collect(),
            ranges: self.ranges.iter().copied().collect(),
            service_nets: self.service_nets.iter().map(|(k, v)| (*k, *v)).collect(),
        }
    }

    /// Every slot a reader may pick resolves to a backend.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        self.v4.violations(&mut v);
        self.v6.violations(&mut v);
        // A master that restricts sources must find its ranges (else it refuses everyone).
        let with_ranges: BTreeSet<Frontend> = self.ranges.iter().filter_map(|k| k.decode()).map(|(fe, _)| fe).collect();
        for f in self.dump().frontends().iter().filter(|f| f.source_ranges.is_empty()) {
            let flagged = match svc_key(&f.frontend) {
                SvcKey::V4(k) => self.v4.restricts_sources(&k),
                SvcKey::V6(k) => self.v6.restricts_sources(&k),
            };
            if flagged && !with_ranges.contains(&f.frontend) {
                v.push(format!("{}: restricts sources but has no source ranges", f.frontend));
            }
        }
        v
    }
}

impl LbMaps for MemMaps {
    fn write(&mut self, w: MapWrite) -> Result<(), MapError> {
        let (s, b) = (self.max_services, self.max_backends);
        match w {
            MapWrite::V4(w) => self.v4.write(w, s, b)?,
            MapWrite::V6(w) => self.v6.write(w, s, b)?,
            MapWrite::PutRange(k) => {
                self.ranges.insert(k);
            }
            MapWrite::DelRange(k) => {
                self.ranges.remove(&k);
            }
        }
        self.writes += 1;
        if self.check_invariant {
            let v = self.violations();
            assert!(v.is_empty(), "make-before-break violated: {v:?}");
        }
        Ok(())
    }

    fn put_service_net(&mut self, net: &Cidr, kind: ServiceNet) -> Result<(), MapError> {
        self.service_nets.insert(*net, kind);
        self.writes += 1;
        Ok(())
    }

    fn del_service_net(&mut self, net: &Cidr) -> Result<(), MapError> {
        self.service_nets.remove(net);
        self.writes += 1;
        Ok(())
    }

    fn write_batch(&mut self, b: Batch<'_>) -> Result<(), BatchError> {
        self.batches += 1;
        super::one_by_one(self, b)
    }

    /// Interleaves the two element by element, `b` first (the invariant is checked after
    /// each write, so a write of one that needs the other's done first is caught).
    fn write_batches(&mut self, a: Batch<'_>, b: Batch<'_>) -> [Result<(), BatchError>; 2] {
        self.batches += 2;
        let mut r = [Ok(()), Ok(())];
        for i in 0..a.len().max(b.len()) {
            for (j, x) in [(1, b), (0, a)] {
                if i < x.len() && r[j].is_ok() {
                    if let Err(error) = self.write(x.get(i)) {
                        r[j] = Err(BatchError { done: i, error });
                    }
                }
            }
        }
        r
    }
}
