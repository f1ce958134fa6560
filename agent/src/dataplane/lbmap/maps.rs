//! The writer's interface to the maps, the same for both families.
//!
//! IPv4 and IPv6 each have a services, a backends and an affinity-match hash map of the same
//! shapes over the address type (`ServiceKey<A>`, `Backend<A>`, `AffinityMatchKey<A>`). A
//! write says which family it is for once, by its tag ([`MapWrite::V4`]/[`MapWrite::V6`],
//! [`Batch::V4`]/[`Batch::V6`]); everything else about it is written once, generic over
//! [`Addr`].
use std::{fmt::Debug, hash::Hash, net::IpAddr};

use gardenet_common::{
    ip6_from_octets, ip6_octets, AffinityMatchKey, Backend as BackendValue, Ip6, ServiceKey, ServiceValue, MAP_AFFINITY_MATCH, MAP_AFFINITY_MATCH6,
    MAP_BACKENDS, MAP_BACKENDS6, MAP_SERVICES, MAP_SERVICES6, MAP_SOURCE_RANGES, MAP_SOURCE_RANGES6,
};

use super::{MapError, RangeKey};

/// An address as the maps hold it, in network byte order: `u32` (IPv4) or [`Ip6`] (IPv6).
pub trait Addr: Copy + Default + Debug + Eq + Ord + Hash + Send + Sync + 'static {
    /// This family's kernel maps.
    const MAPS: MapNames;
    /// The address of `a` in this family (an IPv4 address as IPv4-mapped IPv6 and back; an
    /// IPv6 address that is not mapped becomes 0.0.0.0).
    fn of_ip(a: IpAddr) -> Self;
    fn ip(self) -> IpAddr;
    /// `w` tagged with this family.
    fn tag(w: Write<Self>) -> MapWrite;
    fn batch(e: Elems<'_, Self>) -> Batch<'_>;
}

/// The names of one family's kernel maps.
#[derive(Clone, Copy, Debug)]
pub struct MapNames {
    pub services: &'static str,
    pub backends: &'static str,
    pub matches: &'static str,
    pub ranges: &'static str,
}

impl Addr for u32 {
    const MAPS: MapNames = MapNames { services: MAP_SERVICES, backends: MAP_BACKENDS, matches: MAP_AFFINITY_MATCH, ranges: MAP_SOURCE_RANGES };
    fn of_ip(a: IpAddr) -> Self {
        let v4 = match a {
            IpAddr::V4(a) => a,
            IpAddr::V6(a) => a.to_ipv4_mapped().unwrap_or(std::net::Ipv4Addr::UNSPECIFIED),
        };
        u32::from(v4).to_be()
    }
    fn ip(self) -> IpAddr {
        std::net::Ipv4Addr::from(u32::from_be(self)).into()
    }
    fn tag(w: Write<Self>) -> MapWrite {
        MapWrite::V4(w)
    }
    fn batch(e: Elems<'_, Self>) -> Batch<'_> {
        Batch::V4(e)
    }
}

impl Addr for Ip6 {
    const MAPS: MapNames = MapNames { services: MAP_SERVICES6, backends: MAP_BACKENDS6, matches: MAP_AFFINITY_MATCH6, ranges: MAP_SOURCE_RANGES6 };
    fn of_ip(a: IpAddr) -> Self {
        let v6 = match a {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        ip6_from_octets(v6.octets())
    }
    fn ip(self) -> IpAddr {
        std::net::Ipv6Addr::from(ip6_octets(self)).into()
    }
    fn tag(w: Write<Self>) -> MapWrite {
        MapWrite::V6(w)
    }
    fn batch(e: Elems<'_, Self>) -> Batch<'_> {
        Batch::V6(e)
    }
}

/// An entry of one family's hash maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry<A> {
    /// `GN_BE4`/`GN_BE6`: backend id -> backend.
    Backend(u32, BackendValue<A>),
    /// `GN_SVC4`/`GN_SVC6`: a master (slot 0) or a backend slot.
    Service(ServiceKey<A>, ServiceValue),
    /// `GN_AFFMATCH4`/`GN_AFFMATCH6` (value 1).
    Match(AffinityMatchKey<A>),
}

/// The key of an [`Entry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key<A> {
    Backend(u32),
    Service(ServiceKey<A>),
    Match(AffinityMatchKey<A>),
}

/// A write to one family's hash maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write<A> {
    Put(Entry<A>),
    Del(Key<A>),
}

impl<A: Copy> Write<A> {
    pub fn key(&self) -> Key<A> {
        match *self {
            Write::Put(Entry::Backend(id, _)) => Key::Backend(id),
            Write::Put(Entry::Service(k, _)) => Key::Service(k),
            Write::Put(Entry::Match(k)) => Key::Match(k),
            Write::Del(k) => k,
        }
    }

    /// The write that undoes this one, given the service value it replaced (`None`: the key
    /// did not exist).
    pub fn undo(&self, old: Option<ServiceValue>) -> Write<A> {
        match (self.key(), old) {
            (Key::Service(k), Some(v)) => Write::Put(Entry::Service(k, v)),
            (k, _) => Write::Del(k),
        }
    }
}

/// One write to the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapWrite {
    V4(Write<u32>),
    V6(Write<Ip6>),
    /// `loadBalancerSourceRanges` entries (`GN_SRCRANGE4/6`; the key carries its family).
    PutRange(RangeKey),
    DelRange(RangeKey),
}

impl MapWrite {
    /// See [`Write::undo`].
    pub fn undo(&self, old: Option<ServiceValue>) -> MapWrite {
        match self {
            MapWrite::V4(w) => MapWrite::V4(w.undo(old)),
            MapWrite::V6(w) => MapWrite::V6(w.undo(old)),
            MapWrite::PutRange(k) => MapWrite::DelRange(*k),
            MapWrite::DelRange(k) => MapWrite::PutRange(*k),
        }
    }
}

impl<A: Addr> From<Entry<A>> for MapWrite {
    fn from(e: Entry<A>) -> Self {
        A::tag(Write::Put(e))
    }
}

impl<A: Addr> From<Key<A>> for MapWrite {
    fn from(k: Key<A>) -> Self {
        A::tag(Write::Del(k))
    }
}

/// Many writes to one hash map of one family: keys (and values) in the order they are applied.
#[derive(Clone, Copy, Debug)]
pub enum Elems<'a, A> {
    PutBackends(&'a [u32], &'a [BackendValue<A>]),
    PutServices(&'a [ServiceKey<A>], &'a [ServiceValue]),
    PutMatches(&'a [AffinityMatchKey<A>]),
    DelBackends(&'a [u32]),
    DelServices(&'a [ServiceKey<A>]),
    DelMatches(&'a [AffinityMatchKey<A>]),
}

/// The map an [`Elems`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Backends,
    Services,
    Matches,
}

impl<'a, A: Copy> Elems<'a, A> {
    pub fn len(&self) -> usize {
        match self {
            Elems::PutBackends(k, _) | Elems::DelBackends(k) => k.len(),
            Elems::PutServices(k, _) | Elems::DelServices(k) => k.len(),
            Elems::PutMatches(k) | Elems::DelMatches(k) => k.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn map(&self) -> MapKind {
        match self {
            Elems::PutBackends(..) | Elems::DelBackends(_) => MapKind::Backends,
            Elems::PutServices(..) | Elems::DelServices(_) => MapKind::Services,
            Elems::PutMatches(_) | Elems::DelMatches(_) => MapKind::Matches,
        }
    }

    pub fn is_delete(&self) -> bool {
        matches!(self, Elems::DelBackends(_) | Elems::DelServices(_) | Elems::DelMatches(_))
    }

    /// Element `i` as a single write.
    pub fn get(&self, i: usize) -> Write<A> {
        match self {
            Elems::PutBackends(k, v) => Write::Put(Entry::Backend(k[i], v[i])),
            Elems::PutServices(k, v) => Write::Put(Entry::Service(k[i], v[i])),
            Elems::PutMatches(k) => Write::Put(Entry::Match(k[i])),
            Elems::DelBackends(k) => Write::Del(Key::Backend(k[i])),
            Elems::DelServices(k) => Write::Del(Key::Service(k[i])),
            Elems::DelMatches(k) => Write::Del(Key::Match(k[i])),
        }
    }

    /// The elements from `i` on.
    pub fn from(self, i: usize) -> Self {
        match self {
            Elems::PutBackends(k, v) => Elems::PutBackends(&k[i..], &v[i..]),
            Elems::PutServices(k, v) => Elems::PutServices(&k[i..], &v[i..]),
            Elems::PutMatches(k) => Elems::PutMatches(&k[i..]),
            Elems::DelBackends(k) => Elems::DelBackends(&k[i..]),
            Elems::DelServices(k) => Elems::DelServices(&k[i..]),
            Elems::DelMatches(k) => Elems::DelMatches(&k[i..]),
        }
    }
}

/// Many writes to one hash map, of either family.
#[derive(Clone, Copy, Debug)]
pub enum Batch<'a> {
    V4(Elems<'a, u32>),
    V6(Elems<'a, Ip6>),
}

impl Batch<'_> {
    pub fn len(&self) -> usize {
        match self {
            Batch::V4(e) => e.len(),
            Batch::V6(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a single write.
    pub fn get(&self, i: usize) -> MapWrite {
        match self {
            Batch::V4(e) => MapWrite::V4(e.get(i)),
            Batch::V6(e) => MapWrite::V6(e.get(i)),
        }
    }

    /// The elements from `i` on.
    pub fn from(self, i: usize) -> Self {
        match self {
            Batch::V4(e) => Batch::V4(e.from(i)),
            Batch::V6(e) => Batch::V6(e.from(i)),
        }
    }
}

/// What the writer needs of the maps.
pub trait LbMaps {
    /// One write. Deleting a missing key is not an error.
    fn write(&mut self, w: MapWrite) -> Result<(), MapError>;

    /// Service ranges and ClusterIPs (`GN_SVCNET`, value `SVCNET_*`; one trie for both
    /// families).
    fn put_service_net(&mut self, net: &crate::desired::Cidr, kind: super::ServiceNet) -> Result<(), MapError>;
    fn del_service_net(&mut self, net: &crate::desired::Cidr) -> Result<(), MapError>;

    /// Applies the elements of `b` in order, as if one by one (a reader may see any prefix),
    /// and stops at the first that fails: [`BatchError::done`] elements were written. Deleting
    /// a missing key is not an error. The default writes one by one; the kernel backend uses
    /// `BPF_MAP_UPDATE_BATCH`/`BPF_MAP_DELETE_BATCH` where the kernel has them.
    fn write_batch(&mut self, b: Batch<'_>) -> Result<(), BatchError> {
        one_by_one(self, b)
    }

    /// Writes `a` and `b` as if at the same time (the kernel backend writes them from two
    /// threads): a reader may see any prefix of each, in any interleaving, so nothing in one
    /// may depend on the other. Each result as [`LbMaps::write_batch`]. The default writes
    /// `a`, then `b`.
    fn write_batches(&mut self, a: Batch<'_>, b: Batch<'_>) -> [Result<(), BatchError>; 2] {
        [self.write_batch(a), self.write_batch(b)]
    }
}

/// A batch that stopped: its first `done` elements were written, element `done` failed.
#[derive(Debug, thiserror::Error)]
#[error("{error} (element {done} of a batch)")]
pub struct BatchError {
    pub done: usize,
    #[source]
    pub error: MapError,
}

/// [`LbMaps::write_batch`] with single writes.
pub fn one_by_one<M: LbMaps + ?Sized>(maps: &mut M, b: Batch<'_>) -> Result<(), BatchError> {
    for done in 0..b.len() {
        maps.write(b.get(done)).map_err(|error| BatchError { done, error })?;
    }
    Ok(())
}
