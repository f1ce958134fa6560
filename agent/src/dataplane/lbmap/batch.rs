//! Many frontend changes in one go: the writes of all of them grouped per map and step, each
//! group one [`LbMaps::write_batch`] (one `bpf()` call on the kernel maps).
//!
//! The steps keep [`LbState::upsert`]'s make-before-break order across the whole batch: source
//! ranges, then every new backend, every slot, every affinity match, then the master entries
//! (and the master deletes of removed frontends); only then surplus matches, slots and
//! backends nobody references any more. A master is published after everything it points to,
//! whatever other frontends of the batch do, and a backend is deleted only once no new or old
//! programming can reach it (references are counted over the whole batch first). New slots past
//! a master's current count are unreachable until that master is written, so they go with the
//! new backends, at the same time ([`LbMaps::write_batches`]: two threads on the kernel maps,
//! a third less time for the kernel's part of a sync); a slot a reader can reach now is
//! rewritten only after the backends.
//!
//! Errors: a step that fails (a full map, ...) is undone with everything the batch wrote
//! before it (the batch reports how many of its elements were written), leaving maps and state
//! as they were; then the same changes are made one frontend at a time with
//! [`LbState::upsert`]/[`LbState::delete`], which attribute the error to the frontend concerned
//! and program the others. Failures while retiring are logged and skipped, as in `upsert`.
use std::collections::HashSet;

use gardenet_common::AffinityMatchKey;

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

/// Which op each write of a group belongs to, and the service value it replaces (to undo it).
#[derive(Default)]
struct Meta {
    op: Vec<usize>,
    old: Vec<Option<ServiceValue>>,
}

/// The writes of a batch to one map, in order.
struct Group<K, V> {
    keys: Vec<K>,
    vals: Vec<V>,
    meta: Meta,
}

impl<K, V> Default for Group<K, V> {
    fn default() -> Self {
        Group { keys: Vec::new(), vals: Vec::new(), meta: Meta::default() }
    }
}

impl<K, V> Group<K, V> {
    fn reserve(&mut self, n: usize) {
        self.keys.reserve(n);
        self.vals.reserve(n);
        self.meta.op.reserve(n);
        self.meta.old.reserve(n);
    }

    fn push(&mut self, op: usize, k: K, v: V, old: Option<ServiceValue>) {
        self.keys.push(k);
        self.vals.push(v);
        self.meta.op.push(op);
        self.meta.old.push(old);
    }
}

/// The steps of a batch, in the order they are written, each for IPv4 then IPv6.
#[derive(Clone, Copy, Debug)]
enum Step {
    Backends,
    /// Slots past the master's current count (no reader reaches them yet).
    Fresh,
    /// Slots a reader may reach now (rewritten in place).
    Slots,
    Matches,
    Masters,
    /// Masters of deleted frontends (`old` is the master, to put back on undo).
    Gone,
    // Retiring, after every master.
    Unmatch,
    Unslot,
    Unbe,
}

/// The make steps in order; the steps of a stage are written at the same time.
const MAKE: [&[Step]; 5] = [&[Step::Backends, Step::Fresh], &[Step::Slots], &[Step::Matches], &[Step::Masters], &[Step::Gone]];
const RETIRE: [Step; 3] = [Step::Unmatch, Step::Unslot, Step::Unbe];

#[derive(Clone, Copy, Debug)]
enum Family {
    V4,
    V6,
}

/// `steps` for both families, IPv4 first.
fn both(steps: &[Step]) -> Vec<(Step, Family)> {
    steps.iter().flat_map(|s| [(*s, Family::V4), (*s, Family::V6)]).collect()
}

/// One family's writes of a batch, one group per step.
pub(super) struct Groups<A> {
    backends: Group<u32, BackendValue<A>>,
    fresh: Group<ServiceKey<A>, ServiceValue>,
    slots: Group<ServiceKey<A>, ServiceValue>,
    matches: Group<AffinityMatchKey<A>, ()>,
    masters: Group<ServiceKey<A>, ServiceValue>,
    gone: Group<ServiceKey<A>, ()>,
    unmatch: Group<AffinityMatchKey<A>, ()>,
    unslot: Group<ServiceKey<A>, ()>,
    unbe: Group<u32, ()>,
}

impl<A> Default for Groups<A> {
    fn default() -> Self {
        Groups {
            backends: Group::default(),
            fresh: Group::default(),
            slots: Group::default(),
            matches: Group::default(),
            masters: Group::default(),
            gone: Group::default(),
            unmatch: Group::default(),
            unslot: Group::default(),
            unbe: Group::default(),
        }
    }
}

impl<A: Addr> Groups<A> {
    /// Room for what a batch of new frontends writes: `upserts` masters and up to `backends`
    /// backends and fresh slots (a sync's batches would otherwise grow each vector ~14 times).
    fn reserve(&mut self, upserts: usize, backends: usize) {
        self.backends.reserve(backends);
        self.fresh.reserve(backends);
        self.masters.reserve(upserts);
    }

    /// Files a write of op `op` under its step: puts are make steps (masters are slot 0),
    /// deletes retire, except a master's. A slot without a previous value is past its
    /// master's count (slots 1..=count always exist): fresh.
    pub fn push(&mut self, op: usize, w: Write<A>, old: Option<ServiceValue>) {
        match w {
            Write::Put(Entry::Backend(id, b)) => self.backends.push(op, id, b, old),
            Write::Put(Entry::Service(k, v)) if k.slot == 0 => self.masters.push(op, k, v, old),
            Write::Put(Entry::Service(k, v)) if old.is_none() => self.fresh.push(op, k, v, old),
            Write::Put(Entry::Service(k, v)) => self.slots.push(op, k, v, old),
            Write::Put(Entry::Match(k)) => self.matches.push(op, k, (), old),
            Write::Del(Key::Service(k)) if k.slot == 0 => self.gone.push(op, k, (), old),
            Write::Del(Key::Service(k)) => self.unslot.push(op, k, (), old),
            Write::Del(Key::Match(k)) => self.unmatch.push(op, k, (), old),
            Write::Del(Key::Backend(id)) => self.unbe.push(op, id, (), old),
        }
    }

    fn step(&self, s: Step) -> (Batch<'_>, &Meta) {
        let (e, m) = match s {
            Step::Backends => (Elems::PutBackends(&self.backends.keys, &self.backends.vals), &self.backends.meta),
            Step::Fresh => (Elems::PutServices(&self.fresh.keys, &self.fresh.vals), &self.fresh.meta),
            Step::Slots => (Elems::PutServices(&self.slots.keys, &self.slots.vals), &self.slots.meta),
            Step::Matches => (Elems::PutMatches(&self.matches.keys), &self.matches.meta),
            Step::Masters => (Elems::PutServices(&self.masters.keys, &self.masters.vals), &self.masters.meta),
            Step::Gone => (Elems::DelServices(&self.gone.keys), &self.gone.meta),
            Step::Unmatch => (Elems::DelMatches(&self.unmatch.keys), &self.unmatch.meta),
            Step::Unslot => (Elems::DelServices(&self.unslot.keys), &self.unslot.meta),
            Step::Unbe => (Elems::DelBackends(&self.unbe.keys), &self.unbe.meta),
        };
        (A::batch(e), m)
    }
}

/// The grouped writes of a batch.
#[derive(Default)]
pub(super) struct Lists {
    pub v4: Groups<u32>,
    pub v6: Groups<Ip6>,
}

impl Lists {
    /// A step's writes (one map of one family) and their ops and replaced values.
    fn step(&self, (s, f): (Step, Family)) -> (Batch<'_>, &Meta) {
        match f {
            Family::V4 => self.v4.step(s),
            Family::V6 => self.v6.step(s),
        }
    }

    /// Undoes the first `n` writes of a make step, last first (best effort, like `upsert`'s
    /// undo log): masters go back to their old value, slots to their old backend, new
    /// matches and backends are deleted.
    fn undo(&self, maps: &mut impl LbMaps, s: (Step, Family), n: usize) {
        let (b, m) = self.step(s);
        for i in (0..n.min(b.len())).rev() {
            let w = b.get(i).undo(m.old[i]);
            if let Err(e) = maps.write(w) {
                tracing::warn!("undoing a batched write ({w:?}): {e}");
            }
        }
    }

    /// Writes a retire step; an element that fails is logged, not counted, and skipped.
    fn retire(&self, maps: &mut impl LbMaps, s: (Step, Family), writes: &mut [Writes]) {
        let (b, m) = self.step(s);
        let mut from = 0;
        while from < b.len() {
            match maps.write_batch(b.from(from)) {
                Ok(()) => break,
                Err(e) => {
                    let i = from + e.done;
                    tracing::warn!("retiring ({s:?}): {}", e.error);
                    writes[m.op[i]].deletes = writes[m.op[i]].deletes.saturating_sub(1);
                    from = i + 1;
                }
            }
        }
    }
}

impl LbState {
    /// Applies `ops` in order with the same result as calling [`LbState::upsert`] or
    /// [`LbState::delete`] for each (one result per op, in order), writing each map in a
    /// few batches. A frontend that appears twice splits the work in two batches.
    pub fn apply(&mut self, maps: &mut impl LbMaps, ops: &[Op]) -> Vec<Result<Writes, MapError>> {
        let mut out = Vec::with_capacity(ops.len());
        let mut start = 0;
        let mut seen: HashSet<Frontend, foldhash::fast::RandomState> = HashSet::default();
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
    fn apply_distinct<M: LbMaps>(&mut self, maps: &mut M, ops: &[Op]) -> Vec<Result<Writes, MapError>> {
        if ops.len() <= 1 {
            return ops.iter().map(|op| self.apply_single(maps, op)).collect();
        }
        let mut out: Vec<Option<Result<Writes, MapError>>> = (0..ops.len()).map(|_| None).collect();
        let mut l = Lists::default();
        let upserts = |v4: bool| {
            ops.iter().filter_map(move |op| if let Op::Upsert(fe, spec) = op { (fe.addr.is_ipv4() == v4).then_some(spec.backends.len()) } else { None })
        };
        l.v4.reserve(upserts(true).count(), upserts(true).sum());
        l.v6.reserve(upserts(false).count(), upserts(false).sum());
        let mut planned: Vec<(usize, Planned)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let mut sink = Sink::batch(maps, &mut l, i);
            let r = match op {
                Op::Upsert(fe, spec) => self.plan_upsert(&mut sink, fe, spec),
                Op::Delete(fe) => self.plan_delete(&mut sink, fe),
            };
            match r {
                Ok(Some(p)) => planned.push((i, p)),
                Ok(None) => out[i] = Some(Ok(Writes::default())),
                Err(e) => {
                    sink.undo.replay(sink.maps, &mut self.backends);
                    out[i] = Some(Err(e));
                }
            }
        }

        // Make steps, stage by stage; on failure undo all of them and go one frontend at a time.
        let mut written: Vec<((Step, Family), usize)> = Vec::new();
        for stage in MAKE.iter().flat_map(|st| [Family::V4, Family::V6].map(|f| st.iter().map(move |s| (*s, f)))) {
            let stage: Vec<(Step, Family)> = stage.filter(|s| !l.step(*s).0.is_empty()).collect();
            let results = match stage[..] {
                [] => continue,
                [a] => vec![maps.write_batch(l.step(a).0)],
                [a, b] => maps.write_batches(l.step(a).0, l.step(b).0).into(),
                _ => unreachable!("a stage has at most two steps"),
            };
            let mut failed = None;
            for (s, r) in stage.into_iter().zip(results) {
                match r {
                    Ok(()) => written.push((s, usize::MAX)),
                    Err(e) => {
                        written.push((s, e.done));
                        failed.get_or_insert((s, e));
                    }
                }
            }
            if let Some((s, e)) = failed {
                tracing::debug!("batched {s:?} failed ({e}); undoing the batch and writing its {} frontends one by one", planned.len());
                for (s, n) in written.into_iter().rev() {
                    l.undo(maps, s, n);
                }
                // Forget the whole batch before redoing any of it: a redone upsert must not
                // find a backend of the batch that is in the state but no longer in the map.
                let mut redo = Vec::with_capacity(planned.len());
                for (i, p) in planned {
                    p.undo.replay(maps, &mut self.backends);
                    redo.push(i);
                }
                for i in redo {
                    out[i] = Some(self.apply_single(maps, &ops[i]));
                }
                return out.into_iter().map(|r| r.expect("every op has a result")).collect();
            }
        }

        // Every new reference counts before any old one is dropped: a backend one frontend
        // leaves and another joins in this batch stays.
        for (_, p) in &planned {
            self.hold(&p.commit);
        }
        for (i, p) in &mut planned {
            self.release(&mut Sink::batch(maps, &mut l, *i), p.commit.old_slots(), &mut p.w);
        }
        let mut writes: Vec<Writes> = vec![Writes::default(); ops.len()];
        for (i, p) in &planned {
            writes[*i] = p.w;
        }
        for s in both(&RETIRE) {
            l.retire(maps, s, &mut writes);
        }
        for (i, p) in planned {
            self.commit(maps, &p.fe, p.commit, &mut writes[i]);
            out[i] = Some(Ok(writes[i]));
        }
        out.into_iter().map(|r| r.expect("every op has a result")).collect()
    }
}
