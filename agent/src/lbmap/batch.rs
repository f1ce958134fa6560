//! Many frontend changes in one go: the writes of all of them grouped per map and step, each
//! group one [`LbMaps::write_batch`] (one `bpf()` call on the kernel maps).
//!
//! The steps keep [`LbState::upsert`]'s make-before-break order across the whole batch: source
//! ranges, then every new backend, every slot, every affinity match, then the master entries
//! (and the master deletes of removed frontends); only then surplus matches, slots and
//! backends nobody references any more. A master is published after everything it points to,
//! whatever other frontends of the batch do, and a backend is deleted only once no new or old
//! programming can reach it (references are counted over the whole batch first).
//!
//! Errors: a step that fails (a full map, ...) is undone with everything the batch wrote
//! before it (the batch reports how many of its elements were written), leaving maps and state
//! as they were; then the same changes are made one frontend at a time with
//! [`LbState::upsert`]/[`LbState::delete`], which attribute the error to the frontend concerned
//! and program the others. Failures while retiring are logged and skipped, as in `upsert`.
use std::collections::HashSet;

use super::*;

/// One frontend change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Program the frontend to the spec (as [`LbState::upsert`]).
    Upsert(Frontend, FrontendSpec),
    /// Remove the frontend (as [`LbState::delete`]).
    Delete(Frontend),
}

impl Op {
    pub fn frontend(&self) -> &Frontend {
        match self {
            Op::Upsert(fe, _) | Op::Delete(fe) => fe,
        }
    }
}

/// Writes to one map, with what undoes each and which op it belongs to.
struct List<K, V> {
    keys: Vec<K>,
    vals: Vec<V>,
    /// Service entries: the value before the write (None: the key did not exist).
    old: Vec<Option<ServiceValue>>,
    op: Vec<usize>,
}

impl<K, V> Default for List<K, V> {
    fn default() -> Self {
        List { keys: Vec::new(), vals: Vec::new(), old: Vec::new(), op: Vec::new() }
    }
}

impl<K, V> List<K, V> {
    fn push(&mut self, op: usize, k: K, v: V, old: Option<ServiceValue>) {
        self.keys.push(k);
        self.vals.push(v);
        self.old.push(old);
        self.op.push(op);
    }
}

/// The grouped writes of a batch.
#[derive(Default)]
struct Lists {
    be4: List<u32, Backend4>,
    be6: List<u32, Backend6>,
    slots4: List<ServiceKey4, ServiceValue>,
    slots6: List<ServiceKey6, ServiceValue>,
    match4: List<AffinityMatchKey4, ()>,
    match6: List<AffinityMatchKey6, ()>,
    masters4: List<ServiceKey4, ServiceValue>,
    masters6: List<ServiceKey6, ServiceValue>,
    /// Masters of deleted frontends (`old` is the master, to put back on undo).
    gone4: List<ServiceKey4, ()>,
    gone6: List<ServiceKey6, ()>,
    // Retiring, after every master.
    unmatch4: List<AffinityMatchKey4, ()>,
    unmatch6: List<AffinityMatchKey6, ()>,
    unslot4: List<ServiceKey4, ()>,
    unslot6: List<ServiceKey6, ()>,
    unbe4: List<u32, ()>,
    unbe6: List<u32, ()>,
}

/// The steps, in the order they are written.
#[derive(Clone, Copy, Debug)]
enum Step {
    Be4,
    Be6,
    Slots4,
    Slots6,
    Match4,
    Match6,
    Masters4,
    Masters6,
    Gone4,
    Gone6,
    Unmatch4,
    Unmatch6,
    Unslot4,
    Unslot6,
    Unbe4,
    Unbe6,
}

const MAKE: [Step; 10] =
    [Step::Be4, Step::Be6, Step::Slots4, Step::Slots6, Step::Match4, Step::Match6, Step::Masters4, Step::Masters6, Step::Gone4, Step::Gone6];
const RETIRE: [Step; 6] = [Step::Unmatch4, Step::Unmatch6, Step::Unslot4, Step::Unslot6, Step::Unbe4, Step::Unbe6];

impl Lists {
    /// The step's writes from element `from` on.
    fn batch(&self, s: Step, from: usize) -> Batch<'_> {
        match s {
            Step::Be4 => Batch::PutBackends(&self.be4.keys[from..], &self.be4.vals[from..]),
            Step::Be6 => Batch::PutBackends6(&self.be6.keys[from..], &self.be6.vals[from..]),
            Step::Slots4 => Batch::PutServices(&self.slots4.keys[from..], &self.slots4.vals[from..]),
            Step::Slots6 => Batch::PutServices6(&self.slots6.keys[from..], &self.slots6.vals[from..]),
            Step::Match4 => Batch::PutMatches(&self.match4.keys[from..]),
            Step::Match6 => Batch::PutMatches6(&self.match6.keys[from..]),
            Step::Masters4 => Batch::PutServices(&self.masters4.keys[from..], &self.masters4.vals[from..]),
            Step::Masters6 => Batch::PutServices6(&self.masters6.keys[from..], &self.masters6.vals[from..]),
            Step::Gone4 => Batch::DelServices(&self.gone4.keys[from..]),
            Step::Gone6 => Batch::DelServices6(&self.gone6.keys[from..]),
            Step::Unmatch4 => Batch::DelMatches(&self.unmatch4.keys[from..]),
            Step::Unmatch6 => Batch::DelMatches6(&self.unmatch6.keys[from..]),
            Step::Unslot4 => Batch::DelServices(&self.unslot4.keys[from..]),
            Step::Unslot6 => Batch::DelServices6(&self.unslot6.keys[from..]),
            Step::Unbe4 => Batch::DelBackends(&self.unbe4.keys[from..]),
            Step::Unbe6 => Batch::DelBackends6(&self.unbe6.keys[from..]),
        }
    }

    fn ops(&self, s: Step) -> &[usize] {
        match s {
            Step::Be4 => &self.be4.op,
            Step::Be6 => &self.be6.op,
            Step::Slots4 => &self.slots4.op,
            Step::Slots6 => &self.slots6.op,
            Step::Match4 => &self.match4.op,
            Step::Match6 => &self.match6.op,
            Step::Masters4 => &self.masters4.op,
            Step::Masters6 => &self.masters6.op,
            Step::Gone4 => &self.gone4.op,
            Step::Gone6 => &self.gone6.op,
            Step::Unmatch4 => &self.unmatch4.op,
            Step::Unmatch6 => &self.unmatch6.op,
            Step::Unslot4 => &self.unslot4.op,
            Step::Unslot6 => &self.unslot6.op,
            Step::Unbe4 => &self.unbe4.op,
            Step::Unbe6 => &self.unbe6.op,
        }
    }

    /// Undoes the first `n` writes of a make step, last first (best effort, like `upsert`'s
    /// rollback): masters go back to their old value, slots to their old backend, new
    /// matches and backends are deleted.
    fn undo(&self, maps: &mut impl LbMaps, s: Step, n: usize) {
        let warn = |r: Result<(), MapError>| {
            if let Err(e) = r {
                tracing::warn!("undoing a batched write: {e}");
            }
        };
        let m = maps;
        match s {
            Step::Be4 => self.be4.keys[..n].iter().rev().for_each(|id| warn(m.del_backend(*id))),
            Step::Be6 => self.be6.keys[..n].iter().rev().for_each(|id| warn(m.del_backend6(*id))),
            Step::Match4 => self.match4.keys[..n].iter().rev().for_each(|k| warn(m.del_match(k))),
            Step::Match6 => self.match6.keys[..n].iter().rev().for_each(|k| warn(m.del_match6(k))),
            Step::Slots4 | Step::Masters4 | Step::Gone4 => {
                let l = match s {
                    Step::Slots4 => &self.slots4.keys,
                    Step::Masters4 => &self.masters4.keys,
                    _ => &self.gone4.keys,
                };
                let old = match s {
                    Step::Slots4 => &self.slots4.old,
                    Step::Masters4 => &self.masters4.old,
                    _ => &self.gone4.old,
                };
                for i in (0..n).rev() {
                    warn(match &old[i] {
                        Some(v) => m.put_service(&l[i], v),
                        None => m.del_service(&l[i]),
                    });
                }
            }
            Step::Slots6 | Step::Masters6 | Step::Gone6 => {
                let l = match s {
                    Step::Slots6 => &self.slots6.keys,
                    Step::Masters6 => &self.masters6.keys,
                    _ => &self.gone6.keys,
                };
                let old = match s {
                    Step::Slots6 => &self.slots6.old,
                    Step::Masters6 => &self.masters6.old,
                    _ => &self.gone6.old,
                };
                for i in (0..n).rev() {
                    warn(match &old[i] {
                        Some(v) => m.put_service6(&l[i], v),
                        None => m.del_service6(&l[i]),
                    });
                }
            }
            _ => {}
        }
    }
}

/// What a planned op does once the make steps are written.
enum Commit {
    Upsert { slots: Vec<u32>, affinity_timeout: u32, flags: u16, old_slots: Vec<u32>, old_ranges: BTreeSet<Cidr>, new_ranges: BTreeSet<Cidr> },
    Delete { old: Programmed },
}

struct Planned {
    op: usize,
    fe: Frontend,
    commit: Commit,
    created: Vec<(BeKey, u32)>,
    ranges_put: Vec<RangeKey>,
    w: Writes,
}

impl LbState {
    /// Applies `ops` in order with the same result as calling [`LbState::upsert`] or
    /// [`LbState::delete`] for each (one result per op, in order), writing each map in a
    /// few batches. A frontend that appears twice splits the work in two batches.
    pub fn apply(&mut self, maps: &mut impl LbMaps, ops: &[Op]) -> Vec<Result<Writes, MapError>> {
        let mut out = Vec::with_capacity(ops.len());
        let mut start = 0;
        let mut seen: HashSet<Frontend> = HashSet::new();
        for (i, op) in ops.iter().enumerate() {
            if !seen.insert(*op.frontend()) {
                out.extend(self.apply_distinct(maps, &ops[start..i]));
                start = i;
                seen.clear();
                seen.insert(*op.frontend());
            }
        }
        out.extend(self.apply_distinct(maps, &ops[start..]));
        out
    }

    fn apply_single(&mut self, maps: &mut impl LbMaps, op: &Op) -> Result<Writes, MapError> {
        match op {
            Op::Upsert(fe, spec) => self.upsert(maps, fe, spec),
            Op::Delete(fe) => self.delete(maps, fe),
        }
    }

    /// `ops` name distinct frontends.
    fn apply_distinct(&mut self, maps: &mut impl LbMaps, ops: &[Op]) -> Vec<Result<Writes, MapError>> {
        if ops.len() <= 1 {
            return ops.iter().map(|op| self.apply_single(maps, op)).collect();
        }
        let mut out: Vec<Option<Result<Writes, MapError>>> = (0..ops.len()).map(|_| None).collect();
        let mut l = Lists::default();
        let mut planned: Vec<Planned> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let r = match op {
                Op::Upsert(fe, spec) => self.plan_upsert(maps, i, fe, spec, &mut l),
                Op::Delete(fe) => Ok(self.plan_delete(i, fe, &mut l)),
            };
            match r {
                Ok(Some(p)) => planned.push(p),
                Ok(None) => out[i] = Some(Ok(Writes::default())),
                Err(e) => out[i] = Some(Err(e)),
            }
        }

        // Make steps; on failure undo all of them and go one frontend at a time.
        for (n, s) in MAKE.iter().enumerate() {
            let b = l.batch(*s, 0);
            if b.is_empty() {
                continue;
            }
            if let Err(e) = maps.write_batch(b) {
                tracing::debug!("batched {s:?} failed ({e}); undoing the batch and writing its {} frontends one by one", planned.len());
                l.undo(maps, *s, e.done);
                for s in MAKE[..n].iter().rev() {
                    l.undo(maps, *s, l.ops(*s).len());
                }
                // Forget the whole batch before redoing any of it: a redone upsert must not
                // find a backend of the batch that is in the state but no longer in the map.
                for p in &planned {
                    forget_ranges(maps, &p.ranges_put);
                    for (_, id) in &p.created {
                        self.backends.remove(*id);
                    }
                }
                for p in planned {
                    out[p.op] = Some(self.apply_single(maps, &ops[p.op]));
                }
                return out.into_iter().map(|r| r.expect("every op has a result")).collect();
            }
        }

        let mut writes: Vec<Writes> = vec![Writes::default(); ops.len()];
        for p in &planned {
            writes[p.op] = p.w;
        }
        // Every new reference counts before any old one is dropped: a backend one frontend
        // leaves and another joins in this batch stays.
        for p in &planned {
            if let Commit::Upsert { slots, .. } = &p.commit {
                for id in slots {
                    if let Some(e) = self.backends.get_mut(id) {
                        e.1 += 1;
                    }
                }
            }
        }
        for p in &planned {
            let old = match &p.commit {
                Commit::Upsert { old_slots, .. } => old_slots,
                Commit::Delete { old } => &old.slots,
            };
            for id in old {
                let Some((k, refs)) = self.backends.get_mut(id) else { continue };
                *refs = refs.saturating_sub(1);
                if *refs == 0 {
                    let k = *k;
                    match k.0.addr {
                        IpAddr::V4(_) => l.unbe4.push(p.op, *id, (), None),
                        IpAddr::V6(_) => l.unbe6.push(p.op, *id, (), None),
                    }
                    writes[p.op].deletes += 1;
                    self.backends.remove(*id);
                }
            }
        }
        for s in RETIRE {
            writes_retire(maps, &l, s, &mut writes);
        }

        for p in planned {
            let w = &mut writes[p.op];
            match p.commit {
                Commit::Upsert { slots, affinity_timeout, flags, old_ranges, new_ranges, .. } => {
                    let mut kept = new_ranges;
                    for c in old_ranges.difference(&kept.clone()) {
                        match RangeKey::of(&p.fe, c).map(|k| maps.del_range(&k)) {
                            Some(Err(e)) => {
                                tracing::warn!("{}: deleting source range {c}: {e}", p.fe);
                                kept.insert(*c);
                            }
                            Some(Ok(())) => w.deletes += 1,
                            None => {}
                        }
                    }
                    if kept.is_empty() {
                        self.ranges.remove(&p.fe);
                    } else {
                        self.ranges.insert(p.fe, kept);
                    }
                    self.frontends.insert(p.fe, Programmed { slots, affinity_timeout, flags });
                }
                Commit::Delete { .. } => {
                    self.frontends.remove(&p.fe);
                    for c in self.ranges.remove(&p.fe).unwrap_or_default() {
                        match RangeKey::of(&p.fe, &c).map(|k| maps.del_range(&k)) {
                            Some(Err(e)) => tracing::warn!("{}: deleting source range {c}: {e}", p.fe),
                            Some(Ok(())) => w.deletes += 1,
                            None => {}
                        }
                    }
                }
            }
            out[p.op] = Some(Ok(*w));
        }
        out.into_iter().map(|r| r.expect("every op has a result")).collect()
    }

    /// Plans `upsert(fe, spec)` into `l`: the source ranges it needs are written here (single
    /// writes: LPM tries have no batch operations), new backends get their ids. `None`: nothing
    /// to write.
    fn plan_upsert(&mut self, maps: &mut impl LbMaps, op: usize, fe: &Frontend, spec: &FrontendSpec, l: &mut Lists) -> Result<Option<Planned>, MapError> {
        let mut w = Writes::default();
        let Some(wanted) = self.wanted_backends(fe, spec)? else { return Ok(None) };
        let old = self.frontends.get(fe).cloned();
        let (old_ranges, new_ranges, ranges_put) = self.put_new_ranges(maps, fe, spec, &mut w)?;

        let mut created: Vec<(BeKey, u32)> = Vec::new();
        let mut ids = Vec::with_capacity(wanted.len());
        for b in &wanted {
            let k = (*b, fe.proto);
            if let Some(id) = self.backends.id_of(&k) {
                ids.push(id);
                continue;
            }
            let id = self.alloc_id();
            match b.addr {
                IpAddr::V4(_) => l.be4.push(op, id, backend_value(b, fe.proto), None),
                IpAddr::V6(_) => l.be6.push(op, id, backend_value6(b, fe.proto), None),
            }
            w.puts += 1;
            self.backends.insert(k, id);
            created.push((k, id));
            ids.push(id);
        }

        let old_slots = old.as_ref().map(|o| o.slots.clone()).unwrap_or_default();
        let new_slots = plan_slots(&old_slots, &ids);
        let key = svc_key(fe);
        for (i, id) in new_slots.iter().enumerate() {
            if old_slots.get(i) == Some(id) {
                continue;
            }
            let slot = (i + 1) as u16;
            let val = ServiceValue { backend_id: *id, ..Default::default() };
            let was = old_slots.get(i).map(|b| ServiceValue { backend_id: *b, ..Default::default() });
            match key.with_slot(slot) {
                SvcKey::V4(k) => l.slots4.push(op, k, val, was),
                SvcKey::V6(k) => l.slots6.push(op, k, val, was),
            }
            w.puts += 1;
        }

        let old_matched: BTreeSet<u32> = match &old {
            Some(o) if o.affinity_timeout > 0 => o.slots.iter().copied().collect(),
            _ => BTreeSet::new(),
        };
        if spec.affinity_timeout > 0 {
            for id in new_slots.iter().filter(|id| !old_matched.contains(id)) {
                match key {
                    SvcKey::V4(k) => l.match4.push(op, match_key(&k, *id), (), None),
                    SvcKey::V6(k) => l.match6.push(op, match_key6(&k, *id), (), None),
                }
                w.puts += 1;
            }
        }

        let flags = master_flags(spec);
        let master = ServiceValue { backend_id: 0, count: new_slots.len() as u16, flags, affinity_timeout: spec.affinity_timeout };
        let was = old.as_ref().map(master_value);
        match key {
            SvcKey::V4(k) => l.masters4.push(op, k, master, was),
            SvcKey::V6(k) => l.masters6.push(op, k, master, was),
        }
        w.puts += 1;

        let keep: BTreeSet<u32> = if spec.affinity_timeout > 0 { new_slots.iter().copied().collect() } else { BTreeSet::new() };
        for id in old_matched.difference(&keep) {
            push_unmatch(l, op, &key, *id);
            w.deletes += 1;
        }
        for slot in new_slots.len() + 1..=old_slots.len() {
            push_unslot(l, op, &key, slot);
            w.deletes += 1;
        }
        Ok(Some(Planned {
            op,
            fe: *fe,
            commit: Commit::Upsert { slots: new_slots, affinity_timeout: spec.affinity_timeout, flags, old_slots, old_ranges, new_ranges },
            created,
            ranges_put,
            w,
        }))
    }

    /// Plans `delete(fe)` into `l`.
    fn plan_delete(&mut self, op: usize, fe: &Frontend, l: &mut Lists) -> Option<Planned> {
        let old = self.frontends.get(fe)?.clone();
        let mut w = Writes::default();
        let key = svc_key(fe);
        match key {
            SvcKey::V4(k) => l.gone4.push(op, k, (), Some(master_value(&old))),
            SvcKey::V6(k) => l.gone6.push(op, k, (), Some(master_value(&old))),
        }
        w.deletes += 1;
        if old.affinity_timeout > 0 {
            for id in &old.slots {
                push_unmatch(l, op, &key, *id);
                w.deletes += 1;
            }
        }
        for slot in 1..=old.slots.len() {
            push_unslot(l, op, &key, slot);
            w.deletes += 1;
        }
        Some(Planned { op, fe: *fe, commit: Commit::Delete { old }, created: Vec::new(), ranges_put: Vec::new(), w })
    }
}

fn master_value(p: &Programmed) -> ServiceValue {
    ServiceValue { backend_id: 0, count: p.slots.len() as u16, flags: p.flags, affinity_timeout: p.affinity_timeout }
}

fn push_unmatch(l: &mut Lists, op: usize, key: &SvcKey, id: u32) {
    match key {
        SvcKey::V4(k) => l.unmatch4.push(op, match_key(k, id), (), None),
        SvcKey::V6(k) => l.unmatch6.push(op, match_key6(k, id), (), None),
    }
}

fn push_unslot(l: &mut Lists, op: usize, key: &SvcKey, slot: usize) {
    match key.with_slot(slot as u16) {
        SvcKey::V4(k) => l.unslot4.push(op, k, (), None),
        SvcKey::V6(k) => l.unslot6.push(op, k, (), None),
    }
}

/// Writes a retire step; an element that fails is logged, not counted, and skipped.
fn writes_retire(maps: &mut impl LbMaps, l: &Lists, s: Step, writes: &mut [Writes]) {
    let ops = l.ops(s);
    let mut from = 0;
    while from < ops.len() {
        match maps.write_batch(l.batch(s, from)) {
            Ok(()) => break,
            Err(e) => {
                let i = from + e.done;
                tracing::warn!("retiring ({s:?}): {}", e.error);
                writes[ops[i]].deletes = writes[ops[i]].deletes.saturating_sub(1);
                from = i + 1;
            }
        }
    }
}
