//! The address family as a type. What is the same for IPv4 and IPv6 (backend selection,
//! session affinity, node scope, source ranges, socket LB's translation) is written once,
//! generic over [`Family`]; monomorphisation still gives the verifier one function per
//! family, as hand-written twins did. A family names its address type, its map keys and the
//! maps they go to; nothing else differs.
use aya_ebpf::{bindings::bpf_sock_tuple, maps::lpm_trie::Key};
use gardenet_common::*;

use crate::{GN_AFF4, GN_AFF6, GN_AFFMATCH4, GN_AFFMATCH6, GN_BE4, GN_BE6, GN_SK_RNAT4, GN_SK_RNAT6, GN_SRCRANGE4, GN_SRCRANGE6, GN_SVC4, GN_SVC6};

pub struct V4;
pub struct V6;

pub trait Family {
    /// An address, network byte order: `u32` or `Ip6`.
    type Addr: Copy + 'static;
    /// Key of the service map (`GN_SVC4`/`GN_SVC6`).
    type SvcKey: Copy + 'static;
    /// Value of the backend map (`GN_BE4`/`GN_BE6`).
    type Backend: Copy + 'static;
    /// Who session affinity remembers: a netns cookie (socket LB) or an address (TC LB).
    type Client: Copy;

    fn master_key(addr: Self::Addr, port: u16, proto: u8) -> Self::SvcKey;
    fn with_slot(k: Self::SvcKey, slot: u16) -> Self::SvcKey;
    fn with_scope(k: Self::SvcKey, scope: u8) -> Self::SvcKey;
    fn service(k: &Self::SvcKey) -> Option<&'static ServiceValue>;
    fn backend(id: u32) -> Option<&'static Self::Backend>;
    /// A backend's address and port.
    fn endpoint(b: &Self::Backend) -> (Self::Addr, u16);
    /// The address as `GN_SVCNET` keys it (IPv4 v4-mapped).
    fn net_key(a: Self::Addr) -> Ip6;
    /// `loadBalancerSourceRanges`: whether `client` may open a flow to the frontend of `k`.
    fn source_allowed(k: &Self::SvcKey, client: Self::Addr) -> bool;
    fn netns_client(cookie: u64) -> Self::Client;
    fn addr_client(a: Self::Addr) -> Self::Client;
    /// The affinity entry of `client` for the frontend of `k`, if any.
    fn affinity(client: Self::Client, k: &Self::SvcKey, kind: u8) -> Option<*mut AffinityValue>;
    fn remember_affinity(client: Self::Client, k: &Self::SvcKey, kind: u8, v: &AffinityValue);
    /// Whether backend `id` still belongs to the frontend entry set of `k` (`GN_AFFMATCH*`).
    fn belongs(id: u32, k: &Self::SvcKey) -> bool;
    /// Socket LB's reverse translation of a socket: backend -> frontend it asked for.
    fn remember_socket(cookie: u64, backend: (Self::Addr, u16), frontend: (Self::Addr, u16));
    fn socket_frontend(cookie: u64, backend: (Self::Addr, u16)) -> Option<(Self::Addr, u16)>;
    /// Fills the family's part of a socket-lookup tuple; returns its size for the helper.
    fn sock_tuple(t: &mut bpf_sock_tuple, src: (Self::Addr, u16), dst: (Self::Addr, u16)) -> u32;
}

impl Family for V4 {
    type Addr = u32;
    type SvcKey = ServiceKey4;
    type Backend = Backend4;
    type Client = u64;

    #[inline(always)]
    fn master_key(addr: u32, port: u16, proto: u8) -> ServiceKey4 {
        ServiceKey4::master(addr, port, proto)
    }
    #[inline(always)]
    fn with_slot(k: ServiceKey4, slot: u16) -> ServiceKey4 {
        k.with_slot(slot)
    }
    #[inline(always)]
    fn with_scope(k: ServiceKey4, scope: u8) -> ServiceKey4 {
        k.with_scope(scope)
    }
    #[inline(always)]
    fn service(k: &ServiceKey4) -> Option<&'static ServiceValue> {
        unsafe { GN_SVC4.get(k) }
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<&'static Backend4> {
        unsafe { GN_BE4.get(&id) }
    }
    #[inline(always)]
    fn endpoint(b: &Backend4) -> (u32, u16) {
        (b.addr, b.port)
    }
    #[inline(always)]
    fn net_key(a: u32) -> Ip6 {
        [0, 0, V4_MAPPED_W2, a]
    }
    #[inline(always)]
    fn source_allowed(k: &ServiceKey4, client: u32) -> bool {
        let data = SourceRange4 { fe_addr: k.addr, fe_port: k.port, proto: k.proto, _pad: 0, client };
        GN_SRCRANGE4.get(Key::new(SOURCE_RANGE_FE_BITS4 + 32, data)).is_some()
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
    fn belongs(id: u32, k: &ServiceKey4) -> bool {
        let m = AffinityMatchKey4 { backend_id: id, addr: k.addr, port: k.port, proto: k.proto, scope: k.scope };
        unsafe { GN_AFFMATCH4.get(&m) }.is_some()
    }
    #[inline(always)]
    fn remember_socket(cookie: u64, (addr, port): (u32, u16), (fe_addr, fe_port): (u32, u16)) {
        let _ = GN_SK_RNAT4.insert(&SockRevNatKey4 { cookie, addr, port, _pad: 0 }, &SockRevNatValue4 { addr: fe_addr, port: fe_port, _pad: 0 }, 0);
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
}

impl Family for V6 {
    type Addr = Ip6;
    type SvcKey = ServiceKey6;
    type Backend = Backend6;
    type Client = Ip6;

    #[inline(always)]
    fn master_key(addr: Ip6, port: u16, proto: u8) -> ServiceKey6 {
        ServiceKey6::master(addr, port, proto)
    }
    #[inline(always)]
    fn with_slot(k: ServiceKey6, slot: u16) -> ServiceKey6 {
        k.with_slot(slot)
    }
    #[inline(always)]
    fn with_scope(k: ServiceKey6, scope: u8) -> ServiceKey6 {
        k.with_scope(scope)
    }
    #[inline(always)]
    fn service(k: &ServiceKey6) -> Option<&'static ServiceValue> {
        unsafe { GN_SVC6.get(k) }
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<&'static Backend6> {
        unsafe { GN_BE6.get(&id) }
    }
    #[inline(always)]
    fn endpoint(b: &Backend6) -> (Ip6, u16) {
        (b.addr, b.port)
    }
    #[inline(always)]
    fn net_key(a: Ip6) -> Ip6 {
        a
    }
    #[inline(always)]
    fn source_allowed(k: &ServiceKey6, client: Ip6) -> bool {
        let data = SourceRange6 { fe_addr: k.addr, fe_port: k.port, proto: k.proto, _pad: 0, client };
        GN_SRCRANGE6.get(Key::new(SOURCE_RANGE_FE_BITS6 + 128, data)).is_some()
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
    fn belongs(id: u32, k: &ServiceKey6) -> bool {
        let m = AffinityMatchKey6 { backend_id: id, addr: k.addr, port: k.port, proto: k.proto, scope: k.scope };
        unsafe { GN_AFFMATCH6.get(&m) }.is_some()
    }
    #[inline(always)]
    fn remember_socket(cookie: u64, (addr, port): (Ip6, u16), (fe_addr, fe_port): (Ip6, u16)) {
        let k = SockRevNatKey6 { cookie, addr, port, _pad: 0, _pad2: 0 };
        let _ = GN_SK_RNAT6.insert(&k, &SockRevNatValue6 { addr: fe_addr, port: fe_port, _pad: 0 }, 0);
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
}
