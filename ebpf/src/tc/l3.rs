//! What TC LB needs to know of an IPv4 or IPv6 packet, and nothing else: where the
//! addresses are, how a TCP/UDP flow is found, which checksums an address change touches,
//! the TTL, the FIB lookup's parameters and the shape of an ICMP error. Offsets come from
//! `network-types`' header structs.
use core::mem::offset_of;

use aya_ebpf::{bindings::bpf_fib_lookup as FibParams, programs::TcContext};
use gardenet_common::*;
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{IpProto, Ipv4Hdr, Ipv6Hdr},
};

use super::{Flow, Hdr, BPF_F_PSEUDO_HDR, TCP_FLAGS_OFF};
use crate::family::{Family, V4, V6};

pub const ETH_HLEN: usize = EthHdr::LEN;
const ETH_TYPE_OFF: usize = offset_of!(EthHdr, ether_type);
const IP_CSUM_OFF: usize = ETH_HLEN + offset_of!(Ipv4Hdr, check);

/// The layout of a family's IP header, as TC LB uses it.
pub trait L3: Family {
    /// Offsets of the source and destination address within the IP header.
    const SADDR: usize;
    const DADDR: usize;
    /// `AF_INET`/`AF_INET6`, for the FIB lookup.
    const AF: u8;

    /// A TCP or UDP flow of this family, or `None` (another family or protocol, a fragment,
    /// headers this program does not walk).
    fn parse(h: &Hdr) -> Option<Flow<Self>>;
    /// Writes address `new` over `old` at packet offset `off`, keeping the IPv4 header
    /// checksum and the L4 checksum at `csum` (through the pseudo header) right.
    fn rewrite_addr(ctx: &TcContext, csum: usize, csum_flags: u64, off: usize, old: Self::Addr, new: Self::Addr) -> Option<()>;
    /// Redirected packets skip the stack's forwarding, so the TTL/hop limit is decremented
    /// here; `None` for a packet that would expire (it is not sent on).
    fn decrement_ttl(ctx: &TcContext) -> Option<()>;
    fn fib_set(p: &mut FibParams, src: Self::Addr, dst: Self::Addr);
    fn fib_src(p: &FibParams) -> Self::Addr;
    /// Whether the IP packet ends `len` bytes after `l4` (IPv6: without extension headers).
    fn ends_at(ctx: &TcContext, l4: usize, len: usize) -> Option<bool>;

    /// Where an ICMP error's quoted packet is, if `ctx` holds one of the types worth
    /// translating (destination unreachable, packet too big, time exceeded) about TCP/UDP.
    fn icmp_error(ctx: &TcContext) -> Option<Quote>;
    /// Writes `new` over the quoted address `old` at `off`, keeping the ICMP checksum at
    /// `icmp_csum` (and the quoted IPv4 header's checksum) right.
    fn rewrite_quoted(ctx: &TcContext, q: &Quote, off: usize, old: Self::Addr, new: Self::Addr) -> Option<()>;
    /// Writes `new` over the outer destination `old` of an ICMP error.
    fn rewrite_outer_dst(ctx: &TcContext, q: &Quote, old: Self::Addr, new: Self::Addr) -> Option<()>;
}

/// An ICMP error's offsets: the ICMP header, the quoted IP header and its L4 header.
pub struct Quote {
    pub icmp: usize,
    pub inner: usize,
    pub il4: usize,
    pub iproto: u8,
}

/// The packet's EtherType, as stored (big endian).
#[inline(always)]
pub fn ether_type(h: &Hdr) -> Option<u16> {
    h.load::<u16>(ETH_TYPE_OFF)
}

#[inline(always)]
fn is_l4(proto: u8) -> bool {
    proto == PROTO_TCP || proto == PROTO_UDP
}

#[inline(always)]
fn tcp_flags(h: &Hdr, proto: u8, l4: usize) -> Option<u8> {
    if proto == PROTO_TCP {
        h.load::<u8>(l4 + TCP_FLAGS_OFF)
    } else {
        Some(0)
    }
}

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;
/// Offset of the quoted packet in an ICMP error (type, code, checksum, 4 bytes of data).
const ICMP_QUOTE_OFF: usize = 8;
pub const ICMP_CSUM_OFF: usize = 2;

/// IPv4's header length from the version/IHL byte, or `None` for anything but a valid IPv4
/// header.
#[inline(always)]
fn ipv4_ihl(vihl: u8) -> Option<usize> {
    let ihl = ((vihl & 0x0f) as usize) * 4;
    (vihl >> 4 == 4 && ihl >= Ipv4Hdr::LEN).then_some(ihl & 0x3c)
}

/// Fragments: only the first carries ports; all of them are left to the stack.
const IP_FRAG_MASK: u16 = 0x3fff;

impl L3 for V4 {
    const SADDR: usize = offset_of!(Ipv4Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv4Hdr, dst_addr);
    const AF: u8 = 2;

    #[inline(always)]
    fn parse(h: &Hdr) -> Option<Flow<V4>> {
        if ether_type(h)? != EtherType::Ipv4 as u16 {
            return None;
        }
        let ihl = ipv4_ihl(h.load(ETH_HLEN)?)?;
        if u16::from_be(h.load::<u16>(ETH_HLEN + offset_of!(Ipv4Hdr, frags))?) & IP_FRAG_MASK != 0 {
            return None;
        }
        let proto: u8 = h.load(ETH_HLEN + offset_of!(Ipv4Hdr, proto))?;
        if !is_l4(proto) {
            return None;
        }
        let l4 = ETH_HLEN + ihl;
        let tcp_flags = tcp_flags(h, proto, l4)?;
        let (saddr, daddr) = (h.load(ETH_HLEN + Self::SADDR)?, h.load(ETH_HLEN + Self::DADDR)?);
        Some(Flow { saddr, daddr, sport: h.load(l4)?, dport: h.load(l4 + 2)?, proto, l4, tcp_flags })
    }

    #[inline(always)]
    fn rewrite_addr(ctx: &TcContext, csum: usize, csum_flags: u64, off: usize, old: u32, new: u32) -> Option<()> {
        ctx.l4_csum_replace(csum, old as u64, new as u64, BPF_F_PSEUDO_HDR | 4 | csum_flags).ok()?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4).ok()?;
        ctx.store(off, &new, 0).ok()
    }

    #[inline(always)]
    fn decrement_ttl(ctx: &TcContext) -> Option<()> {
        const TTL_OFF: usize = ETH_HLEN + offset_of!(Ipv4Hdr, ttl);
        let old: u16 = ctx.load(TTL_OFF).ok()?; // TTL and protocol, as stored
        let ttl: u8 = ctx.load(TTL_OFF).ok()?;
        if ttl <= 1 {
            return None;
        }
        ctx.store(TTL_OFF, &(ttl - 1), 0).ok()?;
        let new: u16 = ctx.load(TTL_OFF).ok()?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 2).ok()
    }

    #[inline(always)]
    fn fib_set(p: &mut FibParams, src: u32, dst: u32) {
        p.__bindgen_anon_3.ipv4_src = src;
        p.__bindgen_anon_4.ipv4_dst = dst;
    }

    #[inline(always)]
    fn fib_src(p: &FibParams) -> u32 {
        unsafe { p.__bindgen_anon_3.ipv4_src }
    }

    #[inline(always)]
    fn ends_at(ctx: &TcContext, l4: usize, len: usize) -> Option<bool> {
        let tot_len = u16::from_be(ctx.load::<u16>(ETH_HLEN + offset_of!(Ipv4Hdr, tot_len)).ok()?) as usize;
        Some(tot_len == (l4 - ETH_HLEN) + len)
    }

    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<Quote> {
        if ctx.load::<u16>(ETH_TYPE_OFF).ok()? != EtherType::Ipv4 as u16 {
            return None;
        }
        let ihl = ipv4_ihl(ctx.load(ETH_HLEN).ok()?)?;
        if ctx.load::<u8>(ETH_HLEN + offset_of!(Ipv4Hdr, proto)).ok()? != IpProto::Icmp as u8 {
            return None;
        }
        if u16::from_be(ctx.load::<u16>(ETH_HLEN + offset_of!(Ipv4Hdr, frags)).ok()?) & IP_FRAG_MASK != 0 {
            return None;
        }
        let icmp = ETH_HLEN + ihl;
        let ty: u8 = ctx.load(icmp).ok()?;
        if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
            return None;
        }
        let inner = icmp + ICMP_QUOTE_OFF;
        let iihl = ipv4_ihl(ctx.load(inner).ok()?)?;
        let iproto: u8 = ctx.load(inner + offset_of!(Ipv4Hdr, proto)).ok()?;
        is_l4(iproto).then_some(Quote { icmp, inner, il4: inner + iihl, iproto })
    }

    /// Also keeps the quoted IPv4 header's checksum right (an ICMP checksum covers it).
    #[inline(always)]
    fn rewrite_quoted(ctx: &TcContext, q: &Quote, off: usize, old: u32, new: u32) -> Option<()> {
        let icmp_csum = q.icmp + ICMP_CSUM_OFF;
        let ip_csum = q.inner + offset_of!(Ipv4Hdr, check);
        let old_sum: u16 = ctx.load(ip_csum).ok()?;
        ctx.l3_csum_replace(ip_csum, old as u64, new as u64, 4).ok()?;
        let new_sum: u16 = ctx.load(ip_csum).ok()?;
        ctx.store(off, &new, 0).ok()?;
        ctx.l4_csum_replace(icmp_csum, old as u64, new as u64, 4).ok()?;
        ctx.l4_csum_replace(icmp_csum, old_sum as u64, new_sum as u64, 2).ok()
    }

    /// ICMP's checksum has no pseudo header: only the IP header checksum changes.
    #[inline(always)]
    fn rewrite_outer_dst(ctx: &TcContext, _q: &Quote, old: u32, new: u32) -> Option<()> {
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4).ok()?;
        ctx.store(ETH_HLEN + Self::DADDR, &new, 0).ok()
    }
}

// IPv6: no L3 checksum; the L4 checksum covers the addresses through the pseudo header, so
// every changed address word goes through `l4_csum_replace` with BPF_F_PSEUDO_HDR.
// Hop-by-hop and destination options headers (up to `IP6_MAX_EXT`) are skipped to find TCP
// or UDP; fragments, routing headers (the destination is then not the final one) and
// anything else pass untouched, as IPv4 fragments do.

const IP6_MAX_EXT: usize = 3;

/// Rewrites a 16-byte address word by word into the checksum at `csum`, then stores it.
#[inline(always)]
fn rewrite_ip6(ctx: &TcContext, csum: usize, flags: u64, off: usize, old: &Ip6, new: &Ip6) -> Option<()> {
    for i in 0..4 {
        ctx.l4_csum_replace(csum, old[i] as u64, new[i] as u64, flags | 4).ok()?;
    }
    ctx.store(off, new, 0).ok()
}

impl L3 for V6 {
    const SADDR: usize = offset_of!(Ipv6Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv6Hdr, dst_addr);
    const AF: u8 = 10;

    #[inline(always)]
    fn parse(h: &Hdr) -> Option<Flow<V6>> {
        let v: u8 = h.load(ETH_HLEN)?;
        if v >> 4 != 6 {
            return None;
        }
        let mut proto: u8 = h.load(ETH_HLEN + offset_of!(Ipv6Hdr, next_hdr))?;
        let mut l4 = ETH_HLEN + Ipv6Hdr::LEN;
        for i in 0..IP6_MAX_EXT {
            // Hop-by-hop options may only come first (RFC 8200 4.1; the stack drops a packet
            // with them anywhere else, so it must not be translated either: found by the
            // packet corpus).
            if proto != IpProto::Ipv6Opts as u8 && !(proto == IpProto::HopOpt as u8 && i == 0) {
                break;
            }
            // Both: next header, then the length in 8-octet units not counting the first 8.
            let next: u8 = h.load(l4)?;
            let len: u8 = h.load(l4 + 1)?;
            proto = next;
            l4 += (len as usize + 1) * 8;
        }
        if !is_l4(proto) {
            return None;
        }
        let tcp_flags = tcp_flags(h, proto, l4)?;
        let (saddr, daddr) = (h.load(ETH_HLEN + Self::SADDR)?, h.load(ETH_HLEN + Self::DADDR)?);
        Some(Flow { saddr, daddr, sport: h.load(l4)?, dport: h.load(l4 + 2)?, proto, l4, tcp_flags })
    }

    #[inline(always)]
    fn rewrite_addr(ctx: &TcContext, csum: usize, csum_flags: u64, off: usize, old: Ip6, new: Ip6) -> Option<()> {
        rewrite_ip6(ctx, csum, BPF_F_PSEUDO_HDR | csum_flags, off, &old, &new)
    }

    /// No header checksum in IPv6.
    #[inline(always)]
    fn decrement_ttl(ctx: &TcContext) -> Option<()> {
        const HOP_OFF: usize = ETH_HLEN + offset_of!(Ipv6Hdr, hop_limit);
        let hops: u8 = ctx.load(HOP_OFF).ok()?;
        if hops <= 1 {
            return None;
        }
        ctx.store(HOP_OFF, &(hops - 1), 0).ok()
    }

    #[inline(always)]
    fn fib_set(p: &mut FibParams, src: Ip6, dst: Ip6) {
        p.__bindgen_anon_3.ipv6_src = src;
        p.__bindgen_anon_4.ipv6_dst = dst;
    }

    #[inline(always)]
    fn fib_src(p: &FibParams) -> Ip6 {
        unsafe { p.__bindgen_anon_3.ipv6_src }
    }

    /// The payload length counts extension headers too: a packet with any does not match
    /// (only a SYN without them is answered).
    #[inline(always)]
    fn ends_at(ctx: &TcContext, _l4: usize, len: usize) -> Option<bool> {
        let plen = u16::from_be(ctx.load::<u16>(ETH_HLEN + offset_of!(Ipv6Hdr, payload_len)).ok()?) as usize;
        Some(plen == len)
    }

    /// The error directly after the fixed header.
    #[inline(always)]
    fn icmp_error(ctx: &TcContext) -> Option<Quote> {
        let v: u8 = ctx.load(ETH_HLEN).ok()?;
        if v >> 4 != 6 || ctx.load::<u8>(ETH_HLEN + offset_of!(Ipv6Hdr, next_hdr)).ok()? != IpProto::Ipv6Icmp as u8 {
            return None;
        }
        let icmp = ETH_HLEN + Ipv6Hdr::LEN;
        let ty: u8 = ctx.load(icmp).ok()?;
        if ty != ICMPV6_DEST_UNREACH && ty != ICMPV6_PKT_TOOBIG && ty != ICMPV6_TIME_EXCEED {
            return None;
        }
        let inner = icmp + ICMP_QUOTE_OFF;
        // The quoted packet must be IPv6 (the corpus found errors quoting an IPv4 header
        // translated as if it were one).
        if ctx.load::<u8>(inner).ok()? >> 4 != 6 {
            return None;
        }
        let iproto: u8 = ctx.load(inner + offset_of!(Ipv6Hdr, next_hdr)).ok()?;
        is_l4(iproto).then_some(Quote { icmp, inner, il4: inner + Ipv6Hdr::LEN, iproto })
    }

    #[inline(always)]
    fn rewrite_quoted(ctx: &TcContext, q: &Quote, off: usize, old: Ip6, new: Ip6) -> Option<()> {
        rewrite_ip6(ctx, q.icmp + ICMP_CSUM_OFF, 0, off, &old, &new)
    }

    /// ICMPv6's checksum covers a pseudo header: the outer destination is part of it.
    #[inline(always)]
    fn rewrite_outer_dst(ctx: &TcContext, q: &Quote, old: Ip6, new: Ip6) -> Option<()> {
        rewrite_ip6(ctx, q.icmp + ICMP_CSUM_OFF, BPF_F_PSEUDO_HDR, ETH_HLEN + Self::DADDR, &old, &new)
    }
}
