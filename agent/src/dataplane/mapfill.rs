//! How full the datapath's maps are, and which are under pressure.
//!
//! A map that reaches [`PRESSURE_PERCENT`] of its capacity is reported before it overflows:
//! `gardenet_map_pressure{map}` (next to `gardenet_map_entries`/`_capacity`), the
//! `GardenetMapPressure` Node condition, a Warning Event on the Node and a log line. A full
//! services or backends map makes writes fail (Services are then reported one by one); a full
//! conntrack map makes the LRU evict flows, which breaks them.
use std::{collections::BTreeMap, fmt};

/// Fill level from which a map is reported as under pressure.
pub const PRESSURE_PERCENT: usize = 90;

/// One map's fill level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    pub map: &'static str,
    pub entries: usize,
    pub capacity: usize,
}

impl Fill {
    pub fn percent(&self) -> usize {
        if self.capacity == 0 {
            return 0;
        }
        self.entries.saturating_mul(100) / self.capacity
    }

    pub fn under_pressure(&self) -> bool {
        self.capacity > 0 && self.entries.saturating_mul(100) >= self.capacity.saturating_mul(PRESSURE_PERCENT)
    }
}

impl fmt::Display for Fill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} map {}% full ({} of {} entries)", self.map, self.percent(), self.entries, self.capacity)
    }
}

/// A map came under pressure or left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Pressure(Fill),
    Relieved(Fill),
}

/// The latest fill of each map.
#[derive(Debug, Default)]
pub struct MapFills(BTreeMap<&'static str, Fill>);

impl MapFills {
    /// Records `fill`; returns the change of its pressure state, if any.
    pub fn set(&mut self, fill: Fill) -> Option<Change> {
        let before = self.0.insert(fill.map, fill).is_some_and(|f| f.under_pressure());
        match (before, fill.under_pressure()) {
            (false, true) => Some(Change::Pressure(fill)),
            (true, false) => Some(Change::Relieved(fill)),
            _ => None,
        }
    }

    /// One line per map under pressure, in map order.
    pub fn pressure(&self) -> Vec<String> {
        self.0.values().filter(|f| f.under_pressure()).map(Fill::to_string).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(map: &'static str, entries: usize, capacity: usize) -> Fill {
        Fill { map, entries, capacity }
    }

    #[test]
    fn pressure_starts_at_ninety_percent() {
        assert!(!fill("conntrack", 899, 1000).under_pressure());
        assert!(fill("conntrack", 900, 1000).under_pressure());
        assert!(fill("conntrack", 1000, 1000).under_pressure());
        assert!(!fill("conntrack", 0, 0).under_pressure(), "no capacity known: no verdict");
        assert_eq!(fill("conntrack", 943, 1000).to_string(), "conntrack map 94% full (943 of 1000 entries)");
        assert!(!fill("x", usize::MAX, usize::MAX / 200).to_string().is_empty(), "no overflow");
    }

    #[test]
    fn reports_each_transition_once() {
        let mut m = MapFills::default();
        assert_eq!(m.set(fill("services", 10, 100)), None);
        assert_eq!(m.set(fill("services", 95, 100)), Some(Change::Pressure(fill("services", 95, 100))));
        assert_eq!(m.set(fill("services", 99, 100)), None, "still under pressure: no new report");
        assert_eq!(m.set(fill("conntrack", 91, 100)), Some(Change::Pressure(fill("conntrack", 91, 100))));
        assert_eq!(m.pressure(), ["conntrack map 91% full (91 of 100 entries)", "services map 99% full (99 of 100 entries)"]);
        assert_eq!(m.set(fill("services", 50, 100)), Some(Change::Relieved(fill("services", 50, 100))));
        assert_eq!(m.pressure(), ["conntrack map 91% full (91 of 100 entries)"]);
    }
}
