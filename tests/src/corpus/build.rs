//! Building Ethernet frames of IPv4/IPv6 packets with TCP, UDP, ICMP or raw payloads, with
//! correct lengths and checksums; every field stays settable so that the generator can make
//! them wrong on purpose afterwards.
use std::net::IpAddr;

/// MAC addresses of the frames: to the node, from its peer.
pub const MAC_NODE: [u8; 6] = [0x02, 0, 0, 0, 0x18, 0x01];
pub const MAC_PEER: [u8; 6] = [0x02, 0, 0, 0, 0x18, 0x02];

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const NEXT_HOP: u8 = 0;
pub const NEXT_ROUTING: u8 = 43;
pub const NEXT_FRAGMENT: u8 = 44;
pub const NEXT_AH: u8 = 51;
pub const NEXT_NONE: u8 = 59;
pub const NEXT_DEST: u8 = 60;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

/// The RFC 1071 sum of `data` as big-endian 16-bit words (an odd last byte padded with zero),
/// not folded.
pub fn sum16(data: &[u8]) -> u64 {
    // Eight bytes at a time (the suite runs unoptimised, also under emulation): the sum of
    // big-endian 32-bit words folds to the same 16-bit sum, as 2^16 = 1 (mod 2^16 - 1).
    let mut s = 0u64;
    let mut wide = data.chunks_exact(8);
    for c in &mut wide {
        let x = u64::from_be_bytes(c.try_into().unwrap());
        s += (x >> 32) + (x & 0xffff_ffff);
    }
    let mut chunks = wide.remainder().chunks_exact(2);
    for c in &mut chunks {
        s += u16::from_be_bytes([c[0], c[1]]) as u64;
    }
    if let [b] = chunks.remainder() {
        s += (*b as u64) << 8;
    }
    s
}

/// Folds a sum (of 16- or 32-bit words) to 16 bits with end-around carry.
pub fn fold(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The sum of the TCP/UDP/ICMPv6 pseudo header (either family).
pub fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, len: u32) -> u64 {
    let a = |ip: IpAddr| match ip {
        IpAddr::V4(a) => sum16(&a.octets()),
        IpAddr::V6(a) => sum16(&a.octets()),
    };
    a(src) + a(dst) + proto as u64 + (len >> 16) as u64 + (len & 0xffff) as u64
}

/// The checksum to store for data whose sum (checksum field zero) is `s`.
pub fn csum_of(s: u64) -> u16 {
    !fold(s)
}

/// A transport layer.
#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        window: u16,
        opts: Vec<u8>,
        payload: Vec<u8>,
    },
    /// `no_csum`: checksum 0 ("none", legal for IPv4 only).
    Udp {
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        no_csum: bool,
    },
    /// ICMP (IPv4) or ICMPv6 (IPv6): type, code, the 4 bytes after the checksum, data.
    Icmp {
        ty: u8,
        code: u8,
        rest: [u8; 4],
        payload: Vec<u8>,
    },
    /// Anything else, taken as is.
    Raw {
        proto: u8,
        bytes: Vec<u8>,
    },
}

impl L4 {
    pub fn proto(&self, v6: bool) -> u8 {
        match self {
            L4::Tcp { .. } => PROTO_TCP,
            L4::Udp { .. } => PROTO_UDP,
            L4::Icmp { .. } if v6 => PROTO_ICMPV6,
            L4::Icmp { .. } => PROTO_ICMP,
            L4::Raw { proto, .. } => *proto,
        }
    }

    /// The transport bytes with their checksum for the pseudo header `src` -> `dst`.
    pub fn bytes(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let v6 = src.is_ipv6();
        let proto = self.proto(v6);
        match self {
            L4::Tcp { sport, dport, seq, ack, flags, window, opts, payload } => {
                let mut o = opts.clone();
                while !o.len().is_multiple_of(4) {
                    o.push(0); // EOL padding
                }
                let doff = (20 + o.len()) / 4;
                let mut b = Vec::with_capacity(20 + o.len() + payload.len());
                b.extend(sport.to_be_bytes());
                b.extend(dport.to_be_bytes());
                b.extend(seq.to_be_bytes());
                b.extend(ack.to_be_bytes());
                b.push(((doff & 0xf) as u8) << 4);
                b.push(*flags);
                b.extend(window.to_be_bytes());
                b.extend([0, 0, 0, 0]); // checksum, urgent pointer
                b.extend(o);
                b.extend(payload);
                let c = csum_of(pseudo_sum(src, dst, proto, b.len() as u32) + sum16(&b));
                b[16..18].copy_from_slice(&c.to_be_bytes());
                b
            }
            L4::Udp { sport, dport, payload, no_csum } => {
                let len = 8 + payload.len();
                let mut b = Vec::with_capacity(len);
                b.extend(sport.to_be_bytes());
                b.extend(dport.to_be_bytes());
                b.extend((len.min(0xffff) as u16).to_be_bytes());
                b.extend([0, 0]);
                b.extend(payload);
                if !no_csum {
                    let mut c = csum_of(pseudo_sum(src, dst, proto, len as u32) + sum16(&b));
                    if c == 0 {
                        c = 0xffff; // RFC 768: a computed zero is sent as all ones
                    }
                    b[6..8].copy_from_slice(&c.to_be_bytes());
                }
                b
            }
            L4::Icmp { ty, code, rest, payload } => {
                let mut b = vec![*ty, *code, 0, 0];
                b.extend(rest);
                b.extend(payload);
                let pseudo = if v6 { pseudo_sum(src, dst, proto, b.len() as u32) } else { 0 };
                let c = csum_of(pseudo + sum16(&b));
                b[2..4].copy_from_slice(&c.to_be_bytes());
                b
            }
            L4::Raw { bytes, .. } => bytes.clone(),
        }
    }

    pub fn ports(&self) -> Option<(u16, u16)> {
        match self {
            L4::Tcp { sport, dport, .. } | L4::Udp { sport, dport, .. } => Some((*sport, *dport)),
            _ => None,
        }
    }
}

/// An IPv6 extension header.
#[derive(Clone, Debug)]
pub enum Ext {
    /// Hop-by-hop (0) or destination options (60) with these option bytes (padded with PadN).
    Opts { kind: u8, opts: Vec<u8> },
    /// Routing header: type, segments left, addresses.
    Routing { ty: u8, left: u8, addrs: Vec<[u8; 16]> },
    /// Fragment header: offset in 8-byte units, more fragments, identification.
    Fragment { offset: u16, more: bool, id: u32 },
    /// Any header as raw bytes after the next-header byte (length byte included, unchecked).
    Raw { kind: u8, rest: Vec<u8> },
}

impl Ext {
    pub fn kind(&self) -> u8 {
        match self {
            Ext::Opts { kind, .. } | Ext::Raw { kind, .. } => *kind,
            Ext::Routing { .. } => NEXT_ROUTING,
            Ext::Fragment { .. } => NEXT_FRAGMENT,
        }
    }

    fn bytes(&self, next: u8) -> Vec<u8> {
        match self {
            Ext::Opts { opts, .. } => {
                let mut b = vec![next, 0];
                b.extend(opts);
                let pad = (8 - b.len() % 8) % 8;
                match pad {
                    0 => {}
                    1 => b.push(0), // Pad1
                    n => {
                        b.push(1); // PadN
                        b.push((n - 2) as u8);
                        b.extend(std::iter::repeat_n(0, n - 2));
                    }
                }
                b[1] = (b.len() / 8 - 1) as u8;
                b
            }
            Ext::Routing { ty, left, addrs } => {
                let mut b = vec![next, (addrs.len() * 2) as u8, *ty, *left, 0, 0, 0, 0];
                for a in addrs {
                    b.extend(a);
                }
                b
            }
            Ext::Fragment { offset, more, id } => {
                let mut b = vec![next, 0];
                b.extend(((offset << 3) | *more as u16).to_be_bytes());
                b.extend(id.to_be_bytes());
                b
            }
            Ext::Raw { rest, .. } => {
                let mut b = vec![next];
                b.extend(rest);
                b
            }
        }
    }
}

/// A packet: IP header fields, IPv4 options or IPv6 extension headers, transport.
#[derive(Clone, Debug)]
pub struct Spec {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// TTL or hop limit.
    pub ttl: u8,
    pub tos: u8,
    /// IPv4 identification.
    pub id: u16,
    /// IPv4 flags and fragment offset (DF 0x4000, MF 0x2000, offset in 8-byte units).
    pub frag: u16,
    /// IPv4 options (padded with EOL to a multiple of 4).
    pub ip_opts: Vec<u8>,
    /// IPv6 extension headers, in order.
    pub exts: Vec<Ext>,
    pub l4: L4,
}

impl Spec {
    pub fn new(src: IpAddr, dst: IpAddr, l4: L4) -> Self {
        assert_eq!(src.is_ipv6(), dst.is_ipv6(), "one family");
        Spec { src, dst, ttl: 64, tos: 0, id: 0x1234, frag: 0, ip_opts: Vec::new(), exts: Vec::new(), l4 }
    }

    pub fn v6(&self) -> bool {
        self.src.is_ipv6()
    }

    /// The IP packet (no Ethernet header).
    pub fn ip_bytes(&self) -> Vec<u8> {
        let l4 = self.l4.bytes(self.src, self.dst);
        let proto = self.l4.proto(self.v6());
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut o = self.ip_opts.clone();
                while !o.len().is_multiple_of(4) {
                    o.push(0);
                }
                let hl = 20 + o.len();
                let tot = hl + l4.len();
                let mut b = Vec::with_capacity(tot);
                b.push(0x40 | ((hl / 4) as u8 & 0xf));
                b.push(self.tos);
                b.extend((tot.min(0xffff) as u16).to_be_bytes());
                b.extend(self.id.to_be_bytes());
                b.extend(self.frag.to_be_bytes());
                b.push(self.ttl);
                b.push(proto);
                b.extend([0, 0]);
                b.extend(s.octets());
                b.extend(d.octets());
                b.extend(o);
                let c = csum_of(sum16(&b));
                b[10..12].copy_from_slice(&c.to_be_bytes());
                b.extend(l4);
                b
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut exts = Vec::new();
                for (i, e) in self.exts.iter().enumerate() {
                    let next = self.exts.get(i + 1).map(Ext::kind).unwrap_or(proto);
                    exts.extend(e.bytes(next));
                }
                let first = self.exts.first().map(Ext::kind).unwrap_or(proto);
                let plen = exts.len() + l4.len();
                let mut b = Vec::with_capacity(40 + plen);
                b.push(0x60 | (self.tos >> 4));
                b.extend([self.tos << 4, 0, 0]);
                b.extend((plen.min(0xffff) as u16).to_be_bytes());
                b.push(first);
                b.push(self.ttl);
                b.extend(s.octets());
                b.extend(d.octets());
                b.extend(exts);
                b.extend(l4);
                b
            }
            _ => unreachable!("one family"),
        }
    }

    /// The Ethernet frame.
    pub fn build(&self) -> Vec<u8> {
        let ty = if self.v6() { ETH_P_IPV6 } else { ETH_P_IP };
        frame(ty, &self.ip_bytes())
    }

    /// Offset of the transport header in the frame.
    pub fn l4_offset(&self) -> usize {
        if self.v6() {
            ETH_HLEN + 40 + self.exts.iter().map(|e| e.bytes(0).len()).sum::<usize>()
        } else {
            ETH_HLEN + 20 + self.ip_opts.len().div_ceil(4) * 4
        }
    }
}

/// An Ethernet frame to the node.
pub fn frame(ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(ETH_HLEN + payload.len());
    b.extend(MAC_NODE);
    b.extend(MAC_PEER);
    b.extend(ethertype.to_be_bytes());
    b.extend(payload);
    b
}

/// Typical options of a SYN (MSS, SACK permitted, timestamps, window scale): 20 bytes.
pub fn syn_options(ts: u32) -> Vec<u8> {
    let mut o = vec![2, 4, 0x05, 0xb4, 4, 2, 8, 10];
    o.extend(ts.to_be_bytes());
    o.extend([0, 0, 0, 0, 1, 3, 3, 7]);
    o
}

/// Recomputes the IPv4 header checksum of a frame in place (for mutations that change
/// header fields but want the header itself to stay valid).
pub fn fix_ipv4_csum(frame: &mut [u8]) {
    if frame.len() < ETH_HLEN + 20 || frame[12..14] != ETH_P_IP.to_be_bytes() {
        return;
    }
    let hl = ((frame[ETH_HLEN] & 0xf) as usize) * 4;
    if hl < 20 || frame.len() < ETH_HLEN + hl {
        return;
    }
    frame[ETH_HLEN + 10] = 0;
    frame[ETH_HLEN + 11] = 0;
    let c = csum_of(sum16(&frame[ETH_HLEN..ETH_HLEN + hl]));
    frame[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c.to_be_bytes());
}
