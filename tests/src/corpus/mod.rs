//! Hostile input for the TC and XDP programs (`tests/tests/packet_corpus.rs`): a seeded
//! generator of valid and mutated packets (`gen`), the frames it builds (`build`), and a
//! checker that judges each program's output with an independent parser (etherparse)
//! against what the maps say (`check`). Here: the checker's view of a running agent's maps.
pub mod build;
pub mod check;
pub mod gen;

#[cfg(test)]
mod tests;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use gardenet_agent::dataplane::lbmap::{MapDump, ServiceNet};
use gardenet_common::*;

use check::{Backend, Conntrack, CtKey, CtVal, Frontend, Maps, Net};

fn v4(a: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(a.to_ne_bytes()))
}

fn v6(a: Ip6) -> IpAddr {
    IpAddr::V6(Ipv6Addr::from(ip6_octets(a)))
}

/// The frontends (scope "all"), their backends and the service nets of a map dump.
pub fn maps_from_dump(d: &MapDump) -> Maps {
    let mut m = Maps::default();
    let be4: HashMap<u32, Backend4> = d.backends.iter().copied().collect();
    let be6: HashMap<u32, Backend6> = d.backends6.iter().copied().collect();
    let s4: HashMap<ServiceKey4, ServiceValue> = d.services.iter().copied().collect();
    let s6: HashMap<ServiceKey6, ServiceValue> = d.services6.iter().copied().collect();
    for (k, v) in &s4 {
        if k.slot != 0 || k.scope != SCOPE_ALL {
            continue;
        }
        let backends = (1..=v.count)
            .filter_map(|slot| s4.get(&k.with_slot(slot)).and_then(|s| be4.get(&s.backend_id)))
            .map(|b| Backend { addr: v4(b.addr), port: u16::from_be(b.port), remote: b.flags & BE_FLAG_REMOTE != 0 })
            .collect();
        m.frontends.insert((v4(k.addr), u16::from_be(k.port), k.proto), Frontend { flags: v.flags, backends });
    }
    for (k, v) in &s6 {
        if k.slot != 0 || k.scope != SCOPE_ALL {
            continue;
        }
        let backends = (1..=v.count)
            .filter_map(|slot| s6.get(&k.with_slot(slot)).and_then(|s| be6.get(&s.backend_id)))
            .map(|b| Backend { addr: v6(b.addr), port: u16::from_be(b.port), remote: b.flags & BE_FLAG_REMOTE != 0 })
            .collect();
        m.frontends.insert((v6(k.addr), u16::from_be(k.port), k.proto), Frontend { flags: v.flags, backends });
    }
    for (c, n) in &d.service_nets {
        let n = match n {
            ServiceNet::Range => Net::Range,
            ServiceNet::ClusterIp => Net::ClusterIp,
            ServiceNet::Foreign => Net::Foreign,
        };
        m.nets.push((c.addr, c.len, n));
    }
    m
}

/// The conntrack maps an agent pinned, read with one lookup per question.
pub struct PinnedConntrack {
    v4: BpfHashMap<MapData, CtKey4, CtValue4>,
    v6: BpfHashMap<MapData, CtKey6, CtValue6>,
}

impl PinnedConntrack {
    pub fn open(bpffs: &Path) -> Result<Self> {
        let open = |name: &str| -> Result<Map> { Ok(Map::LruHashMap(MapData::from_pin(bpffs.join(name)).with_context(|| format!("pinned {name}"))?)) };
        Ok(PinnedConntrack { v4: BpfHashMap::try_from(open(MAP_CT)?)?, v6: BpfHashMap::try_from(open(MAP_CT6)?)? })
    }
}

impl Conntrack for PinnedConntrack {
    fn get(&self, k: &CtKey) -> Option<CtVal> {
        match (k.src, k.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let key = CtKey4 {
                    saddr: u32::from_ne_bytes(s.octets()),
                    daddr: u32::from_ne_bytes(d.octets()),
                    sport: k.sport.to_be(),
                    dport: k.dport.to_be(),
                    proto: k.proto,
                    dir: k.dir,
                    _pad: 0,
                };
                let v = self.v4.get(&key, 0).ok()?;
                Some(CtVal { addr: v4(v.addr), port: u16::from_be(v.port), flags: v.flags })
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let key = CtKey6 {
                    saddr: ip6_from_octets(s.octets()),
                    daddr: ip6_from_octets(d.octets()),
                    sport: k.sport.to_be(),
                    dport: k.dport.to_be(),
                    proto: k.proto,
                    dir: k.dir,
                    _pad: 0,
                };
                let v = self.v6.get(&key, 0).ok()?;
                Some(CtVal { addr: v6(v.addr), port: u16::from_be(v.port), flags: v.flags })
            }
            _ => None,
        }
    }
}

/// Hex dump of a frame, 16 bytes a line.
pub fn hexdump(b: &[u8]) -> String {
    b.chunks(16).enumerate().map(|(i, c)| format!("    {:04x}  {}\n", i * 16, c.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" "))).collect()
}
