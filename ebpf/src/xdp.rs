//! XDP on wire-side interfaces: the cheapest place to drop traffic for a Service frontend
//! that has no backends and no local listener. A fresh TCP SYN still goes on to TC, which
//! answers it with a RST (the client sees "connection refused" at once instead of a
//! timeout; XDP_TX could do that too, but on veth it only works when the peer runs NAPI).
//! All other traffic passes untouched to TC, where the LB proper happens. IPv4 and IPv6 (an
//! IPv6 packet with extension headers before TCP/UDP is passed on to TC).
use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        bpf_sock_tuple,
        xdp_action::{XDP_DROP, XDP_PASS},
    },
    helpers::generated::{bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::xdp,
    programs::XdpContext,
    EbpfContext,
};
use gardenet_common::*;

use crate::{
    family::{Family, V4, V6},
    stat,
};

const ETH_HLEN: usize = 14;

#[xdp]
pub fn gn_xdp(ctx: XdpContext) -> u32 {
    // data/data_end are read once: a second read gives the verifier a pointer with no proven
    // range, while LLVM may drop a bounds check it already knows to hold.
    let pkt = Pkt { ctx: &ctx, start: ctx.data(), end: ctx.data_end() };
    check(&pkt).unwrap_or(XDP_PASS)
}

struct Pkt<'a> {
    ctx: &'a XdpContext,
    start: usize,
    end: usize,
}

#[inline(always)]
fn at<T: Copy>(p: &Pkt, off: usize) -> Option<T> {
    if p.start + off + size_of::<T>() > p.end {
        return None;
    }
    // SAFETY: bounds checked against data_end just above (the verifier sees the same check).
    Some(unsafe { core::ptr::read_unaligned((p.start + off) as *const T) })
}

/// Reads the IP header (IPv4 here, IPv6 in `check6`) and hands its addresses and where L4
/// starts to `verdict`; `None` for anything this program leaves alone (not IP, fragments,
/// other protocols, IPv6 extension headers).
#[inline(always)]
fn check(ctx: &Pkt) -> Option<u32> {
    match u16::from_be(at::<u16>(ctx, 12)?) {
        0x0800 => {}
        0x86DD => return check6(ctx),
        _ => return None,
    }
    let vhl: u8 = at(ctx, ETH_HLEN)?;
    let ihl = ((vhl & 0x0f) as usize) * 4;
    if vhl >> 4 != 4 || ihl < 20 {
        return None;
    }
    if u16::from_be(at::<u16>(ctx, ETH_HLEN + 6)?) & 0x3fff != 0 {
        return None; // fragments: leave to the stack
    }
    let proto: u8 = at(ctx, ETH_HLEN + 9)?;
    let saddr: u32 = at(ctx, ETH_HLEN + 12)?;
    let daddr: u32 = at(ctx, ETH_HLEN + 16)?;
    verdict::<V4>(ctx, proto, saddr, daddr, ETH_HLEN + (ihl & 0x3c))
}

#[inline(always)]
fn check6(ctx: &Pkt) -> Option<u32> {
    let v: u8 = at(ctx, ETH_HLEN)?;
    if v >> 4 != 6 {
        return None;
    }
    let proto: u8 = at(ctx, ETH_HLEN + 6)?;
    let saddr: Ip6 = at(ctx, ETH_HLEN + 8)?;
    let daddr: Ip6 = at(ctx, ETH_HLEN + 24)?;
    verdict::<V6>(ctx, proto, saddr, daddr, ETH_HLEN + 40)
}

/// Drops TCP/UDP traffic at offset `l4` to a frontend without backends, unless it is a fresh
/// SYN (TC answers it) or a local socket owns the destination.
#[inline(always)]
fn verdict<F: Family>(ctx: &Pkt, proto: u8, saddr: F::Addr, daddr: F::Addr, l4: usize) -> Option<u32> {
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let base = ctx.start + l4;
    if base + 4 > ctx.end {
        return None;
    }
    // SAFETY: [base, base + 4) checked just above; the verifier carries the proven range only
    // along constant offsets from the pointer that was checked, hence one base.
    let (sport, dport) = unsafe { (core::ptr::read_unaligned(base as *const u16), core::ptr::read_unaligned((base + 2) as *const u16)) };
    let master = F::service(&ServiceKey::master(daddr, dport, proto))?;
    if master.count != 0 {
        return None; // served by TC LB (the NodePort fast path in XDP is future work)
    }
    if proto == PROTO_TCP {
        if base + 14 > ctx.end {
            return None;
        }
        // SAFETY: checked just above (same base pointer).
        let flags: u8 = unsafe { core::ptr::read_unaligned((base + 13) as *const u8) };
        if flags & 0x12 == 0x02 {
            return None; // a fresh SYN: TC answers it with a RST
        }
    }
    // No backends. A socket on this node may still own the address and port.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = F::sock_tuple(&mut tuple, (saddr, sport), (daddr, dport));
    Some(drop_unless_listener(ctx, &mut tuple, size, proto))
}

/// The verdict for traffic to a frontend without backends: pass it if a socket on this node
/// owns the tuple's destination (`size`: of the tuple's address family part), else drop.
#[inline(always)]
fn drop_unless_listener(ctx: &Pkt, tuple: &mut bpf_sock_tuple, size: u32, proto: u8) -> u32 {
    let netns = u64::MAX; // BPF_F_CURRENT_NETNS
    let sk = unsafe {
        if proto == PROTO_TCP {
            bpf_skc_lookup_tcp(ctx.ctx.as_ptr(), tuple, size, netns, 0)
        } else {
            bpf_sk_lookup_udp(ctx.ctx.as_ptr(), tuple, size, netns, 0)
        }
    };
    if !sk.is_null() {
        unsafe { bpf_sk_release(sk.cast()) };
        return XDP_PASS;
    }
    stat(Stat::XdpDropNoBackend);
    XDP_DROP
}
