//! The undo log of a change that fails half-way, and where a change's writes go.
use super::{Backends, LbMaps, Lists, MapError, MapWrite, ServiceValue, Writes};

/// The inverse of every write a change made so far, and the backend ids it added to the
/// writer's state. Replayed (last write first) it leaves maps and state as before the change.
#[derive(Debug, Default)]
pub(super) struct Undo {
    writes: Vec<MapWrite>,
    created: Vec<u32>,
}

impl Undo {
    /// Writes `w`, which replaces `old` (service entries; `None`: the key is new), and logs
    /// its inverse.
    pub fn write(&mut self, maps: &mut impl LbMaps, w: MapWrite, old: Option<ServiceValue>) -> Result<(), MapError> {
        maps.write(w)?;
        self.writes.push(w.undo(old));
        Ok(())
    }

    /// Room for `n` more created backends (a new frontend creates all of its own).
    pub fn reserve_created(&mut self, n: usize) {
        self.created.reserve(n);
    }

    /// A backend id the change added to the state.
    pub fn created(&mut self, id: u32) {
        self.created.push(id);
    }

    /// Undoes the change (best effort: a write that fails is logged and skipped).
    pub fn replay(self, maps: &mut impl LbMaps, backends: &mut Backends) {
        for w in self.writes.into_iter().rev() {
            if let Err(e) = maps.write(w) {
                tracing::warn!("undoing a write ({w:?}): {e}");
            }
        }
        for id in self.created {
            backends.remove(id);
        }
    }
}

/// Where a change's writes go: to the maps at once ([`super::LbState::upsert`] and
/// `delete`), or into the per-map groups of a batch ([`super::LbState::apply`], which writes
/// them later). Source ranges are written at once either way: LPM tries have no batch
/// operations. What is written at once is logged in `undo`.
pub(super) struct Sink<'a, M> {
    pub maps: &'a mut M,
    /// The batch's groups and the index of the op these writes belong to.
    batch: Option<(&'a mut Lists, usize)>,
    pub undo: Undo,
}

impl<'a, M: LbMaps> Sink<'a, M> {
    pub fn now(maps: &'a mut M) -> Self {
        Sink { maps, batch: None, undo: Undo::default() }
    }

    pub fn batch(maps: &'a mut M, lists: &'a mut Lists, op: usize) -> Self {
        Sink { maps, batch: Some((lists, op)), undo: Undo::default() }
    }

    /// A make-before-break write (before or of the master), replacing `old` (see
    /// [`Undo::write`]). An error fails the change.
    pub fn make(&mut self, w: MapWrite, old: Option<ServiceValue>) -> Result<(), MapError> {
        match (&mut self.batch, w) {
            (Some((l, op)), MapWrite::V4(w)) => l.v4.push(*op, w, old),
            (Some((l, op)), MapWrite::V6(w)) => l.v6.push(*op, w, old),
            _ => return self.undo.write(self.maps, w, old),
        }
        Ok(())
    }

    /// A delete after the master. Failures leave unreachable garbage, never a dangling
    /// reference: logged, not counted, and the change goes on.
    pub fn retire(&mut self, w: MapWrite, n: &mut Writes) {
        match (&mut self.batch, w) {
            (Some((l, op)), MapWrite::V4(w)) => l.v4.push(*op, w, None),
            (Some((l, op)), MapWrite::V6(w)) => l.v6.push(*op, w, None),
            _ => {
                if let Err(e) = self.maps.write(w) {
                    tracing::warn!("retiring {w:?}: {e}");
                    return;
                }
            }
        }
        n.deletes += 1;
    }
}
