//! Service + EndpointSlices (+ this node) -> frontends and their backends, the way kube-proxy
//! reads them. Pure: no I/O, unit-tested.
use std::{collections::BTreeSet, net::IpAddr};

use k8s_openapi::api::{
    core::v1::{Service, ServicePort},
    discovery::v1::EndpointSlice,
};

use crate::model::{Backend, Frontend, FrontendSpec, Proto};

/// Label that hands a Service to a specific proxy; gardenet only takes unlabelled ones
/// (or the ones labelled with its own name).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const PROXY_NAME: &str = "gardenet";
/// Label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Default ClientIP affinity timeout (kube-proxy's: 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// What translation needs to know about this node.
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    pub name: String,
    /// Addresses (IPv4 and IPv6) NodePorts are served on, for the Service's families.
    pub addresses: Vec<IpAddr>,
    pub zone: Option<String>,
}

/// Why a Service (or part of it) was not programmed. Logged and counted; the rest of the
/// Service and every other Service still get programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub service: String,
    pub message: String,
}

/// Result of translating one Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Translated {
    pub frontends: Vec<(Frontend, FrontendSpec)>,
    pub problems: Vec<Problem>,
    /// Deliberately not ours (headless, ExternalName, another proxy's).
    pub skipped: Option<String>,
    /// `externalTrafficPolicy: Local` with a `healthCheckNodePort`: the agent answers it.
    pub health_check: Option<HealthCheck>,
}

/// What the healthCheckNodePort reports (as kube-proxy: 200 with local endpoints, else 503).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub namespace: String,
    pub name: String,
    pub local_endpoints: usize,
}

/// Annotations that turn on topology-aware routing.
const TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
const TOPOLOGY_HINTS_OLD: &str = "service.kubernetes.io/topology-aware-hints";

pub fn service_key(svc: &Service) -> String {
    format!("{}/{}", svc.metadata.namespace.as_deref().unwrap_or("default"), svc.metadata.name.as_deref().unwrap_or(""))
}

/// The Service key an EndpointSlice belongs to, if it is labelled.
pub fn slice_service_key(slice: &EndpointSlice) -> Option<String> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some(format!("{}/{}", slice.metadata.namespace.as_deref().unwrap_or("default"), name))
}

pub fn translate(svc: &Service, slices: &[&EndpointSlice], node: &NodeInfo) -> Translated {
    let key = service_key(svc);
    let mut out = Translated::default();
    let problem = |out: &mut Translated, m: String| out.problems.push(Problem { service: key.clone(), message: m });

    if let Some(p) = svc.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL)) {
        if p != PROXY_NAME {
            out.skipped = Some(format!("service-proxy-name is {p:?}"));
            return out;
        }
    }
    let Some(spec) = &svc.spec else {
        problem(&mut out, "no spec".into());
        return out;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        out.skipped = Some("ExternalName".into());
        return out;
    }
    let cluster_ips: Vec<&str> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        (_, Some(ip)) => vec![ip.as_str()],
        _ => vec![],
    };
    if cluster_ips.iter().any(|ip| *ip == "None") {
        out.skipped = Some("headless".into());
        return out;
    }

    // The families this Service has: `ipFamilies` (the API server always fills it in), else
    // the families of its cluster IPs. Addresses of other families are not served.
    let mut families: Vec<bool> = Vec::new(); // true = IPv4
    for f in spec.ip_families.iter().flatten() {
        match f.as_str() {
            "IPv4" => families.push(true),
            "IPv6" => families.push(false),
            other => problem(&mut out, format!("ipFamilies: unknown family {other:?}")),
        }
    }
    let mut vips: Vec<IpAddr> = Vec::new();
    for ip in &cluster_ips {
        match ip.parse::<IpAddr>() {
            Ok(a) => vips.push(a),
            Err(_) => problem(&mut out, format!("clusterIP {ip:?} is not an IP address")),
        }
    }
    if families.is_empty() {
        families = vips.iter().map(|a| a.is_ipv4()).collect();
    }
    let served = |a: &IpAddr| families.is_empty() || families.contains(&a.is_ipv4());
    let fam_name = |a: &IpAddr| if a.is_ipv4() { "IPv4" } else { "IPv6" };
    let keep = |out: &mut Translated, what: &str, a: IpAddr, list: &mut Vec<IpAddr>| {
        if served(&a) {
            list.push(a);
        } else {
            out.problems.push(Problem { service: key.clone(), message: format!("{what} {a}: {} is not in the Service's ipFamilies (skipped)", fam_name(&a)) });
        }
    };
    let all_vips = std::mem::take(&mut vips);
    for a in all_vips {
        keep(&mut out, "clusterIP", a, &mut vips);
    }
    let mut external: Vec<IpAddr> = Vec::new();
    for ip in spec.external_ips.iter().flatten() {
        match ip.parse::<IpAddr>() {
            Ok(a) => keep(&mut out, "externalIP", a, &mut external),
            Err(_) => problem(&mut out, format!("externalIP {ip:?} is not an IP address")),
        }
    }
    let lb_ips = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
    for ing in lb_ips.into_iter().flatten() {
        if let Some(ip) = &ing.ip {
            match ip.parse::<IpAddr>() {
                Ok(a) => keep(&mut out, "loadBalancer ingress", a, &mut external),
                Err(_) => problem(&mut out, format!("loadBalancer ingress {ip:?} is not an IP address")),
            }
        }
    }
    // NodePorts on the node's addresses of the Service's families.
    let node_addrs: Vec<IpAddr> = node.addresses.iter().copied().filter(|a| served(a)).collect();
    // Health checks count the local endpoints of the primary family (a dual-stack pod has one
    // address per family).
    let primary_v4 = families.first().copied().unwrap_or(true);

    let affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .map(|t| t.clamp(1, 86_400) as u32)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT)
    } else {
        0
    };
    let node_ports = matches!(spec.type_.as_deref(), Some("NodePort") | Some("LoadBalancer"));
    let ext_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let int_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let ann = svc.metadata.annotations.as_ref();
    let topology = ann
        .and_then(|a| a.get(TOPOLOGY_MODE).or_else(|| a.get(TOPOLOGY_HINTS_OLD)))
        .is_some_and(|v| v.eq_ignore_ascii_case("auto"));
    let mut local_total: BTreeSet<Backend> = BTreeSet::new();

    let mut seen: BTreeSet<Frontend> = BTreeSet::new();
    for sp in spec.ports.iter().flatten() {
        let proto = match sp.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Proto::Tcp,
            "UDP" => Proto::Udp,
            other => {
                problem(&mut out, format!("port {}: protocol {other} is not supported (skipped)", port_label(sp)));
                continue;
            }
        };
        let Some(port) = valid_port(sp.port) else {
            problem(&mut out, format!("port {}: {} is out of range 1-65535", port_label(sp), sp.port));
            continue;
        };
        let cands = endpoints_for(sp, proto, slices, &mut out, &key);
        // Per family: [IPv4, IPv6] x (internal, external). A frontend only gets backends of
        // its own family (no NAT46/64).
        let mut specs: Vec<(FrontendSpec, FrontendSpec)> = Vec::with_capacity(2);
        for v4 in [true, false] {
            let fam: Vec<&Candidate> = cands.iter().filter(|c| c.backend.addr.is_ipv4() == v4).collect();
            let local = pick(fam.iter().copied().filter(|c| c.node.as_deref() == Some(node.name.as_str()) && !node.name.is_empty()));
            if v4 == primary_v4 {
                local_total.extend(local.iter().copied());
            }
            let cluster = match node.zone.as_deref() {
                // Hints are used only when every endpoint has them and some are for our zone.
                Some(z) if topology && fam.iter().all(|c| c.zones.is_some()) && fam.iter().any(|c| c.zones.as_ref().is_some_and(|zs| zs.iter().any(|x| x == z))) => {
                    pick(fam.iter().copied().filter(|c| c.zones.as_ref().is_some_and(|zs| zs.iter().any(|x| x == z))))
                }
                _ => pick(fam.iter().copied()),
            };
            let internal = FrontendSpec { backends: if int_local { local.clone() } else { cluster.clone() }, affinity_timeout };
            let externl = FrontendSpec { backends: if ext_local { local } else { cluster }, affinity_timeout };
            specs.push((internal, externl));
        }
        let fam_idx = |a: &IpAddr| if a.is_ipv4() { 0 } else { 1 };
        let mut add = |out: &mut Translated, fe: Frontend, fs: &FrontendSpec| {
            if seen.insert(fe) {
                out.frontends.push((fe, fs.clone()));
            } else {
                out.problems.push(Problem { service: key.clone(), message: format!("frontend {fe} listed twice") });
            }
        };
        for vip in &vips {
            add(&mut out, Frontend { addr: *vip, port, proto }, &specs[fam_idx(vip)].0);
        }
        for vip in &external {
            add(&mut out, Frontend { addr: *vip, port, proto }, &specs[fam_idx(vip)].1);
        }
        if node_ports {
            match sp.node_port.map(|p| (p, valid_port(p))) {
                Some((_, Some(np))) => {
                    for a in &node_addrs {
                        add(&mut out, Frontend { addr: *a, port: np, proto }, &specs[fam_idx(a)].1);
                    }
                }
                Some((p, None)) => problem(&mut out, format!("port {}: nodePort {p} is out of range", port_label(sp))),
                None => {} // not allocated yet
            }
        }
    }
    if ext_local && spec.type_.as_deref() == Some("LoadBalancer") {
        if let Some(p) = spec.health_check_node_port.and_then(valid_port) {
            out.health_check = Some(HealthCheck {
                port: p,
                namespace: svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                name: svc.metadata.name.clone().unwrap_or_default(),
                local_endpoints: local_total.len(),
            });
        }
    }
    out
}

/// One endpoint address of a Service port, with what the selection rules need.
struct Candidate {
    backend: Backend,
    ready: bool,
    serving: bool,
    node: Option<String>,
    zones: Option<Vec<String>>,
}

/// Ready endpoints; when none is ready, the serving (terminating) ones, as kube-proxy does.
fn pick<'a>(cands: impl Iterator<Item = &'a Candidate>) -> Vec<Backend> {
    let mut ready = BTreeSet::new();
    let mut serving = BTreeSet::new();
    for c in cands {
        if c.ready {
            ready.insert(c.backend);
        } else if c.serving {
            serving.insert(c.backend);
        }
    }
    if ready.is_empty() { serving.into_iter().collect() } else { ready.into_iter().collect() }
}

fn valid_port(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

fn port_label(sp: &ServicePort) -> String {
    sp.name.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| sp.port.to_string())
}

/// Endpoint candidates for one Service port from all slices (merged; duplicates are resolved
/// by `pick`).
fn endpoints_for(sp: &ServicePort, proto: Proto, slices: &[&EndpointSlice], out: &mut Translated, key: &str) -> Vec<Candidate> {
    let want_name = sp.name.as_deref().unwrap_or("");
    let proto_s = match proto {
        Proto::Tcp => "TCP",
        Proto::Udp => "UDP",
    };
    let mut cands = Vec::new();
    for slice in slices {
        let slice_v4 = match slice.address_type.as_str() {
            "IPv4" => true,
            "IPv6" => false,
            _ => continue, // FQDN
        };
        // EndpointSlice ports are matched to Service ports by name (named targetPorts are
        // resolved by the EndpointSlice controller into the number here).
        let Some(port) = slice.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or("") == want_name && p.protocol.as_deref().unwrap_or("TCP") == proto_s
        }) else {
            continue;
        };
        let Some(pn) = port.port.and_then(valid_port) else {
            out.problems.push(Problem { service: key.into(), message: format!("EndpointSlice {} port {want_name:?} has no valid number", slice.metadata.name.as_deref().unwrap_or("")) });
            continue;
        };
        for ep in slice.endpoints.iter().flatten() {
            let c = ep.conditions.as_ref();
            // nil ready means ready; nil serving means "same as ready".
            let is_ready = c.and_then(|c| c.ready).unwrap_or(true);
            let is_serving = c.and_then(|c| c.serving).unwrap_or(is_ready);
            for a in &ep.addresses {
                let addr = match a.parse::<IpAddr>() {
                    Ok(addr) if addr.is_ipv4() == slice_v4 => addr,
                    _ => {
                        let fam = if slice_v4 { "IPv4" } else { "IPv6" };
                        out.problems.push(Problem { service: key.into(), message: format!("endpoint address {a:?} is not {fam}") });
                        continue;
                    }
                };
                cands.push(Candidate {
                    backend: Backend { addr, port: pn },
                    ready: is_ready,
                    serving: is_serving,
                    node: ep.node_name.clone(),
                    zones: ep.hints.as_ref().and_then(|h| h.for_zones.as_ref()).map(|z| z.iter().map(|z| z.name.clone()).collect()),
                });
            }
        }
    }
    cands
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn svc(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).unwrap()
    }
    pub fn slice(yaml: &str) -> EndpointSlice {
        serde_yaml::from_str(yaml).unwrap()
    }

    const SVC: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: web, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
"#;
    const SLICE: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-abc, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
- addresses: [10.0.0.2]
- addresses: [10.0.0.3]
  conditions: {ready: false, serving: true, terminating: true}
"#;

    fn node() -> NodeInfo {
        NodeInfo { name: "n1".into(), addresses: vec!["192.0.2.10".parse().unwrap()], zone: None }
    }

    fn fe(s: &str) -> Frontend {
        s.parse().unwrap()
    }
    fn bes(v: &[&str]) -> Vec<Backend> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn cluster_ip_with_named_ports_and_two_protocols() {
        let t = translate(&svc(SVC), &[&slice(SLICE)], &node());
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        assert_eq!(t.frontends.len(), 2);
        assert_eq!(t.frontends[0].0, fe("10.96.0.10:80/tcp"));
        assert_eq!(t.frontends[0].1.backends, bes(&["10.0.0.1:8080", "10.0.0.2:8080"]));
        assert_eq!(t.frontends[1].0, fe("10.96.0.10:53/udp"));
        assert_eq!(t.frontends[1].1.backends, bes(&["10.0.0.1:5353", "10.0.0.2:5353"]));
    }

    #[test]
    fn serving_terminating_used_only_when_nothing_is_ready() {
        let s = SLICE.replace("conditions: {ready: true}", "conditions: {ready: false, serving: false}").replace("- addresses: [10.0.0.2]\n", "");
        let t = translate(&svc(SVC), &[&slice(&s)], &node());
        assert_eq!(t.frontends[0].1.backends, bes(&["10.0.0.3:8080"]));
    }

    #[test]
    fn slices_are_merged_and_deduplicated() {
        let a = slice(SLICE);
        let b = slice(&SLICE.replace("web-abc", "web-def").replace("10.0.0.3", "10.0.0.4").replace("conditions: {ready: false, serving: true, terminating: true}", "conditions: {ready: true}"));
        let t = translate(&svc(SVC), &[&a, &b], &node());
        assert_eq!(t.frontends[0].1.backends, bes(&["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.4:8080"]));
    }

    #[test]
    fn no_endpoints_gives_a_frontend_without_backends() {
        let t = translate(&svc(SVC), &[], &node());
        assert_eq!(t.frontends.len(), 2);
        assert!(t.frontends.iter().all(|(_, s)| s.backends.is_empty()));
    }

    #[test]
    fn headless_external_name_and_other_proxies_are_skipped() {
        let h = translate(&svc(&SVC.replace("clusterIP: 10.96.0.10", "clusterIP: None")), &[], &node());
        assert_eq!(h.skipped.as_deref(), Some("headless"));
        let e = translate(&svc(&SVC.replace("clusterIP: 10.96.0.10", "type: ExternalName\n  externalName: example.org")), &[], &node());
        assert_eq!(e.skipped.as_deref(), Some("ExternalName"));
        let o = translate(&svc(&SVC.replace("namespace: demo}", "namespace: demo, labels: {service.kubernetes.io/service-proxy-name: other}}")), &[], &node());
        assert!(o.skipped.is_some() && o.frontends.is_empty());
        let mine = translate(&svc(&SVC.replace("namespace: demo}", "namespace: demo, labels: {service.kubernetes.io/service-proxy-name: gardenet}}")), &[], &node());
        assert!(mine.skipped.is_none());
    }

    #[test]
    fn bad_input_is_reported_and_the_rest_still_programmed() {
        let s = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  externalIPs: [nonsense]")
            .replace("- {name: dns, port: 53, protocol: UDP}", "- {name: dns, port: 53, protocol: UDP}\n  - {name: big, port: 70000}\n  - {name: s, port: 9, protocol: SCTP}");
        let t = translate(&svc(&s), &[&slice(SLICE)], &node());
        assert_eq!(t.frontends.len(), 2);
        let msgs: Vec<_> = t.problems.iter().map(|p| p.message.as_str()).collect();
        assert!(msgs.iter().any(|m| m.contains("nonsense")), "{msgs:?}");
        assert!(msgs.iter().any(|m| m.contains("70000")), "{msgs:?}");
        assert!(msgs.iter().any(|m| m.contains("SCTP")), "{msgs:?}");
    }

    #[test]
    fn node_port_external_ips_and_lb_ingress() {
        let s = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalIPs: [198.51.100.7]
  ports: [{name: http, port: 80, nodePort: 30080}]
status:
  loadBalancer: {ingress: [{ip: 203.0.113.5}]}
"#;
        let t = translate(&svc(s), &[&slice(SLICE)], &node());
        let fes: Vec<String> = t.frontends.iter().map(|(f, _)| f.to_string()).collect();
        assert_eq!(fes, ["10.96.0.10:80/tcp", "198.51.100.7:80/tcp", "203.0.113.5:80/tcp", "192.0.2.10:30080/tcp"]);
    }

    const DUAL_SVC: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:19::10"]
  externalIPs: [198.51.100.7, "2001:db8::7"]
  ports:
  - {name: http, port: 80, nodePort: 30080, protocol: TCP}
  - {name: dns, port: 53, nodePort: 30053, protocol: UDP}
status:
  loadBalancer: {ingress: [{ip: 203.0.113.5}, {ip: "2001:db8::5"}]}
"#;
    const SLICE6: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- addresses: ["fd00:18:1::a"]
  conditions: {ready: true}
- addresses: ["fd00:18:1::b"]
- addresses: ["fd00:18:1::c"]
  conditions: {ready: false, serving: true, terminating: true}
"#;

    fn dual_node() -> NodeInfo {
        NodeInfo { name: "n1".into(), addresses: vec!["192.0.2.10".parse().unwrap(), "2001:db8:1::10".parse().unwrap()], zone: None }
    }

    #[test]
    fn dual_stack_service_gets_frontends_of_both_families_with_their_own_backends() {
        let t = translate(&svc(DUAL_SVC), &[&slice(SLICE), &slice(SLICE6)], &dual_node());
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        let fes: Vec<String> = t.frontends.iter().map(|(f, _)| f.to_string()).collect();
        assert_eq!(
            fes,
            [
                "10.96.0.10:80/tcp",
                "[fd00:19::10]:80/tcp",
                "198.51.100.7:80/tcp",
                "[2001:db8::7]:80/tcp",
                "203.0.113.5:80/tcp",
                "[2001:db8::5]:80/tcp",
                "192.0.2.10:30080/tcp",
                "[2001:db8:1::10]:30080/tcp",
                "10.96.0.10:53/udp",
                "[fd00:19::10]:53/udp",
                "198.51.100.7:53/udp",
                "[2001:db8::7]:53/udp",
                "203.0.113.5:53/udp",
                "[2001:db8::5]:53/udp",
                "192.0.2.10:30053/udp",
                "[2001:db8:1::10]:30053/udp",
            ]
        );
        for (f, s) in &t.frontends {
            let want = match (f.addr.is_ipv4(), f.proto) {
                (true, Proto::Tcp) => bes(&["10.0.0.1:8080", "10.0.0.2:8080"]),
                (true, Proto::Udp) => bes(&["10.0.0.1:5353", "10.0.0.2:5353"]),
                (false, Proto::Tcp) => bes(&["[fd00:18:1::a]:8080", "[fd00:18:1::b]:8080"]),
                (false, Proto::Udp) => bes(&["[fd00:18:1::a]:5353", "[fd00:18:1::b]:5353"]),
            };
            assert_eq!(s.backends, want, "{f}");
        }
    }

    #[test]
    fn ipv6_only_service_and_family_filtering() {
        let v6 = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: "fd00:19::10"
  clusterIPs: ["fd00:19::10"]
  externalIPs: ["198.51.100.7"]
  ports: [{name: http, port: 80, nodePort: 30080}]
"#;
        let t = translate(&svc(v6), &[&slice(SLICE), &slice(SLICE6)], &dual_node());
        let fes: Vec<String> = t.frontends.iter().map(|(f, _)| f.to_string()).collect();
        assert_eq!(fes, ["[fd00:19::10]:80/tcp", "[2001:db8:1::10]:30080/tcp"], "NodePort only on the node's IPv6 address");
        assert!(t.frontends.iter().all(|(_, s)| s.backends == bes(&["[fd00:18:1::a]:8080", "[fd00:18:1::b]:8080"])));
        assert_eq!(t.problems.len(), 1, "{:?}", t.problems);
        assert!(t.problems[0].message.contains("198.51.100.7") && t.problems[0].message.contains("ipFamilies"), "{:?}", t.problems);
        // A dual-stack Service whose IPv6 slice is missing: the IPv6 VIP refuses (no NAT64).
        let d = translate(&svc(DUAL_SVC), &[&slice(SLICE)], &dual_node());
        let v6fe = d.frontends.iter().find(|(f, _)| f.to_string() == "[fd00:19::10]:80/tcp").unwrap();
        assert!(v6fe.1.backends.is_empty());
        // An IPv6 address in an IPv4 slice is reported, not programmed.
        let bad = translate(&svc(SVC), &[&slice(&SLICE.replace("10.0.0.2", "\"fd00::2\""))], &node());
        assert!(bad.problems.iter().any(|p| p.message.contains("fd00::2") && p.message.contains("IPv4")), "{:?}", bad.problems);
    }

    const LOCAL_SLICE: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-abc, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.0.0.1], nodeName: n1, hints: {forZones: [{name: z1}]}}
- {addresses: [10.0.0.2], nodeName: n2, hints: {forZones: [{name: z2}]}}
- {addresses: [10.0.0.3], nodeName: n1, conditions: {ready: false, serving: true, terminating: true}, hints: {forZones: [{name: z1}]}}
"#;
    const LB_SVC: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, nodePort: 30080}]
"#;

    fn backends_of(t: &Translated, fe_s: &str) -> Vec<Backend> {
        t.frontends.iter().find(|(f, _)| *f == fe(fe_s)).map(|(_, s)| s.backends.clone()).unwrap()
    }

    #[test]
    fn external_traffic_policy_local_uses_local_endpoints_for_external_frontends_only() {
        let t = translate(&svc(LB_SVC), &[&slice(LOCAL_SLICE)], &node());
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.1:8080", "10.0.0.2:8080"]));
        assert_eq!(backends_of(&t, "192.0.2.10:30080/tcp"), bes(&["10.0.0.1:8080"]));
        assert_eq!(t.health_check, Some(HealthCheck { port: 32000, namespace: "demo".into(), name: "web".into(), local_endpoints: 1 }));
        // Another node without local endpoints: external frontends have none, health says 0.
        let other = NodeInfo { name: "n3".into(), ..node() };
        let t = translate(&svc(LB_SVC), &[&slice(LOCAL_SLICE)], &other);
        assert!(backends_of(&t, "192.0.2.10:30080/tcp").is_empty());
        assert_eq!(t.health_check.unwrap().local_endpoints, 0);
    }

    #[test]
    fn local_policy_falls_back_to_local_serving_terminating() {
        let s = LOCAL_SLICE.replace("- {addresses: [10.0.0.1], nodeName: n1, hints: {forZones: [{name: z1}]}}\n", "");
        let t = translate(&svc(LB_SVC), &[&slice(&s)], &node());
        assert_eq!(backends_of(&t, "192.0.2.10:30080/tcp"), bes(&["10.0.0.3:8080"]));
    }

    #[test]
    fn internal_traffic_policy_local() {
        let s = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local").replace("  - {name: dns, port: 53, protocol: UDP}\n", "");
        let t = translate(&svc(&s), &[&slice(LOCAL_SLICE)], &node());
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.1:8080"]));
    }

    #[test]
    fn topology_hints_when_asked_and_usable() {
        let with_zone = NodeInfo { zone: Some("z2".into()), ..node() };
        let plain = SVC.replace("  - {name: dns, port: 53, protocol: UDP}\n", "");
        let t = translate(&svc(&plain), &[&slice(LOCAL_SLICE)], &with_zone);
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp").len(), 2, "no annotation: hints ignored");
        let auto = plain.replace("namespace: demo}", "namespace: demo, annotations: {service.kubernetes.io/topology-mode: Auto}}");
        let t = translate(&svc(&auto), &[&slice(LOCAL_SLICE)], &with_zone);
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.2:8080"]));
        // An endpoint without hints disables them for the whole Service.
        let partial = LOCAL_SLICE.replace(", hints: {forZones: [{name: z2}]}", "");
        let t = translate(&svc(&auto), &[&slice(&partial)], &with_zone);
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp").len(), 2);
        // No hint for our zone: all endpoints.
        let z9 = NodeInfo { zone: Some("z9".into()), ..node() };
        assert_eq!(backends_of(&translate(&svc(&auto), &[&slice(LOCAL_SLICE)], &z9), "10.96.0.10:80/tcp").len(), 2);
    }

    #[test]
    fn client_ip_affinity_timeout() {
        let s = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}");
        let t = translate(&svc(&s), &[], &node());
        assert!(t.frontends.iter().all(|(_, f)| f.affinity_timeout == 60));
        let d = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP");
        assert!(translate(&svc(&d), &[], &node()).frontends.iter().all(|(_, f)| f.affinity_timeout == DEFAULT_AFFINITY_TIMEOUT));
    }
}
