//! Interface LB on TC: DNAT of packets addressed to a frontend, connection tracking so every
//! packet of a flow keeps its backend, and reverse NAT of the replies. This serves the traffic
//! socket LB cannot see (NodePort from other nodes, clients outside our cgroup).
//!
//! One path for both families, generic over [`L3`] (`l3.rs`: what differs between an IPv4
//! and an IPv6 packet); source NAT in `snat.rs`, ICMP errors in `icmp.rs`, the L4 rewrites
//! (NAT of an address and port, SYN -> RST) in `l4.rs`.

mod end;
mod icmp;
mod l3;
mod l4;
mod snat;

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    macros::classifier,
    maps::LruHashMap,
    programs::TcContext,
};
use gardenet_common::*;
use l3::L3;
use network_types::{eth::EtherType, tcp::TcpHdr, udp::UdpHdr};

use crate::{
    family::{Family, V4, V6},
    headers::{ether_type, linear, Bytes, Flow, IP6_MAX_EXT, TCP_FLAG_FIN, TCP_FLAG_RST},
    select_backend_affine, service_net, stat,
};

/// "Not ours, carry on": lets later tcx programs / tc filters run (TCX_NEXT / TC_ACT_UNSPEC).
const PASS: i32 = -1;
const DROP: i32 = TC_ACT_SHOT as i32;

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

impl<F: Family> Flow<F> {
    #[inline(always)]
    fn csum_off(&self) -> usize {
        self.l4 + if self.proto == PROTO_TCP { core::mem::offset_of!(TcpHdr, check) } else { core::mem::offset_of!(UdpHdr, check) }
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
    fn ct_key(&self, dir: u8) -> CtKey<F::Addr> {
        CtKey::new(self.saddr, self.daddr, self.sport, self.dport, self.proto, dir)
    }
}

#[classifier]
pub fn gn_tc_ingress(ctx: TcContext) -> i32 {
    // Each family's path is one BPF function with the parsed flow in its own frame; the ICMP
    // error paths are called from here, not from inside them. The verifier adds up the frames
    // of a call chain (each rounded up to 32 bytes) against 512 bytes, and the IPv6 path
    // alone takes almost 400.
    if is_ipv6(&ctx) {
        ingress_or_icmp::<V6>(&ctx)
    } else {
        ingress_or_icmp::<V4>(&ctx)
    }
}

#[inline(always)]
fn ingress_or_icmp<F: L3>(ctx: &TcContext) -> i32 {
    match ingress_flow::<F>(ctx) {
        NOT_L4 => icmp::error::<F>(ctx).unwrap_or(PASS),
        verdict => verdict,
    }
}

/// "Not a TCP or UDP packet we can parse": the caller tries the ICMP error path.
const NOT_L4: i32 = i32::MIN;

#[inline(never)]
fn ingress_flow<F: L3>(ctx: &TcContext) -> i32 {
    match F::parse(&Hdr::new(ctx), IP6_MAX_EXT) {
        Some(flow) => ingress(ctx, &flow).unwrap_or(PASS),
        None => NOT_L4,
    }
}

#[classifier]
pub fn gn_tc_egress(ctx: TcContext) -> i32 {
    if is_ipv6(&ctx) {
        egress::<V6>(&ctx)
    } else {
        egress::<V4>(&ctx)
    }
}

#[inline(always)]
fn egress<F: L3>(ctx: &TcContext) -> i32 {
    match F::parse(&Hdr::new(ctx), IP6_MAX_EXT) {
        Some(flow) => rev_nat(ctx, &flow).unwrap_or(PASS),
        None => PASS,
    }
}

#[inline(always)]
fn is_ipv6(ctx: &TcContext) -> bool {
    ether_type(&Hdr::new(ctx)) == Some(EtherType::Ipv6 as u16)
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
}

impl Bytes for Hdr<'_> {
    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Option<T> {
        if let Some(v) = linear(self.start, self.end, off) {
            return Some(v);
        }
        self.ctx.load::<T>(off).ok()
    }
}

// Inlined into `ingress_flow`: the two families' paths are separate BPF functions (together
// their keys and FIB parameters exceed one frame).
#[inline(always)]
fn ingress<F: L3>(ctx: &TcContext, f: &Flow<F>) -> Option<i32> {
    // A backend's reply to a flow we source-NATed: it is addressed to this node.
    if let Some(v) = snat::reverse(ctx, f) {
        return Some(v);
    }
    let fresh_syn = f.fresh_syn();
    let fkey = f.ct_key(CT_DIR_FORWARD);
    // Established flows keep their backend even if the service changed meanwhile; a new SYN
    // (also one reusing an old 4-tuple) always selects afresh from the current backends.
    // Looked up first: most packets here belong to such flows, and each conntrack lookup is
    // a likely cache miss in a large table.
    if !fresh_syn {
        if let Some(ct) = F::conntrack().get_ptr_mut(&fkey) {
            let ct = unsafe { &mut *ct };
            let (addr, port, flags) = F::ct_target(ct);
            if flags & CT_FLAG_SNAT != 0 {
                // Only source-NAT entries keep their last use: their ports are reused by it.
                let now = unsafe { bpf_ktime_get_ns() };
                touch(F::ct_marks(ct).0, now);
                // The port's entry holds the closing for the programs; this mark lets the
                // agent find the flow should the port go to another flow before it is removed.
                note_close::<F>(ct, f.tcp_flags);
                return Some(snat::established(ctx, f, addr, port, now));
            }
            l4::dnat(ctx, f, addr, port)?;
            note_close::<F>(ct, f.tcp_flags);
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
    let skey = ServiceKey::master(f.daddr, f.dport, f.proto);
    let Some(master) = F::service(&skey) else {
        if fresh_syn || f.proto == PROTO_UDP {
            forget_stale(f);
            match service_net(F::net_key(f.daddr)) {
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
    if master.flags & SVC_FLAG_SOURCE_RANGES != 0 && !F::source_allowed(&skey, f.saddr) {
        stat(Stat::TcSourceRangeDrop);
        return Some(DROP);
    }
    let Some((_, be)) = select_backend_affine::<F>(&skey, master, F::addr_client(f.saddr), AFF_CLIENT_ADDR) else {
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
    let now = unsafe { bpf_ktime_get_ns() };
    if master.flags & SVC_FLAG_SNAT_REMOTE != 0 && be.flags & BE_FLAG_REMOTE != 0 {
        return Some(snat::new(ctx, f, &fkey, &be, now));
    }
    // Reply first: once the backend can answer, the answer must be translated.
    let rkey = CtKey::new(be.addr, f.saddr, be.port, f.sport, f.proto, CT_DIR_REPLY);
    ct_insert(F::conntrack(), &rkey, &F::ct_value(f.daddr, f.dport, 0, now))?;
    ct_insert(F::conntrack(), &fkey, &F::ct_value(be.addr, be.port, 0, now))?;
    stat(Stat::TcCtCreated);
    l4::dnat(ctx, f, be.addr, be.port)?;
    stat(Stat::TcDnat);
    Some(PASS)
}

/// Source NAT of a backend's reply back to the frontend the client used.
#[inline(always)]
fn rev_nat<F: L3>(ctx: &TcContext, f: &Flow<F>) -> Option<i32> {
    let ct = unsafe { &mut *F::conntrack().get_ptr_mut(&f.ct_key(CT_DIR_REPLY))? };
    let (addr, port, _) = F::ct_target(ct);
    l4::snat(ctx, f, addr, port)?;
    note_close::<F>(ct, f.tcp_flags);
    stat(Stat::TcRevNat);
    Some(PASS)
}

/// A new flow straight to a backend (not to a frontend) whose 4-tuple we still remember as the
/// backend side of an earlier translated flow: that flow is over (the client reuses its port),
/// so forget it, or this flow's replies would be rewritten to the old frontend.
#[inline(always)]
fn forget_stale<F: L3>(f: &Flow<F>) {
    let rkey = CtKey::new(f.daddr, f.saddr, f.dport, f.sport, f.proto, CT_DIR_REPLY);
    if let Some(v) = unsafe { F::conntrack().get(&rkey) } {
        let (addr, port, _) = F::ct_target(v);
        let _ = F::conntrack().remove(&CtKey::new(f.saddr, addr, f.sport, port, f.proto, CT_DIR_FORWARD));
        let _ = F::conntrack().remove(&rkey);
        stat(Stat::TcCtStale);
    }
}

/// A frontend with no backends: refuse at once instead of letting the client time out.
/// TCP SYNs are turned into a RST+ACK in place and sent back out of the interface they came
/// in on; everything else is dropped.
#[inline(always)]
fn reject<F: L3>(ctx: &TcContext, f: &Flow<F>) -> i32 {
    if f.fresh_syn() && l4::syn_to_rst(ctx, f).is_some() {
        stat(Stat::TcNoBackendReset);
        return unsafe { bpf_redirect(snat::ingress_ifindex(ctx), 0) } as i32;
    }
    stat(Stat::TcNoBackendDrop);
    DROP
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

/// Marks a translated flow's entry with a FIN or RST that passed in its direction, and when,
/// so the agent can remove closed flows. Stores only on the packets that close (and once per
/// kind): the entry's cache line is not written per packet. UDP has no flags here (0).
#[inline(always)]
fn note_close<F: L3>(ct: &mut F::CtValue, tcp_flags: u8) {
    let close = if tcp_flags & TCP_FLAG_FIN != 0 { CT_FLAG_FIN } else { 0 } | if tcp_flags & TCP_FLAG_RST != 0 { CT_FLAG_RST } else { 0 };
    if close == 0 {
        return;
    }
    let (closed_at, flags) = F::ct_marks(ct);
    if *flags & close != close {
        *flags |= close;
        *closed_at = unsafe { bpf_ktime_get_ns() };
    }
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
