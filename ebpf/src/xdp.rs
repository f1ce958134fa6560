//! XDP on wire-side interfaces: the cheapest place to drop traffic for a Service frontend
//! that has no backends and no local listener. A fresh TCP SYN still goes on to TC, which
//! answers it with a RST (the client sees "connection refused" at once instead of a
//! timeout; XDP_TX could do that too, but on veth it only works when the peer runs NAPI).
//! All other traffic passes untouched to TC, where the LB proper happens. Both families, with
//! the flow found as TC finds it (`headers.rs`), except that an IPv6 packet with extension
//! headers before TCP/UDP is passed on to TC.
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
use network_types::eth::EtherType;

use crate::{
    family::{Family, V4, V6},
    headers::{ether_type, linear, Bytes, Flow, Headers},
    stat,
};

#[xdp]
pub fn gn_xdp(ctx: XdpContext) -> u32 {
    // data/data_end are read once: a second read gives the verifier a pointer with no proven
    // range, while LLVM may drop a bounds check it already knows to hold.
    let pkt = Pkt { ctx: &ctx, start: ctx.data(), end: ctx.data_end() };
    let verdict = if ether_type(&pkt) == Some(EtherType::Ipv6 as u16) {
        V6::parse(&pkt, 0).and_then(|f| verdict(&pkt, &f))
    } else {
        V4::parse(&pkt, 0).and_then(|f| verdict(&pkt, &f))
    };
    verdict.unwrap_or(XDP_PASS)
}

struct Pkt<'a> {
    ctx: &'a XdpContext,
    start: usize,
    end: usize,
}

impl Bytes for Pkt<'_> {
    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Option<T> {
        linear(self.start, self.end, off)
    }
}

/// Drops traffic to a frontend without backends, unless it is a fresh SYN (TC answers it) or
/// a local socket owns the destination; `None` for everything else (left to TC).
#[inline(always)]
fn verdict<F: Family>(ctx: &Pkt, f: &Flow<F>) -> Option<u32> {
    let master = F::service(&ServiceKey::master(f.daddr, f.dport, f.proto))?;
    if master.count != 0 {
        return None; // served by TC LB (the NodePort fast path in XDP is future work)
    }
    if f.fresh_syn() {
        return None; // TC answers it with a RST
    }
    // No backends. A socket on this node may still own the address and port.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = F::sock_tuple(&mut tuple, (f.saddr, f.sport), (f.daddr, f.dport));
    Some(drop_unless_listener(ctx, &mut tuple, size, f.proto))
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
