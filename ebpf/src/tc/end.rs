//! One end of a flow: where its address and port are, and the port's part of a rewrite.
//! Below both `l3` (the families' rewrites use it) and `l4` (which picks the end), so neither
//! imports the other both ways.
use core::mem::offset_of;

use aya_ebpf::programs::TcContext;
use network_types::tcp::TcpHdr;

use crate::headers::{Flow, Headers, ETH_HLEN};

/// Which end of a flow a rewrite changes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    Src,
    Dst,
}

/// Where `end`'s address and port are and what they hold (as parsed). TCP and UDP have
/// their ports at the same offsets.
#[inline(always)]
pub fn end_fields<F: Headers>(f: &Flow<F>, end: End) -> ((usize, F::Addr), (usize, u16)) {
    match end {
        End::Src => ((ETH_HLEN + F::SADDR, f.saddr), (f.l4 + offset_of!(TcpHdr, source), f.sport)),
        End::Dst => ((ETH_HLEN + F::DADDR, f.daddr), (f.l4 + offset_of!(TcpHdr, dest), f.dport)),
    }
}

/// The port's part of a rewrite: its L4 checksum update (ports are not in the pseudo header)
/// and its store; nothing when the port stays (a Service forwarding 80 to 80: two helper
/// calls saved per packet).
#[inline(always)]
pub fn rewrite_port<F: Headers>(ctx: &TcContext, f: &Flow<F>, off: usize, old: u16, new: u16) -> Option<()> {
    if old == new {
        return Some(());
    }
    ctx.l4_csum_replace(f.csum_off(), old as u64, new as u64, 2 | f.csum_flags()).ok()?;
    ctx.store(off, &new, 0).ok()
}
