//! The desired dataplane state: frontends and the backends behind them. Sources and
//! translation produce it; the map writer (`dataplane::lbmap`) programs it.
use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use gardenet_common::{PROTO_TCP, PROTO_UDP};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => PROTO_TCP,
            Proto::Udp => PROTO_UDP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            PROTO_TCP => Some(Proto::Tcp),
            PROTO_UDP => Some(Proto::Udp),
            _ => None,
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// Which clients a frontend's backend set is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scope {
    /// Everyone (the set every hook finds first).
    #[default]
    All,
    /// Clients on this node (socket LB), where they get other backends than traffic from
    /// outside: external frontends of `externalTrafficPolicy: Local` Services.
    ThisNode,
}

impl Scope {
    pub fn number(self) -> u8 {
        match self {
            Scope::All => gardenet_common::SCOPE_ALL,
            Scope::ThisNode => gardenet_common::SCOPE_THIS_NODE,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            gardenet_common::SCOPE_ALL => Some(Scope::All),
            gardenet_common::SCOPE_THIS_NODE => Some(Scope::ThisNode),
            _ => None,
        }
    }

    fn is_all(&self) -> bool {
        *self == Scope::All
    }
}

/// Where clients send traffic: a VIP (ClusterIP, node IP for NodePort, external IP), a port
/// and a protocol; `scope` tells a frontend's second backend set (for clients on this node)
/// from its first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frontend {
    /// IPv4 or IPv6 (the address family selects the v4 or v6 maps).
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Proto,
    #[serde(default, skip_serializing_if = "Scope::is_all")]
    pub scope: Scope,
}

impl Frontend {
    pub fn new(addr: IpAddr, port: u16, proto: Proto) -> Self {
        Frontend { addr, port, proto, scope: Scope::All }
    }

    /// The same frontend's set for clients on this node.
    pub fn for_this_node(self) -> Self {
        Frontend { scope: Scope::ThisNode, ..self }
    }
}

/// Suffix of a `Scope::ThisNode` frontend in its text form.
const THIS_NODE_SUFFIX: &str = "@this-node";

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", SocketAddr::new(self.addr, self.port), self.proto)?;
        if self.scope == Scope::ThisNode {
            f.write_str(THIS_NODE_SUFFIX)?;
        }
        Ok(())
    }
}

/// Parses `ADDR:PORT[/tcp|udp][@this-node]` (default tcp).
impl FromStr for Frontend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(base) = s.strip_suffix(THIS_NODE_SUFFIX) {
            return Ok(base.parse::<Frontend>()?.for_this_node());
        }
        let (hostport, proto) = match s.rsplit_once('/') {
            Some((hp, "tcp")) => (hp, Proto::Tcp),
            Some((hp, "udp")) => (hp, Proto::Udp),
            Some((_, p)) => return Err(format!("unknown protocol {p:?} in {s:?} (tcp or udp)")),
            None => (s, Proto::Tcp),
        };
        let b: Backend = hostport.parse()?;
        Ok(Frontend::new(b.addr, b.port, proto))
    }
}

/// A backend endpoint. Its protocol is the frontend's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
    /// Runs on another node (its EndpointSlice says so): external traffic to it is
    /// source-NATed when the frontend asks for it (`FrontendSpec::snat_remote`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remote: bool,
}

impl Backend {
    /// A backend on this node (or of unknown location).
    pub fn new(addr: IpAddr, port: u16) -> Self {
        Backend { addr, port, remote: false }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", SocketAddr::new(self.addr, self.port))
    }
}

/// Parses `ADDR:PORT` or `[IPV6]:PORT`; port 0 is rejected (it can never be dialled).
impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.rsplit_once(':').ok_or_else(|| format!("{s:?}: expected ADDR:PORT"))?;
        let addr: IpAddr = match a.strip_prefix('[').and_then(|a| a.strip_suffix(']')) {
            Some(v6) => IpAddr::V6(v6.parse().map_err(|e| format!("{s:?}: bad IPv6 address: {e}"))?),
            None => IpAddr::V4(a.parse().map_err(|e| format!("{s:?}: bad IPv4 address (IPv6 goes in brackets): {e}"))?),
        };
        let port: u16 = p.parse().map_err(|_| format!("{s:?}: port must be 1-65535"))?;
        if port == 0 {
            return Err(format!("{s:?}: port must be 1-65535"));
        }
        Ok(Backend::new(addr, port))
    }
}

/// A client prefix of `loadBalancerSourceRanges`, host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// `addr/len` with the bits beyond `len` cleared; `None` if `len` is too long.
    pub fn new(addr: IpAddr, len: u8) -> Option<Self> {
        let addr = match addr {
            IpAddr::V4(a) if len <= 32 => IpAddr::V4((u32::from(a) & u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)).into()),
            IpAddr::V6(a) if len <= 128 => IpAddr::V6((u128::from(a) & u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0)).into()),
            _ => return None,
        };
        Some(Cidr { addr, len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Parses `ADDR/LEN` (as `net.ParseCIDR`: host bits are dropped); a bare address is a /32
/// or /128.
impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, l) = s.trim().split_once('/').map_or((s.trim(), None), |(a, l)| (a, Some(l)));
        let addr: IpAddr = a.parse().map_err(|_| format!("{s:?} is not a CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            Some(l) => l.parse::<u8>().ok().filter(|l| *l <= max).ok_or_else(|| format!("{s:?}: prefix length must be 0-{max}"))?,
            None => max,
        };
        Cidr::new(addr, len).ok_or_else(|| format!("{s:?} is not a CIDR"))
    }
}

/// What one frontend should do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrontendSpec {
    /// Distinct backends; empty means "refuse connections" (or drop them, see `drop`).
    pub backends: Vec<Backend>,
    /// Without backends, drop instead of reject: the Service has endpoints, none usable
    /// here (kube-proxy: "has no local endpoints" DROP vs "has no endpoints" REJECT).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drop: bool,
    /// The frontend also has a `Scope::ThisNode` set (socket LB looks it up).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub two_scopes: bool,
    /// ClientIP session affinity timeout in seconds (0 = none).
    pub affinity_timeout: u32,
    /// Source-NAT TC LB flows to remote backends (external frontends of
    /// `externalTrafficPolicy: Cluster` Services), so their replies come back through here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snat_remote: bool,
    /// `loadBalancerSourceRanges` of a load-balancer frontend (its family only): TC LB admits
    /// new flows only from these. Empty: from anywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<Cidr>,
}

/// The whole desired state.
pub type Desired = BTreeMap<Frontend, FrontendSpec>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_like_parse_cidr() {
        let c: Cidr = "198.51.100.77/24".parse().unwrap();
        assert_eq!(c.to_string(), "198.51.100.0/24");
        assert_eq!("10.0.0.1".parse::<Cidr>().unwrap().to_string(), "10.0.0.1/32");
        assert_eq!("0.0.0.0/0".parse::<Cidr>().unwrap().len, 0);
        assert_eq!("2001:db8::1/32".parse::<Cidr>().unwrap().to_string(), "2001:db8::/32");
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("nonsense/8".parse::<Cidr>().is_err());
    }

    #[test]
    fn frontends_of_both_families_parse_and_print() {
        for (s, shown) in [
            ("10.96.0.10:80/tcp", "10.96.0.10:80/tcp"),
            ("10.96.0.10:53/udp", "10.96.0.10:53/udp"),
            ("[fd00::10]:80/tcp", "[fd00::10]:80/tcp"),
            ("[fd00:19:0::10]:53/udp", "[fd00:19::10]:53/udp"),
            ("[fd00::10]:80", "[fd00::10]:80/tcp"),
        ] {
            let fe: Frontend = s.parse().unwrap();
            assert_eq!(fe.to_string(), shown);
            assert_eq!(fe.to_string().parse::<Frontend>().unwrap(), fe);
        }
        let fe: Frontend = "[fd00::10]:80/tcp".parse().unwrap();
        assert!(fe.addr.is_ipv6());
        let node: Frontend = "10.0.0.1:30080/udp@this-node".parse().unwrap();
        assert_eq!(node, Frontend::new("10.0.0.1".parse().unwrap(), 30080, Proto::Udp).for_this_node());
        assert_eq!(node.to_string(), "10.0.0.1:30080/udp@this-node");
        assert_eq!(serde_json::to_value(node).unwrap()["scope"], "this-node");
        assert!(serde_json::to_value(fe).unwrap().get("scope").is_none());
        assert!("fd00::10:80".parse::<Frontend>().is_err(), "IPv6 needs brackets");
        assert!("[10.0.0.1]:80".parse::<Backend>().is_err());
        assert!("[fd00::1]:0".parse::<Backend>().is_err());
        let b: Backend = "[fd00:18:1::10]:8080".parse().unwrap();
        assert_eq!(b.to_string(), "[fd00:18:1::10]:8080");
        assert_eq!(serde_json::to_value(b).unwrap()["addr"], "fd00:18:1::10");
    }
}
