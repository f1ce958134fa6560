//! Programs frontends into the service/backend maps, make-before-break.
//!
//! Order of writes for an upsert: new backends, then backend slots, then the master entry
//! (which publishes the new count), then surplus slots are deleted, then backends nobody uses
//! any more. A datapath reader therefore always finds a backend for every slot it can pick,
//! at every instant. Backend ids are never reused while the agent runs, so a reader that
//! raced with a delete cannot land on another service's backend.
//!
//! Everything here is pure (maps behind the [`LbMaps`] trait) and unit-tested with an
//! in-memory map that checks that invariant after every single write.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use gardenet_common::{AffinityMatchKey4, Backend4, ServiceKey4, ServiceValue4, SVC_FLAG_NONE};

use crate::model::{Backend, Frontend, FrontendSpec, Proto};

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

/// The four write operations the programmer needs.
pub trait LbMaps {
    fn put_backend(&mut self, id: u32, be: &Backend4) -> Result<(), MapError>;
    fn del_backend(&mut self, id: u32) -> Result<(), MapError>;
    fn put_service(&mut self, key: &ServiceKey4, val: &ServiceValue4) -> Result<(), MapError>;
    fn del_service(&mut self, key: &ServiceKey4) -> Result<(), MapError>;
    /// Affinity match entries: "backend belongs to frontend" (only for frontends with affinity).
    fn put_match(&mut self, key: &AffinityMatchKey4) -> Result<(), MapError>;
    fn del_match(&mut self, key: &AffinityMatchKey4) -> Result<(), MapError>;
}

pub fn match_key(fe: &ServiceKey4, backend_id: u32) -> AffinityMatchKey4 {
    AffinityMatchKey4 { backend_id, addr: fe.addr, port: fe.port, proto: fe.proto, _pad: 0 }
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
}

type BeKey = (Backend, Proto);

/// What is programmed in the maps, as the writer knows it.
#[derive(Debug, Default)]
pub struct LbState {
    frontends: BTreeMap<Frontend, Programmed>,
    /// Backend -> id.
    backends: HashMap<BeKey, u32>,
    /// Id -> (backend, number of frontends using it).
    by_id: HashMap<u32, (BeKey, u32)>,
    next_id: u32,
}

pub fn service_key(fe: &Frontend) -> ServiceKey4 {
    ServiceKey4::master(u32::from(fe.addr).to_be(), fe.port.to_be(), fe.proto.number())
}

pub fn backend_value(be: &Backend, proto: Proto) -> Backend4 {
    Backend4 { addr: u32::from(be.addr).to_be(), port: be.port.to_be(), proto: proto.number(), flags: 0 }
}

pub fn backend_from_value(v: &Backend4) -> Backend {
    Backend { addr: u32::from_be(v.addr).into(), port: u16::from_be(v.port) }
}

/// A dump of the maps as the kernel has them (for adoption after a restart, and `lb list`).
#[derive(Clone, Debug, Default)]
pub struct MapDump {
    pub services: Vec<(ServiceKey4, ServiceValue4)>,
    pub backends: Vec<(u32, Backend4)>,
}

/// One frontend as found in the maps.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DumpedFrontend {
    pub frontend: Frontend,
    pub backends: Vec<Backend>,
    pub affinity_timeout: u32,
    /// Slots whose backend id is missing from the backend map (should never happen).
    pub dangling_slots: u32,
}

impl MapDump {
    /// Groups the raw entries per frontend, in frontend order.
    pub fn frontends(&self) -> Vec<DumpedFrontend> {
        let bes: HashMap<u32, Backend4> = self.backends.iter().copied().collect();
        let mut slots: BTreeMap<(u32, u16, u8), BTreeMap<u16, u32>> = BTreeMap::new();
        let mut masters = BTreeMap::new();
        for (k, v) in &self.services {
            let id = (k.addr, k.port, k.proto);
            if k.slot == 0 {
                masters.insert(id, *v);
            } else {
                slots.entry(id).or_default().insert(k.slot, v.backend_id);
            }
        }
        let mut out = Vec::new();
        for ((addr, port, proto), m) in masters {
            let Some(proto_e) = Proto::from_number(proto) else { continue };
            let frontend = Frontend { addr: u32::from_be(addr).into(), port: u16::from_be(port), proto: proto_e };
            let mut backends = Vec::new();
            let mut dangling = 0;
            let sl = slots.get(&(addr, port, proto));
            for s in 1..=m.count {
                match sl.and_then(|sl| sl.get(&s)).and_then(|id| bes.get(id)) {
                    Some(b) => backends.push(backend_from_value(b)),
                    None => dangling += 1,
                }
            }
            out.push(DumpedFrontend { frontend, backends, affinity_timeout: m.affinity_timeout, dangling_slots: dangling });
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
        let bes: HashMap<u32, Backend4> = dump.backends.iter().copied().collect();
        let mut slots: HashMap<ServiceKey4, u32> = HashMap::new();
        for (k, v) in &dump.services {
            if k.slot != 0 {
                slots.insert(*k, v.backend_id);
            }
        }
        let max_id = dump.backends.iter().map(|(id, _)| *id).max().unwrap_or(0);
        st.next_id = max_id.wrapping_add(1).max(1);
        for (k, v) in dump.services.iter().filter(|(k, _)| k.slot == 0) {
            let Some(proto) = Proto::from_number(k.proto) else { continue };
            let fe = Frontend { addr: u32::from_be(k.addr).into(), port: u16::from_be(k.port), proto };
            let mut ids = Vec::new();
            for s in 1..=v.count {
                let Some(id) = slots.get(&k.with_slot(s)) else { break };
                if !bes.contains_key(id) {
                    break;
                }
                ids.push(*id);
            }
            if ids.len() != v.count as usize {
                // Inconsistent: forget the frontend; the sync reprograms it from scratch
                // (upsert writes every slot) or deletes it.
                continue;
            }
            for id in &ids {
                let k = (backend_from_value(&bes[id]), proto);
                st.backends.entry(k).or_insert(*id);
                st.by_id.entry(*id).or_insert((k, 0)).1 += 1;
            }
            st.frontends.insert(fe, Programmed { slots: ids, affinity_timeout: v.affinity_timeout });
        }
        st
    }

    pub fn frontends(&self) -> impl Iterator<Item = &Frontend> {
        self.frontends.keys()
    }

    pub fn contains(&self, fe: &Frontend) -> bool {
        self.frontends.contains_key(fe)
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

    /// Monotonic ids; after a u32 wrap, ids still in use are skipped.
    fn alloc_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1).max(1);
            if !self.by_id.contains_key(&id) {
                return id;
            }
        }
    }

    fn forget_created(&mut self, maps: &mut impl LbMaps, created: Vec<(BeKey, u32)>) {
        for (k, id) in created {
            let _ = maps.del_backend(id);
            self.backends.remove(&k);
            self.by_id.remove(&id);
        }
    }

    /// Programs `fe` to `spec`. On error the maps and this state are left as they were
    /// before the call (best effort rollback of the writes already done).
    pub fn upsert(&mut self, maps: &mut impl LbMaps, fe: &Frontend, spec: &FrontendSpec) -> Result<Writes, MapError> {
        let mut w = Writes::default();
        let mut wanted: Vec<Backend> = spec.backends.clone();
        wanted.sort();
        wanted.dedup();
        if wanted.len() > u16::MAX as usize {
            return Err(MapError::Other(format!("{fe}: {} backends, at most {} per frontend", wanted.len(), u16::MAX)));
        }
        let old = self.frontends.get(fe).cloned();
        if let Some(o) = &old {
            if o.affinity_timeout == spec.affinity_timeout && self.same_backends(o, &wanted, fe.proto) {
                return Ok(w);
            }
        }

        // 1. Backends that do not exist yet.
        let mut created: Vec<(BeKey, u32)> = Vec::new();
        let mut ids = Vec::with_capacity(wanted.len());
        for b in &wanted {
            let k = (*b, fe.proto);
            if let Some(id) = self.backends.get(&k) {
                ids.push(*id);
                continue;
            }
            let id = self.alloc_id();
            if let Err(e) = maps.put_backend(id, &backend_value(b, fe.proto)) {
                self.forget_created(maps, created);
                return Err(e);
            }
            w.puts += 1;
            self.backends.insert(k, id);
            self.by_id.insert(id, (k, 0));
            created.push((k, id));
            ids.push(id);
        }

        // 2. Slots. Keep surviving backends in their slots, fill holes with new ones, then
        //    close remaining holes from the tail: one backend change costs O(1) slot writes.
        let old_slots = old.as_ref().map(|o| o.slots.clone()).unwrap_or_default();
        let new_slots = plan_slots(&old_slots, &ids);
        let key = service_key(fe);
        let mut written: Vec<u16> = Vec::new();
        for (i, id) in new_slots.iter().enumerate() {
            if old_slots.get(i) == Some(id) {
                continue;
            }
            let slot = (i + 1) as u16;
            let val = ServiceValue4 { backend_id: *id, ..Default::default() };
            if let Err(e) = maps.put_service(&key.with_slot(slot), &val) {
                self.rollback_slots(maps, &key, &old_slots, &written);
                self.forget_created(maps, created);
                return Err(e);
            }
            w.puts += 1;
            written.push(slot);
        }

        // 2b. Affinity: new members become eligible before the master publishes them.
        let old_matched: BTreeSet<u32> = match &old {
            Some(o) if o.affinity_timeout > 0 => o.slots.iter().copied().collect(),
            _ => BTreeSet::new(),
        };
        if spec.affinity_timeout > 0 {
            for id in new_slots.iter().filter(|id| !old_matched.contains(id)) {
                if let Err(e) = maps.put_match(&match_key(&key, *id)) {
                    self.rollback_slots(maps, &key, &old_slots, &written);
                    self.forget_created(maps, created);
                    return Err(e);
                }
                w.puts += 1;
            }
        }

        // 3. Publish.
        let master = ServiceValue4 {
            backend_id: 0,
            count: new_slots.len() as u16,
            flags: SVC_FLAG_NONE,
            affinity_timeout: spec.affinity_timeout,
        };
        if let Err(e) = maps.put_service(&key, &master) {
            self.rollback_slots(maps, &key, &old_slots, &written);
            self.forget_created(maps, created);
            return Err(e);
        }
        w.puts += 1;

        // 4. Retire: affinity matches of members that left, surplus slots, then backends nobody
        //    references any more. Failures here leave unreachable garbage, never a dangling
        //    reference; log and carry on.
        let keep: BTreeSet<u32> = if spec.affinity_timeout > 0 { new_slots.iter().copied().collect() } else { BTreeSet::new() };
        for id in old_matched.difference(&keep) {
            match maps.del_match(&match_key(&key, *id)) {
                Ok(()) => w.deletes += 1,
                Err(e) => tracing::warn!("{fe}: deleting affinity match {id}: {e}"),
            }
        }
        for slot in new_slots.len() + 1..=old_slots.len() {
            match maps.del_service(&key.with_slot(slot as u16)) {
                Ok(()) => w.deletes += 1,
                Err(e) => tracing::warn!("{fe}: deleting surplus slot {slot}: {e}"),
            }
        }
        for id in &new_slots {
            if let Some(e) = self.by_id.get_mut(id) {
                e.1 += 1;
            }
        }
        w.deletes += self.release(maps, &old_slots);
        self.frontends.insert(*fe, Programmed { slots: new_slots, affinity_timeout: spec.affinity_timeout });
        Ok(w)
    }

    /// Removes `fe`: master first (no new selections), then its slots and orphaned backends.
    pub fn delete(&mut self, maps: &mut impl LbMaps, fe: &Frontend) -> Result<Writes, MapError> {
        let mut w = Writes::default();
        let Some(old) = self.frontends.get(fe).cloned() else { return Ok(w) };
        let key = service_key(fe);
        maps.del_service(&key)?;
        w.deletes += 1;
        self.frontends.remove(fe);
        if old.affinity_timeout > 0 {
            for id in &old.slots {
                match maps.del_match(&match_key(&key, *id)) {
                    Ok(()) => w.deletes += 1,
                    Err(e) => tracing::warn!("{fe}: deleting affinity match {id}: {e}"),
                }
            }
        }
        for slot in 1..=old.slots.len() {
            match maps.del_service(&key.with_slot(slot as u16)) {
                Ok(()) => w.deletes += 1,
                Err(e) => tracing::warn!("{fe}: deleting slot {slot}: {e}"),
            }
        }
        w.deletes += self.release(maps, &old.slots);
        Ok(w)
    }

    fn same_backends(&self, o: &Programmed, wanted: &[Backend], proto: Proto) -> bool {
        if o.slots.len() != wanted.len() {
            return false;
        }
        let have: BTreeSet<u32> = o.slots.iter().copied().collect();
        wanted.iter().all(|b| self.backends.get(&(*b, proto)).is_some_and(|id| have.contains(id)))
    }

    /// Drops one reference per id; deletes backends that reach zero. Returns deletes done.
    fn release(&mut self, maps: &mut impl LbMaps, ids: &[u32]) -> u32 {
        let mut n = 0;
        for id in ids {
            let Some((k, refs)) = self.by_id.get_mut(id) else { continue };
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                let k = *k;
                match maps.del_backend(*id) {
                    Ok(()) => n += 1,
                    Err(err) => tracing::warn!("deleting backend {id}: {err}"),
                }
                self.backends.remove(&k);
                self.by_id.remove(id);
            }
        }
        n
    }

    fn rollback_slots(&self, maps: &mut impl LbMaps, key: &ServiceKey4, old: &[u32], written: &[u16]) {
        for slot in written {
            let i = *slot as usize - 1;
            let r = match old.get(i) {
                Some(id) => maps.put_service(&key.with_slot(*slot), &ServiceValue4 { backend_id: *id, ..Default::default() }),
                None => maps.del_service(&key.with_slot(*slot)),
            };
            if let Err(e) = r {
                tracing::warn!("rollback of slot {slot}: {e}");
            }
        }
    }
}

/// New slot order: survivors stay where they are, newcomers fill the holes, and leftover
/// holes are closed by moving entries from the tail.
pub fn plan_slots(old: &[u32], wanted: &[u32]) -> Vec<u32> {
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

/// In-memory maps for tests and benchmarks: checks after every write that each master's
/// slots resolve to existing backends, and can be told to fail when "full".
#[derive(Debug, Default)]
pub struct MemMaps {
    pub services: HashMap<ServiceKey4, ServiceValue4>,
    pub backends: HashMap<u32, Backend4>,
    pub matches: BTreeSet<(u32, u32, u16, u8)>,
    pub max_services: Option<usize>,
    pub max_backends: Option<usize>,
    pub check_invariant: bool,
    pub writes: u64,
}

impl MemMaps {
    pub fn checked() -> Self {
        MemMaps { check_invariant: true, ..Default::default() }
    }

    pub fn dump(&self) -> MapDump {
        MapDump {
            services: self.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: self.backends.iter().map(|(k, v)| (*k, *v)).collect(),
        }
    }

    /// Every slot a reader may pick resolves to a backend.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (k, m) in self.services.iter().filter(|(k, _)| k.slot == 0) {
            for s in 1..=m.count {
                match self.services.get(&k.with_slot(s)) {
                    None => v.push(format!("{k:?}: slot {s} missing")),
                    Some(sv) if !self.backends.contains_key(&sv.backend_id) => {
                        v.push(format!("{k:?}: slot {s} -> missing backend {}", sv.backend_id))
                    }
                    _ => {}
                }
            }
        }
        for (id, addr, port, proto) in &self.matches {
            if !self.backends.contains_key(id) {
                v.push(format!("affinity match for {addr}:{port}/{proto} -> missing backend {id}"));
            }
        }
        v
    }

    fn after_write(&mut self) {
        self.writes += 1;
        if self.check_invariant {
            let v = self.violations();
            assert!(v.is_empty(), "make-before-break violated: {v:?}");
        }
    }
}

impl LbMaps for MemMaps {
    fn put_backend(&mut self, id: u32, be: &Backend4) -> Result<(), MapError> {
        if !self.backends.contains_key(&id) && self.max_backends.is_some_and(|m| self.backends.len() >= m) {
            return Err(MapError::Full { map: "backends", op: format!("put {id}") });
        }
        self.backends.insert(id, *be);
        self.after_write();
        Ok(())
    }
    fn del_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.backends.remove(&id);
        self.after_write();
        Ok(())
    }
    fn put_service(&mut self, key: &ServiceKey4, val: &ServiceValue4) -> Result<(), MapError> {
        if !self.services.contains_key(key) && self.max_services.is_some_and(|m| self.services.len() >= m) {
            return Err(MapError::Full { map: "services", op: format!("put {key:?}") });
        }
        self.services.insert(*key, *val);
        self.after_write();
        Ok(())
    }
    fn del_service(&mut self, key: &ServiceKey4) -> Result<(), MapError> {
        self.services.remove(key);
        self.after_write();
        Ok(())
    }
    fn put_match(&mut self, k: &AffinityMatchKey4) -> Result<(), MapError> {
        self.matches.insert((k.backend_id, k.addr, k.port, k.proto));
        self.after_write();
        Ok(())
    }
    fn del_match(&mut self, k: &AffinityMatchKey4) -> Result<(), MapError> {
        self.matches.remove(&(k.backend_id, k.addr, k.port, k.proto));
        self.after_write();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fe(port: u16) -> Frontend {
        Frontend { addr: "10.96.0.10".parse().unwrap(), port, proto: Proto::Tcp }
    }
    fn be(last: u8) -> Backend {
        Backend { addr: format!("10.0.0.{last}").parse().unwrap(), port: 8080 }
    }
    fn spec(bs: &[u8]) -> FrontendSpec {
        FrontendSpec { backends: bs.iter().map(|b| be(*b)).collect(), affinity_timeout: 0 }
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
        let master = m.services[&service_key(&fe(80))];
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
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let all: Vec<u8> = (1..=100).collect();
        st.upsert(&mut m, &fe(80), &spec(&all)).unwrap();
        let fewer: Vec<u8> = (1..=100).filter(|b| *b != 7).collect();
        let w = st.upsert(&mut m, &fe(80), &spec(&fewer)).unwrap();
        // slot of 7 gets the tail's backend, master, tail slot delete, backend delete.
        assert!(w.total() <= 4, "{w:?}");
        assert_eq!(programmed(&m, &fe(80)).len(), 99);
        assert!(!programmed(&m, &fe(80)).contains(&be(7)));
        assert!(!m.backends.values().any(|b| backend_from_value(b) == be(7)));
    }

    #[test]
    fn every_intermediate_state_is_consistent() {
        // MemMaps::checked() asserts the invariant after each write; walk through many shapes.
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let shapes: [&[u8]; 7] = [&[1], &[1, 2, 3], &[3], &[], &[4, 5, 6, 7], &[1, 7], &[2, 3, 4, 5, 6, 7, 8, 9]];
        for s in shapes {
            st.upsert(&mut m, &fe(80), &spec(s)).unwrap();
            st.upsert(&mut m, &fe(81), &spec(s)).unwrap();
            assert_eq!(programmed(&m, &fe(80)), spec(s).backends);
        }
        st.delete(&mut m, &fe(80)).unwrap();
        st.delete(&mut m, &fe(81)).unwrap();
        assert!(m.services.is_empty() && m.backends.is_empty());
    }

    #[test]
    fn zero_backends_is_a_master_with_count_zero() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[])).unwrap();
        assert_eq!(m.services[&service_key(&fe(80))].count, 0);
        assert_eq!(m.services.len(), 1);
    }

    #[test]
    fn backends_are_shared_and_refcounted() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        st.upsert(&mut m, &fe(81), &spec(&[2, 3])).unwrap();
        assert_eq!(m.backends.len(), 3);
        st.delete(&mut m, &fe(80)).unwrap();
        assert_eq!(m.backends.len(), 2, "backend 2 is still used by :81");
        assert_eq!(programmed(&m, &fe(81)), vec![be(2), be(3)]);
    }

    #[test]
    fn ids_are_not_reused_while_running() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1])).unwrap();
        let first: Vec<u32> = m.backends.keys().copied().collect();
        st.upsert(&mut m, &fe(80), &spec(&[2])).unwrap();
        assert!(!m.backends.keys().any(|k| first.contains(k)));
    }

    #[test]
    fn full_map_leaves_previous_programming_intact() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        st.upsert(&mut m, &fe(80), &spec(&[1, 2])).unwrap();
        m.max_services = Some(m.services.len() + 1);
        let err = st.upsert(&mut m, &fe(80), &spec(&[1, 2, 3, 4])).unwrap_err();
        assert!(matches!(err, MapError::Full { .. }), "{err}");
        assert_eq!(programmed(&m, &fe(80)), vec![be(1), be(2)]);
        assert_eq!(m.backends.len(), 2, "backends created for the failed upsert are removed");
        // And the state still matches the maps: a later, smaller change works.
        m.max_services = None;
        st.upsert(&mut m, &fe(80), &spec(&[2, 3])).unwrap();
        assert_eq!(programmed(&m, &fe(80)), vec![be(2), be(3)]);
        m.max_backends = Some(0);
        assert!(st.upsert(&mut m, &fe(90), &spec(&[9])).is_err());
        assert!(!m.services.contains_key(&service_key(&fe(90))));
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
        assert!(m.backends.values().any(|b| backend_from_value(b) == be(3)), "still used by :80");
        let ids: BTreeSet<u32> = m.backends.keys().copied().collect();
        adopted.upsert(&mut m, &fe(82), &spec(&[9])).unwrap();
        let new_id = *m.backends.keys().find(|k| !ids.contains(k)).unwrap();
        assert!(new_id > *ids.iter().max().unwrap());
    }

    #[test]
    fn adopt_drops_inconsistent_frontends() {
        let mut m = MemMaps::default();
        let key = service_key(&fe(80));
        m.services.insert(key, ServiceValue4 { count: 2, ..Default::default() });
        m.services.insert(key.with_slot(1), ServiceValue4 { backend_id: 5, ..Default::default() });
        m.backends.insert(5, backend_value(&be(1), Proto::Tcp));
        let st = LbState::adopt(&m.dump());
        assert!(!st.contains(&fe(80)));
        assert_eq!(st.backend_count(), 0);
    }

    #[test]
    fn affinity_match_entries_follow_membership() {
        let mut m = MemMaps::checked();
        let mut st = LbState::new();
        let aff = |bs: &[u8]| FrontendSpec { affinity_timeout: 60, ..spec(bs) };
        st.upsert(&mut m, &fe(80), &aff(&[1, 2, 3])).unwrap();
        assert_eq!(m.matches.len(), 3);
        st.upsert(&mut m, &fe(80), &aff(&[1, 3])).unwrap();
        let ids: BTreeSet<u32> = m.matches.iter().map(|(id, ..)| *id).collect();
        let live: BTreeSet<u32> = m.backends.keys().copied().collect();
        assert_eq!(ids, live, "exactly the current members are eligible for affinity");
        st.upsert(&mut m, &fe(80), &spec(&[1, 3])).unwrap();
        assert!(m.matches.is_empty(), "affinity switched off");
        st.upsert(&mut m, &fe(80), &aff(&[1])).unwrap();
        st.delete(&mut m, &fe(80)).unwrap();
        assert!(m.matches.is_empty() && m.backends.is_empty());
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
    fn dump_reports_dangling_slots() {
        let mut m = MemMaps::default();
        let key = service_key(&fe(80));
        m.services.insert(key, ServiceValue4 { count: 1, ..Default::default() });
        let d = m.dump().frontends();
        assert_eq!(d[0].dangling_slots, 1);
    }
}
