//! Rewrites of a TCP/UDP packet in place: one end's address and port (DNAT, SNAT; the
//! family writes them, `L3::rewrite_end`, as its header's layout allows), and a SYN turned
//! into the RST a closed port would send, written once for both families.
use core::mem::offset_of;

use aya_ebpf::programs::TcContext;
use network_types::{eth::EthHdr, tcp::TcpHdr};

use super::{end::End, l3::L3};
use crate::headers::{Flow, ETH_HLEN, TCP_FLAGS_OFF, TCP_FLAG_ACK, TCP_FLAG_RST};

/// Rewrites the destination address and port.
#[inline(always)]
pub fn dnat<F: L3>(ctx: &TcContext, f: &Flow<F>, addr: F::Addr, port: u16) -> Option<()> {
    F::rewrite_end(ctx, f, End::Dst, addr, port)
}

/// Rewrites the source address and port (the counterpart of `dnat`).
#[inline(always)]
pub fn snat<F: L3>(ctx: &TcContext, f: &Flow<F>, addr: F::Addr, port: u16) -> Option<()> {
    F::rewrite_end(ctx, f, End::Src, addr, port)
}

/// Rewrites a SYN into the RST+ACK a closed port would send. Every changed field goes through
/// the csum helpers, which keeps both fully checksummed and CHECKSUM_PARTIAL skbs right.
/// Swapping addresses or ports leaves the one's-complement sums unchanged (IPv4's header
/// checksum and the pseudo header alike).
#[inline(always)]
pub fn syn_to_rst<F: L3>(ctx: &TcContext, f: &Flow<F>) -> Option<()> {
    let l4 = f.l4;
    let csum = f.csum_off();
    let word_off = l4 + TCP_FLAGS_OFF - 1; // data offset and flags, as one 16-bit word
    let hdr_word: u16 = ctx.load(word_off).ok()?;
    let doff = ((ctx.load::<u8>(word_off).ok()? >> 4) as usize) * 4;
    // A SYN carrying data (TFO) would need trimming: not worth it, the caller drops it.
    if doff < TcpHdr::LEN || !F::ends_at(ctx, l4, doff)? {
        return None;
    }
    // Ethernet: back to the sender.
    let dst_mac: [u8; 6] = ctx.load(offset_of!(EthHdr, dst_addr)).ok()?;
    let src_mac: [u8; 6] = ctx.load(offset_of!(EthHdr, src_addr)).ok()?;
    ctx.store(offset_of!(EthHdr, dst_addr), &src_mac, 0).ok()?;
    ctx.store(offset_of!(EthHdr, src_addr), &dst_mac, 0).ok()?;
    // Addresses and ports swapped.
    ctx.store(ETH_HLEN + F::SADDR, &f.daddr, 0).ok()?;
    ctx.store(ETH_HLEN + F::DADDR, &f.saddr, 0).ok()?;
    ctx.store(l4 + offset_of!(TcpHdr, source), &f.dport, 0).ok()?;
    ctx.store(l4 + offset_of!(TcpHdr, dest), &f.sport, 0).ok()?;
    // seq = 0, ack = their seq + 1.
    let seq: u32 = ctx.load(l4 + offset_of!(TcpHdr, seq)).ok()?;
    let old_ack: u32 = ctx.load(l4 + offset_of!(TcpHdr, ack_seq)).ok()?;
    let ack = (u32::from_be(seq).wrapping_add(1)).to_be();
    replace32(ctx, csum, l4 + offset_of!(TcpHdr, seq), seq, 0)?;
    replace32(ctx, csum, l4 + offset_of!(TcpHdr, ack_seq), old_ack, ack)?;
    // Flags: RST|ACK, keep the data offset.
    let new_word = (hdr_word & 0x00ff) | ((TCP_FLAG_RST | TCP_FLAG_ACK) as u16) << 8;
    ctx.l4_csum_replace(csum, hdr_word as u64, new_word as u64, 2).ok()?;
    ctx.store(word_off, &new_word, 0).ok()?;
    // Window and urgent pointer: zero.
    for off in [offset_of!(TcpHdr, window), offset_of!(TcpHdr, urg_ptr)] {
        let old: u16 = ctx.load(l4 + off).ok()?;
        ctx.l4_csum_replace(csum, old as u64, 0, 2).ok()?;
        ctx.store(l4 + off, &0u16, 0).ok()?;
    }
    // Options (MSS, SACK, timestamps, ...) become NOPs: same length, nothing to trim.
    let nops = 0x0101_0101u32;
    let mut off = TcpHdr::LEN;
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
