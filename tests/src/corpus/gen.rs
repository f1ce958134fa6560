//! The corpus: seeded, deterministic for a given plan. Each case is a well-formed base
//! packet (to a frontend with or without backends, to a ClusterIP port not served, to an
//! unallocated service address, to no service, a backend's reply, an ICMP error about a
//! flow, other ICMP, non-IP, garbage) of either family, and then usually one mutation
//! (IPv4 options, IPv6 extension-header chains, fragments, truncation at and around every
//! header boundary, lying length fields, zero and maximal sizes, broken checksums, TCP
//! flags, bogus ICMP quotes, byte flips). Where the outcome of a case is known in advance
//! for each program it carries it (`want`); the checker judges every case either way.
use std::{
    net::{IpAddr, SocketAddr},
    ops::Range,
};

use rand::{rngs::SmallRng, seq::SliceRandom, Rng, RngCore, SeedableRng};

use super::{build::*, check::Kind::*, check::Want};

/// Client ports of the flows the suite establishes before the corpus runs; generated
/// traffic never uses them (a fresh SYN straight to a backend from a tracked flow's client
/// port would, by design, purge that flow's conntrack entries).
pub const TRACKED_PORTS: Range<u16> = 40_000..41_000;

/// A flow established (through gn_tc_ingress) before the corpus runs.
#[derive(Clone, Debug)]
pub struct Flow {
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub proto: u8,
    pub backend: SocketAddr,
    /// Source NAT: the node address and port the backend sees instead of the client.
    pub snat: Option<SocketAddr>,
}

/// Addresses of the world the corpus is aimed at (both families in each list).
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Frontends with backends (TCP and UDP each).
    pub web: Vec<SocketAddr>,
    /// Frontends without backends (TCP and UDP each).
    pub empty: Vec<SocketAddr>,
    /// ClusterIPs with a port they do not serve.
    pub unserved: Vec<SocketAddr>,
    /// Unallocated addresses of a service range.
    pub unallocated: Vec<IpAddr>,
    /// Hosts that are no service (backends, node addresses, others).
    pub others: Vec<IpAddr>,
    pub clients: Vec<IpAddr>,
    /// Senders of ICMP errors.
    pub routers: Vec<IpAddr>,
    pub flows: Vec<Flow>,
    /// Largest frame the kernel takes for a test run.
    pub max_frame: usize,
}

/// One generated packet and what each program (`Prog as usize`) may do with it.
#[derive(Clone, Debug)]
pub struct Case {
    pub bytes: Vec<u8>,
    pub base: &'static str,
    pub mutation: &'static str,
    pub want: [Want; 3],
}

const ING: usize = 0;
const XDP: usize = 2;

fn pass3() -> [Want; 3] {
    let p = Want::of(&[Passed]);
    [p, p, p]
}

/// A base packet before mutation.
struct Base {
    spec: Spec,
    name: &'static str,
    want: [Want; 3],
    /// For ICMP errors: the flow the error is about (for bogus-quote mutations).
    flow: Option<Flow>,
}

pub struct Gen {
    rng: SmallRng,
    plan: Plan,
    /// `plan.flows` by family (IPv4, IPv6).
    flows: [Vec<Flow>; 2],
}

fn fam<T: Clone>(v: &[T], v6: bool, is6: impl Fn(&T) -> bool) -> Vec<T> {
    v.iter().filter(|x| is6(x) == v6).cloned().collect()
}

impl Gen {
    pub fn new(seed: u64, plan: Plan) -> Self {
        let flows = [fam(&plan.flows, false, |f| f.client.is_ipv6()), fam(&plan.flows, true, |f| f.client.is_ipv6())];
        Gen { rng: SmallRng::seed_from_u64(seed), plan, flows }
    }

    fn pick<T: Clone>(&mut self, v: &[T]) -> Option<T> {
        v.choose(&mut self.rng).cloned()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0; n];
        self.rng.fill_bytes(&mut b);
        b
    }

    /// A client port outside the tracked flows' range.
    fn port(&mut self) -> u16 {
        loop {
            let p = self.rng.gen_range(1024..=65535);
            if !TRACKED_PORTS.contains(&p) {
                return p;
            }
        }
    }

    fn client(&mut self, v6: bool) -> IpAddr {
        let c = fam(&self.plan.clients, v6, |a| a.is_ipv6());
        self.pick(&c).expect("clients of both families")
    }

    pub fn tcp(&mut self, sport: u16, dport: u16, flags: u8, payload: usize) -> L4 {
        let opts = if flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
            syn_options(self.rng.gen())
        } else if self.rng.gen_bool(0.5) {
            let mut o = vec![1, 1, 8, 10];
            o.extend(self.bytes(8));
            o
        } else {
            Vec::new()
        };
        let ack = if flags & TCP_ACK != 0 { self.rng.gen() } else { 0 };
        L4::Tcp { sport, dport, seq: self.rng.gen(), ack, flags, window: 64_240, opts, payload: self.bytes(payload) }
    }

    pub fn udp(&mut self, sport: u16, dport: u16) -> L4 {
        let n = self.rng.gen_range(0..64);
        L4::Udp { sport, dport, payload: self.bytes(n), no_csum: false }
    }

    /// Flags of a packet in the middle of a connection.
    fn est_flags(&mut self) -> (u8, usize) {
        match self.rng.gen_range(0..5) {
            0 => (TCP_ACK, 0),
            1 => (TCP_PSH | TCP_ACK, self.rng.gen_range(1..200)),
            2 => (TCP_FIN | TCP_ACK, 0),
            3 => (TCP_RST | TCP_ACK, 0),
            _ => (TCP_RST, 0),
        }
    }

    /// TCP (SYN or established) or UDP to `to` from a random client.
    fn to(&mut self, to: SocketAddr) -> (Spec, bool, bool) {
        let v6 = to.is_ipv6();
        let src = self.client(v6);
        let sport = self.port();
        let r = self.rng.gen_range(0..10);
        let (l4, syn, tcp) = if r < 4 {
            (self.tcp(sport, to.port(), TCP_SYN, 0), true, true)
        } else if r < 7 {
            let (fl, n) = self.est_flags();
            (self.tcp(sport, to.port(), fl, n), false, true)
        } else {
            (self.udp(sport, to.port()), false, false)
        };
        (Spec::new(src, to.ip(), l4), syn, tcp)
    }

    fn base(&mut self) -> Base {
        let v6 = self.rng.gen_bool(0.5);
        let w = self.rng.gen_range(0..100);
        let flows = std::mem::take(&mut self.flows[v6 as usize]);
        let b = self.base_of(v6, w, &flows);
        self.flows[v6 as usize] = flows;
        b
    }

    fn base_of(&mut self, v6: bool, w: u32, flows: &[Flow]) -> Base {
        let p = Want::of(&[Passed]);
        match w {
            // A new flow to a frontend with backends.
            0..=13 => {
                let fe = self.pick(&fam(&self.plan.web, v6, |a| a.is_ipv6())).unwrap();
                let src = self.client(v6);
                let sport = self.port();
                let l4 = if self.rng.gen_bool(0.5) { self.tcp(sport, fe.port(), TCP_SYN, 0) } else { self.udp(sport, fe.port()) };
                Base { spec: Spec::new(src, fe.ip(), l4), name: "new flow to a frontend", want: [Want::of(&[Dnat, Snat]), p, p], flow: None }
            }
            // A packet of an established flow.
            14..=23 if !flows.is_empty() => {
                let f = self.pick(flows).unwrap();
                let l4 = if f.proto == PROTO_TCP {
                    let (fl, n) = self.est_flags();
                    self.tcp(f.client.port(), f.frontend.port(), fl, n)
                } else {
                    self.udp(f.client.port(), f.frontend.port())
                };
                // DNAT, or DNAT plus source NAT: the corpus itself re-opens tracked flows
                // (mutated SYNs), and a new backend may be on another node.
                Base { spec: Spec::new(f.client.ip(), f.frontend.ip(), l4), name: "established flow", want: [Want::of(&[Dnat, Snat]), p, p], flow: Some(f) }
            }
            // A frontend without backends.
            24..=33 => {
                let fe = self.pick(&fam(&self.plan.empty, v6, |a| a.is_ipv6())).unwrap();
                let (spec, syn, _) = self.to(fe);
                let want = if syn { [Want::of(&[Rst]), p, p] } else { [Want::of(&[Dropped]), p, Want::of(&[Dropped])] };
                Base { spec, name: "frontend without backends", want, flow: None }
            }
            // A ClusterIP on a port it does not serve.
            34..=38 => {
                let to = self.pick(&fam(&self.plan.unserved, v6, |a| a.is_ipv6())).unwrap();
                let (spec, syn, tcp) = self.to(to);
                let ing = if syn {
                    Want::of(&[Rst])
                } else if !tcp {
                    Want::of(&[Dropped])
                } else {
                    p
                };
                Base { spec, name: "ClusterIP port not served", want: [ing, p, p], flow: None }
            }
            // An unallocated address of a service range.
            39..=43 => {
                let a = self.pick(&fam(&self.plan.unallocated, v6, |a| a.is_ipv6())).unwrap();
                let port = if self.rng.gen_bool(0.5) { 80 } else { self.port() };
                let (spec, syn, tcp) = self.to(SocketAddr::new(a, port));
                let ing = if syn || !tcp { Want::of(&[Dropped]) } else { p };
                Base { spec, name: "unallocated service address", want: [ing, p, p], flow: None }
            }
            // No service at all.
            44..=53 => {
                let a = self.pick(&fam(&self.plan.others, v6, |a| a.is_ipv6())).unwrap();
                let port = if self.rng.gen_bool(0.5) { *[80, 8080, 30080].choose(&mut self.rng).unwrap() } else { self.port() };
                let (spec, _, _) = self.to(SocketAddr::new(a, port));
                Base { spec, name: "no service", want: pass3(), flow: None }
            }
            // A backend's reply.
            54..=65 if !flows.is_empty() => {
                let f = self.pick(flows).unwrap();
                let to = f.snat.unwrap_or(f.client);
                let l4 = if f.proto == PROTO_TCP {
                    let (fl, n) = if self.rng.gen_bool(0.2) { (TCP_SYN | TCP_ACK, 0) } else { self.est_flags() };
                    self.tcp(f.backend.port(), to.port(), fl, n)
                } else {
                    self.udp(f.backend.port(), to.port())
                };
                let want = if f.snat.is_some() { [Want::of(&[SnatRev]), p, p] } else { [Want::of(&[RevNat]), Want::of(&[RevNat]), p] };
                Base { spec: Spec::new(f.backend.ip(), to.ip(), l4), name: "backend's reply", want, flow: Some(f) }
            }
            // An ICMP error about a flow's reply, sent to the frontend by a router.
            66..=75 if !flows.is_empty() => {
                let f = self.pick(flows).unwrap();
                let spec = self.icmp_error(&f, Fault::None);
                Base { spec, name: "ICMP error about a flow", want: [Want::of(&[IcmpRevNat]), p, p], flow: Some(f) }
            }
            // Other ICMP.
            76..=81 => Base { spec: self.icmp_other(v6, flows), name: "other ICMP", want: pass3(), flow: None },
            // Non-IP, or IP behind the wrong EtherType (made in `case`).
            82..=85 => Base { spec: self.icmp_other(v6, flows), name: "non-IP", want: pass3(), flow: None },
            // Garbage (made in `case`).
            86..=89 => Base { spec: self.icmp_other(v6, flows), name: "garbage", want: [Want::ANY; 3], flow: None },
            // More new flows, also when no flows are tracked.
            _ => {
                let fe = self.pick(&fam(&self.plan.web, v6, |a| a.is_ipv6())).unwrap();
                let (spec, _, _) = self.to(fe);
                Base { spec, name: "new flow to a frontend", want: [Want::of(&[Dnat, Snat]), p, p], flow: None }
            }
        }
    }

    /// An ICMP error (destination unreachable, fragmentation needed / packet too big, time
    /// exceeded) from a router to `f`'s frontend, quoting the frontend's reply to the client.
    fn icmp_error(&mut self, f: &Flow, fault: Fault) -> Spec {
        let v6 = f.client.is_ipv6();
        let mut cport = f.client.port();
        if fault == Fault::UnknownFlow {
            // A client port nobody uses: the top of the tracked range (tracked flows count up
            // from its bottom, generated traffic stays out of it).
            cport = TRACKED_PORTS.end - 1 - self.rng.gen_range(0..200);
        }
        let l4 = if f.proto == PROTO_TCP { self.tcp(f.frontend.port(), cport, TCP_ACK | TCP_PSH, 100) } else { self.udp(f.frontend.port(), cport) };
        let mut quoted = Spec::new(f.frontend.ip(), f.client.ip(), l4);
        quoted.ttl = 1;
        if fault == Fault::QuotedProto {
            quoted.l4 = L4::Icmp { ty: 8, code: 0, rest: [0, 1, 0, 1], payload: self.bytes(16) };
        }
        let mut q = quoted.ip_bytes();
        let ihl = if v6 { 40 } else { 20 };
        let keep = match fault {
            Fault::CutBeforePorts => self.rng.gen_range(0..ihl + 4),
            Fault::CutInL4 => self.rng.gen_range(ihl + 4..ihl + 8),
            _ => (ihl + 8 + self.rng.gen_range(0..=48)).min(q.len()),
        };
        q.truncate(keep);
        match fault {
            Fault::QuotedVersion if !q.is_empty() => q[0] = (q[0] & 0x0f) | if v6 { 0x40 } else { 0x60 },
            Fault::QuotedIhl if !v6 && !q.is_empty() => q[0] = 0x40 | self.rng.gen_range(0..5),
            _ => {}
        }
        let (ty, code, rest) = match (v6, self.rng.gen_range(0..3)) {
            (false, 0) => (3, *[0u8, 1, 3].choose(&mut self.rng).unwrap(), [0; 4]),
            (false, 1) => (3, 4, [0, 0, 0x05, 0xdc]), // fragmentation needed, MTU 1500
            (false, _) => (11, 0, [0; 4]),
            (true, 0) => (1, self.rng.gen_range(0..5), [0; 4]),
            (true, 1) => (2, 0, 1280u32.to_be_bytes()),
            (true, _) => (3, 0, [0; 4]),
        };
        let routers = fam(&self.plan.routers, v6, |a| a.is_ipv6());
        let src = self.pick(&routers).unwrap();
        let mut dst = f.frontend.ip();
        if fault == Fault::OtherHost {
            let o = fam(&self.plan.others, v6, |a| a.is_ipv6());
            dst = self.pick(&o).unwrap();
        }
        Spec::new(src, dst, L4::Icmp { ty, code, rest, payload: q })
    }

    /// Packets that gn_tc_ingress once translated and must pass untouched (found by this
    /// corpus): ICMP errors about a flow addressed to another host than its frontend, ICMPv6
    /// errors quoting a header that is not IPv6, a TCP SYN and a UDP datagram to a frontend
    /// whose hop-by-hop header follows a destination-options header.
    pub fn regressions(&mut self) -> Vec<(&'static str, Vec<u8>)> {
        let mut out = Vec::new();
        for v6 in [false, true] {
            let Some(f) = self.flows[v6 as usize].first().cloned() else { continue };
            out.push(("ICMP error to another host quoting a frontend", self.icmp_error(&f, Fault::OtherHost).build()));
            if v6 {
                out.push(("ICMPv6 error quoting an IPv4 header", self.icmp_error(&f, Fault::QuotedVersion).build()));
                for tcp in [true, false] {
                    let sport = self.port();
                    let l4 = if tcp { self.tcp(sport, f.frontend.port(), TCP_SYN, 0) } else { self.udp(sport, f.frontend.port()) };
                    let mut s = Spec::new(self.client(true), f.frontend.ip(), l4);
                    s.exts = vec![Ext::Opts { kind: NEXT_DEST, opts: vec![] }, Ext::Opts { kind: NEXT_HOP, opts: vec![] }];
                    out.push(("IPv6 hop-by-hop header after destination options", s.build()));
                }
            }
        }
        out
    }

    /// Echo requests, parameter problems, errors about unknown flows, neighbour solicitation.
    fn icmp_other(&mut self, v6: bool, flows: &[Flow]) -> Spec {
        let fe = self.pick(&fam(&self.plan.web, v6, |a| a.is_ipv6())).unwrap();
        let src = self.client(v6);
        match self.rng.gen_range(0..4) {
            0 => {
                let ty = if v6 { 128 } else { 8 };
                Spec::new(src, fe.ip(), L4::Icmp { ty, code: 0, rest: [0x12, 0x34, 0, 1], payload: self.bytes(32) })
            }
            1 if !flows.is_empty() => {
                // Parameter problem about a tracked flow: not an error TC LB rewrites.
                let f = self.pick(flows).unwrap();
                let mut s = self.icmp_error(&f, Fault::None);
                if let L4::Icmp { ty, code, .. } = &mut s.l4 {
                    *ty = if v6 { 4 } else { 12 };
                    *code = 0;
                }
                s
            }
            2 if !flows.is_empty() => {
                let f = self.pick(flows).unwrap();
                self.icmp_error(&f, Fault::UnknownFlow)
            }
            _ if v6 => {
                let mut body = vec![0u8; 0];
                body.extend(self.bytes(16)); // target address
                Spec::new(src, fe.ip(), L4::Icmp { ty: 135, code: 0, rest: [0; 4], payload: body })
            }
            _ => Spec::new(src, fe.ip(), L4::Icmp { ty: 13, code: 0, rest: [0, 1, 0, 1], payload: self.bytes(12) }),
        }
    }

    /// Frames that are not IP as their EtherType says.
    fn non_ip(&mut self, spec: &Spec) -> Vec<u8> {
        match self.rng.gen_range(0..5) {
            0 => {
                // ARP request
                let mut b = vec![0, 1, 8, 0, 6, 4, 0, 1];
                b.extend(self.bytes(20));
                frame(0x0806, &b)
            }
            1 => {
                // 802.1Q-tagged: the programs do not look behind VLAN tags.
                let mut b = vec![0x00, 0x05];
                b.extend((if spec.v6() { ETH_P_IPV6 } else { ETH_P_IP }).to_be_bytes());
                b.extend(spec.ip_bytes());
                frame(0x8100, &b)
            }
            2 => frame(if spec.v6() { ETH_P_IP } else { ETH_P_IPV6 }, &spec.ip_bytes()),
            3 => {
                let n = self.rng.gen_range(0..100);
                let b = self.bytes(n);
                frame(0x88cc, &b)
            }
            _ => {
                let n = self.rng.gen_range(0..60);
                let b = self.bytes(n);
                frame(0x0000, &b)
            }
        }
    }

    /// The next case.
    pub fn case(&mut self) -> Case {
        let mut b = self.base();
        if b.name == "non-IP" {
            let bytes = self.non_ip(&b.spec);
            return Case { bytes, base: b.name, mutation: "none", want: pass3() };
        }
        if b.name == "garbage" {
            let n = self.rng.gen_range(14..200);
            let mut bytes = self.bytes(n);
            if self.rng.gen_bool(0.7) {
                let ty = if self.rng.gen_bool(0.5) { ETH_P_IP } else { ETH_P_IPV6 };
                bytes[12..14].copy_from_slice(&ty.to_be_bytes());
                if let Some(b) = bytes.get_mut(ETH_HLEN) {
                    *b = (*b & 0x0f) | if ty == ETH_P_IP { 0x40 } else { 0x60 };
                }
            }
            return Case { bytes, base: b.name, mutation: "none", want: [Want::ANY; 3] };
        }
        let v6 = b.spec.v6();
        let icmp_error = b.name == "ICMP error about a flow";
        let w = self.rng.gen_range(0..100);
        let (mutation, bytes): (&'static str, Vec<u8>) = match w {
            0..=19 => ("none", b.spec.build()),
            20..=24 if !v6 => {
                b.spec.ip_opts = self.ip_options(false);
                ("IPv4 options", b.spec.build())
            }
            25..=26 if !v6 => {
                b.spec.ip_opts = self.ip_options(true);
                b.want = [Want::ANY; 3];
                ("bogus IPv4 options", b.spec.build())
            }
            20..=26 => {
                let n = self.rng.gen_range(1..=3);
                b.spec.exts = self.opt_exts(n);
                b.want[ING] = b.want[ING].swap(Rst, Dropped).swap(IcmpRevNat, Passed);
                b.want[XDP] = b.want[XDP].swap(Dropped, Passed);
                ("IPv6 hop-by-hop/destination options", b.spec.build())
            }
            27..=31 => {
                b.want = pass3();
                if v6 {
                    match self.rng.gen_range(0..3) {
                        0 => {
                            let n = self.rng.gen_range(4..=6);
                            b.spec.exts = self.opt_exts(n);
                            ("IPv6 extension chain longer than 3", b.spec.build())
                        }
                        1 => {
                            let n = self.rng.gen_range(0..=2);
                            let mut e = self.opt_exts(n);
                            let addr: [u8; 16] = self.rng.gen();
                            e.push(Ext::Routing { ty: *[0u8, 2, 4].choose(&mut self.rng).unwrap(), left: self.rng.gen_range(0..2), addrs: vec![addr] });
                            b.spec.exts = e;
                            ("IPv6 routing header", b.spec.build())
                        }
                        _ => {
                            let n = self.rng.gen_range(0..=1);
                            let mut e = self.opt_exts(n);
                            let (offset, more) = *[(0, true), (0, false), (185, true), (185, false)].choose(&mut self.rng).unwrap();
                            e.push(Ext::Fragment { offset, more, id: self.rng.gen() });
                            b.spec.exts = e;
                            ("IPv6 fragment", b.spec.build())
                        }
                    }
                } else {
                    b.spec.frag = *[0x2000u16, 0x20b9, 0x00b9, 0x3fff, 0x0001].choose(&mut self.rng).unwrap();
                    ("IPv4 fragment", b.spec.build())
                }
            }
            32..=34 if v6 => {
                b.spec.exts = self.random_exts();
                b.want = [Want::ANY; 3];
                ("random IPv6 extension chain", b.spec.build())
            }
            32..=34 => {
                b.spec.frag = 0x4000; // DF: not a fragment
                ("DF set", b.spec.build())
            }
            35..=49 => {
                let full = b.spec.build();
                let cut = self.cut_point(&b.spec, full.len());
                b.want = [Want::ANY; 3];
                let mut bytes = full;
                bytes.truncate(cut);
                ("truncated", bytes)
            }
            50..=57 => {
                b.want = [Want::ANY; 3];
                let bytes = self.lying_length(&b.spec);
                ("length field lies", bytes)
            }
            58..=60 => {
                let room = self.plan.max_frame.saturating_sub(b.spec.build().len());
                match &mut b.spec.l4 {
                    L4::Tcp { payload, .. } | L4::Udp { payload, .. } | L4::Icmp { payload, .. } => payload.extend(std::iter::repeat_n(0xa5, room)),
                    L4::Raw { bytes, .. } => bytes.extend(std::iter::repeat_n(0xa5, room)),
                }
                // A SYN carrying data is not answered in place; source NAT sends packets on
                // itself, and drops those larger than the route's MTU (bpf_fib_lookup says
                // "fragmentation needed").
                b.want[ING] = b.want[ING].swap(Rst, Dropped).also(Snat, Dropped).also(SnatRev, Dropped);
                ("maximal size", b.spec.build())
            }
            61..=63 => {
                let mut bytes = b.spec.build();
                if !v6 {
                    bytes[ETH_HLEN + 10] ^= 0x5a;
                    ("bad IPv4 header checksum", bytes)
                } else {
                    let o = b.spec.l4_offset()
                        + if matches!(b.spec.l4, L4::Tcp { .. }) {
                            16
                        } else if matches!(b.spec.l4, L4::Udp { .. }) {
                            6
                        } else {
                            2
                        };
                    bytes[o] ^= 0x5a;
                    ("bad transport checksum", bytes)
                }
            }
            64..=66 => {
                let mut bytes = b.spec.build();
                let o = b.spec.l4_offset()
                    + if matches!(b.spec.l4, L4::Tcp { .. }) {
                        16
                    } else if matches!(b.spec.l4, L4::Udp { .. }) {
                        6
                    } else {
                        2
                    };
                bytes[o + 1] ^= 0x01;
                ("bad transport checksum", bytes)
            }
            67..=68 if matches!(b.spec.l4, L4::Udp { .. }) => {
                if let L4::Udp { no_csum, .. } = &mut b.spec.l4 {
                    *no_csum = true;
                }
                ("UDP checksum zero", b.spec.build())
            }
            67..=70 if matches!(b.spec.l4, L4::Tcp { .. }) => {
                if let L4::Tcp { flags, .. } = &mut b.spec.l4 {
                    *flags = self.rng.gen();
                }
                b.want = [Want::ANY; 3];
                ("random TCP flags", b.spec.build())
            }
            71..=73 => {
                b.spec.ttl = self.rng.gen_range(0..=1);
                for w in &mut b.want {
                    *w = w.swap(Snat, Dropped).swap(SnatRev, Dropped);
                }
                ("TTL 0 or 1", b.spec.build())
            }
            74..=85 if icmp_error => {
                let f = b.flow.clone().unwrap();
                let faults: &[Fault] = if v6 {
                    &[Fault::CutBeforePorts, Fault::CutInL4, Fault::QuotedVersion, Fault::QuotedProto, Fault::UnknownFlow, Fault::OtherHost]
                } else {
                    &[Fault::CutBeforePorts, Fault::CutInL4, Fault::QuotedVersion, Fault::QuotedIhl, Fault::QuotedProto, Fault::UnknownFlow, Fault::OtherHost]
                };
                let fault = *faults.choose(&mut self.rng).unwrap();
                let spec = self.icmp_error(&f, fault);
                b.want = pass3();
                if fault == Fault::CutInL4 {
                    b.want[ING] = Want::ANY; // ports are there: translated or not, judged by the checker
                }
                (fault.name(), spec.build())
            }
            _ => {
                let mut bytes = b.spec.build();
                let n = self.rng.gen_range(1..=4);
                for _ in 0..n {
                    let i = self.rng.gen_range(0..bytes.len().min(100));
                    bytes[i] ^= self.rng.gen_range(1..=255u8);
                }
                b.want = [Want::ANY; 3];
                ("byte flips", bytes)
            }
        };
        Case { bytes, base: b.name, mutation, want: b.want }
    }

    /// IPv4 options: valid ones (NOP, record route, timestamp, router alert, EOL), or ones
    /// with lengths that are zero, one or run past the header.
    fn ip_options(&mut self, bogus: bool) -> Vec<u8> {
        let mut o = Vec::new();
        let n = self.rng.gen_range(1..=3);
        for _ in 0..n {
            match self.rng.gen_range(0..4) {
                0 => o.push(1),
                1 => {
                    o.extend([7, 11, 4]);
                    o.extend([0; 8]);
                }
                2 => {
                    o.extend([68, 12, 5, 0]);
                    o.extend([0; 8]);
                }
                _ => o.extend([148, 4, 0, 0]),
            }
        }
        if bogus {
            let at = self.rng.gen_range(0..=o.len());
            let len = *[0u8, 1, 2, 39, 255].choose(&mut self.rng).unwrap();
            o.splice(at..at, [*[7u8, 68, 130, 131, 137].choose(&mut self.rng).unwrap(), len]);
        }
        o.truncate(40);
        o
    }

    /// `n` hop-by-hop (first only) and destination-options headers.
    fn opt_exts(&mut self, n: usize) -> Vec<Ext> {
        (0..n)
            .map(|i| {
                let kind = if i == 0 && self.rng.gen_bool(0.5) { NEXT_HOP } else { NEXT_DEST };
                let mut opts = Vec::new();
                if self.rng.gen_bool(0.5) {
                    opts.extend([5, 2, 0, 0]); // router alert
                }
                let pad = self.rng.gen_range(0..12);
                if pad > 0 {
                    opts.extend([1, pad as u8]);
                    opts.extend(std::iter::repeat_n(0, pad));
                }
                Ext::Opts { kind, opts }
            })
            .collect()
    }

    /// Chains of any extension headers in any order, also with lengths that lie.
    fn random_exts(&mut self) -> Vec<Ext> {
        let n = self.rng.gen_range(1..=8);
        (0..n)
            .map(|_| match self.rng.gen_range(0..6) {
                0 => Ext::Opts { kind: NEXT_HOP, opts: vec![] },
                1 => Ext::Opts { kind: NEXT_DEST, opts: self.bytes(6) },
                2 => Ext::Routing { ty: 0, left: 1, addrs: vec![self.rng.gen()] },
                3 => Ext::Fragment { offset: self.rng.gen_range(0..4), more: self.rng.gen(), id: self.rng.gen() },
                4 => {
                    let len = self.rng.gen();
                    let mut rest = vec![len];
                    rest.extend(self.bytes(6));
                    Ext::Raw { kind: *[NEXT_HOP, NEXT_DEST, NEXT_ROUTING, NEXT_AH, NEXT_NONE, 50].choose(&mut self.rng).unwrap(), rest }
                }
                _ => Ext::Raw { kind: NEXT_AH, rest: vec![1, 0, 0, 0, 0, 0, 0] },
            })
            .collect()
    }

    /// A truncation point: at or next to a header boundary, or anywhere.
    fn cut_point(&mut self, spec: &Spec, len: usize) -> usize {
        let l4 = spec.l4_offset();
        let ip_hl = if spec.v6() { 40 } else { 20 + spec.ip_opts.len().div_ceil(4) * 4 };
        let l4_hl = match &spec.l4 {
            L4::Tcp { opts, .. } => 20 + opts.len().div_ceil(4) * 4,
            _ => 8,
        };
        let marks = [
            0,
            ETH_HLEN,
            ETH_HLEN + 1,
            ETH_HLEN + 6,
            ETH_HLEN + ip_hl,
            l4,
            l4 + 2,
            l4 + 4,
            l4 + 8,
            l4 + 13,
            l4 + 14,
            l4 + 16,
            l4 + 18,
            l4 + l4_hl,
            l4 + l4_hl + 8,
        ];
        let c = if self.rng.gen_bool(0.8) {
            let m = *marks.choose(&mut self.rng).unwrap() as i64 + self.rng.gen_range(-1..=1);
            m.max(0) as usize
        } else {
            self.rng.gen_range(0..len)
        };
        c.min(len.saturating_sub(1))
    }

    /// A length field set to zero, to one less or more than the truth, to the header length
    /// alone or to the maximum (the IPv4 header checksum kept valid).
    fn lying_length(&mut self, spec: &Spec) -> Vec<u8> {
        let mut b = spec.build();
        let l4 = spec.l4_offset();
        let v6 = spec.v6();
        match self.rng.gen_range(0..4) {
            0 => {
                // IP total length / payload length
                let (off, truth, hl) = if v6 { (ETH_HLEN + 4, b.len() - ETH_HLEN - 40, 0) } else { (ETH_HLEN + 2, b.len() - ETH_HLEN, l4 - ETH_HLEN) };
                let v = *[0, 1, hl.saturating_sub(1), hl, hl + 2, truth - 1, truth + 1, 0xffff].choose(&mut self.rng).unwrap();
                b[off..off + 2].copy_from_slice(&(v.min(0xffff) as u16).to_be_bytes());
            }
            1 if !v6 => {
                // IHL
                let ihl = *[0u8, 1, 4, 6, 15].choose(&mut self.rng).unwrap();
                b[ETH_HLEN] = 0x40 | ihl;
            }
            1 | 2 => match &spec.l4 {
                L4::Udp { .. } => {
                    let truth = b.len() - l4;
                    let v = *[0usize, 1, 7, 8, truth - 1, truth + 1, 0xffff].choose(&mut self.rng).unwrap();
                    b[l4 + 4..l4 + 6].copy_from_slice(&(v.min(0xffff) as u16).to_be_bytes());
                }
                L4::Tcp { .. } => {
                    let doff = *[0u8, 1, 4, 6, 15].choose(&mut self.rng).unwrap();
                    b[l4 + 12] = (doff << 4) | (b[l4 + 12] & 0x0f);
                }
                _ => {
                    if b.len() > l4 {
                        b.truncate(l4 + (b.len() - l4) / 2);
                    }
                }
            },
            _ => {
                // Frame with trailing bytes (Ethernet padding) beyond the IP datagram.
                let n = self.rng.gen_range(1..=32);
                b.extend(std::iter::repeat_n(0, n));
            }
        }
        if !v6 {
            fix_ipv4_csum(&mut b);
        }
        b
    }
}

/// What is wrong with a quoted packet in an ICMP error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// The quote ends before the ports.
    CutBeforePorts,
    /// The quote has the ports but less than 8 bytes of the transport header.
    CutInL4,
    QuotedVersion,
    QuotedIhl,
    QuotedProto,
    /// A flow nobody knows.
    UnknownFlow,
    /// Addressed to another host than the frontend it quotes.
    OtherHost,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::CutBeforePorts => "ICMP quote cut before the ports",
            Fault::CutInL4 => "ICMP quote cut inside the transport header",
            Fault::QuotedVersion => "ICMP quote of the wrong IP version",
            Fault::QuotedIhl => "ICMP quote with IHL < 5",
            Fault::QuotedProto => "ICMP quote of an ICMP packet",
            Fault::UnknownFlow => "ICMP error about an unknown flow",
            Fault::OtherHost => "ICMP error to another host quoting a frontend",
        }
    }
}
