//! The desired dataplane state: frontends and the backends behind them. Sources and
//! translation produce it; the map writer (`lbmap`) programs it.
use std::{collections::BTreeMap, fmt, net::Ipv4Addr, str::FromStr};

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

/// Where clients send traffic: a VIP (ClusterIP, node IP for NodePort, external IP), a port
/// and a protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Proto,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto)
    }
}

/// Parses `ADDR:PORT[/tcp|udp]` (default tcp).
impl FromStr for Frontend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (hostport, proto) = match s.rsplit_once('/') {
            Some((hp, "tcp")) => (hp, Proto::Tcp),
            Some((hp, "udp")) => (hp, Proto::Udp),
            Some((_, p)) => return Err(format!("unknown protocol {p:?} in {s:?} (tcp or udp)")),
            None => (s, Proto::Tcp),
        };
        let b: Backend = hostport.parse()?;
        Ok(Frontend { addr: b.addr, port: b.port, proto })
    }
}

/// A backend endpoint. Its protocol is the frontend's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Backend {
    pub addr: Ipv4Addr,
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.addr, self.port)
    }
}

/// Parses `ADDR:PORT`; port 0 is rejected (it can never be dialled).
impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.rsplit_once(':').ok_or_else(|| format!("{s:?}: expected ADDR:PORT"))?;
        let addr = a.parse().map_err(|e| format!("{s:?}: bad IPv4 address: {e}"))?;
        let port: u16 = p.parse().map_err(|_| format!("{s:?}: port must be 1-65535"))?;
        if port == 0 {
            return Err(format!("{s:?}: port must be 1-65535"));
        }
        Ok(Backend { addr, port })
    }
}

/// What one frontend should do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrontendSpec {
    /// Distinct backends; empty means "refuse connections".
    pub backends: Vec<Backend>,
    /// ClientIP session affinity timeout in seconds (0 = none).
    pub affinity_timeout: u32,
}

/// The whole desired state.
pub type Desired = BTreeMap<Frontend, FrontendSpec>;
