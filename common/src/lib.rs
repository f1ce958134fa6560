//! Map layouts shared by the eBPF programs and the agent.
//!
//! Every type is `#[repr(C)]`, has no padding holes (checked at compile time below) and stores
//! addresses and ports in **network byte order**, exactly as they appear in packets and in
//! `bpf_sock_addr`, so the datapath never converts.
//!
//! Service table layout (borrowed from Cilium's `lb4_services_v2`): one frontend is a set of
//! entries that share `addr/port/proto/scope`. Slot 0 is the *master* entry and carries the
//! backend count; slots `1..=count` each name one backend id. Userspace writes backends, then
//! slots, then the master, so a reader that sees a count always finds every slot it may pick.
//!
//! Dual stack: every IPv4 map has an IPv6 twin (`*6`, 128-bit addresses as four network-order
//! words) with the same layout rules. Backend ids come from one id space for both families.
#![no_std]

/// Map names (the kernel keeps at most 15 characters).
pub const MAP_SERVICES: &str = "GN_SVC4";
pub const MAP_BACKENDS: &str = "GN_BE4";
pub const MAP_SOCK_REVNAT: &str = "GN_SK_RNAT4";
pub const MAP_CT: &str = "GN_CT4";
pub const MAP_STATS: &str = "GN_STATS";
pub const MAP_AFFINITY: &str = "GN_AFF4";
pub const MAP_AFFINITY_MATCH: &str = "GN_AFFMATCH4";
/// IPv6 twins of the maps above (same layouts with 128-bit addresses).
pub const MAP_SERVICES6: &str = "GN_SVC6";
pub const MAP_BACKENDS6: &str = "GN_BE6";
pub const MAP_SOCK_REVNAT6: &str = "GN_SK_RNAT6";
pub const MAP_CT6: &str = "GN_CT6";
pub const MAP_AFFINITY6: &str = "GN_AFF6";
pub const MAP_AFFINITY_MATCH6: &str = "GN_AFFMATCH6";
pub const MAP_SOURCE_RANGES: &str = "GN_SRCRANGE4";
pub const MAP_SOURCE_RANGES6: &str = "GN_SRCRANGE6";
/// Service ranges (ServiceCIDRs) and allocated ClusterIPs, both families in one LPM trie.
pub const MAP_SERVICE_NETS: &str = "GN_SVCNET";
/// One-entry array: the [`LAYOUT_VERSION`] of the pinned maps beside it (absent: version 0,
/// pins of a release before the layout carried a version).
pub const MAP_LAYOUT: &str = "GN_LAYOUT";
/// Version of the pinned maps' layout. Bump it when a pinned map keeps its sizes but changes
/// its meaning, and list the map in the agent's `layout::CHANGED` for the new version: the
/// agent recreates such maps instead of adopting them. Size changes (key, value, entries,
/// flags) are found by comparing definitions and need no bump.
pub const LAYOUT_VERSION: u32 = 1;

/// Default map sizes; the agent can override them at load time.
pub const DEFAULT_SERVICES_MAX: u32 = 262_144;
pub const DEFAULT_BACKENDS_MAX: u32 = 131_072;
pub const DEFAULT_SOCK_REVNAT_MAX: u32 = 262_144;
pub const DEFAULT_CT_MAX: u32 = 262_144;
pub const DEFAULT_AFFINITY_MAX: u32 = 131_072;
pub const DEFAULT_AFFINITY_MATCH_MAX: u32 = 131_072;
/// `loadBalancerSourceRanges` entries (frontend x allowed prefix).
pub const DEFAULT_SOURCE_RANGES_MAX: u32 = 16_384;
/// ServiceCIDRs plus one entry per ClusterIP.
pub const DEFAULT_SERVICE_NETS_MAX: u32 = 131_072;

/// `GN_SVCNET` values: what the longest matching prefix of a destination says about it when
/// no frontend matched. As kube-proxy's nftables proxier: traffic to an unallocated address
/// of a service range is dropped, to a ClusterIP on a port it does not serve rejected.
/// Keys are IPv6 addresses; IPv4 ones as `::ffff:a.b.c.d` (prefix length + 96).
pub const SVCNET_RANGE: u8 = 1;
/// A ClusterIP of a Service gardenet serves (a /32 or /128 entry).
pub const SVCNET_CLUSTER_IP: u8 = 2;
/// A ClusterIP of a Service left to another proxy (`service.kubernetes.io/service-proxy-name`):
/// passed untouched.
pub const SVCNET_FOREIGN: u8 = 3;
/// `::ffff:0:0/96` word 2 in network order (IPv4-mapped IPv6 addresses).
pub const V4_MAPPED_W2: u32 = 0x0000_ffffu32.to_be();

/// Affinity client kinds: socket LB identifies a client by its network namespace cookie (one
/// per pod), TC LB by its source address.
pub const AFF_CLIENT_NETNS: u8 = 0;
pub const AFF_CLIENT_ADDR: u8 = 1;

/// Program names as they appear in the object file.
pub const PROG_CONNECT4: &str = "gn_connect4";
pub const PROG_SENDMSG4: &str = "gn_sendmsg4";
/// Twins of the connect/sendmsg programs for kernels without `bpf_set_retval` (< 5.18).
pub const PROG_CONNECT4_NR: &str = "gn_connect4_nr";
pub const PROG_SENDMSG4_NR: &str = "gn_sendmsg4_nr";
pub const PROG_CONNECT6_NR: &str = "gn_connect6_nr";
pub const PROG_SENDMSG6_NR: &str = "gn_sendmsg6_nr";
pub const PROG_RECVMSG4: &str = "gn_recvmsg4";
pub const PROG_GETPEERNAME4: &str = "gn_getpeername4";
pub const PROG_CONNECT6: &str = "gn_connect6";
pub const PROG_SENDMSG6: &str = "gn_sendmsg6";
pub const PROG_RECVMSG6: &str = "gn_recvmsg6";
pub const PROG_GETPEERNAME6: &str = "gn_getpeername6";
pub const PROG_TC_INGRESS: &str = "gn_tc_ingress";
pub const PROG_TC_EGRESS: &str = "gn_tc_egress";
pub const PROG_XDP: &str = "gn_xdp";

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Frontend scope: traffic from anywhere (the entry every hook looks up first).
pub const SCOPE_ALL: u8 = 0;
/// Frontend scope: clients on this node (socket LB), for external frontends of
/// `externalTrafficPolicy: Local` Services. kube-proxy sends traffic from the node's own pods
/// and host to an external address of such a Service to the *cluster* endpoints (its
/// "short-circuit"); only traffic from outside is limited to local endpoints. The `SCOPE_ALL`
/// master carries `SVC_FLAG_TWO_SCOPES` when this second entry set exists.
pub const SCOPE_THIS_NODE: u8 = 1;

/// Master-entry flags.
pub const SVC_FLAG_NONE: u16 = 0;
/// An external frontend (NodePort, externalIP, LB ingress) of an `externalTrafficPolicy:
/// Cluster` Service: TC LB source-NATs flows it sends to a backend on another node, so the
/// reply comes back through this node (as kube-proxy's masquerade does).
pub const SVC_FLAG_SNAT_REMOTE: u16 = 1;
/// A load-balancer frontend with `loadBalancerSourceRanges`: TC LB admits new flows only
/// from clients in `GN_SRCRANGE4/6` for it.
pub const SVC_FLAG_SOURCE_RANGES: u16 = 2;
/// Socket LB looks the frontend up again with `SCOPE_THIS_NODE` (see there).
pub const SVC_FLAG_TWO_SCOPES: u16 = 4;
/// With no backends, drop instead of reject: the Service has endpoints, just none usable
/// from here (kube-proxy's DROP for "has no local endpoints"; REJECT is kept for "has no
/// endpoints"). Socket LB fails the call with EHOSTUNREACH instead of ECONNREFUSED.
pub const SVC_FLAG_DROP: u16 = 8;

/// `Backend4/6::flags`: the endpoint runs on another node.
pub const BE_FLAG_REMOTE: u8 = 1;

/// Conntrack direction.
pub const CT_DIR_FORWARD: u8 = 0;
pub const CT_DIR_REPLY: u8 = 1;
/// Source NAT of a forward flow, keyed by the packet after DNAT (client -> backend); the
/// value is the node address and port it leaves with.
pub const CT_DIR_SNAT_FWD: u8 = 2;
/// Its reverse, keyed by the backend's reply (backend -> node address:port); the value is
/// the client to send it back to.
pub const CT_DIR_SNAT_REPLY: u8 = 3;
/// `CtValue4/6::flags` of a forward entry whose flow is also source-NATed.
pub const CT_FLAG_SNAT: u16 = 1;
/// `CtValue4/6::flags` of a forward or reply entry: a TCP FIN, or RST, passed in the entry's
/// direction (`last_seen_ns` then holds when it was first seen). A FIN both ways or a RST
/// either way closes the flow; the agent's conntrack scan removes its entries a while later
/// (`--conntrack-closed-secs`) instead of leaving them until the LRU evicts them.
pub const CT_FLAG_FIN: u16 = 2;
pub const CT_FLAG_RST: u16 = 4;
/// Ports used for source NAT: above the default ephemeral range (32768-60999) and the
/// NodePort range, so they do not collide with the node's own connections.
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_COUNT: u16 = 4_536;

/// Indexes into the per-CPU `GN_STATS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    SockTranslated = 0,
    SockNoBackend = 1,
    SockRevNat = 2,
    TcDnat = 3,
    TcRevNat = 4,
    TcNoBackendReset = 5,
    TcNoBackendDrop = 6,
    TcCtCreated = 7,
    TcMissingBackend = 8,
    AffinityHit = 9,
    XdpDropNoBackend = 10,
    TcCtStale = 11,
    TcSnat = 12,
    TcSnatRevNat = 13,
    /// No free source-NAT port or no route to the backend: the packet was dropped.
    TcSnatFailed = 14,
    /// A client outside the frontend's `loadBalancerSourceRanges`: dropped.
    TcSourceRangeDrop = 15,
    /// An ICMP error about a translated flow, rewritten for its backend.
    TcIcmpRevNat = 16,
    /// A frontend whose endpoints are all elsewhere (`SVC_FLAG_DROP`): dropped.
    TcNoLocalBackendDrop = 17,
    /// A new flow to an unallocated address of a service range: dropped.
    ServiceRangeDrop = 18,
    /// A new flow to a ClusterIP on a port it does not serve: rejected.
    ClusterIpPortReject = 19,
    /// A conntrack entry of a new flow could not be inserted (the LRU map found no free
    /// entry): the packet went on untranslated.
    TcCtInsertFailed = 20,
}
pub const STATS_LEN: u32 = 21;
pub const STAT_NAMES: [&str; STATS_LEN as usize] = [
    "sock_translated",
    "sock_no_backend",
    "sock_revnat",
    "tc_dnat",
    "tc_revnat",
    "tc_no_backend_reset",
    "tc_no_backend_drop",
    "tc_ct_created",
    "tc_missing_backend",
    "affinity_hit",
    "xdp_drop_no_backend",
    "tc_ct_stale_purged",
    "tc_snat",
    "tc_snat_revnat",
    "tc_snat_failed",
    "tc_source_range_drop",
    "tc_icmp_revnat",
    "tc_no_local_backend_drop",
    "service_range_drop",
    "cluster_ip_port_reject",
    "tc_ct_insert_failed",
];

/// Key of `GN_SVC4` (`A` = `u32`) and `GN_SVC6` (`A` = `Ip6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey<A> {
    /// Frontend address, network byte order.
    pub addr: A,
    /// Frontend port, network byte order.
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    /// 0 = master entry, 1..=count = backend slots.
    pub slot: u16,
    pub _pad: u16,
}

/// Value of `GN_SVC4` and `GN_SVC6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Backend id (backend slots only).
    pub backend_id: u32,
    /// Number of backend slots (master only). Zero means "reject".
    pub count: u16,
    /// `SVC_FLAG_*` (master only).
    pub flags: u16,
    /// Session-affinity timeout in seconds (master only, 0 = none).
    pub affinity_timeout: u32,
}

/// Value of `GN_BE4`/`GN_BE6`, keyed by backend id (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend<A> {
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// Key of `GN_SK_RNAT4`: what a socket was translated to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey4 {
    pub cookie: u64,
    /// Backend address and port the socket talks to (network byte order).
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}

/// Value of `GN_SK_RNAT4`/`GN_SK_RNAT6`: the frontend the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNatValue<A> {
    pub addr: A,
    pub port: u16,
    pub _pad: u16,
}

/// Key of `GN_CT4`/`GN_CT6` (LRU). Forward entries are keyed by the packet as the client
/// sent it, reply entries by the packet as the backend sends it back.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: u16,
}

/// Value of `GN_CT4`. Forward: the backend to DNAT to. Reply: the frontend to SNAT back to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue4 {
    pub addr: u32,
    pub port: u16,
    pub flags: u16,
    /// `bpf_ktime_get_ns()` when the entry was made. Source-NAT entries (`CT_DIR_SNAT_*` and
    /// forward entries flagged `CT_FLAG_SNAT`): of the last packet that used it, at most a
    /// second old, since a source-NAT port is reused by idle time; other entries are not
    /// updated per packet (a clock read per packet costs), only when they are first marked
    /// `CT_FLAG_FIN` or `CT_FLAG_RST`: then it is the time of the close.
    pub last_seen_ns: u64,
}

/// Key of `GN_AFF4` (LRU): which backend a client was last sent to for a frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey4 {
    /// Netns cookie (`AFF_CLIENT_NETNS`) or IPv4 address in network order (`AFF_CLIENT_ADDR`).
    pub client: u64,
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub kind: u8,
}

/// Value of `GN_AFF4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    pub last_used_ns: u64,
}

/// Key of `GN_AFFMATCH4`/`GN_AFFMATCH6` (value `u8`, always 1): backend `backend_id`
/// currently belongs to the frontend. Written by userspace for frontends with affinity, so a
/// remembered backend that left the Service is never chosen again.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey<A> {
    pub backend_id: u32,
    pub addr: A,
    pub port: u16,
    pub proto: u8,
    /// The frontend entry set's scope (`SCOPE_*`): a backend may belong to one and not the other.
    pub scope: u8,
}

/// An IPv6 address as four 32-bit words, each in network byte order (the layout of
/// `bpf_sock_addr.user_ip6` and of the address bytes in a packet).
pub type Ip6 = [u32; 4];

// The same shapes for both families (an IPv4 and an IPv6 address are the only difference,
// and both are arrays of 32-bit words, so no layout gets a hole): one generic type, named per
// family where a map needs a concrete one.
pub type ServiceKey4 = ServiceKey<u32>;
pub type ServiceKey6 = ServiceKey<Ip6>;
pub type Backend4 = Backend<u32>;
pub type Backend6 = Backend<Ip6>;
pub type SockRevNatValue4 = SockRevNatValue<u32>;
pub type SockRevNatValue6 = SockRevNatValue<Ip6>;
pub type CtKey4 = CtKey<u32>;
pub type CtKey6 = CtKey<Ip6>;
pub type AffinityMatchKey4 = AffinityMatchKey<u32>;
pub type AffinityMatchKey6 = AffinityMatchKey<Ip6>;
pub type SourceRange4 = SourceRange<u32>;
pub type SourceRange6 = SourceRange<Ip6>;

/// Key of `GN_SK_RNAT6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey6 {
    pub cookie: u64,
    pub addr: Ip6,
    pub port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

/// Value of `GN_CT6`, as `CtValue4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue6 {
    pub addr: Ip6,
    pub port: u16,
    pub flags: u16,
    pub _pad: u32,
    pub last_seen_ns: u64,
}

/// Key of `GN_AFF6` (LRU); the value is `AffinityValue`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey6 {
    /// Netns cookie in words 0-1 (`AFF_CLIENT_NETNS`, words 2-3 zero) or the client's IPv6
    /// address (`AFF_CLIENT_ADDR`).
    pub client: Ip6,
    pub addr: Ip6,
    pub port: u16,
    pub proto: u8,
    pub kind: u8,
}

/// Data of a `GN_SRCRANGE4`/`GN_SRCRANGE6` key (LPM trie, value `u8` 1): the frontend,
/// matched whole, then an allowed client prefix. The key's prefix length is
/// `SOURCE_RANGE_FE_BITS4`/`6` + the prefix length of the client range; lookups use the full
/// length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRange<A> {
    pub fe_addr: A,
    pub fe_port: u16,
    pub proto: u8,
    pub _pad: u8,
    pub client: A,
}
pub const SOURCE_RANGE_FE_BITS4: u32 = 64;

pub const SOURCE_RANGE_FE_BITS6: u32 = 160;

// No padding holes: the kernel compares keys bytewise, so an uninitialised hole would make
// equal keys miss each other.
const _: () = {
    assert!(core::mem::size_of::<ServiceKey4>() == 12);
    assert!(core::mem::size_of::<ServiceValue>() == 12);
    assert!(core::mem::size_of::<Backend4>() == 8);
    assert!(core::mem::size_of::<SockRevNatKey4>() == 16);
    assert!(core::mem::size_of::<SockRevNatValue4>() == 8);
    assert!(core::mem::size_of::<CtKey4>() == 16);
    assert!(core::mem::size_of::<CtValue4>() == 16);
    assert!(core::mem::size_of::<AffinityKey4>() == 16);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<AffinityMatchKey4>() == 12);
    assert!(core::mem::size_of::<ServiceKey6>() == 24);
    assert!(core::mem::size_of::<Backend6>() == 20);
    assert!(core::mem::size_of::<SockRevNatKey6>() == 32);
    assert!(core::mem::size_of::<SockRevNatValue6>() == 20);
    assert!(core::mem::size_of::<CtKey6>() == 40);
    assert!(core::mem::size_of::<CtValue6>() == 32);
    assert!(core::mem::size_of::<AffinityKey6>() == 36);
    assert!(core::mem::size_of::<AffinityMatchKey6>() == 24);
    assert!(core::mem::size_of::<SourceRange4>() == 12);
    assert!(core::mem::size_of::<SourceRange6>() == 36);
};

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: plain old data, repr(C), no padding, every bit pattern valid.
    unsafe impl aya::Pod for ServiceKey4 {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for SockRevNatKey4 {}
    unsafe impl aya::Pod for SockRevNatValue4 {}
    unsafe impl aya::Pod for CtKey4 {}
    unsafe impl aya::Pod for CtValue4 {}
    unsafe impl aya::Pod for AffinityKey4 {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for AffinityMatchKey4 {}
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for SockRevNatKey6 {}
    unsafe impl aya::Pod for SockRevNatValue6 {}
    unsafe impl aya::Pod for CtKey6 {}
    unsafe impl aya::Pod for CtValue6 {}
    unsafe impl aya::Pod for AffinityKey6 {}
    unsafe impl aya::Pod for AffinityMatchKey6 {}
    unsafe impl aya::Pod for SourceRange4 {}
    unsafe impl aya::Pod for SourceRange6 {}
}

impl<A: Copy> ServiceKey<A> {
    /// Key of a frontend's master entry (addr/port already in network byte order).
    pub const fn master(addr: A, port: u16, proto: u8) -> Self {
        ServiceKey { addr, port, proto, scope: SCOPE_ALL, slot: 0, _pad: 0 }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        ServiceKey { slot, ..self }
    }

    pub const fn with_scope(self, scope: u8) -> Self {
        ServiceKey { scope, ..self }
    }
}

impl<A: Copy> CtKey<A> {
    pub const fn new(saddr: A, daddr: A, sport: u16, dport: u16, proto: u8, dir: u8) -> Self {
        CtKey { saddr, daddr, sport, dport, proto, dir, _pad: 0 }
    }
}

/// The 16 address bytes (as in a packet) as `Ip6` words.
pub const fn ip6_from_octets(o: [u8; 16]) -> Ip6 {
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

/// `Ip6` words back to the 16 address bytes.
pub const fn ip6_octets(a: Ip6) -> [u8; 16] {
    let (w0, w1, w2, w3) = (a[0].to_ne_bytes(), a[1].to_ne_bytes(), a[2].to_ne_bytes(), a[3].to_ne_bytes());
    [w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3], w2[0], w2[1], w2[2], w2[3], w3[0], w3[1], w3[2], w3[3]]
}
