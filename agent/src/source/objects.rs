//! What translation reads from a Service or an EndpointSlice, digested once on arrival.
//!
//! Sources keep these (and share them with the pipeline) instead of whole k8s-openapi objects:
//! an endpoint is ~56 bytes here against ~780 as an object, which is the difference between
//! an agent that fits its memory budget with 100,000 endpoints and one that does not.
//! Digesting is where addresses are parsed; what does not parse is kept as a problem and
//! reported whenever the Service is translated, exactly as before.
use std::net::IpAddr;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};

use crate::desired::{Cidr, Proto};

/// Label that hands a Service to a specific proxy; gardenet only takes unlabelled ones
/// (or the ones labelled with its own name).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const PROXY_NAME: &str = "gardenet";
/// Label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Default ClientIP affinity timeout (kube-proxy's: 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// A Service as translation sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceView {
    pub namespace: String,
    pub name: String,
    /// `creationTimestamp` in seconds: when two Services claim one frontend, the older keeps it.
    pub created: Option<i64>,
    /// Why gardenet leaves this Service alone (another proxy's, ExternalName, headless).
    pub skipped: Option<String>,
    /// Found while digesting: unparsable addresses, unknown families, a missing spec.
    pub problems: Vec<String>,
    /// Families served, primary first (`true` = IPv4): `ipFamilies`, else those of the
    /// cluster IPs. Empty: no restriction.
    pub families: Vec<bool>,
    /// Cluster IPs of the served families.
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.externalIPs` of the served families.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of the served families.
    pub lb_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` (applied to `lb_ips`); empty: no restriction.
    pub source_ranges: Vec<Cidr>,
    pub ports: Vec<PortView>,
    /// `NodePort` or `LoadBalancer`.
    pub node_ports: bool,
    pub load_balancer: bool,
    /// ClientIP affinity timeout in seconds; 0 without affinity.
    pub affinity_timeout: u32,
    pub external_local: bool,
    pub internal_local: bool,
    /// ClusterIPs of a Service left to another proxy (`skipped`): traffic to them is not
    /// ours to drop or reject.
    pub foreign_cluster_ips: Vec<IpAddr>,
    pub health_check_node_port: Option<i32>,
}

/// A ServiceCIDR (`networking.k8s.io/v1`, GA in 1.33): the service ranges it declares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceCidrView {
    pub name: String,
    pub cidrs: Vec<Cidr>,
    /// Ranges that do not parse (reported; the others still apply).
    pub problems: Vec<String>,
}

impl From<&ServiceCIDR> for ServiceCidrView {
    fn from(o: &ServiceCIDR) -> Self {
        let mut v = ServiceCidrView { name: o.metadata.name.clone().unwrap_or_default(), ..Default::default() };
        for c in o.spec.iter().flat_map(|s| s.cidrs.iter().flatten()) {
            match c.parse::<Cidr>() {
                Ok(c) => v.cidrs.push(c),
                Err(e) => v.problems.push(format!("ServiceCIDR {}: {e}", v.name)),
            }
        }
        v
    }
}

/// One `spec.ports[]` entry (validated at translation, where problems are reported).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortView {
    /// Empty when unnamed.
    pub name: String,
    /// The protocol, or its name when gardenet does not support it.
    pub proto: Result<Proto, String>,
    pub port: i32,
    pub node_port: Option<i32>,
}

impl PortView {
    /// How problems name this port.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            self.port.to_string()
        } else {
            self.name.clone()
        }
    }
}

/// An EndpointSlice as translation sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceView {
    pub namespace: String,
    pub name: String,
    /// The owning Service's name (`kubernetes.io/service-name`), if labelled.
    pub service: Option<String>,
    /// `true` = IPv4, `false` = IPv6; `None` for FQDN slices, which are not used.
    pub ipv4: Option<bool>,
    pub ports: Vec<SlicePortView>,
    /// One entry per endpoint address.
    pub endpoints: Vec<EndpointView>,
    /// Addresses that are not of the slice's family or do not parse.
    pub problems: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePortView {
    pub name: String,
    pub proto: Result<Proto, String>,
    pub port: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointView {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<Box<str>>,
    /// Topology hints; `None` when the endpoint has none (most endpoints: one pointer).
    pub hints: Option<Box<Hints>>,
}

/// An endpoint's `hints`: zones (`forZones`, written for `trafficDistribution: PreferClose`
/// / `PreferSameZone` and `topology-mode: Auto`) and nodes (`forNodes`, for
/// `PreferSameNode`). Empty lists mean "no hint of that kind".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub zones: Box<[Box<str>]>,
    pub nodes: Box<[Box<str>]>,
}

impl EndpointView {
    pub fn zone_hints(&self) -> &[Box<str>] {
        self.hints.as_ref().map_or(&[], |h| &h.zones)
    }

    pub fn node_hints(&self) -> &[Box<str>] {
        self.hints.as_ref().map_or(&[], |h| &h.nodes)
    }
}

fn proto(p: Option<&str>) -> Result<Proto, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Proto::Tcp),
        "UDP" => Ok(Proto::Udp),
        other => Err(other.to_owned()),
    }
}

fn family_name(v4: bool) -> &'static str {
    if v4 {
        "IPv4"
    } else {
        "IPv6"
    }
}

impl ServiceView {
    /// `namespace/name`, the key Services and their slices are matched by.
    pub fn key(&self) -> String {
        object_key(&self.namespace, &self.name)
    }

    /// Precedence for a contested frontend: older first, then by key (a Service without a
    /// timestamp counts as newest). Stable across restarts, unlike "whoever came first".
    pub fn rank(&self) -> (i64, String) {
        (self.created.unwrap_or(i64::MAX), self.key())
    }
}

impl From<&Service> for ServiceView {
    fn from(svc: &Service) -> Self {
        let meta = &svc.metadata;
        let mut v = ServiceView {
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().unwrap_or_default(),
            created: meta.creation_timestamp.as_ref().map(|t| t.0.as_second()),
            ..Default::default()
        };
        if let Some(p) = meta.labels.as_ref().and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL)) {
            if p != PROXY_NAME {
                v.skipped = Some(format!("service-proxy-name is {p:?}"));
                let spec = svc.spec.as_ref();
                let ips = spec.and_then(|s| s.cluster_ips.clone()).or_else(|| spec.and_then(|s| s.cluster_ip.clone()).map(|ip| vec![ip])).unwrap_or_default();
                v.foreign_cluster_ips = ips.iter().filter_map(|ip| ip.parse().ok()).collect();
                return v;
            }
        }
        let Some(spec) = &svc.spec else {
            v.problems.push("no spec".into());
            return v;
        };
        let type_ = spec.type_.as_deref();
        if type_ == Some("ExternalName") {
            v.skipped = Some("ExternalName".into());
            return v;
        }
        let cluster_ips: Vec<&str> = match (&spec.cluster_ips, &spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
            (_, Some(ip)) => vec![ip.as_str()],
            _ => vec![],
        };
        if cluster_ips.contains(&"None") {
            v.skipped = Some("headless".into());
            return v;
        }

        // `ipFamilies` (the API server always fills it in), else the cluster IPs' families.
        for f in spec.ip_families.iter().flatten() {
            match f.as_str() {
                "IPv4" => v.families.push(true),
                "IPv6" => v.families.push(false),
                other => v.problems.push(format!("ipFamilies: unknown family {other:?}")),
            }
        }
        let mut vips = Vec::new();
        for ip in &cluster_ips {
            match ip.parse::<IpAddr>() {
                Ok(a) => vips.push(a),
                Err(_) => v.problems.push(format!("clusterIP {ip:?} is not an IP address")),
            }
        }
        if v.families.is_empty() {
            v.families = vips.iter().map(IpAddr::is_ipv4).collect();
        }
        for a in vips {
            v.keep("clusterIP", a, Dest::Cluster);
        }
        for ip in spec.external_ips.iter().flatten() {
            match ip.parse::<IpAddr>() {
                Ok(a) => v.keep("externalIP", a, Dest::External),
                Err(_) => v.problems.push(format!("externalIP {ip:?} is not an IP address")),
            }
        }
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
        // `ipMode: Proxy` (KEP-1860): the load balancer proxies and must see the traffic, so
        // the node does not short-circuit its IP (as kube-proxy).
        for ip in ingress.into_iter().flatten().filter(|i| i.ip_mode.as_deref() != Some("Proxy")).filter_map(|i| i.ip.as_ref()) {
            match ip.parse::<IpAddr>() {
                Ok(a) => v.keep("loadBalancer ingress", a, Dest::LoadBalancer),
                Err(_) => v.problems.push(format!("loadBalancer ingress {ip:?} is not an IP address")),
            }
        }

        v.ports = spec
            .ports
            .iter()
            .flatten()
            .map(|sp| PortView { name: sp.name.clone().unwrap_or_default(), proto: proto(sp.protocol.as_deref()), port: sp.port, node_port: sp.node_port })
            .collect();
        v.node_ports = matches!(type_, Some("NodePort") | Some("LoadBalancer"));
        v.load_balancer = type_ == Some("LoadBalancer");
        v.affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
            spec.session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .map(|t| t.clamp(1, 86_400) as u32)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT)
        } else {
            0
        };
        v.external_local = spec.external_traffic_policy.as_deref() == Some("Local");
        v.internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
        // Topology (the `topology-mode` annotation, `trafficDistribution`) reaches the proxy
        // only as EndpointSlice hints, which the EndpointSlice controller writes: as in
        // kube-proxy since 1.31, the hints alone decide.
        v.health_check_node_port = spec.health_check_node_port;
        for r in spec.load_balancer_source_ranges.iter().flatten() {
            match r.parse::<Cidr>() {
                Ok(c) => v.source_ranges.push(c),
                // kube-proxy ignores what does not parse; an empty result would open the
                // Service to everyone, so a range that does not parse is also reported.
                Err(e) => v.problems.push(format!("loadBalancerSourceRanges: {e} (ignored)")),
            }
        }
        v.source_ranges.sort();
        v.source_ranges.dedup();
        v
    }
}

impl ServiceView {
    /// Whether addresses of this family are served.
    pub fn serves(&self, a: &IpAddr) -> bool {
        self.families.is_empty() || self.families.contains(&a.is_ipv4())
    }

    fn keep(&mut self, what: &str, a: IpAddr, dest: Dest) {
        if !self.serves(&a) {
            self.problems.push(format!("{what} {a}: {} is not in the Service's ipFamilies (skipped)", family_name(a.is_ipv4())));
            return;
        }
        match dest {
            Dest::Cluster => self.cluster_ips.push(a),
            Dest::External => self.external_ips.push(a),
            Dest::LoadBalancer => self.lb_ips.push(a),
        }
    }
}

/// Which list of a `ServiceView` an address goes to.
enum Dest {
    Cluster,
    External,
    LoadBalancer,
}

impl SliceView {
    /// `namespace/name` of this slice.
    pub fn key(&self) -> String {
        object_key(&self.namespace, &self.name)
    }

    /// The key of the Service this slice belongs to, if it is labelled.
    pub fn service_key(&self) -> Option<String> {
        self.service.as_ref().map(|s| object_key(&self.namespace, s))
    }
}

impl From<&EndpointSlice> for SliceView {
    fn from(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        let ipv4 = match slice.address_type.as_str() {
            "IPv4" => Some(true),
            "IPv6" => Some(false),
            _ => None, // FQDN
        };
        let mut v = SliceView {
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().unwrap_or_default(),
            service: meta.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)).cloned(),
            ipv4,
            ..Default::default()
        };
        let Some(v4) = ipv4 else { return v };
        v.ports = slice
            .ports
            .iter()
            .flatten()
            .map(|p| SlicePortView { name: p.name.clone().unwrap_or_default(), proto: proto(p.protocol.as_deref()), port: p.port })
            .collect();
        for ep in slice.endpoints.iter().flatten() {
            let c = ep.conditions.as_ref();
            // nil ready means ready; nil serving means "same as ready".
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            let serving = c.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
            let hints = ep.hints.as_ref().and_then(|h| {
                let zones: Box<[Box<str>]> = h.for_zones.iter().flatten().map(|z| z.name.as_str().into()).collect();
                let nodes: Box<[Box<str>]> = h.for_nodes.iter().flatten().map(|n| n.name.as_str().into()).collect();
                (!zones.is_empty() || !nodes.is_empty()).then(|| Box::new(Hints { zones, nodes }))
            });
            for a in &ep.addresses {
                match a.parse::<IpAddr>() {
                    Ok(addr) if addr.is_ipv4() == v4 => v.endpoints.push(EndpointView {
                        addr,
                        ready,
                        serving,
                        terminating,
                        node: ep.node_name.as_deref().map(Into::into),
                        hints: hints.clone(),
                    }),
                    _ => v.problems.push(format!("endpoint address {a:?} is not {}", family_name(v4))),
                }
            }
        }
        v.endpoints.shrink_to_fit();
        v
    }
}

/// `namespace/name`, as the pipeline keys its objects. Built by hand: `format!` costs several
/// times as much, and a full sync makes a few of these per object.
pub fn object_key(namespace: &str, name: &str) -> String {
    let mut k = String::with_capacity(namespace.len() + 1 + name.len());
    k.push_str(namespace);
    k.push('/');
    k.push_str(name);
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_small() {
        // The memory budget (10,000 Services x 10 endpoints in < 150 MiB) rests on this.
        assert!(std::mem::size_of::<EndpointView>() <= 56, "{}", std::mem::size_of::<EndpointView>());
    }

    #[test]
    fn slice_digest_keeps_conditions_and_reports_foreign_addresses() {
        let s: EndpointSlice = serde_yaml::from_str(
            "metadata: {name: a, namespace: d, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 80, protocol: SCTP}]\nendpoints:\n- {addresses: [10.0.0.1, \"fd00::1\"], nodeName: n1, conditions: {ready: false, serving: true}}",
        )
        .unwrap();
        let v = SliceView::from(&s);
        assert_eq!(v.service_key().as_deref(), Some("d/web"));
        assert_eq!(v.ports[0].proto, Err("SCTP".into()));
        assert_eq!(v.endpoints.len(), 1);
        assert!(!v.endpoints[0].ready && v.endpoints[0].serving);
        assert_eq!(v.endpoints[0].node.as_deref(), Some("n1"));
        assert_eq!(v.problems, ["endpoint address \"fd00::1\" is not IPv4"]);
    }

    #[test]
    fn fqdn_slices_are_kept_empty() {
        let s: EndpointSlice = serde_yaml::from_str("metadata: {name: a, namespace: d}\naddressType: FQDN\nendpoints: [{addresses: [example.org]}]").unwrap();
        let v = SliceView::from(&s);
        assert_eq!(v.ipv4, None);
        assert!(v.endpoints.is_empty() && v.problems.is_empty());
    }
}
