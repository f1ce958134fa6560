//! Finding a TCP/UDP flow in an Ethernet frame, once for both families and for both hooks
//! that read packets (XDP and TC). Offsets come from `network-types`' header structs.
use core::mem::{offset_of, size_of};

use gardenet_common::*;
use network_types::{
    eth::EthHdr,
    ip::{IpProto, Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};

use crate::family::{Family, V4, V6};

pub const ETH_HLEN: usize = EthHdr::LEN;
const ETH_TYPE_OFF: usize = offset_of!(EthHdr, ether_type);

/// The TCP header's flags byte (after the data offset byte) and its flags.
pub const TCP_FLAGS_OFF: usize = offset_of!(TcpHdr, window) - 1;
pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// Fragments: only the first carries ports; all of them are left to the stack.
pub const IP_FRAG_MASK: u16 = 0x3fff;
/// IPv6 extension headers TC walks to find TCP/UDP (XDP walks none: it leaves such packets
/// to TC).
pub const IP6_MAX_EXT: usize = 3;

/// Reads of a packet's bytes at an offset from the Ethernet header.
pub trait Bytes {
    fn load<T: Copy>(&self, off: usize) -> Option<T>;
}

/// A read from the linear packet data [`start`, `end`), if `off` lies in it.
#[inline(always)]
pub fn linear<T: Copy>(start: usize, end: usize, off: usize) -> Option<T> {
    let p = start + off;
    // At least 2: LLVM turns `p + 1 <= end` into `p < end`, which verifiers do not take as
    // a proof that p[0] is in range.
    let need = if size_of::<T>() < 2 { 2 } else { size_of::<T>() };
    if p + need > end {
        return None;
    }
    // SAFETY: [p, p + size) lies within the linear data, checked just above (the verifier
    // sees the same check against data_end).
    Some(unsafe { core::ptr::read_unaligned(p as *const T) })
}

/// A TCP or UDP packet's flow, as parsed by [`Headers::parse`].
pub struct Flow<F: Family> {
    pub saddr: F::Addr,
    pub daddr: F::Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// Offset of the L4 header (after any IPv4 options or IPv6 extension headers).
    pub l4: usize,
    pub tcp_flags: u8,
}

impl<F: Family> Flow<F> {
    /// A SYN without ACK: the first packet of a TCP connection.
    #[inline(always)]
    pub fn fresh_syn(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }
}

/// The packet's EtherType, as stored (big endian, as `EtherType`'s values are).
#[inline(always)]
pub fn ether_type(b: &impl Bytes) -> Option<u16> {
    b.load::<u16>(ETH_TYPE_OFF)
}

#[inline(always)]
pub fn is_l4(proto: u8) -> bool {
    proto == PROTO_TCP || proto == PROTO_UDP
}

/// IPv4's header length from the version/IHL byte, or `None` for anything but a valid IPv4
/// header.
#[inline(always)]
pub fn ipv4_ihl(vihl: u8) -> Option<usize> {
    let ihl = ((vihl & 0x0f) as usize) * 4;
    (vihl >> 4 == 4 && ihl >= Ipv4Hdr::LEN).then_some(ihl & 0x3c)
}

#[inline(always)]
fn flow<F: Family>(b: &impl Bytes, proto: u8, l4: usize, addrs: (usize, usize)) -> Option<Flow<F>> {
    let tcp_flags = if proto == PROTO_TCP { b.load::<u8>(l4 + TCP_FLAGS_OFF)? } else { 0 };
    let (saddr, daddr) = (b.load(ETH_HLEN + addrs.0)?, b.load(ETH_HLEN + addrs.1)?);
    Some(Flow { saddr, daddr, sport: b.load(l4 + offset_of!(TcpHdr, source))?, dport: b.load(l4 + offset_of!(TcpHdr, dest))?, proto, l4, tcp_flags })
}

/// The layout of a family's IP header.
pub trait Headers: Family {
    /// Offsets of the source and destination address within the IP header.
    const SADDR: usize;
    const DADDR: usize;

    /// A TCP or UDP flow of this family, or `None` (another protocol, a fragment, headers
    /// this program does not walk; IPv6: more than `max_ext` extension headers). IPv4
    /// checks the EtherType; IPv6 expects the caller to.
    fn parse(b: &impl Bytes, max_ext: usize) -> Option<Flow<Self>>;
}

impl Headers for V4 {
    const SADDR: usize = offset_of!(Ipv4Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv4Hdr, dst_addr);

    #[inline(always)]
    fn parse(b: &impl Bytes, _max_ext: usize) -> Option<Flow<V4>> {
        if ether_type(b)? != network_types::eth::EtherType::Ipv4 as u16 {
            return None;
        }
        let ihl = ipv4_ihl(b.load(ETH_HLEN)?)?;
        if u16::from_be(b.load::<u16>(ETH_HLEN + offset_of!(Ipv4Hdr, frags))?) & IP_FRAG_MASK != 0 {
            return None;
        }
        let proto: u8 = b.load(ETH_HLEN + offset_of!(Ipv4Hdr, proto))?;
        if !is_l4(proto) {
            return None;
        }
        flow(b, proto, ETH_HLEN + ihl, (Self::SADDR, Self::DADDR))
    }
}

/// Hop-by-hop and destination options headers (up to `max_ext`) are skipped to find TCP
/// or UDP; fragments, routing headers (the destination is then not the final one) and
/// anything else are not parsed, as IPv4 fragments are not.
impl Headers for V6 {
    const SADDR: usize = offset_of!(Ipv6Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv6Hdr, dst_addr);

    #[inline(always)]
    fn parse(b: &impl Bytes, max_ext: usize) -> Option<Flow<V6>> {
        let v: u8 = b.load(ETH_HLEN)?;
        if v >> 4 != 6 {
            return None;
        }
        let mut proto: u8 = b.load(ETH_HLEN + offset_of!(Ipv6Hdr, next_hdr))?;
        let mut l4 = ETH_HLEN + Ipv6Hdr::LEN;
        for i in 0..max_ext {
            // Hop-by-hop options may only come first (RFC 8200 4.1; the stack drops a packet
            // with them anywhere else, so it must not be translated either: found by the
            // packet corpus).
            if proto != IpProto::Ipv6Opts as u8 && !(proto == IpProto::HopOpt as u8 && i == 0) {
                break;
            }
            // Both: next header, then the length in 8-octet units not counting the first 8.
            let next: u8 = b.load(l4)?;
            let len: u8 = b.load(l4 + 1)?;
            proto = next;
            l4 += (len as usize + 1) * 8;
        }
        if !is_l4(proto) {
            return None;
        }
        flow(b, proto, l4, (Self::SADDR, Self::DADDR))
    }
}
