//! The judge of one program run: reads the packet before and after with etherparse (and raw
//! offsets it found), and accepts exactly these outcomes:
//!
//! - passed untouched (TCX_NEXT / XDP_PASS, identical bytes);
//! - dropped by design (no backends, ClusterIP port not served, unallocated service address,
//!   source NAT impossible), the reason named by the maps;
//! - answered by design: a SYN to a frontend without backends turned into the RST+ACK a
//!   closed port sends, redirected back;
//! - translated as the maps say: destination to the backend the flow's conntrack entry names
//!   (which must be a backend of that frontend), a backend's reply back to its frontend, an
//!   ICMP error about a translated flow rewritten for its backend, source NAT; everything else
//!   byte for byte as it was.
//!
//! Checksums: the program updates them incrementally, so each one's residual (the one's
//! complement sum over what it covers, checksum included: 0xffff when valid) must be the same
//! before and after; a valid one stays valid and a broken one stays broken by the same
//! amount. A well-formed input (etherparse parses it strictly, checksums valid) must also
//! give a well-formed output.
use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use etherparse::{Ipv4HeaderSlice, Ipv6ExtensionsSlice, Ipv6HeaderSlice, NetSlice, SlicedPacket, TransportSlice};
use gardenet_common::{
    CT_DIR_FORWARD, CT_DIR_REPLY, CT_DIR_SNAT_FWD, CT_DIR_SNAT_REPLY, CT_FLAG_SNAT, SNAT_PORT_COUNT, SNAT_PORT_MIN, SVC_FLAG_DROP, SVC_FLAG_SNAT_REMOTE,
    SVC_FLAG_SOURCE_RANGES,
};

use super::build::*;

/// The programs under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Prog {
    TcIngress,
    TcEgress,
    Xdp,
}

impl Prog {
    pub const ALL: [Prog; 3] = [Prog::TcIngress, Prog::TcEgress, Prog::Xdp];

    pub fn name(self) -> &'static str {
        match self {
            Prog::TcIngress => "gn_tc_ingress",
            Prog::TcEgress => "gn_tc_egress",
            Prog::Xdp => "gn_xdp",
        }
    }
}

/// What happened to one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// The kernel refuses to run the program: shorter than an Ethernet header, or (TC) an
    /// IPv4/IPv6 EtherType with less than an IP header after it (`bpf_prog_test_run_skb`,
    /// since a 2024 fix backported to the stable kernels).
    Short,
    Passed,
    Dropped,
    /// Answered with a RST+ACK (SYN to a frontend without backends).
    Rst,
    Dnat,
    RevNat,
    IcmpRevNat,
    /// DNAT plus source NAT to a backend on another node.
    Snat,
    /// A source-NATed flow's reply back to its client.
    SnatRev,
}

impl Kind {
    pub const ALL: [Kind; 9] = [Kind::Short, Kind::Passed, Kind::Dropped, Kind::Rst, Kind::Dnat, Kind::RevNat, Kind::IcmpRevNat, Kind::Snat, Kind::SnatRev];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Short => "refused by the kernel",
            Kind::Passed => "passed untouched",
            Kind::Dropped => "dropped by design",
            Kind::Rst => "answered (RST)",
            Kind::Dnat => "DNAT to backend",
            Kind::RevNat => "reverse NAT",
            Kind::IcmpRevNat => "ICMP error to backend",
            Kind::Snat => "DNAT + source NAT",
            Kind::SnatRev => "source NAT reversed",
        }
    }
}

/// A set of outcomes (what a generated packet may lead to).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Want(u16);

impl Want {
    pub const ANY: Want = Want(u16::MAX);

    pub fn of(kinds: &[Kind]) -> Want {
        Want(kinds.iter().fold(0, |m, k| m | 1 << *k as u16))
    }

    pub fn has(self, k: Kind) -> bool {
        self.0 & (1 << k as u16) != 0
    }

    /// The same set with `also` added if it has `kind`.
    pub fn also(self, kind: Kind, also: Kind) -> Want {
        if self.has(kind) {
            Want(self.0 | 1 << also as u16)
        } else {
            self
        }
    }

    /// The same set with `from` replaced by `to` (if present).
    pub fn swap(self, from: Kind, to: Kind) -> Want {
        if self == Want::ANY || !self.has(from) {
            return self;
        }
        Want((self.0 & !(1 << from as u16)) | 1 << to as u16)
    }
}

impl fmt::Debug for Want {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Want::ANY {
            return write!(f, "any");
        }
        let names: Vec<&str> = Kind::ALL.iter().filter(|k| self.has(**k)).map(|k| k.name()).collect();
        write!(f, "{}", names.join(" | "))
    }
}

/// A backend as the maps name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
    pub remote: bool,
}

/// A frontend's master entry and its backends.
#[derive(Clone, Debug, Default)]
pub struct Frontend {
    pub flags: u16,
    pub backends: Vec<Backend>,
}

/// `GN_SVCNET` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    Range,
    ClusterIp,
    Foreign,
}

/// What the service maps say, in the checker's own shape.
#[derive(Clone, Debug, Default)]
pub struct Maps {
    /// (address, port, protocol) of each frontend (scope "all").
    pub frontends: HashMap<(IpAddr, u16, u8), Frontend>,
    /// Service ranges and ClusterIPs: prefix, length, what.
    pub nets: Vec<(IpAddr, u8, Net)>,
}

impl Maps {
    pub fn frontend(&self, addr: IpAddr, port: u16, proto: u8) -> Option<&Frontend> {
        self.frontends.get(&(addr, port, proto))
    }

    /// Longest-prefix match in the service nets.
    pub fn net_of(&self, addr: IpAddr) -> Option<Net> {
        let bits = |a: IpAddr| -> (u128, u8) {
            match a {
                IpAddr::V4(a) => (u32::from(a) as u128, 32),
                IpAddr::V6(a) => (u128::from(a), 128),
            }
        };
        let (a, width) = bits(addr);
        let mut best: Option<(u8, Net)> = None;
        for (p, len, what) in &self.nets {
            let (pa, pw) = bits(*p);
            if pw != width || *len > width {
                continue;
            }
            let shift = (width - len) as u32;
            let same = if *len == 0 { true } else { a.checked_shr(shift).unwrap_or(0) == pa.checked_shr(shift).unwrap_or(0) };
            if same && best.is_none_or(|(l, _)| *len > l) {
                best = Some((*len, *what));
            }
        }
        best.map(|(_, w)| w)
    }
}

/// A conntrack key (either family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
}

/// A conntrack value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtVal {
    pub addr: IpAddr,
    pub port: u16,
    pub flags: u16,
}

/// Conntrack as the checker reads it, after the run.
pub trait Conntrack {
    fn get(&self, key: &CtKey) -> Option<CtVal>;
}

impl Conntrack for HashMap<CtKey, CtVal> {
    fn get(&self, key: &CtKey) -> Option<CtVal> {
        HashMap::get(self, key).copied()
    }
}

/// What the kernel said to one `BPF_PROG_TEST_RUN`.
#[derive(Clone, Debug)]
pub enum Run {
    /// The syscall failed with this errno.
    Rejected(i32),
    Ran {
        retval: i32,
        data: Vec<u8>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Outcome {
    pub kind: Kind,
    /// The input was not a well-formed packet (see `wellformed`).
    pub malformed: bool,
}

const TC_PASS: i32 = -1; // TCX_NEXT / TC_ACT_UNSPEC
const TC_SHOT: i32 = 2;
const TC_REDIRECT: i32 = 7;
const XDP_DROP: i32 = 1;
const XDP_PASS: i32 = 2;

/// Judges one run of `prog` on `input`.
pub fn check(prog: Prog, maps: &Maps, ct: &dyn Conntrack, input: &[u8], run: &Run) -> Result<Outcome, String> {
    let malformed = wellformed(input).is_err();
    let kind = match run {
        Run::Rejected(e) if *e == libc::EINVAL && refused_by_kernel(prog, input) => Kind::Short,
        Run::Rejected(e) => return Err(format!("the kernel refused a {}-byte packet: {}", input.len(), std::io::Error::from_raw_os_error(*e))),
        Run::Ran { retval, data } => {
            let j = Judge { prog, maps, ct, input, out: data, malformed };
            j.judge(*retval)?
        }
    };
    Ok(Outcome { kind, malformed })
}

/// Whether `BPF_PROG_TEST_RUN` refuses to run `prog` on `p` (then the program never sees it).
fn refused_by_kernel(prog: Prog, p: &[u8]) -> bool {
    if p.len() < ETH_HLEN {
        return true;
    }
    let ip_hdr = match u16::from_be_bytes([p[12], p[13]]) {
        ETH_P_IP => 20,
        ETH_P_IPV6 => 40,
        _ => 0,
    };
    prog != Prog::Xdp && p.len() < ETH_HLEN + ip_hdr
}

/// Where a packet's IP and transport headers are (found by etherparse's header parsers on
/// the whole frame, whatever the length fields say: a program reads the frame, not the
/// lengths).
#[derive(Clone, Debug)]
struct Loc {
    v6: bool,
    src: IpAddr,
    dst: IpAddr,
    /// The transport protocol (after IPv6 extension headers).
    proto: u8,
    /// IPv4 header length (with options); 40 for IPv6.
    ihl: usize,
    /// Offset of the transport header in the frame.
    l4: usize,
    /// A fragment (IPv4 MF or offset, any IPv6 fragment header).
    frag: bool,
    /// IPv6 routing header present.
    routed: bool,
    /// IPv6 extension headers parsed.
    exts: usize,
    /// Where the IP datagram ends by its length field (may lie beyond the frame).
    ip_end: usize,
}

fn locate(p: &[u8]) -> Option<Loc> {
    if p.len() < ETH_HLEN {
        return None;
    }
    let ip = &p[ETH_HLEN..];
    match u16::from_be_bytes([p[12], p[13]]) {
        ETH_P_IP => {
            let h = Ipv4HeaderSlice::from_slice(ip).ok()?;
            let ihl = h.slice().len();
            Some(Loc {
                v6: false,
                src: IpAddr::V4(h.source_addr()),
                dst: IpAddr::V4(h.destination_addr()),
                proto: h.protocol().0,
                ihl,
                l4: ETH_HLEN + ihl,
                frag: h.more_fragments() || h.fragments_offset().value() != 0,
                routed: false,
                exts: 0,
                ip_end: ETH_HLEN + h.total_len() as usize,
            })
        }
        ETH_P_IPV6 => {
            let h = Ipv6HeaderSlice::from_slice(ip).ok()?;
            let (exts, next, _, _) = Ipv6ExtensionsSlice::from_slice_lax(h.next_header(), &ip[40..]);
            let kinds = ext_kinds(h.next_header().0, exts.slice());
            let (frag, routed, n) = (kinds.contains(&NEXT_FRAGMENT), kinds.contains(&NEXT_ROUTING), kinds.len());
            Some(Loc {
                v6: true,
                src: IpAddr::V6(h.source_addr()),
                dst: IpAddr::V6(h.destination_addr()),
                proto: next.0,
                ihl: 40,
                l4: ETH_HLEN + 40 + exts.slice().len(),
                frag,
                routed,
                exts: n,
                ip_end: ETH_HLEN + 40 + h.payload_length() as usize,
            })
        }
        _ => None,
    }
}

/// The kinds of the IPv6 extension headers in `exts`, a chain etherparse parsed that starts
/// with `first`. Walked here rather than with etherparse's iterator: on a chain that
/// `Ipv6ExtensionsSlice::from_slice_lax` stopped in (e.g. at a hop-by-hop header not at
/// the start), that iterator goes on reading past the slice (etherparse 0.21; debug builds
/// abort on the out-of-bounds `get_unchecked`).
fn ext_kinds(first: u8, exts: &[u8]) -> Vec<u8> {
    let (mut kinds, mut next, mut off) = (Vec::new(), first, 0);
    while off + 2 <= exts.len() {
        kinds.push(next);
        let len = match next {
            NEXT_FRAGMENT => 8,
            NEXT_AH => (exts[off + 1] as usize + 2) * 4,
            _ => (exts[off + 1] as usize + 1) * 8,
        };
        next = exts[off];
        off += len;
    }
    kinds
}

fn be16(p: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*p.get(off)?, *p.get(off + 1)?]))
}

fn be32(p: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_be_bytes(p.get(off..off + 4)?.try_into().ok()?))
}

fn put16(p: &mut [u8], off: usize, v: u16) {
    p[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

fn addr_at(p: &[u8], off: usize, v6: bool) -> Option<IpAddr> {
    if v6 {
        let o: [u8; 16] = p.get(off..off + 16)?.try_into().ok()?;
        Some(IpAddr::V6(Ipv6Addr::from(o)))
    } else {
        let o: [u8; 4] = p.get(off..off + 4)?.try_into().ok()?;
        Some(IpAddr::V4(Ipv4Addr::from(o)))
    }
}

fn put_addr(p: &mut [u8], off: usize, a: IpAddr) {
    match a {
        IpAddr::V4(a) => p[off..off + 4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => p[off..off + 16].copy_from_slice(&a.octets()),
    }
}

fn src_off(v6: bool) -> usize {
    ETH_HLEN + if v6 { 8 } else { 12 }
}

fn dst_off(v6: bool) -> usize {
    ETH_HLEN + if v6 { 24 } else { 16 }
}

/// Residuals are compared with the two zeros of one's complement taken as one.
fn norm(x: u16) -> u16 {
    if x == 0 {
        0xffff
    } else {
        x
    }
}

/// Residual of the IPv4 header checksum of the frame `p` (header at 14, length `ihl`).
fn ip_residual(p: &[u8], at: usize, ihl: usize) -> u16 {
    norm(fold(sum16(&p[at..(at + ihl).min(p.len())])))
}

/// Residual of a transport checksum over the frame's bytes from `l4` on, with the pseudo
/// header of the packet's own addresses (none for ICMPv4).
fn l4_residual(p: &[u8], l: &Loc) -> Option<u16> {
    let src = addr_at(p, src_off(l.v6), l.v6)?;
    let dst = addr_at(p, dst_off(l.v6), l.v6)?;
    let seg = p.get(l.l4..)?;
    let pseudo = if l.proto == PROTO_ICMP { 0 } else { pseudo_sum(src, dst, l.proto, seg.len() as u32) };
    Some(norm(fold(pseudo + sum16(seg))))
}

/// Offset of the transport checksum.
fn l4_csum_off(l: &Loc) -> usize {
    l.l4 + if l.proto == PROTO_TCP {
        16
    } else if l.proto == PROTO_UDP {
        6
    } else {
        2
    }
}

struct Judge<'a> {
    prog: Prog,
    maps: &'a Maps,
    ct: &'a dyn Conntrack,
    input: &'a [u8],
    out: &'a [u8],
    malformed: bool,
}

/// The flow of a TCP/UDP packet.
struct Flow {
    l: Loc,
    sport: u16,
    dport: u16,
    /// TCP flags, if the frame has them.
    flags: Option<u8>,
}

impl Flow {
    fn fresh_syn(&self) -> bool {
        self.l.proto == PROTO_TCP && self.flags.is_some_and(|f| f & (TCP_SYN | TCP_ACK) == TCP_SYN)
    }

    fn key(&self, dir: u8) -> CtKey {
        CtKey { src: self.l.src, dst: self.l.dst, sport: self.sport, dport: self.dport, proto: self.l.proto, dir }
    }
}

fn flow_of(p: &[u8]) -> Option<Flow> {
    let l = locate(p)?;
    if l.proto != PROTO_TCP && l.proto != PROTO_UDP {
        return None;
    }
    let (sport, dport) = (be16(p, l.l4)?, be16(p, l.l4 + 2)?);
    let flags = if l.proto == PROTO_TCP { p.get(l.l4 + 13).copied() } else { None };
    Some(Flow { l, sport, dport, flags })
}

impl Judge<'_> {
    fn judge(&self, retval: i32) -> Result<Kind, String> {
        use Prog::*;
        match (self.prog, retval) {
            (Xdp, XDP_PASS) | (TcIngress | TcEgress, TC_PASS) => {
                if self.out == self.input {
                    return Ok(Kind::Passed);
                }
                if self.out.len() != self.input.len() {
                    return Err(format!("passed with its length changed from {} to {}", self.input.len(), self.out.len()));
                }
                if self.prog == Xdp {
                    return Err("XDP_PASS with the packet changed (gn_xdp never rewrites)".into());
                }
                self.translated()
            }
            (TcIngress, TC_SHOT) => self.tc_drop().map(|()| Kind::Dropped),
            (Xdp, XDP_DROP) => self.xdp_drop().map(|()| Kind::Dropped),
            (TcIngress, TC_REDIRECT) => {
                if self.out.len() != self.input.len() {
                    return Err(format!("redirected with its length changed from {} to {}", self.input.len(), self.out.len()));
                }
                self.redirected()
            }
            (p, r) => Err(format!("{} returned {r}, which it never should here", p.name())),
        }
    }

    /// Passed, but changed: must be one of the translations.
    fn translated(&self) -> Result<Kind, String> {
        let l = locate(self.input).ok_or("changed a packet that is not IP")?;
        if l.frag || l.routed {
            return Err("changed a fragment or a packet with a routing header".into());
        }
        let mut why = Vec::new();
        if let Some(f) = flow_of(self.input) {
            if self.prog == Prog::TcIngress {
                match self.dnat(&f) {
                    Ok(()) => return Ok(Kind::Dnat),
                    Err(e) => why.push(format!("not DNAT: {e}")),
                }
            }
            match self.rev_nat(&f) {
                Ok(()) => return Ok(Kind::RevNat),
                Err(e) => why.push(format!("not reverse NAT: {e}")),
            }
        } else if self.prog == Prog::TcIngress && (l.proto == PROTO_ICMP || l.proto == PROTO_ICMPV6) {
            match self.icmp(&l) {
                Ok(()) => return Ok(Kind::IcmpRevNat),
                Err(e) => why.push(format!("not an ICMP error rewritten for its backend: {e}")),
            }
        }
        Err(format!("changed, but not as the maps say ({})", why.join("; ")))
    }

    fn backend_of(&self, fe: &Frontend, addr: IpAddr, port: u16) -> Result<Backend, String> {
        fe.backends.iter().find(|b| b.addr == addr && b.port == port).cloned().ok_or_else(|| format!("{addr} port {port} is no backend of the frontend"))
    }

    fn dnat(&self, f: &Flow) -> Result<(), String> {
        let fe = self.maps.frontend(f.l.dst, f.dport, f.l.proto).ok_or("the destination is no frontend")?;
        let ct = self.ct.get(&f.key(CT_DIR_FORWARD)).ok_or("no conntrack entry for the flow")?;
        if ct.flags & CT_FLAG_SNAT != 0 {
            return Err("the flow is source-NATed but the packet was not redirected".into());
        }
        let be = self.backend_of(fe, ct.addr, ct.port)?;
        let mut exp = self.input.to_vec();
        put_addr(&mut exp, dst_off(f.l.v6), be.addr);
        put16(&mut exp, f.l.l4 + 2, be.port);
        self.same_but_checksums(&exp, &f.l, &[])
    }

    fn rev_nat(&self, f: &Flow) -> Result<(), String> {
        let ct = self.ct.get(&f.key(CT_DIR_REPLY)).ok_or("no reply conntrack entry")?;
        let fe = self.maps.frontend(ct.addr, ct.port, f.l.proto).ok_or("the reply entry names no frontend")?;
        self.backend_of(fe, f.l.src, f.sport)?;
        let mut exp = self.input.to_vec();
        put_addr(&mut exp, src_off(f.l.v6), ct.addr);
        put16(&mut exp, f.l.l4, ct.port);
        self.same_but_checksums(&exp, &f.l, &[])
    }

    /// An ICMP error about a translated flow: the quoted packet went frontend -> client.
    fn icmp(&self, l: &Loc) -> Result<(), String> {
        let p = self.input;
        let ty = *p.get(l.l4).ok_or("no ICMP header")?;
        let error = if l.v6 { matches!(ty, 1..=3) } else { matches!(ty, 3 | 11) };
        if !error {
            return Err(format!("ICMP type {ty} is no error the dataplane translates"));
        }
        let inner = l.l4 + 8;
        let il = locate_inner(p, inner, l.v6).ok_or("no quoted IP header")?;
        if il.proto != PROTO_TCP && il.proto != PROTO_UDP {
            return Err("the quoted packet is no TCP or UDP".into());
        }
        let (isport, idport) = (be16(p, il.l4).ok_or("quoted ports cut")?, be16(p, il.l4 + 2).ok_or("quoted ports cut")?);
        let key = CtKey { src: il.dst, dst: il.src, sport: idport, dport: isport, proto: il.proto, dir: CT_DIR_FORWARD };
        let ct = self.ct.get(&key).ok_or("no conntrack entry for the quoted flow")?;
        let fe = self.maps.frontend(il.src, isport, il.proto).ok_or("the quoted source is no frontend")?;
        let be = self.backend_of(fe, ct.addr, ct.port)?;
        if l.dst != il.src {
            return Err(format!(
                "an ICMP error addressed to {} was redirected to backend {}; it quotes a packet from frontend {}, whose errors go to the frontend",
                l.dst, be.addr, il.src
            ));
        }
        let mut exp = p.to_vec();
        put_addr(&mut exp, dst_off(l.v6), be.addr);
        put_addr(&mut exp, il.src_at, be.addr);
        put16(&mut exp, il.l4, be.port);
        if ct.flags & CT_FLAG_SNAT != 0 {
            let skey = CtKey { src: il.dst, dst: be.addr, sport: idport, dport: be.port, proto: il.proto, dir: CT_DIR_SNAT_FWD };
            let nat = self.ct.get(&skey).ok_or("source-NATed flow without its source NAT entry")?;
            put_addr(&mut exp, il.src_at + if l.v6 { 16 } else { 4 }, nat.addr);
            put16(&mut exp, il.l4 + 2, nat.port);
        }
        let inner_csum = if l.v6 { vec![] } else { vec![(inner + 10, inner, il.ihl)] };
        self.same_but_checksums(&exp, l, &inner_csum)
    }

    /// `exp` (the input as the maps say it should have become) equals the output except in
    /// the checksum fields (the IPv4 header's, the transport one's and `extra` IPv4 headers'
    /// (checksum offset, header offset, length)), and every checksum's residual is kept.
    fn same_but_checksums(&self, exp: &[u8], l: &Loc, extra: &[(usize, usize, usize)]) -> Result<(), String> {
        let out = self.out;
        let mut exp = exp.to_vec();
        let mut fields = vec![l4_csum_off(l)];
        if !l.v6 {
            fields.push(ETH_HLEN + 10);
        }
        fields.extend(extra.iter().map(|e| e.0));
        for &f in &fields {
            if f + 2 <= exp.len() {
                exp[f..f + 2].copy_from_slice(&out[f..f + 2]);
            }
        }
        if exp != out {
            let diff: Vec<usize> = (0..out.len()).filter(|&i| exp[i] != out[i]).collect();
            return Err(format!("bytes at {diff:?} differ from what the maps say"));
        }
        let (i, o) = (self.input, out);
        if !l.v6 && ip_residual(i, ETH_HLEN, l.ihl) != ip_residual(o, ETH_HLEN, l.ihl) {
            return Err("IPv4 header checksum broken by the rewrite".into());
        }
        for &(_, at, len) in extra {
            if ip_residual(i, at, len) != ip_residual(o, at, len) {
                return Err("quoted IPv4 header checksum broken by the rewrite".into());
            }
        }
        let c = l4_csum_off(l);
        if l.proto == PROTO_UDP && be16(i, c) == Some(0) {
            if be16(o, c) != Some(0) {
                return Err("UDP without checksum got one".into());
            }
        } else if c + 2 <= i.len() && l4_residual(i, l) != l4_residual(o, l) {
            return Err(format!("transport checksum broken by the rewrite ({:04x} -> {:04x})", l4_residual(i, l).unwrap_or(0), l4_residual(o, l).unwrap_or(0)));
        }
        if !self.malformed {
            wellformed(out).map_err(|e| format!("a well-formed packet came out malformed: {e}"))?;
        }
        Ok(())
    }

    /// TC ingress dropped it: only traffic the maps say to drop.
    fn tc_drop(&self) -> Result<(), String> {
        let f = flow_of(self.input).ok_or("dropped a packet that is not TCP or UDP over IP")?;
        if f.l.frag || f.l.routed {
            return Err("dropped a fragment or a packet with a routing header".into());
        }
        if let Some(fe) = self.maps.frontend(f.l.dst, f.dport, f.l.proto) {
            if fe.backends.is_empty() || fe.flags & (SVC_FLAG_SOURCE_RANGES | SVC_FLAG_SNAT_REMOTE) != 0 {
                // No backends (rejected or dropped), a client outside the source ranges, or
                // source NAT impossible (no route or port; TTL expiring).
                return Ok(());
            }
            return Err("dropped a packet to a frontend with backends".into());
        }
        let fresh = f.l.proto == PROTO_UDP || f.fresh_syn();
        if fresh && matches!(self.maps.net_of(f.l.dst), Some(Net::Range | Net::ClusterIp)) {
            return Ok(()); // unallocated service address; ClusterIP port not served
        }
        if f.dport >= SNAT_PORT_MIN && self.ct.get(&f.key(CT_DIR_SNAT_REPLY)).is_some() {
            return Ok(()); // a source-NATed flow's reply that cannot be sent on (TTL, route)
        }
        Err("dropped, but the maps say nothing about this flow".into())
    }

    /// XDP dropped it: a non-SYN packet to a frontend without backends.
    fn xdp_drop(&self) -> Result<(), String> {
        let f = flow_of(self.input).ok_or("dropped a packet that is not TCP or UDP over IP")?;
        if f.l.frag || f.l.exts != 0 {
            return Err("dropped a fragment or an IPv6 packet with extension headers".into());
        }
        let fe = self.maps.frontend(f.l.dst, f.dport, f.l.proto).ok_or("dropped a packet to no frontend")?;
        if !fe.backends.is_empty() {
            return Err("dropped a packet to a frontend with backends".into());
        }
        if f.l.proto == PROTO_TCP && (f.flags.is_none() || f.fresh_syn()) {
            return Err("dropped a SYN (TC answers those) or a TCP packet without flags".into());
        }
        Ok(())
    }

    /// TC ingress redirected it: the RST answer, or source NAT either way.
    fn redirected(&self) -> Result<Kind, String> {
        let f = flow_of(self.input).ok_or("redirected a packet that is not TCP or UDP over IP")?;
        if f.l.frag || f.l.routed {
            return Err("redirected a fragment or a packet with a routing header".into());
        }
        let mut why = Vec::new();
        match self.rst(&f) {
            Ok(()) => return Ok(Kind::Rst),
            Err(e) => why.push(format!("not a RST answer: {e}")),
        }
        match self.snat(&f) {
            Ok(()) => return Ok(Kind::Snat),
            Err(e) => why.push(format!("not source NAT: {e}")),
        }
        match self.snat_rev(&f) {
            Ok(()) => return Ok(Kind::SnatRev),
            Err(e) => why.push(format!("not a source-NATed reply: {e}")),
        }
        Err(format!("redirected, but not as the maps say ({})", why.join("; ")))
    }

    fn rst(&self, f: &Flow) -> Result<(), String> {
        if !f.fresh_syn() {
            return Err("not a SYN".into());
        }
        let refused = match self.maps.frontend(f.l.dst, f.dport, PROTO_TCP) {
            Some(fe) => fe.backends.is_empty() && fe.flags & SVC_FLAG_DROP == 0,
            None => self.maps.net_of(f.l.dst) == Some(Net::ClusterIp),
        };
        if !refused {
            return Err("the maps do not refuse this SYN".into());
        }
        let (p, l4) = (self.input, f.l.l4);
        let doff = ((*p.get(l4 + 12).ok_or("TCP header cut")? >> 4) as usize) * 4;
        if doff < 20 || l4 + doff != f.l.ip_end || f.l.ip_end > p.len() {
            return Err("a SYN with data, extension headers or a length that lies cannot be answered in place".into());
        }
        let seq = be32(p, l4 + 4).ok_or("TCP header cut")?;
        let mut exp = p.to_vec();
        exp[0..6].copy_from_slice(&p[6..12]);
        exp[6..12].copy_from_slice(&p[0..6]);
        put_addr(&mut exp, src_off(f.l.v6), f.l.dst);
        put_addr(&mut exp, dst_off(f.l.v6), f.l.src);
        put16(&mut exp, l4, f.dport);
        put16(&mut exp, l4 + 2, f.sport);
        exp[l4 + 4..l4 + 8].copy_from_slice(&[0; 4]);
        exp[l4 + 8..l4 + 12].copy_from_slice(&seq.wrapping_add(1).to_be_bytes());
        exp[l4 + 13] = TCP_RST | TCP_ACK;
        put16(&mut exp, l4 + 14, 0);
        put16(&mut exp, l4 + 18, 0);
        exp[l4 + 20..l4 + doff].fill(1); // options become NOPs
        self.same_but_checksums(&exp, &f.l, &[])
    }

    fn snat(&self, f: &Flow) -> Result<(), String> {
        let fe = self.maps.frontend(f.l.dst, f.dport, f.l.proto).ok_or("the destination is no frontend")?;
        if fe.flags & SVC_FLAG_SNAT_REMOTE == 0 {
            return Err("the frontend does not source-NAT".into());
        }
        let ct = self.ct.get(&f.key(CT_DIR_FORWARD)).ok_or("no conntrack entry for the flow")?;
        if ct.flags & CT_FLAG_SNAT == 0 {
            return Err("the flow's conntrack entry is not source-NATed".into());
        }
        let be = self.backend_of(fe, ct.addr, ct.port)?;
        if !be.remote {
            return Err("source NAT to a backend on this node".into());
        }
        let skey = CtKey { src: f.l.src, dst: be.addr, sport: f.sport, dport: be.port, proto: f.l.proto, dir: CT_DIR_SNAT_FWD };
        let nat = self.ct.get(&skey).ok_or("no source NAT entry")?;
        if !(SNAT_PORT_MIN as u32..SNAT_PORT_MIN as u32 + SNAT_PORT_COUNT as u32).contains(&(nat.port as u32)) {
            return Err(format!("source NAT port {} outside the range", nat.port));
        }
        let back = CtKey { src: be.addr, dst: nat.addr, sport: be.port, dport: nat.port, proto: f.l.proto, dir: CT_DIR_SNAT_REPLY };
        let r = self.ct.get(&back).ok_or("no source NAT reply entry")?;
        if (r.addr, r.port) != (f.l.src, f.sport) {
            return Err("the source NAT reply entry points at another client".into());
        }
        let exp = self.rewrite(f, (nat.addr, nat.port), (be.addr, be.port))?;
        self.same_but_checksums(&exp, &f.l, &[])
    }

    fn snat_rev(&self, f: &Flow) -> Result<(), String> {
        if f.dport < SNAT_PORT_MIN {
            return Err("not to a source NAT port".into());
        }
        let r = self.ct.get(&f.key(CT_DIR_SNAT_REPLY)).ok_or("no source NAT reply entry")?;
        let rkey = CtKey { src: f.l.src, dst: r.addr, sport: f.sport, dport: r.port, proto: f.l.proto, dir: CT_DIR_REPLY };
        let fe = self.ct.get(&rkey).ok_or("no reply entry for the client")?;
        let front = self.maps.frontend(fe.addr, fe.port, f.l.proto).ok_or("the reply entry names no frontend")?;
        self.backend_of(front, f.l.src, f.sport)?;
        let exp = self.rewrite(f, (fe.addr, fe.port), (r.addr, r.port))?;
        self.same_but_checksums(&exp, &f.l, &[])
    }

    /// The input with new source and destination, forwarded (TTL or hop limit one less).
    fn rewrite(&self, f: &Flow, src: (IpAddr, u16), dst: (IpAddr, u16)) -> Result<Vec<u8>, String> {
        let mut exp = self.input.to_vec();
        let ttl_off = ETH_HLEN + if f.l.v6 { 7 } else { 8 };
        if exp[ttl_off] <= 1 {
            return Err("forwarded a packet whose TTL ran out".into());
        }
        exp[ttl_off] -= 1;
        put_addr(&mut exp, src_off(f.l.v6), src.0);
        put_addr(&mut exp, dst_off(f.l.v6), dst.0);
        put16(&mut exp, f.l.l4, src.1);
        put16(&mut exp, f.l.l4 + 2, dst.1);
        Ok(exp)
    }
}

/// The packet quoted in an ICMP error at `at`.
struct Inner {
    src: IpAddr,
    dst: IpAddr,
    /// Offset of the quoted source address.
    src_at: usize,
    ihl: usize,
    proto: u8,
    l4: usize,
}

fn locate_inner(p: &[u8], at: usize, v6: bool) -> Option<Inner> {
    let q = p.get(at..)?;
    if v6 {
        let h = Ipv6HeaderSlice::from_slice(q).ok()?;
        let (exts, next, _, _) = Ipv6ExtensionsSlice::from_slice_lax(h.next_header(), &q[40..]);
        Some(Inner {
            src: IpAddr::V6(h.source_addr()),
            dst: IpAddr::V6(h.destination_addr()),
            src_at: at + 8,
            ihl: 40,
            proto: next.0,
            l4: at + 40 + exts.slice().len(),
        })
    } else {
        let h = Ipv4HeaderSlice::from_slice(q).ok()?;
        let ihl = h.slice().len();
        Some(Inner { src: IpAddr::V4(h.source_addr()), dst: IpAddr::V4(h.destination_addr()), src_at: at + 12, ihl, proto: h.protocol().0, l4: at + ihl })
    }
}

/// Whether `p` is a packet an IP stack would take as it is: etherparse parses it strictly to
/// the transport layer, IPv4 header and transport checksums are valid, no fragment, no IPv6
/// routing/fragment/AH header, UDP length as the IP layer says, ICMP errors quoting at least
/// an IP header and 8 bytes.
pub fn wellformed(p: &[u8]) -> Result<(), String> {
    let s = SlicedPacket::from_ethernet(p).map_err(|e| e.to_string())?;
    let (src, dst, v6, ip_payload) = match &s.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header();
            if h.to_header().calc_header_checksum() != h.header_checksum() {
                return Err("IPv4 header checksum".into());
            }
            if ip.is_payload_fragmented() {
                return Err("fragment".into());
            }
            (IpAddr::V4(h.source_addr()), IpAddr::V4(h.destination_addr()), false, ip.payload().payload.len())
        }
        Some(NetSlice::Ipv6(ip)) => {
            if ext_kinds(ip.header().next_header().0, ip.extensions().slice()).iter().any(|k| *k != NEXT_HOP && *k != NEXT_DEST) {
                return Err("IPv6 routing, fragment or AH header".into());
            }
            (IpAddr::V6(ip.header().source_addr()), IpAddr::V6(ip.header().destination_addr()), true, ip.payload().payload.len())
        }
        _ => return Err("not IP".into()),
    };
    let (s4, d4, s6, d6) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (s.octets(), d.octets(), [0; 16], [0; 16]),
        (IpAddr::V6(s), IpAddr::V6(d)) => ([0; 4], [0; 4], s.octets(), d.octets()),
        _ => unreachable!(),
    };
    match &s.transport {
        Some(TransportSlice::Tcp(t)) => {
            let c = if v6 { t.calc_checksum_ipv6(s6, d6) } else { t.calc_checksum_ipv4(s4, d4) }.map_err(|e| e.to_string())?;
            if c != t.checksum() {
                return Err("TCP checksum".into());
            }
        }
        Some(TransportSlice::Udp(u)) => {
            if u.length() as usize != ip_payload {
                return Err("UDP length differs from the IP payload's".into());
            }
            if u.checksum() == 0 {
                if v6 {
                    return Err("IPv6 UDP without checksum".into());
                }
            } else {
                let h = u.to_header();
                let c = if v6 { h.calc_checksum_ipv6_raw(s6, d6, u.payload()) } else { h.calc_checksum_ipv4_raw(s4, d4, u.payload()) }
                    .map_err(|e| e.to_string())?;
                if c != u.checksum() {
                    return Err("UDP checksum".into());
                }
            }
        }
        Some(TransportSlice::Icmpv4(i)) if !v6 => {
            // Summed here: etherparse's `Icmpv4Header::with_checksum` rebuilds the header from
            // its parsed type and drops bytes some types leave unused (parameter problem).
            if fold(sum16(i.slice())) != 0xffff {
                return Err("ICMP checksum".into());
            }
            if matches!(i.type_u8(), 3 | 4 | 5 | 11 | 12) {
                let q = Ipv4HeaderSlice::from_slice(i.payload()).map_err(|_| "ICMP error quoting no IPv4 header")?;
                if i.payload().len() < q.slice().len() + 8 {
                    return Err("ICMP error quoting less than 8 bytes of the packet".into());
                }
            }
        }
        Some(TransportSlice::Icmpv6(i)) if v6 => {
            if fold(pseudo_sum(src, dst, PROTO_ICMPV6, i.slice().len() as u32) + sum16(i.slice())) != 0xffff {
                return Err("ICMPv6 checksum".into());
            }
            if matches!(i.type_u8(), 1..=4) {
                Ipv6HeaderSlice::from_slice(i.payload()).map_err(|_| "ICMPv6 error quoting no IPv6 header")?;
                if i.payload().len() < 48 {
                    return Err("ICMPv6 error quoting less than 8 bytes of the packet".into());
                }
            }
        }
        _ => return Err("no TCP, UDP or ICMP".into()),
    }
    Ok(())
}
