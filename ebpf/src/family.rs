//! The address family as a type. Everything that is the same for IPv4 and IPv6 (backend
//! selection, session affinity, node scope, source ranges, socket LB's translation, TC LB's
//! conntrack, NAT and ICMP handling) is written once, generic over [`Family`];
//! monomorphisation still gives the verifier one function per family, as hand-written twins
//! did. A family names its address type and the maps of its keys; the map key and value
//! types themselves are shared (`ServiceKey<A>`, `Backend<A>`, `CtKey<A>`, ...). Packet
//! header layout is in `tc::l3`.
use aya_ebpf::{
    bindings::bpf_sock_tuple,
    maps::{lpm_trie::Key, HashMap, LpmTrie, LruHashMap},
};
use gardenet_common::*;

use crate::{
    GN_AFF4, GN_AFF6, GN_AFFMATCH4, GN_AFFMATCH6, GN_BE4, GN_BE6, GN_CT4, GN_CT6, GN_SK_RNAT4, GN_SK_RNAT6, GN_SRCRANGE4, GN_SRCRANGE6, GN_SVC4, GN_SVC6,
};

pub struct V4;
pub struct V6;

pub trait Family: Sized + 'static {
    /// An address, network byte order: `u32` or `Ip6`.
    type Addr: Copy + PartialEq + 'static;
    /// Who session affinity remembers: a netns cookie (socket LB) or an address (TC LB).
    type Client: Copy;
    /// Value of the conntrack map (the IPv6 one needs padding the IPv4 one has not).
    type CtValue: Copy + 'static;
    /// Bits of a `SourceRange<Addr>` key before the client address (`SOURCE_RANGE_FE_BITS*`).
    const RANGE_FE_BITS: u32;
    /// Bits of an address.
    const ADDR_BITS: u32;

    fn services() -> &'static HashMap<ServiceKey<Self::Addr>, ServiceValue>;
    fn backends() -> &'static HashMap<u32, Backend<Self::Addr>>;
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey<Self::Addr>, u8>;
    fn source_ranges() -> &'static LpmTrie<SourceRange<Self::Addr>, u8>;
    fn conntrack() -> &'static LruHashMap<CtKey<Self::Addr>, Self::CtValue>;

    /// The address as `GN_SVCNET` keys it (IPv4 v4-mapped).
    fn net_key(a: Self::Addr) -> Ip6;
    fn netns_client(cookie: u64) -> Self::Client;
    fn addr_client(a: Self::Addr) -> Self::Client;
    /// The affinity entry of `client` for the frontend of `k`, if any.
    fn affinity(client: Self::Client, k: &ServiceKey<Self::Addr>, kind: u8) -> Option<*mut AffinityValue>;
    fn remember_affinity(client: Self::Client, k: &ServiceKey<Self::Addr>, kind: u8, v: &AffinityValue);
    /// Socket LB's reverse translation of a socket: backend -> frontend it asked for.
    fn remember_socket(cookie: u64, backend: (Self::Addr, u16), frontend: (Self::Addr, u16));
    fn socket_frontend(cookie: u64, backend: (Self::Addr, u16)) -> Option<(Self::Addr, u16)>;
    /// Fills the family's part of a socket-lookup tuple; returns its size for the helper.
    fn sock_tuple(t: &mut bpf_sock_tuple, src: (Self::Addr, u16), dst: (Self::Addr, u16)) -> u32;

    fn ct_value(addr: Self::Addr, port: u16, flags: u16, last_seen_ns: u64) -> Self::CtValue;
    /// A conntrack entry's address, port and flags.
    fn ct_target(v: &Self::CtValue) -> (Self::Addr, u16, u16);
    /// A conntrack entry's last use and flags, to update in place.
    fn ct_marks(v: &mut Self::CtValue) -> (&mut u64, &mut u16);

    #[inline(always)]
    fn service(k: &ServiceKey<Self::Addr>) -> Option<&'static ServiceValue> {
        unsafe { Self::services().get(k) }
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<&'static Backend<Self::Addr>> {
        unsafe { Self::backends().get(&id) }
    }
    /// `loadBalancerSourceRanges`: whether `client` may open a flow to the frontend of `k`.
    #[inline(always)]
    fn source_allowed(k: &ServiceKey<Self::Addr>, client: Self::Addr) -> bool {
        let data = SourceRange { fe_addr: k.addr, fe_port: k.port, proto: k.proto, _pad: 0, client };
        Self::source_ranges().get(Key::new(Self::RANGE_FE_BITS + Self::ADDR_BITS, data)).is_some()
    }
    /// Whether backend `id` still belongs to the frontend entry set of `k` (`GN_AFFMATCH*`).
    #[inline(always)]
    fn belongs(id: u32, k: &ServiceKey<Self::Addr>) -> bool {
        let m = AffinityMatchKey { backend_id: id, addr: k.addr, port: k.port, proto: k.proto, scope: k.scope };
        unsafe { Self::affinity_matches().get(&m) }.is_some()
    }
}

impl Family for V4 {
    type Addr = u32;
    type Client = u64;
    type CtValue = CtValue4;
    const RANGE_FE_BITS: u32 = SOURCE_RANGE_FE_BITS4;
    const ADDR_BITS: u32 = 32;

    #[inline(always)]
    fn services() -> &'static HashMap<ServiceKey4, ServiceValue> {
        &GN_SVC4
    }
    #[inline(always)]
    fn backends() -> &'static HashMap<u32, Backend4> {
        &GN_BE4
    }
    #[inline(always)]
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey4, u8> {
        &GN_AFFMATCH4
    }
    #[inline(always)]
    fn source_ranges() -> &'static LpmTrie<SourceRange4, u8> {
        &GN_SRCRANGE4
    }
    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<CtKey4, CtValue4> {
        &GN_CT4
    }
    #[inline(always)]
    fn net_key(a: u32) -> Ip6 {
        [0, 0, V4_MAPPED_W2, a]
    }
    #[inline(always)]
    fn netns_client(cookie: u64) -> u64 {
        cookie
    }
    #[inline(always)]
    fn addr_client(a: u32) -> u64 {
        a as u64
    }
    #[inline(always)]
    fn affinity(client: u64, k: &ServiceKey4, kind: u8) -> Option<*mut AffinityValue> {
        GN_AFF4.get_ptr_mut(&AffinityKey4 { client, addr: k.addr, port: k.port, proto: k.proto, kind })
    }
    #[inline(always)]
    fn remember_affinity(client: u64, k: &ServiceKey4, kind: u8, v: &AffinityValue) {
        let _ = GN_AFF4.insert(&AffinityKey4 { client, addr: k.addr, port: k.port, proto: k.proto, kind }, v, 0);
    }
    #[inline(always)]
    fn remember_socket(cookie: u64, (addr, port): (u32, u16), (fe_addr, fe_port): (u32, u16)) {
        let _ = GN_SK_RNAT4.insert(&SockRevNatKey4 { cookie, addr, port, _pad: 0 }, &SockRevNatValue { addr: fe_addr, port: fe_port, _pad: 0 }, 0);
    }
    #[inline(always)]
    fn socket_frontend(cookie: u64, (addr, port): (u32, u16)) -> Option<(u32, u16)> {
        unsafe { GN_SK_RNAT4.get(&SockRevNatKey4 { cookie, addr, port, _pad: 0 }) }.map(|v| (v.addr, v.port))
    }
    #[inline(always)]
    fn sock_tuple(t: &mut bpf_sock_tuple, (saddr, sport): (u32, u16), (daddr, dport): (u32, u16)) -> u32 {
        // SAFETY: writing plain integers into the union's IPv4 member.
        unsafe {
            let v4 = &mut t.__bindgen_anon_1.ipv4;
            v4.saddr = saddr;
            v4.daddr = daddr;
            v4.sport = sport;
            v4.dport = dport;
        }
        12 // sizeof(tuple.ipv4)
    }
    #[inline(always)]
    fn ct_value(addr: u32, port: u16, flags: u16, last_seen_ns: u64) -> CtValue4 {
        CtValue4 { addr, port, flags, last_seen_ns }
    }
    #[inline(always)]
    fn ct_target(v: &CtValue4) -> (u32, u16, u16) {
        (v.addr, v.port, v.flags)
    }
    #[inline(always)]
    fn ct_marks(v: &mut CtValue4) -> (&mut u64, &mut u16) {
        (&mut v.last_seen_ns, &mut v.flags)
    }
}

impl Family for V6 {
    type Addr = Ip6;
    type Client = Ip6;
    type CtValue = CtValue6;
    const RANGE_FE_BITS: u32 = SOURCE_RANGE_FE_BITS6;
    const ADDR_BITS: u32 = 128;

    #[inline(always)]
    fn services() -> &'static HashMap<ServiceKey6, ServiceValue> {
        &GN_SVC6
    }
    #[inline(always)]
    fn backends() -> &'static HashMap<u32, Backend6> {
        &GN_BE6
    }
    #[inline(always)]
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey6, u8> {
        &GN_AFFMATCH6
    }
    #[inline(always)]
    fn source_ranges() -> &'static LpmTrie<SourceRange6, u8> {
        &GN_SRCRANGE6
    }
    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<CtKey6, CtValue6> {
        &GN_CT6
    }
    #[inline(always)]
    fn net_key(a: Ip6) -> Ip6 {
        a
    }
    /// The cookie in words 0-1, words 2-3 zero (see `AffinityKey6`).
    #[inline(always)]
    fn netns_client(cookie: u64) -> Ip6 {
        [cookie as u32, (cookie >> 32) as u32, 0, 0]
    }
    #[inline(always)]
    fn addr_client(a: Ip6) -> Ip6 {
        a
    }
    #[inline(always)]
    fn affinity(client: Ip6, k: &ServiceKey6, kind: u8) -> Option<*mut AffinityValue> {
        GN_AFF6.get_ptr_mut(&AffinityKey6 { client, addr: k.addr, port: k.port, proto: k.proto, kind })
    }
    #[inline(always)]
    fn remember_affinity(client: Ip6, k: &ServiceKey6, kind: u8, v: &AffinityValue) {
        let _ = GN_AFF6.insert(&AffinityKey6 { client, addr: k.addr, port: k.port, proto: k.proto, kind }, v, 0);
    }
    #[inline(always)]
    fn remember_socket(cookie: u64, (addr, port): (Ip6, u16), (fe_addr, fe_port): (Ip6, u16)) {
        let k = SockRevNatKey6 { cookie, addr, port, _pad: 0, _pad2: 0 };
        let _ = GN_SK_RNAT6.insert(&k, &SockRevNatValue { addr: fe_addr, port: fe_port, _pad: 0 }, 0);
    }
    #[inline(always)]
    fn socket_frontend(cookie: u64, (addr, port): (Ip6, u16)) -> Option<(Ip6, u16)> {
        unsafe { GN_SK_RNAT6.get(&SockRevNatKey6 { cookie, addr, port, _pad: 0, _pad2: 0 }) }.map(|v| (v.addr, v.port))
    }
    #[inline(always)]
    fn sock_tuple(t: &mut bpf_sock_tuple, (saddr, sport): (Ip6, u16), (daddr, dport): (Ip6, u16)) -> u32 {
        // SAFETY: writing plain integers into the union's IPv6 member.
        unsafe {
            let v6 = &mut t.__bindgen_anon_1.ipv6;
            v6.saddr = saddr;
            v6.daddr = daddr;
            v6.sport = sport;
            v6.dport = dport;
        }
        36 // sizeof(tuple.ipv6)
    }
    #[inline(always)]
    fn ct_value(addr: Ip6, port: u16, flags: u16, last_seen_ns: u64) -> CtValue6 {
        CtValue6 { addr, port, flags, _pad: 0, last_seen_ns }
    }
    #[inline(always)]
    fn ct_target(v: &CtValue6) -> (Ip6, u16, u16) {
        (v.addr, v.port, v.flags)
    }
    #[inline(always)]
    fn ct_marks(v: &mut CtValue6) -> (&mut u64, &mut u16) {
        (&mut v.last_seen_ns, &mut v.flags)
    }
}
