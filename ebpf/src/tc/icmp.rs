//! ICMP errors about translated flows. A router between this node and the client reports a
//! problem with a reply (above all "fragmentation needed"/"packet too big", which path MTU
//! discovery lives on) to the reply's source: the frontend, i.e. this node. The backend that
//! sent it must hear it, so the error is rewritten as the backend would have received it
//! without the translation: outer destination -> backend; the quoted packet's source
//! (frontend) -> backend, and for a source-NATed flow its destination (client) -> the node
//! address and port the backend saw. Checksums: outer IP (IPv4), quoted IP (IPv4), and the
//! ICMP checksum over every changed quoted word and, for ICMPv6, the pseudo header (the
//! quoted L4 checksum is not fixed: stacks do not check it in an ICMP error).
use core::mem::offset_of;

use aya_ebpf::programs::TcContext;
use gardenet_common::*;
use network_types::tcp::TcpHdr;

use super::{
    l3::{ICMP_CSUM_OFF, L3},
    PASS,
};
use crate::{headers::ETH_HLEN, stat};

/// Called from the hook, not from inside the flow path: its frame must not add to that one.
#[inline(never)]
pub fn error<F: L3>(ctx: &TcContext) -> Option<i32> {
    let q = F::icmp_error(ctx)?;
    let isrc: F::Addr = ctx.load(q.inner + F::SADDR).ok()?;
    let idst: F::Addr = ctx.load(q.inner + F::DADDR).ok()?;
    // An error about a packet the frontend sent goes to the frontend. One addressed to any
    // other host is not about our flow (spoofed, or for someone else): leave it alone, as
    // Linux conntrack does, instead of redirecting it to the backend (found by the packet
    // corpus, tests/tests/packet_corpus.rs).
    let outer_dst: F::Addr = ctx.load(ETH_HLEN + F::DADDR).ok()?;
    if outer_dst != isrc {
        return None;
    }
    let (isport_off, idport_off) = (q.il4 + offset_of!(TcpHdr, source), q.il4 + offset_of!(TcpHdr, dest));
    let isport: u16 = ctx.load(isport_off).ok()?;
    let idport: u16 = ctx.load(idport_off).ok()?;
    // The quoted packet went frontend -> client: its flow's forward key is client -> frontend.
    let ct = unsafe { F::conntrack().get(&CtKey::new(idst, isrc, idport, isport, q.iproto, CT_DIR_FORWARD)) }?;
    let (be, be_port, flags) = F::ct_target(ct);
    // Quoted source: frontend -> backend (address, port).
    F::rewrite_quoted(ctx, &q, q.inner + F::SADDR, isrc, be)?;
    rewrite_port(ctx, q.icmp, isport_off, isport, be_port)?;
    if flags & CT_FLAG_SNAT != 0 {
        // Quoted destination: client -> the node address and port the backend sent to.
        let n = unsafe { F::conntrack().get(&CtKey::new(idst, be, idport, be_port, q.iproto, CT_DIR_SNAT_FWD)) }?;
        let (nat, nat_port, _) = F::ct_target(n);
        F::rewrite_quoted(ctx, &q, q.inner + F::DADDR, idst, nat)?;
        rewrite_port(ctx, q.icmp, idport_off, idport, nat_port)?;
    }
    // Outer destination: this node -> the backend (the stack forwards it there).
    F::rewrite_outer_dst(ctx, &q, outer_dst, be)?;
    stat(Stat::TcIcmpRevNat);
    Some(PASS)
}

/// Rewrites a quoted port inside an ICMP error, keeping the ICMP checksum right.
#[inline(always)]
fn rewrite_port(ctx: &TcContext, icmp: usize, off: usize, old: u16, new: u16) -> Option<()> {
    ctx.store(off, &new, 0).ok()?;
    ctx.l4_csum_replace(icmp + ICMP_CSUM_OFF, old as u64, new as u64, 2).ok()
}
