//! Source NAT for external frontends whose backend runs on another node: that backend's reply
//! would otherwise go straight to the client (from the pod's address, which the client never
//! talked to). The flow leaves with this node's address toward the backend and a port from
//! SNAT_PORT_MIN.., so the reply comes back here, is translated back, and is sent to the
//! client. Both directions are transmitted with `bpf_redirect_neigh`: after the rewrite the
//! packet carries a local source address, which the stack's input path would drop as martian.
use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_FIB_LOOKUP_SRC, BPF_NOEXIST},
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_fib_lookup, bpf_get_prandom_u32, bpf_redirect_neigh},
    },
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};
use gardenet_common::*;

use super::{l3::L3, l4, touch, DROP};
use crate::{
    headers::{Flow, TCP_FLAG_FIN, TCP_FLAG_RST},
    stat,
};

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
    // frame that verifiers before 6.8 count as 32 bytes (over the 512-byte limit with the
    // IPv6 ingress path), and a zeroed temporary would sit on the stack.
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
fn route<F: L3>(ctx: &TcContext, proto: u8, src: F::Addr, dst: F::Addr, want_src: bool) -> Option<(u32, F::Addr)> {
    let p = fib_params()?;
    p.family = F::AF;
    p.l4_protocol = proto;
    p.ifindex = ingress_ifindex(ctx);
    F::fib_set(p, src, dst);
    let flags = BPF_FIB_LOOKUP_SKIP_NEIGH | if want_src { BPF_FIB_LOOKUP_SRC } else { 0 };
    let rc = unsafe { bpf_fib_lookup(ctx.skb.skb.cast(), p, core::mem::size_of::<FibParams>() as i32, flags) };
    if rc != 0 {
        return None;
    }
    Some((p.ifindex, F::fib_src(p)))
}

#[inline(always)]
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    unsafe { (*ctx.skb.skb).ifindex }
}

#[inline(always)]
fn transmit(ifindex: u32) -> i32 {
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// Whether a reserved source-NAT port (its reply entry's flags and last use) may be given to
/// a new flow.
#[inline(always)]
fn port_free(flags: u16, last_seen_ns: u64, proto: u8, now: u64) -> bool {
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

/// Records a use of a source-NAT port's reply entry; a FIN or RST in either direction starts
/// the short hold of the port. (The reply entry's `CT_FLAG_SNAT` means "closing" here.)
#[inline(always)]
fn note_use<F: L3>(v: &mut F::CtValue, f: &Flow<F>, now: u64) {
    let (last_seen, flags) = F::ct_marks(v);
    touch(last_seen, now);
    if f.proto == PROTO_TCP && f.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0 {
        *flags |= CT_FLAG_SNAT;
    }
}

/// The rewrite of both ends and the transmission, shared by all source-NAT paths.
#[inline(always)]
fn send<F: L3>(ctx: &TcContext, f: &Flow<F>, to: (F::Addr, u16), from: (F::Addr, u16), out_if: u32) -> Option<i32> {
    F::decrement_ttl(ctx)?;
    l4::dnat(ctx, f, to.0, to.1)?;
    l4::snat(ctx, f, from.0, from.1)?;
    Some(transmit(out_if))
}

/// First packet of a flow to `be` that needs source NAT. One key and one value are reused
/// for all entries: separate 40-byte locals would not fit the IPv6 path into the 512-byte
/// stack.
#[inline(always)]
pub fn new<F: L3>(ctx: &TcContext, f: &Flow<F>, fkey: &CtKey<F::Addr>, be: &Backend<F::Addr>, now: u64) -> i32 {
    let Some((out_if, nat_addr)) = route::<F>(ctx, f.proto, f.saddr, be.addr, true) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let ct = F::conntrack();
    // A port: random start, a few tries; a port whose flow is long idle or closed is reused.
    // Its reply entry: backend -> node address:port, pointing back at the client.
    let start = unsafe { bpf_get_prandom_u32() };
    let mut key = CtKey::new(be.addr, nat_addr, be.port, 0, f.proto, CT_DIR_SNAT_REPLY);
    let mut val = F::ct_value(f.saddr, f.sport, 0, now);
    let mut nat_port = 0u16;
    for i in 0..SNAT_PORT_TRIES {
        key.dport = (SNAT_PORT_MIN + (start.wrapping_add(i) % SNAT_PORT_COUNT as u32) as u16).to_be();
        let taken = match ct.get_ptr_mut(&key) {
            None => ct.insert(&key, &val, BPF_NOEXIST as u64).is_ok(),
            Some(v) => {
                let (last_seen, flags) = F::ct_marks(unsafe { &mut *v });
                port_free(*flags, *last_seen, f.proto, now) && ct.insert(&key, &val, 0).is_ok()
            }
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
    key = CtKey::new(be.addr, f.saddr, be.port, f.sport, f.proto, CT_DIR_REPLY);
    val = F::ct_value(f.daddr, f.dport, 0, now);
    let ok_reply = ct.insert(&key, &val, 0).is_ok();
    // Forward source NAT (client -> backend) to the node address and port.
    key = CtKey::new(f.saddr, be.addr, f.sport, be.port, f.proto, CT_DIR_SNAT_FWD);
    val = F::ct_value(nat_addr, nat_port, 0, now);
    let ok_fwd_snat = ct.insert(&key, &val, 0).is_ok();
    // Forward (client -> frontend) to the backend, flagged as source-NATed.
    val = F::ct_value(be.addr, be.port, CT_FLAG_SNAT, now);
    if !ok_reply || !ok_fwd_snat || ct.insert(fkey, &val, 0).is_err() {
        stat(Stat::TcSnatFailed);
        return DROP;
    }
    stat(Stat::TcCtCreated);
    let Some(v) = send(ctx, f, (be.addr, be.port), (nat_addr, nat_port), out_if) else {
        return DROP;
    };
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    v
}

/// Later packets of a source-NATed flow (the forward entry said so).
#[inline(always)]
pub fn established<F: L3>(ctx: &TcContext, f: &Flow<F>, be_addr: F::Addr, be_port: u16, now: u64) -> i32 {
    let ct = F::conntrack();
    let mut key = CtKey::new(f.saddr, be_addr, f.sport, be_port, f.proto, CT_DIR_SNAT_FWD);
    let Some(s) = ct.get_ptr_mut(&key) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let s = unsafe { &mut *s };
    touch(F::ct_marks(s).0, now);
    let (nat_addr, nat_port, _) = F::ct_target(s);
    key = CtKey::new(be_addr, nat_addr, be_port, nat_port, f.proto, CT_DIR_SNAT_REPLY);
    if let Some(r) = ct.get_ptr_mut(&key) {
        note_use(unsafe { &mut *r }, f, now);
    }
    let Some((out_if, _)) = route::<F>(ctx, f.proto, nat_addr, be_addr, false) else {
        stat(Stat::TcSnatFailed);
        return DROP;
    };
    let Some(v) = send(ctx, f, (be_addr, be_port), (nat_addr, nat_port), out_if) else {
        return DROP;
    };
    stat(Stat::TcDnat);
    stat(Stat::TcSnat);
    v
}

/// A backend's reply to a source-NATed flow: back to the client, from the frontend.
#[inline(always)]
pub fn reverse<F: L3>(ctx: &TcContext, f: &Flow<F>) -> Option<i32> {
    // Only packets to a source-NAT port can be replies of such flows: skip the lookup for
    // all other traffic.
    if u16::from_be(f.dport) < SNAT_PORT_MIN {
        return None;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let ct = F::conntrack();
    let r = ct.get_ptr_mut(&f.ct_key(CT_DIR_SNAT_REPLY))?;
    let r = unsafe { &mut *r };
    note_use(r, f, now);
    let (client, client_port, _) = F::ct_target(r);
    let rkey = CtKey::new(f.saddr, client, f.sport, client_port, f.proto, CT_DIR_REPLY);
    let Some(fe) = ct.get_ptr_mut(&rkey) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    let fe = unsafe { &mut *fe };
    touch(F::ct_marks(fe).0, now);
    super::note_close::<F>(fe, f.tcp_flags);
    let (fe_addr, fe_port, _) = F::ct_target(fe);
    let Some((out_if, _)) = route::<F>(ctx, f.proto, fe_addr, client, false) else {
        stat(Stat::TcSnatFailed);
        return Some(DROP);
    };
    let Some(v) = send(ctx, f, (client, client_port), (fe_addr, fe_port), out_if) else {
        return Some(DROP);
    };
    stat(Stat::TcSnatRevNat);
    Some(v)
}
