//! Interface LB on TC: DNAT of packets addressed to a frontend, connection tracking so every
//! packet of a flow keeps its backend, and reverse NAT of the replies. This serves the traffic
//! socket LB cannot see (NodePort from other nodes, clients outside our cgroup).

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC, BPF_NOEXIST, TC_ACT_SHOT},
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_fib_lookup, bpf_get_prandom_u32, bpf_redirect, bpf_redirect_neigh},
    },
    macros::{classifier, map},
    maps::{LruHashMap, PerCpuArray},
    programs::TcContext,
};
use gardenet_common::*;

use crate::{
    family::{Family, V4, V6},
    select_backend_affine, service_net, stat, GN_CT4, GN_CT6, GN_SVC4, GN_SVC6,
};

/// "Not ours, carry on": lets later tcx programs / tc filters run (TCX_NEXT / TC_ACT_UNSPEC).
const PASS: i32 = -1;
const DROP: i32 = TC_ACT_SHOT as i32;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IP6_PLEN_OFF: usize = ETH_HLEN + 4;
const IP6_NEXT_OFF: usize = ETH_HLEN + 6;
const IP6_SRC_OFF: usize = ETH_HLEN + 8;
const IP6_DST_OFF: usize = ETH_HLEN + 24;
const IP6_L4_OFF: usize = ETH_HLEN + 40;
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_SRC_OFF: usize = ETH_HLEN + 12;
const IP_DST_OFF: usize = ETH_HLEN + 16;

const TCP_FLAG_FIN: u8 = 0x01;
const TCP_FLAG_RST: u8 = 0x04;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

struct Flow {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
    /// Offset of the L4 header.
    l4: usize,
    tcp_flags: u8,
}

impl Flow {
    #[inline(always)]
    fn csum_off(&self) -> usize {
        self.l4 + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    /// UDP may carry checksum 0 ("none"): keep it that way.
    #[inline(always)]
    fn csum_flags(&self) -> u64 {
        if self.proto == PROTO_UDP {
            BPF_F_MARK_MANGLED_0
        } else {
            0
        }
    }

    #[inline(always)]
    fn ct_key(&self, dir: u8) -> CtKey4 {
        CtKey4 { saddr: self.saddr, daddr: self.daddr, sport: self.sport, dport: self.dport, proto: self.proto, dir, _pad: 0 }
    }
}

#[classifier]
pub fn gn_tc_ingress(ctx: TcContext) -> i32 {
    // Each family's path is one BPF function with the parsed flow in its own frame; the ICMP
    // error paths are called from here, not from inside them. The verifier adds up the frames
    // of a call chain (each rounded up to 32 bytes) against 512 bytes, and the IPv6 path
    // alone takes almost 400.
    if is_ipv6(&ctx) {
        match ingress6_flow(&ctx) {
            NOT_L4 => icmp6_error(&ctx).unwrap_or(PASS),
            verdict => verdict,
        }
    } else {
        match ingress4_flow(&ctx) {
            NOT_L4 => icmp_error(&ctx).unwrap_or(PASS),
            verdict => verdict,
        }
    }
}

/// "Not a TCP or UDP packet we can parse": the caller tries the ICMP error path.
const NOT_L4: i32 = i32::MIN;

#[inline(never)]
fn ingress4_flow(ctx: &TcContext) -> i32 {
    match parse(ctx) {
        Some(flow) => ingress(ctx, &flow).unwrap_or(PASS),
        None => NOT_L4,
    }
}

#[inline(never)]
fn ingress6_flow(ctx: &TcContext) -> i32 {
    match parse6(ctx) {
        Some(flow) => ingress6(ctx, &flow).unwrap_or(PASS),
        None => NOT_L4,
    }
}

#[classifier]
pub fn gn_tc_egress(ctx: TcContext) -> i32 {
    if is_ipv6(&ctx) {
        return match parse6(&ctx) {
            Some(flow) => rev_nat6(&ctx, &flow).unwrap_or(PASS),
            None => PASS,
        };
    }
    match parse(&ctx) {
        Some(flow) => rev_nat(&ctx, &flow).unwrap_or(PASS),
        None => PASS,
    }
}

#[inline(always)]
fn is_ipv6(ctx: &TcContext) -> bool {
    Hdr::new(ctx).load::<u16>(12).is_some_and(|p| u16::from_be(p) == ETH_P_IPV6)
}

/// Reads of the packet's headers: straight from the linear data where the header is there
/// (one bounds check instead of a `bpf_skb_load_bytes` call, which cost ~20 ns each and a
/// parse takes nine), through the helper otherwise (headers in paged data).
struct Hdr<'a> {
    ctx: &'a TcContext,
    start: usize,
    end: usize,
}

impl<'a> Hdr<'a> {
    #[inline(always)]
    fn new(ctx: &'a TcContext) -> Self {
        Hdr { ctx, start: ctx.data(), end: ctx.data_end() }
    }

    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Option<T> {
        let p = self.start + off;
        // At least 2: LLVM turns `p + 1 <= end` into `p < end`, which verifiers do not take
        // as a proof that p[0] is in range.
        let need = if core::mem::size_of::<T>() < 2 { 2 } else { core::mem::size_of::<T>() };
        if p + need <= self.end {
            // SAFETY: [p, p + size) lies within the linear data, checked just above (the
            // verifier sees the same check against data_end).
            return Some(unsafe { core::ptr::read_unaligned(p as *const T) });
        }
        self.ctx.load::<T>(off).ok()
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Flow> {
    let h = Hdr::new(ctx);
    let eth_proto = u16::from_be(h.load::<u16>(12)?);
    if eth_proto != ETH_P_IP {
        return None;
    }
    let vhl: u8 = h.load(ETH_HLEN)?;
    let ihl = ((vhl & 0x0f) as usize) * 4;
    if vhl >> 4 != 4 || ihl < 20 {
        return None;
    }
    // Fragments: only the first carries ports; leave all of them to the stack.
    let frag = u16::from_be(h.load::<u16>(ETH_HLEN + 6)?);
    if frag & 0x3fff != 0 {
        return None;
    }
    let proto: u8 = h.load(ETH_HLEN + 9)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let l4 = ETH_HLEN + (ihl & 0x3c);
    let tcp_flags = if proto == PROTO_TCP { h.load::<u8>(l4 + 13)? } else { 0 };
    Some(Flow { saddr: h.load(IP_SRC_OFF)?, daddr: h.load(IP_DST_OFF)?, sport: h.load(l4)?, dport: h.load(l4 + 2)?, proto, l4, tcp_flags })
}

// Inlined into `ingress4_flow`, as `ingress6` into `ingress6_flow`: the two families' paths
// are separate BPF functions (together their keys and FIB parameters exceed one frame).
#[inline(always)]
fn ingress(ctx: &TcContext, f: &Flow) -> Option<i32> {
    // A backend's reply to a flow we source-NATed: it is addressed to this node.
    if let Some(v) = snat_reverse(ctx, f) {
        return Some(v);
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let fresh_syn = f.proto == PROTO_TCP && f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN;
    let fkey = f.ct_key(CT_DIR_FORWARD);
    // Established flows keep their backend even if the service changed meanwhile; a new SYN
    // (also one reusing an old 4-tuple) always selects afresh from the current backends.
    // Looked up first: most packets here belong to such flows, and each conntrack lookup is
    // a likely cache miss in a large table.
    if !fresh_syn {
        if let Some(ct) = GN_CT4.get_ptr_mut(&fkey) {
            let ct = unsafe { &mut *ct };
            touch(&mut ct.last_seen_ns, now);
            let (addr, port, flags) = (ct.addr, ct.port, ct.flags);
            if flags & CT_FLAG_SNAT != 0 {
                return Some(snat_established(ctx, f, addr, port, now));
            }
            dnat(ctx, f, addr, port)?;
            stat(Stat::TcDnat);
            return Some(PASS);
        }
    }
    // A reply of a flow we DNATed earlier that re-enters the node here (never a bare SYN).
    if !fresh_syn {
        if let Some(v) = rev_nat(ctx, f) {
            return Some(v);
        }
    }
    let skey = ServiceKey4::master(f.daddr, f.dport, f.proto);
    let Some(master) = (unsafe { GN_SVC4.get(&skey) }) else {
        if fresh_syn || f.proto == PROTO_UDP {
            forget_stale(f);
            match service_net([0, 0, V4_MAPPED_W2, f.daddr]) {
                SVCNET_CLUSTER_IP => {
                    stat(Stat::ClusterIpPortReject);
                    return Some(reject(ctx, f));
                }
                SVCNET_RANGE => {
                    stat(Stat::ServiceRangeDrop);
                    return Some(DROP);
                }
                _ => {}
            }
        }
        return None;
    };
    if master.flags & SVC_FLAG_SOURCE_RANGES != 0 && !V4::source_allowed(&skey, f.saddr) {
        stat(Stat::TcSourceRangeDrop);
        return Some(DROP);
    }
    let Some((_, be)) = select_backend_affine::<V4>(&skey, master, V4::addr_client(f.saddr), AFF_CLIENT_ADDR) else {
        if master.count == 0 {
            if master.flags & SVC_FLAG_DROP != 0 {
                // Endpoints exist, none for traffic arriving here: drop, as kube-proxy does.
                stat(Stat::TcNoLocalBackendDrop);
                return Some(DROP);
            }
            return Some(reject(ctx, f));
        }
        stat(Stat::TcMissingBackend);
        return None;
    };
    if master.flags & SVC_FLAG_SNAT_REMOTE != 0 && be.flags & BE_FLAG_REMOTE != 0 {
        return Some(snat_new(ctx, f, &fkey, &be, now));
    }
    // Reply first: once the backend can answer, the answer must be translated.
    let rkey = CtKey4 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    let rval = CtValue4 { addr: f.daddr, port: f.dport, flags: 0, last_seen_ns: now };
    ct_insert(&GN_CT4, &rkey, &rval)?;
    let fval = CtValue4 { addr: be.addr, port: be.port, flags: 0, last_seen_ns: now };
    ct_insert(&GN_CT4, &fkey, &fval)?;
    stat(Stat::TcCtCreated);
    dnat(ctx, f, be.addr, be.port)?;
    stat(Stat::TcDnat);
    Some(PASS)
}

// ---------------------------------------------------------------------------------------------
// Source NAT for external frontends whose backend runs on another node: that backend's reply
// would otherwise go straight to the client (from the pod's address, which the client never
// talked to). The flow leaves with this node's address toward the backend and a port from
// SNAT_PORT_MIN.., so the reply comes back here, is translated back, and is sent to the client.
// Both directions are transmitted with `bpf_redirect_neigh`: after the rewrite the packet
// carries a local source address, which the stack's input path would drop as martian.

/// How long an idle source-NAT port stays reserved (no packets in either direction), and how
/// long after a FIN or RST. Kept short after a close so busy backends do not run out of the
/// 4,536 ports they have per node address.
const SNAT_IDLE_TCP_NS: u64 = 7_200 * 1_000_000_000;
const SNAT_IDLE_UDP_NS: u64 = 120 * 1_000_000_000;
const SNAT_CLOSED_NS: u64 = 10 * 1_000_000_000;
const SNAT_PORT_TRIES: u32 = 8;

/// Per-CPU room for the 64-byte FIB lookup parameters: on the stack they would push the
/// IPv6 ingress path over the verifier's 512 bytes.
#[map]
static GN_FIB_SCRATCH: PerCpuArray<FibParams> = PerCpuArray::with_max_entries(1, 0);

/// Zeroed FIB parameters in this CPU's scratch slot.
#[inline(always)]
fn fib_params() -> Option<&'static mut FibParams> {
    let p = GN_FIB_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, not shared while the program runs. Zeroed word by word with
    // volatile stores: `write_bytes` becomes a call to a `memset` subprogram, a third stack
    // frame that verifiers before 6.8 count as 32 bytes (over the 512-byte limit with
    // `ingress6`), and a zeroed temporary would sit on the stack.
    unsafe {
        let words = p.cast::<u64>();
        for i in 0..core::mem::size_of::<FibParams>() / 8 {
            core::ptr::write_volatile(words.add(i), 0);
        }
        Some(&mut *p)
    }
}

/// Route from this node to `dst` as if forwarding a packet that came in on `ifindex`: the
/// egress interface and, with `want_src`, the node's preferred source address on that route.
#[inline(always)]
fn route(ctx: &TcContext, ifindex: u32, proto: u8, src: u32, dst: u32, want_src: bool) -> Option<(u32, u32)> {
    let p = fib_params()?;
    p.family = 2; // AF_INET
    p.l4_protocol = proto;
    p.ifindex = ifindex;
    p.__bindgen_anon_3.ipv4_src = src;
    p.__bindgen_anon_4.ipv4_dst = dst;
    let flags = BPF_FIB_LOOKUP_SKIP_NEIGH | if want_src { BPF_FIB_LOOKUP_SRC } else { 0 };
    let rc = unsafe { bpf_fib_lookup(ctx.skb.skb.cast(), p, core::mem::size_of::<FibParams>() as i32, flags) };
    if rc != 0 {
        return None;
    }
    Some((p.ifindex, unsafe { p.__bindgen_anon_3.ipv4_src }))
}

#[inline(always)]
fn ingress_ifindex(ctx: &TcContext) -> u32 {
    unsafe { (*ctx.skb.skb).ifindex }
}

#[inline(always)]
fn transmit(ifindex: u32) -> i32 {
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// Redirected packets skip the stack's forwarding, so the TTL is decremented here (and a
/// packet that would expire is not sent on).
#[inline(always)]
fn decrement_ttl(ctx: &TcContext) -> Option<()> {
    const TTL_OFF: usize = ETH_HLEN + 8;
    let old: u16 = ctx.load(TTL_OFF).ok()?; // TTL and protocol, as stored
    let ttl: u8 = ctx.load(TTL_OFF).ok()?;
    if ttl <= 1 {
        return None;
    }
    ctx.store(TTL_OFF, &(ttl - 1), 0).ok()?;
    let new: u16 = ctx.load(TTL_OFF).ok()?;
    ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 2).ok()
}

/// IPv6 twin of `decrement_ttl` (no header checksum).
#[inline(always)]
fn decrement_hop_limit(ctx: &TcContext) -> Option<()> {
    const HOP_OFF: usize = ETH_HLEN + 7;
    let hops: u8 = ctx.load(HOP_OFF).ok()?;
    if hops <= 1 {
        return None;
    }
    ctx.store(HOP_OFF, &(hops - 1), 0).ok()
}

/// Inserts a conntrack entry of a new flow; a failure (the LRU map found no free entry) is
/// counted, and the packet goes on untranslated.
#[inline(always)]
fn ct_insert<K, V>(map: &LruHashMap<K, V>, key: &K, val: &V) -> Option<()> {
    if map.insert(key, val, 0).is_err() {
        stat(Stat::TcCtInsertFailed);
        return None;
    }
    Some(())
}

/// Records that a conntrack entry was used at `now`, at most once a second: a store on every
/// packet would keep the entry's cache line bouncing between the CPUs that handle the two
/// directions, and the times are only compared against limits of 10 s and more.
#[inline(always)]
fn touch(last_seen_ns: &mut u64, now: u64) {
    if now.wrapping_sub(*last_seen_ns) > 1_000_000_000 {
        *last_seen_ns = now;
    }
}

/// Whether a reserved source-NAT port (its reply entry's flags and last use) may be given to
/// a new flow.
#[inline(always)]
fn snat_port_free(flags: u16, last_seen_ns: u64, proto: u8, now: u64) -> bool {
    let idle = now.wrapping_sub(last_seen_ns);
    let limit = if flags & CT_FLAG_SNAT != 0 {
        SNAT_CLOSED_NS
    } else if proto == PROTO_TCP {
        SNAT_IDLE_TCP_NS
    } else {
        SNAT_IDLE_UDP_NS
    };
    idle > limit
}

/// A FIN or RST in either direction starts the short hold of the flow's port. (The reply
/// entry's `CT_FLAG_SNAT` means "closing" here.)
#[inline(always)]
fn snat_note_close(proto: u8, tcp_flags: u8, flags: &mut u16) {
    if proto == PROTO_TCP && tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0 {
        *flags |= CT_FLAG_SNAT;
    }
}

/// First packet of a flow to `be` that needs source NAT.
#[inline(always)]
fn snat_new(ctx: &TcContext, f: &Flow, fkey: &CtKey4, be: &Backend4, now: u64) -> i32 {
    let Some((out_if, nat_addr)) = route(ctx, ingress_ifindex(ctx), f.proto, f.saddr, be.addr, true) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    // A port: random start, a few tries; a port whose flow is long idle or closed is reused.
    let start = unsafe { bpf_get_prandom_u32() };
    let back = CtValue4 { addr: f.saddr, port: f.sport, flags: 0, last_seen_ns: now };
    let mut nat_port = 0u16;
    for i in 0..SNAT_PORT_TRIES {
        let port = (SNAT_PORT_MIN + (start.wrapping_add(i) % SNAT_PORT_COUNT as u32) as u16).to_be();
        let key = CtKey4 { saddr: be.addr, daddr: nat_addr, sport: be.port, dport: port, proto: f.proto, dir: CT_DIR_SNAT_REPLY, _pad: 0 };
        let taken = match unsafe { GN_CT4.get(&key) } {
            None => GN_CT4.insert(&key, &back, BPF_NOEXIST as u64).is_ok(),
            Some(v) if snat_port_free(v.flags, v.last_seen_ns, f.proto, now) => GN_CT4.insert(&key, &back, 0).is_ok(),
            Some(_) => false,
        };
        if taken {
            nat_port = port;
            break;
        }
    }
    if nat_port == 0 {
        stat(Stat::TcSnatFailed);
        return DROP;
    }
    // The reply, once its destination is restored, is translated back to the frontend.
    let rkey = CtKey4 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    let rval = CtValue4 { addr: f.daddr, port: f.dport, flags: 0, last_seen_ns: now };
    let skey = CtKey4 { saddr: f.saddr, daddr: be.addr, sport: f.sport, dport: be.port, proto: f.proto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
    let sval = CtValue4 { addr: nat_addr, port: nat_port, flags: 0, last_seen_ns: now };
    let fval = CtValue4 { addr: be.addr, port: be.port, flags: CT_FLAG_SNAT, last_seen_ns: now };
    if GN_CT4.insert(&rkey, &rval, 0).is_err() || GN_CT4.insert(&skey, &sval, 0).is_err() || GN_CT4.insert(fkey, &fval, 0).is_err() {
        stat(Stat::TcSnatFailed);
        return DROP;
    }
    stat(Stat::TcCtCreated);
    if decrement_ttl(ctx).is_none() || dnat(ctx, f, be.addr, be.port).is_none() || snat(ctx, f, nat_addr, nat_port).is_none() {
        return DROP;
    }
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    transmit(out_if)
}

/// Later packets of a source-NATed flow (the forward entry said so).
#[inline(always)]
fn snat_established(ctx: &TcContext, f: &Flow, be_addr: u32, be_port: u16, now: u64) -> i32 {
    let skey = CtKey4 { saddr: f.saddr, daddr: be_addr, sport: f.sport, dport: be_port, proto: f.proto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
    let Some(s) = GN_CT4.get_ptr_mut(&skey) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let s = unsafe { &mut *s };
    touch(&mut s.last_seen_ns, now);
    let (nat_addr, nat_port) = (s.addr, s.port);
    let rkey = CtKey4 { saddr: be_addr, daddr: nat_addr, sport: be_port, dport: nat_port, proto: f.proto, dir: CT_DIR_SNAT_REPLY, _pad: 0 };
    if let Some(r) = GN_CT4.get_ptr_mut(&rkey) {
        let r = unsafe { &mut *r };
        touch(&mut r.last_seen_ns, now);
        snat_note_close(f.proto, f.tcp_flags, &mut r.flags);
    }
    let Some((out_if, _)) = route(ctx, ingress_ifindex(ctx), f.proto, nat_addr, be_addr, false) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    if decrement_ttl(ctx).is_none() || dnat(ctx, f, be_addr, be_port).is_none() || snat(ctx, f, nat_addr, nat_port).is_none() {
        return DROP;
    }
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    transmit(out_if)
}

/// A backend's reply to a source-NATed flow: back to the client, from the frontend.
#[inline(always)]
fn snat_reverse(ctx: &TcContext, f: &Flow) -> Option<i32> {
    // Only packets to a source-NAT port can be replies of such flows: skip the lookup for
    // all other traffic.
    if u16::from_be(f.dport) < SNAT_PORT_MIN {
        return None;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let r = GN_CT4.get_ptr_mut(&f.ct_key(CT_DIR_SNAT_REPLY))?;
    let r = unsafe { &mut *r };
    touch(&mut r.last_seen_ns, now);
    snat_note_close(f.proto, f.tcp_flags, &mut r.flags);
    let (client, client_port) = (r.addr, r.port);
    let rkey = CtKey4 { saddr: f.saddr, daddr: client, sport: f.sport, dport: client_port, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    let Some(fe) = GN_CT4.get_ptr_mut(&rkey) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    let fe = unsafe { &mut *fe };
    touch(&mut fe.last_seen_ns, now);
    let (fe_addr, fe_port) = (fe.addr, fe.port);
    let Some((out_if, _)) = route(ctx, ingress_ifindex(ctx), f.proto, fe_addr, client, false) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    if decrement_ttl(ctx).is_none() || dnat(ctx, f, client, client_port).is_none() || snat(ctx, f, fe_addr, fe_port).is_none() {
        return Some(DROP);
    }
    stat(Stat::TcSnatRevNat);
    Some(transmit(out_if))
}

/// Rewrites the source address and port (the counterpart of `dnat`).
#[inline(always)]
fn snat(ctx: &TcContext, f: &Flow, addr: u32, port: u16) -> Option<()> {
    let csum = f.csum_off();
    let fl = f.csum_flags();
    ctx.l4_csum_replace(csum, f.saddr as u64, addr as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, f.sport as u64, port as u64, 2 | fl).ok()?;
    ctx.l3_csum_replace(IP_CSUM_OFF, f.saddr as u64, addr as u64, 4).ok()?;
    ctx.store(IP_SRC_OFF, &addr, 0).ok()?;
    ctx.store(f.l4, &port, 0).ok()?;
    Some(())
}

// ---------------------------------------------------------------------------------------------
// ICMP errors about translated flows. A router between this node and the client reports a
// problem with a reply (above all "fragmentation needed", which path MTU discovery lives on)
// to the reply's source: the frontend, i.e. this node. The backend that sent it must hear it,
// so the error is rewritten as the backend would have received it without the translation:
// outer destination -> backend; the quoted packet's source (frontend) -> backend, and for a
// source-NATed flow its destination (client) -> the node address and port the backend saw.
// Checksums: outer IP, quoted IP, and the ICMP checksum over every changed quoted word (the
// quoted L4 checksum is not fixed: stacks do not check it in an ICMP error).

const PROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;

#[inline(never)]
fn icmp_error(ctx: &TcContext) -> Option<i32> {
    if u16::from_be(ctx.load::<u16>(12).ok()?) != ETH_P_IP {
        return None;
    }
    let vhl: u8 = ctx.load(ETH_HLEN).ok()?;
    let ihl = ((vhl & 0x0f) as usize) * 4;
    if vhl >> 4 != 4 || ihl < 20 || ctx.load::<u8>(ETH_HLEN + 9).ok()? != PROTO_ICMP {
        return None;
    }
    if u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?) & 0x3fff != 0 {
        return None;
    }
    let icmp = ETH_HLEN + (ihl & 0x3c);
    let ty: u8 = ctx.load(icmp).ok()?;
    if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
        return None;
    }
    let inner = icmp + 8;
    let ivhl: u8 = ctx.load(inner).ok()?;
    let iihl = ((ivhl & 0x0f) as usize) * 4;
    if ivhl >> 4 != 4 || iihl < 20 {
        return None;
    }
    let iproto: u8 = ctx.load(inner + 9).ok()?;
    if iproto != PROTO_TCP && iproto != PROTO_UDP {
        return None;
    }
    let isrc: u32 = ctx.load(inner + 12).ok()?;
    let idst: u32 = ctx.load(inner + 16).ok()?;
    // An error about a packet the frontend sent goes to the frontend. One addressed to any
    // other host is not about our flow (spoofed, or for someone else): leave it alone, as
    // Linux conntrack does, instead of redirecting it to the backend (found by the packet
    // corpus, tests/tests/packet_corpus.rs).
    let outer_dst: u32 = ctx.load(IP_DST_OFF).ok()?;
    if outer_dst != isrc {
        return None;
    }
    let il4 = inner + (iihl & 0x3c);
    let isport: u16 = ctx.load(il4).ok()?;
    let idport: u16 = ctx.load(il4 + 2).ok()?;
    // The quoted packet went frontend -> client: its flow's forward key is client -> frontend.
    let fkey = CtKey4 { saddr: idst, daddr: isrc, sport: idport, dport: isport, proto: iproto, dir: CT_DIR_FORWARD, _pad: 0 };
    let ct = unsafe { GN_CT4.get(&fkey) }?;
    let (be, be_port, flags) = (ct.addr, ct.port, ct.flags);
    let csum = icmp + 2;
    // Quoted source: frontend -> backend (address, its header checksum, port).
    icmp_rewrite32(ctx, csum, inner + 12, inner + 10, isrc, be)?;
    icmp_rewrite16(ctx, csum, il4, isport, be_port)?;
    if flags & CT_FLAG_SNAT != 0 {
        // Quoted destination: client -> the node address and port the backend sent to.
        let skey = CtKey4 { saddr: idst, daddr: be, sport: idport, dport: be_port, proto: iproto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
        let n = unsafe { GN_CT4.get(&skey) }?;
        let (nat, nat_port) = (n.addr, n.port);
        icmp_rewrite32(ctx, csum, inner + 16, inner + 10, idst, nat)?;
        icmp_rewrite16(ctx, csum, il4 + 2, idport, nat_port)?;
    }
    // Outer destination: this node -> the backend (the stack forwards it there).
    ctx.l3_csum_replace(IP_CSUM_OFF, outer_dst as u64, be as u64, 4).ok()?;
    ctx.store(IP_DST_OFF, &be, 0).ok()?;
    stat(Stat::TcIcmpRevNat);
    Some(PASS)
}

/// Rewrites a 4-byte word of the quoted IP header (with its header checksum at `ip_csum`)
/// inside an ICMP error, keeping the ICMP checksum at `icmp_csum` right.
#[inline(always)]
fn icmp_rewrite32(ctx: &TcContext, icmp_csum: usize, off: usize, ip_csum: usize, old: u32, new: u32) -> Option<()> {
    let old_sum: u16 = ctx.load(ip_csum).ok()?;
    ctx.l3_csum_replace(ip_csum, old as u64, new as u64, 4).ok()?;
    let new_sum: u16 = ctx.load(ip_csum).ok()?;
    ctx.store(off, &new, 0).ok()?;
    ctx.l4_csum_replace(icmp_csum, old as u64, new as u64, 4).ok()?;
    ctx.l4_csum_replace(icmp_csum, old_sum as u64, new_sum as u64, 2).ok()
}

const PROTO_ICMPV6: u8 = 58;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;

/// IPv6 twin of `icmp_error` (packet too big, destination unreachable, time exceeded; the
/// error directly after the fixed header). ICMPv6's checksum covers a pseudo header, so the
/// outer destination is part of it too.
#[inline(never)]
fn icmp6_error(ctx: &TcContext) -> Option<i32> {
    let v: u8 = ctx.load(ETH_HLEN).ok()?;
    if v >> 4 != 6 || ctx.load::<u8>(IP6_NEXT_OFF).ok()? != PROTO_ICMPV6 {
        return None;
    }
    let icmp = IP6_L4_OFF;
    let ty: u8 = ctx.load(icmp).ok()?;
    if ty != ICMPV6_DEST_UNREACH && ty != ICMPV6_PKT_TOOBIG && ty != ICMPV6_TIME_EXCEED {
        return None;
    }
    let inner = icmp + 8;
    // The quoted packet must be IPv6 (the corpus found errors quoting an IPv4 header
    // translated as if it were one).
    if ctx.load::<u8>(inner).ok()? >> 4 != 6 {
        return None;
    }
    let iproto: u8 = ctx.load(inner + 6).ok()?;
    if iproto != PROTO_TCP && iproto != PROTO_UDP {
        return None;
    }
    let isrc: Ip6 = ctx.load(inner + 8).ok()?;
    let idst: Ip6 = ctx.load(inner + 24).ok()?;
    // Addressed to the frontend that sent the quoted packet, or not ours (see icmp_error).
    let outer_dst: Ip6 = ctx.load(IP6_DST_OFF).ok()?;
    if outer_dst != isrc {
        return None;
    }
    let il4 = inner + 40;
    let isport: u16 = ctx.load(il4).ok()?;
    let idport: u16 = ctx.load(il4 + 2).ok()?;
    let fkey = CtKey6 { saddr: idst, daddr: isrc, sport: idport, dport: isport, proto: iproto, dir: CT_DIR_FORWARD, _pad: 0 };
    let ct = unsafe { GN_CT6.get(&fkey) }?;
    let (be, be_port, flags) = (ct.addr, ct.port, ct.flags);
    let csum = icmp + 2;
    icmp6_rewrite_addr(ctx, csum, inner + 8, &isrc, &be, 0)?;
    icmp_rewrite16(ctx, csum, il4, isport, be_port)?;
    if flags & CT_FLAG_SNAT != 0 {
        let skey = CtKey6 { saddr: idst, daddr: be, sport: idport, dport: be_port, proto: iproto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
        let n = unsafe { GN_CT6.get(&skey) }?;
        let (nat, nat_port) = (n.addr, n.port);
        icmp6_rewrite_addr(ctx, csum, inner + 24, &idst, &nat, 0)?;
        icmp_rewrite16(ctx, csum, il4 + 2, idport, nat_port)?;
    }
    icmp6_rewrite_addr(ctx, csum, IP6_DST_OFF, &outer_dst, &be, BPF_F_PSEUDO_HDR)?;
    stat(Stat::TcIcmpRevNat);
    Some(PASS)
}

/// Rewrites a 16-byte address in an ICMPv6 error (`flags`: `BPF_F_PSEUDO_HDR` for the outer
/// one), keeping the ICMPv6 checksum right.
#[inline(always)]
fn icmp6_rewrite_addr(ctx: &TcContext, icmp_csum: usize, off: usize, old: &Ip6, new: &Ip6, flags: u64) -> Option<()> {
    for i in 0..4 {
        ctx.l4_csum_replace(icmp_csum, old[i] as u64, new[i] as u64, flags | 4).ok()?;
    }
    ctx.store(off, new, 0).ok()
}

/// Rewrites a quoted port inside an ICMP error, keeping the ICMP checksum right.
#[inline(always)]
fn icmp_rewrite16(ctx: &TcContext, icmp_csum: usize, off: usize, old: u16, new: u16) -> Option<()> {
    ctx.store(off, &new, 0).ok()?;
    ctx.l4_csum_replace(icmp_csum, old as u64, new as u64, 2).ok()
}

/// A new flow straight to a backend (not to a frontend) whose 4-tuple we still remember as the
/// backend side of an earlier translated flow: that flow is over (the client reuses its port),
/// so forget it, or this flow's replies would be rewritten to the old frontend.
#[inline(always)]
fn forget_stale(f: &Flow) {
    let rkey = CtKey4 { saddr: f.daddr, daddr: f.saddr, sport: f.dport, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    if let Some(v) = unsafe { GN_CT4.get(&rkey) } {
        let fkey = CtKey4 { saddr: f.saddr, daddr: v.addr, sport: f.sport, dport: v.port, proto: f.proto, dir: CT_DIR_FORWARD, _pad: 0 };
        let _ = GN_CT4.remove(&fkey);
        let _ = GN_CT4.remove(&rkey);
        stat(Stat::TcCtStale);
    }
}

/// Source NAT of a backend's reply back to the frontend the client used.
#[inline(always)]
fn rev_nat(ctx: &TcContext, f: &Flow) -> Option<i32> {
    let ct = GN_CT4.get_ptr_mut(&f.ct_key(CT_DIR_REPLY))?;
    let ct = unsafe { &mut *ct };
    touch(&mut ct.last_seen_ns, unsafe { bpf_ktime_get_ns() });
    let (addr, port) = (ct.addr, ct.port);
    snat(ctx, f, addr, port)?;
    stat(Stat::TcRevNat);
    Some(PASS)
}

#[inline(always)]
fn dnat(ctx: &TcContext, f: &Flow, addr: u32, port: u16) -> Option<()> {
    let csum = f.csum_off();
    let fl = f.csum_flags();
    ctx.l4_csum_replace(csum, f.daddr as u64, addr as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, f.dport as u64, port as u64, 2 | fl).ok()?;
    ctx.l3_csum_replace(IP_CSUM_OFF, f.daddr as u64, addr as u64, 4).ok()?;
    ctx.store(IP_DST_OFF, &addr, 0).ok()?;
    ctx.store(f.l4 + 2, &port, 0).ok()?;
    Some(())
}

/// A frontend with no backends: refuse at once instead of letting the client time out.
/// TCP SYNs are turned into a RST+ACK in place and sent back out of the interface they came
/// in on; everything else is dropped.
#[inline(always)]
fn reject(ctx: &TcContext, f: &Flow) -> i32 {
    if f.proto == PROTO_TCP && f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN {
        if syn_to_rst(ctx, f).is_some() {
            stat(Stat::TcNoBackendReset);
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            return unsafe { bpf_redirect(ifindex, 0) } as i32;
        }
    }
    stat(Stat::TcNoBackendDrop);
    DROP
}

/// Rewrites a SYN into the RST+ACK a closed port would send. Every changed field goes through
/// the csum helpers, which keeps both fully checksummed and CHECKSUM_PARTIAL skbs right.
/// Swapping addresses or ports leaves the one's-complement sums unchanged.
#[inline(always)]
fn syn_to_rst(ctx: &TcContext, f: &Flow) -> Option<()> {
    let l4 = f.l4;
    let csum = f.csum_off();
    let tot_len = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).ok()?) as usize;
    let hdr_word: u16 = ctx.load(l4 + 12).ok()?;
    let doff = ((ctx.load::<u8>(l4 + 12).ok()? >> 4) as usize) * 4;
    // A SYN carrying data (TFO) would need trimming: not worth it, the caller drops it.
    if doff < 20 || tot_len != (l4 - ETH_HLEN) + doff {
        return None;
    }
    // Ethernet: back to the sender.
    let dst_mac: [u8; 6] = ctx.load(0).ok()?;
    let src_mac: [u8; 6] = ctx.load(6).ok()?;
    ctx.store(0, &src_mac, 0).ok()?;
    ctx.store(6, &dst_mac, 0).ok()?;
    // IP and ports swapped.
    ctx.store(IP_SRC_OFF, &f.daddr, 0).ok()?;
    ctx.store(IP_DST_OFF, &f.saddr, 0).ok()?;
    ctx.store(l4, &f.dport, 0).ok()?;
    ctx.store(l4 + 2, &f.sport, 0).ok()?;
    // seq = 0, ack = their seq + 1.
    let seq: u32 = ctx.load(l4 + 4).ok()?;
    let old_ack: u32 = ctx.load(l4 + 8).ok()?;
    let ack = (u32::from_be(seq).wrapping_add(1)).to_be();
    replace32(ctx, csum, l4 + 4, seq, 0)?;
    replace32(ctx, csum, l4 + 8, old_ack, ack)?;
    // Flags: RST|ACK, keep the data offset.
    let new_word = (hdr_word & 0x00ff) | ((TCP_FLAG_RST | TCP_FLAG_ACK) as u16) << 8;
    ctx.l4_csum_replace(csum, hdr_word as u64, new_word as u64, 2).ok()?;
    ctx.store(l4 + 12, &new_word, 0).ok()?;
    // Window and urgent pointer: zero.
    let win: u16 = ctx.load(l4 + 14).ok()?;
    ctx.l4_csum_replace(csum, win as u64, 0, 2).ok()?;
    ctx.store(l4 + 14, &0u16, 0).ok()?;
    let urg: u16 = ctx.load(l4 + 18).ok()?;
    ctx.l4_csum_replace(csum, urg as u64, 0, 2).ok()?;
    ctx.store(l4 + 18, &0u16, 0).ok()?;
    // Options (MSS, SACK, timestamps, ...) become NOPs: same length, nothing to trim.
    let nops = 0x0101_0101u32;
    let mut off = 20;
    for _ in 0..10 {
        if off >= doff {
            break;
        }
        let old: u32 = ctx.load(l4 + off).ok()?;
        replace32(ctx, csum, l4 + off, old, nops)?;
        off += 4;
    }
    Some(())
}

#[inline(always)]
fn replace32(ctx: &TcContext, csum: usize, off: usize, old: u32, new: u32) -> Option<()> {
    ctx.l4_csum_replace(csum, old as u64, new as u64, 4).ok()?;
    ctx.store(off, &new, 0).ok()
}

// ---------------------------------------------------------------------------------------------
// IPv6: the same design. No L3 checksum; the L4 checksum covers the addresses through the
// pseudo header, so every changed address word goes through `l4_csum_replace` with
// BPF_F_PSEUDO_HDR. Hop-by-hop and destination options headers (up to `IP6_MAX_EXT`) are
// skipped to find TCP or UDP; fragments, routing headers (the destination is then not the
// final one) and anything else pass untouched, as IPv4 fragments do.

struct Flow6 {
    saddr: Ip6,
    daddr: Ip6,
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    /// Offset of the L4 header (after any extension headers).
    l4: usize,
}

const IP6_MAX_EXT: usize = 3;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_DEST: u8 = 60;

impl Flow6 {
    #[inline(always)]
    fn csum_off(&self) -> usize {
        self.l4 + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    #[inline(always)]
    fn csum_flags(&self) -> u64 {
        if self.proto == PROTO_UDP {
            BPF_F_MARK_MANGLED_0
        } else {
            0
        }
    }

    #[inline(always)]
    fn ct_key(&self, dir: u8) -> CtKey6 {
        CtKey6 { saddr: self.saddr, daddr: self.daddr, sport: self.sport, dport: self.dport, proto: self.proto, dir, _pad: 0 }
    }
}

#[inline(always)]
fn parse6(ctx: &TcContext) -> Option<Flow6> {
    let h = Hdr::new(ctx);
    let v: u8 = h.load(ETH_HLEN)?;
    if v >> 4 != 6 {
        return None;
    }
    let mut proto: u8 = h.load(IP6_NEXT_OFF)?;
    let mut l4 = IP6_L4_OFF;
    for i in 0..IP6_MAX_EXT {
        // Hop-by-hop options may only come first (RFC 8200 4.1; the stack drops a packet
        // with them anywhere else, so it must not be translated either: found by the
        // packet corpus).
        if proto != NEXTHDR_DEST && !(proto == NEXTHDR_HOP && i == 0) {
            break;
        }
        // Both: next header, then the length in 8-octet units not counting the first 8.
        let next: u8 = h.load(l4)?;
        let len: u8 = h.load(l4 + 1)?;
        proto = next;
        l4 += (len as usize + 1) * 8;
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let tcp_flags = if proto == PROTO_TCP { h.load::<u8>(l4 + 13)? } else { 0 };
    Some(Flow6 { saddr: h.load(IP6_SRC_OFF)?, daddr: h.load(IP6_DST_OFF)?, sport: h.load(l4)?, dport: h.load(l4 + 2)?, proto, tcp_flags, l4 })
}

/// IPv6 twin of `forget_stale`.
#[inline(always)]
fn forget_stale6(f: &Flow6) {
    let rkey = CtKey6 { saddr: f.daddr, daddr: f.saddr, sport: f.dport, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    if let Some(v) = unsafe { GN_CT6.get(&rkey) } {
        let fkey = CtKey6 { saddr: f.saddr, daddr: v.addr, sport: f.sport, dport: v.port, proto: f.proto, dir: CT_DIR_FORWARD, _pad: 0 };
        let _ = GN_CT6.remove(&fkey);
        let _ = GN_CT6.remove(&rkey);
        stat(Stat::TcCtStale);
    }
}

#[inline(always)]
fn ingress6(ctx: &TcContext, f: &Flow6) -> Option<i32> {
    if let Some(v) = snat_reverse6(ctx, f) {
        return Some(v);
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let fresh_syn = f.proto == PROTO_TCP && f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN;
    let fkey = f.ct_key(CT_DIR_FORWARD);
    if !fresh_syn {
        if let Some(ct) = GN_CT6.get_ptr_mut(&fkey) {
            let ct = unsafe { &mut *ct };
            touch(&mut ct.last_seen_ns, now);
            let (addr, port, flags) = (ct.addr, ct.port, ct.flags);
            if flags & CT_FLAG_SNAT != 0 {
                return Some(snat_established6(ctx, f, &addr, port, now));
            }
            nat6(ctx, f, &f.daddr, &addr, IP6_DST_OFF, f.dport, port, f.l4 + 2)?;
            stat(Stat::TcDnat);
            return Some(PASS);
        }
    }
    if !fresh_syn {
        if let Some(v) = rev_nat6(ctx, f) {
            return Some(v);
        }
    }
    let skey = ServiceKey6::master(f.daddr, f.dport, f.proto);
    let Some(master) = (unsafe { GN_SVC6.get(&skey) }) else {
        if fresh_syn || f.proto == PROTO_UDP {
            forget_stale6(f);
            match service_net(f.daddr) {
                SVCNET_CLUSTER_IP => {
                    stat(Stat::ClusterIpPortReject);
                    return Some(reject6(ctx, f));
                }
                SVCNET_RANGE => {
                    stat(Stat::ServiceRangeDrop);
                    return Some(DROP);
                }
                _ => {}
            }
        }
        return None;
    };
    if master.flags & SVC_FLAG_SOURCE_RANGES != 0 && !V6::source_allowed(&skey, f.saddr) {
        stat(Stat::TcSourceRangeDrop);
        return Some(DROP);
    }
    let Some((_, be)) = select_backend_affine::<V6>(&skey, master, V6::addr_client(f.saddr), AFF_CLIENT_ADDR) else {
        if master.count == 0 {
            if master.flags & SVC_FLAG_DROP != 0 {
                // Endpoints exist, none for traffic arriving here: drop, as kube-proxy does.
                stat(Stat::TcNoLocalBackendDrop);
                return Some(DROP);
            }
            return Some(reject6(ctx, f));
        }
        stat(Stat::TcMissingBackend);
        return None;
    };
    if master.flags & SVC_FLAG_SNAT_REMOTE != 0 && be.flags & BE_FLAG_REMOTE != 0 {
        return Some(snat_new6(ctx, f, &fkey, &be, now));
    }
    let rkey = CtKey6 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    let rval = CtValue6 { addr: f.daddr, port: f.dport, flags: 0, _pad: 0, last_seen_ns: now };
    ct_insert(&GN_CT6, &rkey, &rval)?;
    let fval = CtValue6 { addr: be.addr, port: be.port, flags: 0, _pad: 0, last_seen_ns: now };
    ct_insert(&GN_CT6, &fkey, &fval)?;
    stat(Stat::TcCtCreated);
    nat6(ctx, f, &f.daddr, &be.addr, IP6_DST_OFF, f.dport, be.port, f.l4 + 2)?;
    stat(Stat::TcDnat);
    Some(PASS)
}

#[inline(always)]
fn rev_nat6(ctx: &TcContext, f: &Flow6) -> Option<i32> {
    let ct = GN_CT6.get_ptr_mut(&f.ct_key(CT_DIR_REPLY))?;
    let ct = unsafe { &mut *ct };
    touch(&mut ct.last_seen_ns, unsafe { bpf_ktime_get_ns() });
    let (addr, port) = (ct.addr, ct.port);
    nat6(ctx, f, &f.saddr, &addr, IP6_SRC_OFF, f.sport, port, f.l4)?;
    stat(Stat::TcRevNat);
    Some(PASS)
}

/// IPv6 twin of `route`.
#[inline(always)]
fn route6(ctx: &TcContext, ifindex: u32, proto: u8, src: &Ip6, dst: &Ip6, want_src: bool) -> Option<(u32, Ip6)> {
    let p = fib_params()?;
    p.family = 10; // AF_INET6
    p.l4_protocol = proto;
    p.ifindex = ifindex;
    p.__bindgen_anon_3.ipv6_src = *src;
    p.__bindgen_anon_4.ipv6_dst = *dst;
    let flags = BPF_FIB_LOOKUP_SKIP_NEIGH | if want_src { BPF_FIB_LOOKUP_SRC } else { 0 };
    let rc = unsafe { bpf_fib_lookup(ctx.skb.skb.cast(), p, core::mem::size_of::<FibParams>() as i32, flags) };
    if rc != 0 {
        return None;
    }
    Some((p.ifindex, unsafe { p.__bindgen_anon_3.ipv6_src }))
}

/// IPv6 twin of `snat_new`. One key and one value are reused for all entries: separate
/// 40-byte locals would not fit the IPv6 path into the 512-byte stack.
#[inline(always)]
fn snat_new6(ctx: &TcContext, f: &Flow6, fkey: &CtKey6, be: &Backend6, now: u64) -> i32 {
    let Some((out_if, nat_addr)) = route6(ctx, ingress_ifindex(ctx), f.proto, &f.saddr, &be.addr, true) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let start = unsafe { bpf_get_prandom_u32() };
    // The port's reply entry: backend -> node address:port, pointing back at the client.
    let mut key = CtKey6 { saddr: be.addr, daddr: nat_addr, sport: be.port, dport: 0, proto: f.proto, dir: CT_DIR_SNAT_REPLY, _pad: 0 };
    let mut val = CtValue6 { addr: f.saddr, port: f.sport, flags: 0, _pad: 0, last_seen_ns: now };
    let mut nat_port = 0u16;
    for i in 0..SNAT_PORT_TRIES {
        key.dport = (SNAT_PORT_MIN + (start.wrapping_add(i) % SNAT_PORT_COUNT as u32) as u16).to_be();
        let taken = match unsafe { GN_CT6.get(&key) } {
            None => GN_CT6.insert(&key, &val, BPF_NOEXIST as u64).is_ok(),
            Some(v) if snat_port_free(v.flags, v.last_seen_ns, f.proto, now) => GN_CT6.insert(&key, &val, 0).is_ok(),
            Some(_) => false,
        };
        if taken {
            nat_port = key.dport;
            break;
        }
    }
    if nat_port == 0 {
        stat(Stat::TcSnatFailed);
        return DROP;
    }
    // Reply (backend -> client) back to the frontend.
    key = CtKey6 { saddr: be.addr, daddr: f.saddr, sport: be.port, dport: f.sport, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    val.addr = f.daddr;
    val.port = f.dport;
    let ok_reply = GN_CT6.insert(&key, &val, 0).is_ok();
    // Forward source NAT (client -> backend) to the node address and port.
    key = CtKey6 { saddr: f.saddr, daddr: be.addr, sport: f.sport, dport: be.port, proto: f.proto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
    val.addr = nat_addr;
    val.port = nat_port;
    let ok_fwd_snat = GN_CT6.insert(&key, &val, 0).is_ok();
    // Forward (client -> frontend) to the backend, flagged as source-NATed.
    val.addr = be.addr;
    val.port = be.port;
    val.flags = CT_FLAG_SNAT;
    if !ok_reply || !ok_fwd_snat || GN_CT6.insert(fkey, &val, 0).is_err() {
        stat(Stat::TcSnatFailed);
        return DROP;
    }
    stat(Stat::TcCtCreated);
    if decrement_hop_limit(ctx).is_none()
        || nat6(ctx, f, &f.daddr, &be.addr, IP6_DST_OFF, f.dport, be.port, f.l4 + 2).is_none()
        || nat6(ctx, f, &f.saddr, &nat_addr, IP6_SRC_OFF, f.sport, nat_port, f.l4).is_none()
    {
        return DROP;
    }
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    transmit(out_if)
}

/// IPv6 twin of `snat_established`.
#[inline(always)]
fn snat_established6(ctx: &TcContext, f: &Flow6, be_addr: &Ip6, be_port: u16, now: u64) -> i32 {
    let skey = CtKey6 { saddr: f.saddr, daddr: *be_addr, sport: f.sport, dport: be_port, proto: f.proto, dir: CT_DIR_SNAT_FWD, _pad: 0 };
    let Some(s) = GN_CT6.get_ptr_mut(&skey) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let s = unsafe { &mut *s };
    touch(&mut s.last_seen_ns, now);
    let (nat_addr, nat_port) = (s.addr, s.port);
    let mut skey = skey;
    skey.saddr = *be_addr;
    skey.daddr = nat_addr;
    skey.sport = be_port;
    skey.dport = nat_port;
    skey.dir = CT_DIR_SNAT_REPLY;
    if let Some(r) = GN_CT6.get_ptr_mut(&skey) {
        let r = unsafe { &mut *r };
        touch(&mut r.last_seen_ns, now);
        snat_note_close(f.proto, f.tcp_flags, &mut r.flags);
    }
    let Some((out_if, _)) = route6(ctx, ingress_ifindex(ctx), f.proto, &nat_addr, be_addr, false) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    if decrement_hop_limit(ctx).is_none()
        || nat6(ctx, f, &f.daddr, be_addr, IP6_DST_OFF, f.dport, be_port, f.l4 + 2).is_none()
        || nat6(ctx, f, &f.saddr, &nat_addr, IP6_SRC_OFF, f.sport, nat_port, f.l4).is_none()
    {
        return DROP;
    }
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    transmit(out_if)
}

/// IPv6 twin of `snat_reverse`.
#[inline(always)]
fn snat_reverse6(ctx: &TcContext, f: &Flow6) -> Option<i32> {
    if u16::from_be(f.dport) < SNAT_PORT_MIN {
        return None;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let r = GN_CT6.get_ptr_mut(&f.ct_key(CT_DIR_SNAT_REPLY))?;
    let r = unsafe { &mut *r };
    touch(&mut r.last_seen_ns, now);
    snat_note_close(f.proto, f.tcp_flags, &mut r.flags);
    let (client, client_port) = (r.addr, r.port);
    let rkey = CtKey6 { saddr: f.saddr, daddr: client, sport: f.sport, dport: client_port, proto: f.proto, dir: CT_DIR_REPLY, _pad: 0 };
    let Some(fe) = GN_CT6.get_ptr_mut(&rkey) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    let fe = unsafe { &mut *fe };
    touch(&mut fe.last_seen_ns, now);
    let (fe_addr, fe_port) = (fe.addr, fe.port);
    let Some((out_if, _)) = route6(ctx, ingress_ifindex(ctx), f.proto, &fe_addr, &client, false) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    if decrement_hop_limit(ctx).is_none()
        || nat6(ctx, f, &f.daddr, &client, IP6_DST_OFF, f.dport, client_port, f.l4 + 2).is_none()
        || nat6(ctx, f, &f.saddr, &fe_addr, IP6_SRC_OFF, f.sport, fe_port, f.l4).is_none()
    {
        return Some(DROP);
    }
    stat(Stat::TcSnatRevNat);
    Some(transmit(out_if))
}

/// Rewrites one address (at `addr_off`) and one port (at `port_off`) of an IPv6 packet.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn nat6(ctx: &TcContext, f: &Flow6, old: &Ip6, new: &Ip6, addr_off: usize, old_port: u16, new_port: u16, port_off: usize) -> Option<()> {
    let csum = f.csum_off();
    let fl = f.csum_flags();
    ctx.l4_csum_replace(csum, old[0] as u64, new[0] as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, old[1] as u64, new[1] as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, old[2] as u64, new[2] as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, old[3] as u64, new[3] as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
    ctx.l4_csum_replace(csum, old_port as u64, new_port as u64, 2 | fl).ok()?;
    ctx.store(addr_off, new, 0).ok()?;
    ctx.store(port_off, &new_port, 0).ok()?;
    Some(())
}

#[inline(always)]
fn reject6(ctx: &TcContext, f: &Flow6) -> i32 {
    if f.proto == PROTO_TCP && f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN {
        if syn_to_rst6(ctx, f).is_some() {
            stat(Stat::TcNoBackendReset);
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            return unsafe { bpf_redirect(ifindex, 0) } as i32;
        }
    }
    stat(Stat::TcNoBackendDrop);
    DROP
}

/// `syn_to_rst` for IPv6: the swap of addresses and ports keeps the pseudo-header sum.
#[inline(always)]
fn syn_to_rst6(ctx: &TcContext, f: &Flow6) -> Option<()> {
    // Only a SYN without extension headers is answered (the check on the payload length
    // below); others are dropped.
    let l4 = f.l4;
    let csum = f.csum_off();
    let plen = u16::from_be(ctx.load::<u16>(IP6_PLEN_OFF).ok()?) as usize;
    let hdr_word: u16 = ctx.load(l4 + 12).ok()?;
    let doff = ((ctx.load::<u8>(l4 + 12).ok()? >> 4) as usize) * 4;
    if doff < 20 || plen != doff {
        return None;
    }
    let dst_mac: [u8; 6] = ctx.load(0).ok()?;
    let src_mac: [u8; 6] = ctx.load(6).ok()?;
    ctx.store(0, &src_mac, 0).ok()?;
    ctx.store(6, &dst_mac, 0).ok()?;
    ctx.store(IP6_SRC_OFF, &f.daddr, 0).ok()?;
    ctx.store(IP6_DST_OFF, &f.saddr, 0).ok()?;
    ctx.store(l4, &f.dport, 0).ok()?;
    ctx.store(l4 + 2, &f.sport, 0).ok()?;
    let seq: u32 = ctx.load(l4 + 4).ok()?;
    let old_ack: u32 = ctx.load(l4 + 8).ok()?;
    let ack = (u32::from_be(seq).wrapping_add(1)).to_be();
    replace32(ctx, csum, l4 + 4, seq, 0)?;
    replace32(ctx, csum, l4 + 8, old_ack, ack)?;
    let new_word = (hdr_word & 0x00ff) | ((TCP_FLAG_RST | TCP_FLAG_ACK) as u16) << 8;
    ctx.l4_csum_replace(csum, hdr_word as u64, new_word as u64, 2).ok()?;
    ctx.store(l4 + 12, &new_word, 0).ok()?;
    let win: u16 = ctx.load(l4 + 14).ok()?;
    ctx.l4_csum_replace(csum, win as u64, 0, 2).ok()?;
    ctx.store(l4 + 14, &0u16, 0).ok()?;
    let urg: u16 = ctx.load(l4 + 18).ok()?;
    ctx.l4_csum_replace(csum, urg as u64, 0, 2).ok()?;
    ctx.store(l4 + 18, &0u16, 0).ok()?;
    let nops = 0x0101_0101u32;
    let mut off = 20;
    for _ in 0..10 {
        if off >= doff {
            break;
        }
        let old: u32 = ctx.load(l4 + off).ok()?;
        replace32(ctx, csum, l4 + off, old, nops)?;
        off += 4;
    }
    Some(())
}
