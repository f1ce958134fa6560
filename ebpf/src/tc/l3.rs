//! What TC LB needs to know of an IPv4 or IPv6 packet beyond finding its flow
//! (`headers.rs`): which checksums an address change touches, the TTL, the FIB lookup's
//! parameters and the shape of an ICMP error. Offsets come from `network-types`' header
//! structs.
use core::mem::offset_of;

use aya_ebpf::{bindings::bpf_fib_lookup as FibParams, programs::TcContext};
use gardenet_common::*;
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{IpProto, Ipv4Hdr, Ipv6Hdr},
};

use super::{
    end::{end_fields, rewrite_port, End},
    BPF_F_PSEUDO_HDR,
};
use crate::{
    family::{V4, V6},
    headers::{ipv4_ihl, is_l4, linear, Flow, Headers, ETH_HLEN, IP_FRAG_MASK},
};

const ETH_TYPE_OFF: usize = offset_of!(EthHdr, ether_type);
const IP_CSUM_OFF: usize = ETH_HLEN + offset_of!(Ipv4Hdr, check);

/// IPv4 header checksum, source and destination address, then (without options) the ports.
const RUN_LEN: usize = 2 + 4 + 4 + 2 + 2;

/// Writes `addr` and `port` into `end`'s place in a copy of the 14 bytes from the IPv4
/// header checksum to the destination port, and updates that checksum for the address
/// (RFC 1624: HC' = ~(~HC + ~m + m'), one 16-bit word at a time). Words are summed as
/// they are stored; a one's-complement sum comes out the same in either byte order.
#[inline(always)]
fn patch_run(run: &mut [u8; RUN_LEN], end: End, old: u32, addr: u32, port: u16) {
    let hc = u16::from_ne_bytes([run[0], run[1]]);
    let (o, n) = (old.to_ne_bytes(), addr.to_ne_bytes());
    let mut sum = (!hc) as u32;
    sum += (!u16::from_ne_bytes([o[0], o[1]])) as u32 + (!u16::from_ne_bytes([o[2], o[3]])) as u32;
    sum += u16::from_ne_bytes([n[0], n[1]]) as u32 + u16::from_ne_bytes([n[2], n[3]]) as u32;
    // Two folds are always enough (a loop would make the verifier walk every count).
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    run[..2].copy_from_slice(&(!(sum as u16)).to_ne_bytes());
    let p = port.to_ne_bytes();
    match end {
        End::Src => {
            run[2..6].copy_from_slice(&n);
            run[10..12].copy_from_slice(&p);
        }
        End::Dst => {
            run[6..10].copy_from_slice(&n);
            run[12..14].copy_from_slice(&p);
        }
    }
}

/// The layout of a family's IP header, as TC LB uses it.
pub trait L3: Headers {
    /// `AF_INET`/`AF_INET6`, for the FIB lookup.
    const AF: u8;

    /// Writes `addr` and `port` over the address and port of `end` of the flow `f`, keeping
    /// the IPv4 header checksum and the L4 checksum right (the address through the pseudo
    /// header).
    fn rewrite_end(ctx: &TcContext, f: &Flow<Self>, end: End, addr: Self::Addr, port: u16) -> Option<()>;
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

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;
/// Offset of the quoted packet in an ICMP error (type, code, checksum, 4 bytes of data).
const ICMP_QUOTE_OFF: usize = 8;
pub const ICMP_CSUM_OFF: usize = 2;

impl L3 for V4 {
    const AF: u8 = 2;

    #[inline(always)]
    fn rewrite_end(ctx: &TcContext, f: &Flow<V4>, end: End, addr: u32, port: u16) -> Option<()> {
        let ((addr_off, old), (port_off, old_port)) = end_fields(f, end);
        let (csum, fl) = (f.csum_off(), f.csum_flags());
        // Without IP options, the header checksum, both addresses and both ports are 14
        // bytes in a row: the header checksum is updated here and the run is written back
        // with one store, instead of a checksum helper and two stores (~45 ns a call).
        if f.l4 == ETH_HLEN + Ipv4Hdr::LEN {
            if let Some(mut run) = linear::<[u8; RUN_LEN]>(ctx.data(), ctx.data_end(), IP_CSUM_OFF) {
                ctx.l4_csum_replace(csum, old as u64, addr as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
                if port != old_port {
                    ctx.l4_csum_replace(csum, old_port as u64, port as u64, 2 | fl).ok()?;
                }
                patch_run(&mut run, end, old, addr, port);
                return ctx.store(IP_CSUM_OFF, &run, 0).ok();
            }
        }
        ctx.l4_csum_replace(csum, old as u64, addr as u64, BPF_F_PSEUDO_HDR | 4 | fl).ok()?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, addr as u64, 4).ok()?;
        ctx.store(addr_off, &addr, 0).ok()?;
        rewrite_port(ctx, f, port_off, old_port, port)
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
// every changed address goes into it through `l4_csum_replace` with BPF_F_PSEUDO_HDR.

/// Rewrites a 16-byte address into the checksum at `csum`, then stores it. One helper call
/// for the checksum instead of one per 32-bit word: the difference of the two addresses is
/// summed here (as `bpf_csum_diff` would) and handed over as such (field size 0).
#[inline(always)]
fn rewrite_ip6(ctx: &TcContext, csum: usize, flags: u64, off: usize, old: &Ip6, new: &Ip6) -> Option<()> {
    let mut diff: u64 = 0;
    for i in 0..4 {
        diff += (!old[i]) as u64 + new[i] as u64;
    }
    // To a 32-bit one's-complement sum; two folds are always enough.
    diff = (diff & 0xffff_ffff) + (diff >> 32);
    diff = (diff & 0xffff_ffff) + (diff >> 32);
    ctx.l4_csum_replace(csum, 0, diff, flags).ok()?;
    ctx.store(off, new, 0).ok()
}

impl L3 for V6 {
    const AF: u8 = 10;

    #[inline(always)]
    fn rewrite_end(ctx: &TcContext, f: &Flow<V6>, end: End, addr: Ip6, port: u16) -> Option<()> {
        let ((addr_off, old), (port_off, old_port)) = end_fields(f, end);
        rewrite_ip6(ctx, f.csum_off(), BPF_F_PSEUDO_HDR | f.csum_flags(), addr_off, &old, &addr)?;
        rewrite_port(ctx, f, port_off, old_port, port)
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
