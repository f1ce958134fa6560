//! The CNI protocol's data: versions, the error object with the spec's codes, and the
//! result in the shape each version defines (SPEC.md 1.1.0, "Result Types"; 0.3.x/0.4.0
//! carry `version` per IP, 1.1.0 adds an interface's `mtu`).
use std::{fmt, net::IpAddr};

use ipnet::IpNet;
use serde_json::{json, Map, Value};

/// What this plugin speaks, oldest first (the result formats from 0.3.0 on; 0.1.0/0.2.0
/// results had no interfaces and are not served).
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const LATEST: Version = Version(1, 1, 0);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u16, pub u16, pub u16);

impl Version {
    pub fn parse(s: &str) -> Option<Version> {
        let mut it = s.split('.').map(|p| p.parse::<u16>().ok());
        let v = Version(it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    }

    pub fn supported(self) -> bool {
        SUPPORTED_VERSIONS.contains(&self.to_string().as_str())
    }

    /// Results before 1.0.0 say each address's family (`"version": "4"`).
    fn ips_carry_version(self) -> bool {
        self < Version(1, 0, 0)
    }

    /// `STATUS` and `GC` exist from 1.1.0 on.
    pub fn has_status_and_gc(self) -> bool {
        self >= Version(1, 1, 0)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The spec's well-known error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    UnknownContainer = 3,
    InvalidEnvironment = 4,
    Io = 5,
    Decode = 6,
    InvalidConfig = 7,
    TryAgainLater = 11,
    NotAvailable = 50,
    LimitedConnectivity = 51,
    Internal = 999,
}

/// A failure as the runtime is told it: `{"cniVersion", "code", "msg", "details"}` on
/// stdout, and a non-zero exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        Self { code: code as u32, msg: msg.into(), details: String::new() }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// Adds what was being done to the message, keeping the code.
    pub fn context(mut self, what: &str) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    pub fn to_json(&self, version: Version) -> Value {
        let mut m = Map::new();
        m.insert("cniVersion".into(), json!(version.to_string()));
        m.insert("code".into(), json!(self.code));
        m.insert("msg".into(), json!(self.msg));
        if !self.details.is_empty() {
            m.insert("details".into(), json!(self.details));
        }
        Value::Object(m)
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.msg, self.code)?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

pub type CniResult<T> = Result<T, CniError>;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: String,
    pub mtu: Option<u32>,
    /// The pod's network namespace, for interfaces inside it.
    pub sandbox: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`.
    pub interface: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dns {
    pub nameservers: Vec<String>,
    pub domain: Option<String>,
    pub search: Vec<String>,
    pub options: Vec<String>,
}

/// A version-independent result; [`Outcome::to_json`] gives it the requested version's shape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

impl Outcome {
    pub fn to_json(&self, version: Version) -> Value {
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut m = Map::new();
                m.insert("name".into(), json!(i.name));
                if !i.mac.is_empty() {
                    m.insert("mac".into(), json!(i.mac));
                }
                if let (Some(mtu), true) = (i.mtu, version >= Version(1, 1, 0)) {
                    m.insert("mtu".into(), json!(mtu));
                }
                if let Some(s) = &i.sandbox {
                    m.insert("sandbox".into(), json!(s));
                }
                Value::Object(m)
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|ip| {
                let mut m = Map::new();
                if version.ips_carry_version() {
                    m.insert("version".into(), json!(if ip.address.addr().is_ipv4() { "4" } else { "6" }));
                }
                m.insert("address".into(), json!(ip.address.to_string()));
                if let Some(g) = ip.gateway {
                    m.insert("gateway".into(), json!(g.to_string()));
                }
                if let Some(i) = ip.interface {
                    m.insert("interface".into(), json!(i));
                }
                Value::Object(m)
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|r| match r.gw {
                Some(gw) => json!({"dst": r.dst.to_string(), "gw": gw.to_string()}),
                None => json!({"dst": r.dst.to_string()}),
            })
            .collect();
        let mut dns = Map::new();
        if !self.dns.nameservers.is_empty() {
            dns.insert("nameservers".into(), json!(self.dns.nameservers));
        }
        if let Some(d) = &self.dns.domain {
            dns.insert("domain".into(), json!(d));
        }
        if !self.dns.search.is_empty() {
            dns.insert("search".into(), json!(self.dns.search));
        }
        if !self.dns.options.is_empty() {
            dns.insert("options".into(), json!(self.dns.options));
        }
        let mut m = Map::new();
        m.insert("cniVersion".into(), json!(version.to_string()));
        m.insert("interfaces".into(), Value::Array(interfaces));
        m.insert("ips".into(), Value::Array(ips));
        if !routes.is_empty() {
            m.insert("routes".into(), Value::Array(routes));
        }
        m.insert("dns".into(), Value::Object(dns));
        Value::Object(m)
    }

    /// Reads a result of any supported version (a delegated IPAM plugin's, or a
    /// `prevResult`); fields a version does not have are simply absent.
    pub fn from_json(v: &Value) -> CniResult<Outcome> {
        let bad = |what: String| CniError::new(Code::Decode, format!("result: {what}"));
        let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        let text = |v: &Value, field: &str| -> CniResult<Option<String>> {
            match v.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(format!("{field}: expected a string, got {other}"))),
            }
        };
        let list = |field: &str| -> CniResult<Vec<Value>> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(a)) => Ok(a.clone()),
                Some(other) => Err(bad(format!("{field}: expected a list, got {other}"))),
            }
        };
        let addr = |s: String, field: &str| -> CniResult<IpAddr> { s.parse().map_err(|_| bad(format!("{field}: {s:?} is not an IP address"))) };
        let net = |s: String, field: &str| -> CniResult<IpNet> { s.parse().map_err(|_| bad(format!("{field}: {s:?} is not an address with a prefix length"))) };
        let mut out = Outcome::default();
        for i in list("interfaces")? {
            out.interfaces.push(Interface {
                name: text(&i, "name")?.ok_or_else(|| bad("interfaces[].name is missing".into()))?,
                mac: text(&i, "mac")?.unwrap_or_default(),
                mtu: i.get("mtu").and_then(Value::as_u64).map(|m| m as u32),
                sandbox: text(&i, "sandbox")?,
            });
        }
        for ip in list("ips")? {
            let address = net(text(&ip, "address")?.ok_or_else(|| bad("ips[].address is missing".into()))?, "ips[].address")?;
            let gateway = text(&ip, "gateway")?.map(|g| addr(g, "ips[].gateway")).transpose()?;
            let interface = match ip.get("interface") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| bad(format!("ips[].interface: expected an index, got {v}")))? as usize),
            };
            out.ips.push(IpConfig { address, gateway, interface });
        }
        for r in list("routes")? {
            let dst = net(text(&r, "dst")?.ok_or_else(|| bad("routes[].dst is missing".into()))?, "routes[].dst")?;
            let gw = text(&r, "gw")?.map(|g| addr(g, "routes[].gw")).transpose()?;
            out.routes.push(Route { dst, gw });
        }
        if let Some(d) = obj.get("dns").filter(|d| d.is_object()) {
            let strings = |field: &str| -> Vec<String> {
                d.get(field).and_then(Value::as_array).map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect()).unwrap_or_default()
            };
            out.dns = Dns { nameservers: strings("nameservers"), domain: text(d, "domain")?, search: strings("search"), options: strings("options") };
        }
        Ok(out)
    }
}

/// `VERSION`'s answer.
pub fn version_info(version: Version) -> Value {
    json!({"cniVersion": version.to_string(), "supportedVersions": SUPPORTED_VERSIONS})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Outcome {
        Outcome {
            interfaces: vec![
                Interface { name: "gn0123456789ab".into(), mac: "ee:ee:ee:ee:ee:ee".into(), mtu: Some(1450), sandbox: None },
                Interface { name: "eth0".into(), mac: "02:00:00:00:00:01".into(), mtu: Some(1450), sandbox: Some("/run/netns/p".into()) },
            ],
            ips: vec![
                IpConfig { address: "198.18.100.2/32".parse().unwrap(), gateway: Some("169.254.1.1".parse().unwrap()), interface: Some(1) },
                IpConfig { address: "fd00:100::2/128".parse().unwrap(), gateway: Some("fe80::ecee:eeff:feee:eeee".parse().unwrap()), interface: Some(1) },
            ],
            routes: vec![Route { dst: "0.0.0.0/0".parse().unwrap(), gw: Some("169.254.1.1".parse().unwrap()) }],
            dns: Dns::default(),
        }
    }

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(Version::parse("1.1.0"), Some(Version(1, 1, 0)));
        assert_eq!(Version::parse("0.3.1"), Some(Version(0, 3, 1)));
        for bad in ["", "1", "1.0", "1.0.0.0", "a.b.c", "1.0.-1", " 1.0.0"] {
            assert_eq!(Version::parse(bad), None, "{bad:?}");
        }
        assert!(Version(0, 4, 0) < Version(1, 0, 0));
        assert!(Version(1, 0, 0).supported() && !Version(0, 2, 0).supported() && !Version(2, 0, 0).supported());
        assert!(Version(1, 1, 0).has_status_and_gc() && !Version(1, 0, 0).has_status_and_gc());
    }

    #[test]
    fn results_take_the_shape_of_the_requested_version() {
        let r = sample();
        let old = r.to_json(Version(0, 4, 0));
        assert_eq!(old["cniVersion"], "0.4.0");
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        assert!(old["interfaces"][0].get("mtu").is_none());
        let v1 = r.to_json(Version(1, 0, 0));
        assert!(v1["ips"][0].get("version").is_none());
        assert!(v1["interfaces"][1].get("mtu").is_none());
        assert_eq!(v1["interfaces"][1]["sandbox"], "/run/netns/p");
        let v11 = r.to_json(Version(1, 1, 0));
        assert_eq!(v11["interfaces"][1]["mtu"], 1450);
        assert_eq!(v11["ips"][1]["address"], "fd00:100::2/128");
        assert_eq!(v11["routes"][0]["gw"], "169.254.1.1");
    }

    #[test]
    fn a_result_reads_back_in_every_version() {
        let r = sample();
        for v in SUPPORTED_VERSIONS {
            let v = Version::parse(v).unwrap();
            let mut back = Outcome::from_json(&r.to_json(v)).unwrap();
            if v < Version(1, 1, 0) {
                back.interfaces.iter_mut().zip(&r.interfaces).for_each(|(b, o)| b.mtu = o.mtu);
            }
            assert_eq!(back, r, "{v}");
        }
    }

    #[test]
    fn host_local_results_parse() {
        let v = serde_json::json!({"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.1.0.2/24","gateway":"10.1.0.1"}],"dns":{}});
        let r = Outcome::from_json(&v).unwrap();
        assert_eq!(r.ips[0].address.to_string(), "10.1.0.2/24");
        assert_eq!(r.ips[0].interface, None);
        for bad in [
            serde_json::json!([]),
            serde_json::json!({"ips":[{"address":"10.1.0.2"}]}),
            serde_json::json!({"ips":[{"address":"x/24"}]}),
            serde_json::json!({"ips":"10.1.0.2/24"}),
            serde_json::json!({"ips":[{"address":"10.1.0.2/24","interface":-1}]}),
            serde_json::json!({"routes":[{"gw":"10.0.0.1"}]}),
        ] {
            assert_eq!(Outcome::from_json(&bad).unwrap_err().code, Code::Decode as u32, "{bad}");
        }
    }

    #[test]
    fn errors_carry_code_message_and_details() {
        let e = CniError::new(Code::InvalidConfig, "mtu: 20 is below 68").with_details("from the conflist");
        let j = e.to_json(Version(1, 0, 0));
        assert_eq!(j, serde_json::json!({"cniVersion":"1.0.0","code":7,"msg":"mtu: 20 is below 68","details":"from the conflist"}));
        assert!(CniError::new(Code::Io, "x").to_json(LATEST).get("details").is_none());
    }
}
