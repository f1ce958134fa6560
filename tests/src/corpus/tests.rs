//! The generator's packets are what they claim to be, and the checker accepts what the
//! maps say and refuses everything else (translations done here by rebuilding the packet).
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
};

use gardenet_common::{CT_DIR_FORWARD, CT_DIR_REPLY};

use super::{
    build::*,
    check::{check, wellformed, Backend, CtKey, CtVal, Frontend, Kind, Maps, Net, Prog, Run, Want},
    gen::{Flow, Gen, Plan},
};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

const VIP: &str = "198.19.0.10";
const EMPTY: &str = "198.19.0.20";
const CLIENT: &str = "198.18.0.2";
const BE: &str = "198.18.1.10";

fn maps() -> Maps {
    let mut m = Maps::default();
    for proto in [PROTO_TCP, PROTO_UDP] {
        let be = |a: &str| Backend { addr: ip(a), port: 8080, remote: false };
        m.frontends.insert((ip(VIP), 80, proto), Frontend { flags: 0, backends: vec![be(BE), be("198.18.1.11")] });
        m.frontends.insert((ip(EMPTY), 80, proto), Frontend::default());
        m.frontends.insert((ip("fd00:19::10"), 80, proto), Frontend { flags: 0, backends: vec![be("fd00:18:1::10")] });
    }
    m.nets = vec![(ip("198.19.0.0"), 24, Net::Range), (ip(VIP), 32, Net::ClusterIp), (ip(EMPTY), 32, Net::ClusterIp)];
    m
}

fn syn(src: &str, dst: &str, sport: u16, dport: u16) -> Spec {
    Spec::new(ip(src), ip(dst), L4::Tcp { sport, dport, seq: 1000, ack: 0, flags: TCP_SYN, window: 1000, opts: syn_options(7), payload: vec![] })
}

fn ran(retval: i32, data: Vec<u8>) -> Run {
    Run::Ran { retval, data }
}

fn ct_fwd(src: &str, dst: &str, sport: u16, dport: u16, proto: u8, to: &str, port: u16) -> HashMap<CtKey, CtVal> {
    let mut ct = HashMap::new();
    ct.insert(CtKey { src: ip(src), dst: ip(dst), sport, dport, proto, dir: CT_DIR_FORWARD }, CtVal { addr: ip(to), port, flags: 0 });
    ct
}

#[test]
fn built_packets_are_well_formed() {
    let udp = |no_csum| L4::Udp { sport: 5, dport: 53, payload: vec![1, 2, 3], no_csum };
    for (src, dst) in [(CLIENT, VIP), ("fd00:18::2", "fd00:19::10")] {
        let mut specs = vec![syn(src, dst, 1234, 80), Spec::new(ip(src), ip(dst), udp(false))];
        specs.push(Spec::new(ip(src), ip(dst), L4::Icmp { ty: if dst.contains(':') { 128 } else { 8 }, code: 0, rest: [0, 1, 0, 1], payload: vec![9; 20] }));
        let mut q = specs[0].clone();
        q.ip_opts = vec![1, 7, 7, 4, 0, 0, 0, 0];
        q.exts =
            if dst.contains(':') { vec![Ext::Opts { kind: NEXT_HOP, opts: vec![5, 2, 0, 0] }, Ext::Opts { kind: NEXT_DEST, opts: vec![] }] } else { vec![] };
        specs.push(q);
        for s in &specs {
            let b = s.build();
            wellformed(&b).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        }
    }
    // UDP without checksum: fine over IPv4, not over IPv6.
    assert!(wellformed(&Spec::new(ip(CLIENT), ip(VIP), udp(true)).build()).is_ok());
    assert!(wellformed(&Spec::new(ip("fd00:18::2"), ip("fd00:19::10"), udp(true)).build()).is_err());
    let mut f = syn(CLIENT, VIP, 1, 80);
    f.frag = 0x2000;
    assert!(wellformed(&f.build()).is_err(), "fragments are not well-formed for the checker");
    let mut b = syn(CLIENT, VIP, 1, 80).build();
    b[ETH_HLEN + 10] ^= 1;
    assert!(wellformed(&b).is_err());
}

#[test]
fn untouched_packets_pass_and_changed_xdp_packets_fail() {
    let m = maps();
    let ct = HashMap::new();
    let b = syn(CLIENT, "198.18.9.9", 1, 2).build();
    let o = check(Prog::TcEgress, &m, &ct, &b, &ran(-1, b.clone())).unwrap();
    assert_eq!(o.kind, Kind::Passed);
    assert!(!o.malformed);
    let mut c = b.clone();
    c[30] ^= 1;
    assert!(check(Prog::Xdp, &m, &ct, &b, &ran(2, c)).is_err());
    assert!(check(Prog::TcIngress, &m, &ct, &b, &ran(0, b.clone())).is_err(), "TC_ACT_OK is not what the programs return");
    assert_eq!(check(Prog::Xdp, &m, &ct, &b[..10], &Run::Rejected(22)).unwrap().kind, Kind::Short);
    assert!(check(Prog::Xdp, &m, &ct, &b, &Run::Rejected(22)).is_err());
    // TC test runs refuse an IP EtherType without the IP header after it; XDP runs do not.
    assert_eq!(check(Prog::TcIngress, &m, &ct, &b[..33], &Run::Rejected(22)).unwrap().kind, Kind::Short);
    assert!(check(Prog::Xdp, &m, &ct, &b[..33], &Run::Rejected(22)).is_err());
}

#[test]
fn dnat_to_the_conntrack_backend_with_valid_checksums_is_accepted() {
    let m = maps();
    let input = syn(CLIENT, VIP, 1234, 80);
    let mut out = input.clone();
    out.dst = ip(BE);
    if let L4::Tcp { dport, .. } = &mut out.l4 {
        *dport = 8080;
    }
    let ct = ct_fwd(CLIENT, VIP, 1234, 80, PROTO_TCP, BE, 8080);
    let o = check(Prog::TcIngress, &m, &ct, &input.build(), &ran(-1, out.build())).unwrap();
    assert_eq!(o.kind, Kind::Dnat);
    // Another backend of the same frontend than the one conntrack names: refused.
    let ct2 = ct_fwd(CLIENT, VIP, 1234, 80, PROTO_TCP, "198.18.1.11", 8080);
    assert!(check(Prog::TcIngress, &m, &ct2, &input.build(), &ran(-1, out.build())).is_err());
    // A broken checksum: refused.
    let mut bad = out.build();
    let l4 = out.l4_offset();
    bad[l4 + 17] ^= 1;
    let e = check(Prog::TcIngress, &m, &ct, &input.build(), &ran(-1, bad)).unwrap_err();
    assert!(e.contains("checksum"), "{e}");
    // The egress program never DNATs.
    assert!(check(Prog::TcEgress, &m, &ct, &input.build(), &ran(-1, out.build())).is_err());
}

#[test]
fn a_bad_input_checksum_must_stay_bad_by_the_same_amount() {
    let m = maps();
    let input = syn(CLIENT, VIP, 1234, 80);
    let mut out = input.clone();
    out.dst = ip(BE);
    if let L4::Tcp { dport, .. } = &mut out.l4 {
        *dport = 8080;
    }
    let ct = ct_fwd(CLIENT, VIP, 1234, 80, PROTO_TCP, BE, 8080);
    let l4 = input.l4_offset();
    let (mut i, mut o) = (input.build(), out.build());
    i[l4 + 16] ^= 0x10;
    o[l4 + 16] ^= 0x10;
    let r = check(Prog::TcIngress, &m, &ct, &i, &ran(-1, o.clone())).unwrap();
    assert_eq!((r.kind, r.malformed), (Kind::Dnat, true));
    // "Repairing" it is as wrong as breaking it.
    assert!(check(Prog::TcIngress, &m, &ct, &i, &ran(-1, out.build())).is_err());
}

#[test]
fn reverse_nat_and_udp_without_checksum() {
    let m = maps();
    let mut ct = HashMap::new();
    ct.insert(
        CtKey { src: ip(BE), dst: ip(CLIENT), sport: 8080, dport: 1234, proto: PROTO_UDP, dir: CT_DIR_REPLY },
        CtVal { addr: ip(VIP), port: 80, flags: 0 },
    );
    for no_csum in [false, true] {
        let input = Spec::new(ip(BE), ip(CLIENT), L4::Udp { sport: 8080, dport: 1234, payload: vec![7; 9], no_csum });
        let mut out = input.clone();
        out.src = ip(VIP);
        if let L4::Udp { sport, .. } = &mut out.l4 {
            *sport = 80;
        }
        for p in [Prog::TcIngress, Prog::TcEgress] {
            assert_eq!(check(p, &m, &ct, &input.build(), &ran(-1, out.build())).unwrap().kind, Kind::RevNat);
        }
        // Translated to a frontend the reply entry does not name: refused.
        out.src = ip(EMPTY);
        assert!(check(Prog::TcEgress, &m, &ct, &input.build(), &ran(-1, out.build())).is_err());
    }
}

#[test]
fn the_rst_answer_must_be_exact() {
    let m = maps();
    let ct = HashMap::new();
    let input = syn(CLIENT, EMPTY, 1234, 80);
    let mut rst = Spec::new(
        ip(EMPTY),
        ip(CLIENT),
        L4::Tcp { sport: 80, dport: 1234, seq: 0, ack: 1001, flags: TCP_RST | TCP_ACK, window: 0, opts: vec![1; 20], payload: vec![] },
    );
    let mut out = rst.build();
    out[0..6].copy_from_slice(&MAC_PEER);
    out[6..12].copy_from_slice(&MAC_NODE);
    assert_eq!(check(Prog::TcIngress, &m, &ct, &input.build(), &ran(7, out)).unwrap().kind, Kind::Rst);
    rst.l4 = L4::Tcp { sport: 80, dport: 1234, seq: 0, ack: 1000, flags: TCP_RST | TCP_ACK, window: 0, opts: vec![1; 20], payload: vec![] };
    let mut out = rst.build();
    out[0..6].copy_from_slice(&MAC_PEER);
    out[6..12].copy_from_slice(&MAC_NODE);
    assert!(check(Prog::TcIngress, &m, &ct, &input.build(), &ran(7, out)).is_err(), "ack must be seq + 1");
    // A SYN to a frontend with backends is never answered with a RST.
    let b = syn(CLIENT, VIP, 1234, 80).build();
    assert!(check(Prog::TcIngress, &m, &ct, &b, &ran(7, b.clone())).is_err());
}

#[test]
fn drops_only_where_the_maps_say() {
    let m = maps();
    let ct = HashMap::new();
    let ack = |dst: &str| {
        Spec::new(ip(CLIENT), ip(dst), L4::Tcp { sport: 1, dport: 80, seq: 1, ack: 1, flags: TCP_ACK, window: 1, opts: vec![], payload: vec![] }).build()
    };
    let drop = |p: Prog, b: &[u8], v: i32| check(p, &m, &ct, b, &ran(v, b.to_vec()));
    assert_eq!(drop(Prog::TcIngress, &ack(EMPTY), 2).unwrap().kind, Kind::Dropped);
    assert_eq!(drop(Prog::Xdp, &ack(EMPTY), 1).unwrap().kind, Kind::Dropped);
    assert!(drop(Prog::Xdp, &syn(CLIENT, EMPTY, 1, 80).build(), 1).is_err(), "XDP leaves SYNs to TC");
    assert!(drop(Prog::TcIngress, &ack(VIP), 2).is_err());
    assert!(drop(Prog::TcEgress, &ack(EMPTY), 2).is_err(), "egress never drops");
    // Unallocated service address: fresh SYNs and UDP only.
    assert_eq!(drop(Prog::TcIngress, &syn(CLIENT, "198.19.0.99", 1, 80).build(), 2).unwrap().kind, Kind::Dropped);
    assert!(drop(Prog::TcIngress, &ack("198.19.0.99"), 2).is_err());
}

#[test]
fn icmp_errors_are_rewritten_only_for_the_frontend_they_quote() {
    let m = maps();
    let ct = ct_fwd(CLIENT, VIP, 1234, 80, PROTO_TCP, BE, 8080);
    let quote = |src: &str| {
        let mut q = Spec::new(
            ip(src),
            ip(CLIENT),
            L4::Tcp { sport: if src == VIP { 80 } else { 8080 }, dport: 1234, seq: 5, ack: 6, flags: TCP_ACK, window: 9, opts: vec![], payload: vec![] },
        );
        q.ttl = 1;
        q.ip_bytes()[..28].to_vec()
    };
    let err = |dst: &str, src: &str| Spec::new(ip("198.18.0.254"), ip(dst), L4::Icmp { ty: 11, code: 0, rest: [0; 4], payload: quote(src) });
    let input = err(VIP, VIP);
    let out = err(BE, BE);
    assert_eq!(check(Prog::TcIngress, &m, &ct, &input.build(), &ran(-1, out.build())).unwrap().kind, Kind::IcmpRevNat);
    // The same error addressed to another host: must not be turned into one for the backend.
    let input = err("198.18.0.77", VIP);
    let e = check(Prog::TcIngress, &m, &ct, &input.build(), &ran(-1, out.build())).unwrap_err();
    assert!(e.contains("addressed to 198.18.0.77"), "{e}");
}

#[test]
fn the_wide_checksum_sum_folds_like_the_plain_one() {
    let plain = |d: &[u8]| fold(d.chunks(2).map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u64).sum());
    let mut d = Vec::new();
    for n in 0..300u32 {
        d.push((n.wrapping_mul(2_654_435_761) >> 13) as u8);
        assert_eq!(fold(sum16(&d)), plain(&d), "{} bytes", d.len());
    }
    assert_eq!(fold(sum16(&[0xff; 4096])), plain(&[0xff; 4096]));
}

#[test]
fn want_sets() {
    let w = Want::of(&[Kind::Rst, Kind::Passed]);
    assert!(w.has(Kind::Rst) && w.has(Kind::Passed) && !w.has(Kind::Dropped));
    let s = w.swap(Kind::Rst, Kind::Dropped);
    assert!(!s.has(Kind::Rst) && s.has(Kind::Dropped) && s.has(Kind::Passed));
    assert_eq!(Want::ANY.swap(Kind::Rst, Kind::Dropped), Want::ANY);
}

fn plan() -> Plan {
    let v = |s: &[&str]| s.iter().map(|a| ip(a)).collect::<Vec<_>>();
    Plan {
        web: vec![sa("198.19.0.10:80"), sa("[fd00:19::10]:80")],
        empty: vec![sa("198.19.0.20:80"), sa("[fd00:19::20]:80")],
        unserved: vec![sa("198.19.0.10:81"), sa("[fd00:19::10]:81")],
        unallocated: v(&["198.19.0.99", "fd00:19::99"]),
        others: v(&[BE, "fd00:18:1::10"]),
        clients: v(&[CLIENT, "fd00:18::2"]),
        routers: v(&["198.18.0.254", "fd00:18::fe"]),
        flows: vec![Flow { client: sa("198.18.0.2:40000"), frontend: sa("198.19.0.10:80"), proto: PROTO_TCP, backend: sa("198.18.1.10:8080"), snat: None }],
        max_frame: 1500,
    }
}

#[test]
fn the_generator_is_deterministic_and_covers_its_kinds() {
    let a: Vec<_> = {
        let mut g = Gen::new(7, plan());
        (0..3000).map(|_| g.case()).collect()
    };
    let mut g = Gen::new(7, plan());
    for c in &a {
        assert_eq!(g.case().bytes, c.bytes);
    }
    let mut mutations: HashMap<&str, usize> = HashMap::new();
    for c in &a {
        *mutations.entry(c.mutation).or_default() += 1;
        assert!(c.bytes.len() <= 1500, "{} {} is {} bytes", c.base, c.mutation, c.bytes.len());
        if c.mutation == "none" && c.base != "garbage" {
            // Unmutated bases are well-formed IP packets (or not IP at all).
            assert!(c.base == "non-IP" || wellformed(&c.bytes).is_ok(), "{} {:?}: {:?}", c.base, wellformed(&c.bytes), c.bytes);
        }
    }
    for m in [
        "none",
        "truncated",
        "IPv4 options",
        "IPv6 hop-by-hop/destination options",
        "IPv4 fragment",
        "IPv6 fragment",
        "IPv6 routing header",
        "byte flips",
        "maximal size",
        "length field lies",
    ] {
        assert!(mutations.get(m).copied().unwrap_or(0) > 10, "{m}: {mutations:?}");
    }
    assert!(mutations.keys().any(|m| m.starts_with("ICMP")), "{mutations:?}");
}

#[test]
fn extension_chains_that_stop_parsing_are_located_safely() {
    // Hop-by-hop after a destination-options header: etherparse's lax parse stops there.
    let mut s = syn("fd00:18::2", "fd00:19::10", 1, 80);
    s.exts = vec![Ext::Opts { kind: NEXT_DEST, opts: vec![] }, Ext::Opts { kind: NEXT_HOP, opts: vec![] }];
    let b = s.build();
    assert!(wellformed(&b).is_err());
    let o = check(Prog::TcIngress, &maps(), &HashMap::new(), &b, &ran(-1, b.clone())).unwrap();
    assert_eq!((o.kind, o.malformed), (Kind::Passed, true));
    // A length byte that runs past the frame.
    let mut b = b;
    b[ETH_HLEN + 41] = 200;
    check(Prog::Xdp, &maps(), &HashMap::new(), &b, &ran(2, b.clone())).unwrap();
}
