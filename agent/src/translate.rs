//! Service + EndpointSlices (+ this node) -> frontends and their backends, the way kube-proxy
//! reads them. Pure: no I/O, unit-tested. Works on the digested views of `crate::source::objects`.
use std::{collections::BTreeSet, net::IpAddr};

use crate::{
    desired::{Backend, Frontend, FrontendSpec, Proto},
    source::objects::{EndpointView, PortView, ServiceView, SliceView},
};

pub use crate::source::objects::{DEFAULT_AFFINITY_TIMEOUT, PROXY_NAME, SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL};

/// What translation needs to know about this node.
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    pub name: String,
    /// Addresses (IPv4 and IPv6) NodePorts are served on, for the Service's families.
    pub addresses: Vec<IpAddr>,
    pub zone: Option<String>,
    /// The kernel cannot source-NAT on the TC path (`BPF_FIB_LOOKUP_SRC` needs Linux 6.7):
    /// external traffic to remote endpoints is then only DNATed, as before source NAT existed.
    pub no_source_nat: bool,
    /// `spec.externalIPs` are ignored (NetworkConfig `externalIPs.enabled: false`; Kubernetes
    /// is deprecating them, CVE-2020-8554).
    pub no_external_ips: bool,
    /// Frontends sent to a listener on this node while it is there (node-local DNS).
    pub local_redirects: Vec<LocalRedirect>,
}

/// A local-redirect rule with what the agent currently sees listening: for clients on this
/// node (the `SCOPE_THIS_NODE` set), the ClusterIP frontends of `service` whose protocol and
/// port are in `listening` go to `to` (same port) instead of the Service's endpoints; traffic
/// from the wire keeps the endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRedirect {
    /// `namespace/name` of the Service (e.g. `kube-system/kube-dns`).
    pub service: String,
    /// The local listener's address (node-local DNS: 169.254.20.10), IPv4 or IPv6.
    pub to: IpAddr,
    /// `(protocol, port)` with a socket bound on `to` right now.
    pub listening: BTreeSet<(Proto, u16)>,
}

/// Why a Service (or part of it) was not programmed. Logged, counted and posted as an Event
/// on the object; the rest of the Service and every other Service still get programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// What `service` names: a Service, or an EndpointSlice that cannot be used at all.
    pub object: ProblemObject,
    /// `namespace/name` of that object.
    pub service: String,
    /// What went wrong; the metric label and the Event derive from it, never from `message`.
    pub kind: ProblemKind,
    pub message: String,
}

impl Problem {
    /// A problem with Service `service` (`namespace/name`).
    pub fn service(service: impl Into<String>, kind: ProblemKind, message: impl Into<String>) -> Problem {
        Problem { object: ProblemObject::Service, service: service.into(), kind, message: message.into() }
    }

    /// An EndpointSlice (`namespace/name`) that cannot be used at all.
    pub fn slice(slice: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem { object: ProblemObject::EndpointSlice, service: slice.into(), kind: ProblemKind::Translate, message: message.into() }
    }
}

/// The kinds of [`Problem`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProblemKind {
    /// The object cannot be translated as written (a bad address, port or protocol, a slice
    /// without its Service).
    Translate,
    /// An older Service holds the frontend.
    Conflict,
    /// A map is full.
    MapFull,
    /// Any other failed map write.
    MapIo,
}

impl ProblemKind {
    /// The reason of the Event posted on the object.
    pub fn event_reason(self) -> &'static str {
        // One reason for all kinds (the note says which): what users filter Events by.
        "ServiceNotProgrammed"
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProblemObject {
    #[default]
    Service,
    EndpointSlice,
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

pub fn translate(svc: &ServiceView, slices: &[&SliceView], node: &NodeInfo) -> Translated {
    let key = svc.key();
    let mut out = Translated::default();
    if let Some(why) = &svc.skipped {
        out.skipped = Some(why.clone());
        return out;
    }
    let problem = |out: &mut Translated, m: String| out.problems.push(Problem::service(key.clone(), ProblemKind::Translate, m));
    for m in &svc.problems {
        problem(&mut out, m.clone());
    }
    for m in slices.iter().flat_map(|s| &s.problems) {
        problem(&mut out, m.clone());
    }

    // NodePorts on the node's addresses of the Service's families.
    let node_addrs: Vec<IpAddr> = node.addresses.iter().copied().filter(|a| svc.serves(a)).collect();
    let external_ips: &[IpAddr] = if node.no_external_ips { &[] } else { &svc.external_ips };
    // kube-proxy's ExternallyAccessible, and the policies as it reads them: an external
    // policy only exists for NodePort and LoadBalancer Services.
    let externally = svc.node_ports || !svc.lb_ips.is_empty() || !external_ips.is_empty();
    let external_local = svc.external_local && svc.node_ports;
    let policy = Policy { uses_cluster: !svc.internal_local || externally, uses_local: svc.internal_local || (external_local && externally) };
    // Health checks count the ready local endpoints of the primary family (a dual-stack pod
    // has one address per family); terminating ones keep serving but make the load balancer
    // move away, as in kube-proxy.
    let primary_v4 = svc.families.first().copied().unwrap_or(true);
    let affinity_timeout = svc.affinity_timeout;
    let mut local_ready: BTreeSet<Backend> = BTreeSet::new();
    let redirect = node.local_redirects.iter().find(|r| r.service == key);

    let mut seen: BTreeSet<Frontend> = BTreeSet::new();
    for sp in &svc.ports {
        let proto = match &sp.proto {
            Ok(p) => *p,
            Err(other) => {
                problem(&mut out, format!("port {}: protocol {other} is not supported (skipped)", sp.label()));
                continue;
            }
        };
        let Some(port) = valid_port(sp.port) else {
            problem(&mut out, format!("port {}: {} is out of range 1-65535", sp.label(), sp.port));
            continue;
        };
        let cands = endpoints_for(sp, proto, slices, node, &mut out, &key);
        // Per family (a frontend only gets backends of its own family, no NAT46/64).
        let mut specs: Vec<FamilySpecs> = Vec::with_capacity(2);
        for v4 in [true, false] {
            // Collected into room for all of them: a filtered collect grows one doubling at a
            // time, and a full sync does this for every port.
            let mut fam: Vec<&Candidate> = Vec::with_capacity(cands.len());
            fam.extend(cands.iter().filter(|c| c.backend.addr.is_ipv4() == v4));
            if v4 == primary_v4 {
                local_ready.extend(fam.iter().filter(|c| c.ep.ready && c.local).map(|c| c.backend));
            }
            let cat = categorize(&fam, policy, node);
            let with = |backends: &Option<Vec<Backend>>| {
                let backends = backends.clone().unwrap_or_default();
                // Nothing usable but endpoints somewhere: drop; no endpoints at all: reject.
                FrontendSpec { drop: backends.is_empty() && cat.has_any, backends, affinity_timeout, ..Default::default() }
            };
            let internal = with(if svc.internal_local { &cat.local } else { &cat.cluster });
            if !externally {
                // ClusterIPs only: no external frontends to build.
                specs.push(FamilySpecs { internal, external: FrontendSpec::default(), lb: FrontendSpec::default(), this_node: None });
                continue;
            }
            let external = if external_local {
                // Only traffic from outside is limited to local endpoints; clients on this
                // node use the cluster's (kube-proxy's short-circuit), through a second set.
                FrontendSpec { two_scopes: true, ..with(&cat.local) }
            } else {
                // External clients may land on another node's endpoint, whose reply must
                // come back through here: source NAT (kube-proxy masquerades).
                FrontendSpec { snat_remote: !node.no_source_nat, ..with(&cat.cluster) }
            };
            let this_node = external_local.then(|| with(&cat.cluster));
            // Load-balancer IPs also admit only the Service's source ranges (of their family).
            let lb = FrontendSpec { source_ranges: svc.source_ranges.iter().filter(|c| c.addr.is_ipv4() == v4).copied().collect(), ..external.clone() };
            specs.push(FamilySpecs { internal, external, lb, this_node });
        }
        let fam = |a: &IpAddr| &specs[if a.is_ipv4() { 0 } else { 1 }];
        let mut add = |out: &mut Translated, fe: Frontend, fs: &FrontendSpec, this_node: Option<&FrontendSpec>| {
            if seen.insert(fe) {
                out.frontends.push((fe, fs.clone()));
                if let Some(tn) = this_node {
                    out.frontends.push((fe.for_this_node(), tn.clone()));
                }
            } else {
                out.problems.push(Problem::service(key.clone(), ProblemKind::Translate, format!("frontend {fe} listed twice")));
            }
        };
        for vip in &svc.cluster_ips {
            let fe = Frontend::new(*vip, port, proto);
            match redirect.filter(|r| r.to.is_ipv4() == vip.is_ipv4() && r.listening.contains(&(proto, port))) {
                // A listener on this node takes the frontend (node-local DNS) for clients on
                // this node while it is there: the `SCOPE_THIS_NODE` set, which socket LB
                // uses. Traffic from the wire (TC LB) keeps the Service's endpoints: a node's
                // cache serves that node's pods, as node-local DNS does with kube-proxy's
                // IPVS mode and Cilium's LocalRedirectPolicy.
                Some(r) => add(
                    &mut out,
                    fe,
                    &FrontendSpec { two_scopes: true, ..fam(vip).internal.clone() },
                    Some(&FrontendSpec { backends: vec![Backend::new(r.to, port)], ..Default::default() }),
                ),
                None => add(&mut out, fe, &fam(vip).internal, None),
            }
        }
        for vip in external_ips {
            add(&mut out, Frontend::new(*vip, port, proto), &fam(vip).external, fam(vip).this_node.as_ref());
        }
        for vip in &svc.lb_ips {
            add(&mut out, Frontend::new(*vip, port, proto), &fam(vip).lb, fam(vip).this_node.as_ref());
        }
        if svc.node_ports {
            match sp.node_port.map(|p| (p, valid_port(p))) {
                Some((_, Some(np))) => {
                    for a in &node_addrs {
                        add(&mut out, Frontend::new(*a, np, proto), &fam(a).external, fam(a).this_node.as_ref());
                    }
                }
                Some((p, None)) => problem(&mut out, format!("port {}: nodePort {p} is out of range", sp.label())),
                None => {} // not allocated yet
            }
        }
    }
    if svc.external_local && svc.load_balancer {
        if let Some(p) = svc.health_check_node_port.and_then(valid_port) {
            out.health_check = Some(HealthCheck { port: p, namespace: svc.namespace.clone(), name: svc.name.clone(), local_endpoints: local_ready.len() });
        }
    }
    out
}

/// One family's frontend specs for a Service port.
struct FamilySpecs {
    /// ClusterIPs.
    internal: FrontendSpec,
    /// NodePorts and externalIPs.
    external: FrontendSpec,
    /// Load-balancer IPs (external + source ranges).
    lb: FrontendSpec,
    /// The second set of external frontends for clients on this node (Local policy only).
    this_node: Option<FrontendSpec>,
}

/// Which endpoint lists a Service port uses (kube-proxy's `UsesClusterEndpoints` and
/// `UsesLocalEndpoints`).
#[derive(Clone, Copy, Debug)]
struct Policy {
    uses_cluster: bool,
    uses_local: bool,
}

/// kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go) for one port and family.
#[derive(Debug, Default, PartialEq, Eq)]
struct Categorized {
    /// Cluster-policy endpoints, topology applied; `None` if the port never uses them.
    cluster: Option<Vec<Backend>>,
    /// Local-policy endpoints; `None` if the port never uses them.
    local: Option<Vec<Backend>>,
    /// Usable endpoints exist somewhere in the cluster (decides drop vs reject).
    has_any: bool,
}

/// How cluster endpoints are narrowed by hints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    Any,
    SameNode,
    SameZone,
}

/// kube-proxy's `topologyModeFromHints`: same node when every ready endpoint has node hints
/// and one names this node; else same zone when every ready endpoint has zone hints and one
/// names this node's zone; else none. Unready endpoints take no part.
fn topology_mode(cands: &[&Candidate], node: &NodeInfo) -> Topology {
    let ready = || cands.iter().filter(|c| c.ep.ready);
    if ready().next().is_none() {
        return Topology::Any;
    }
    let names = |h: &[Box<str>], v: &str| h.iter().any(|x| &**x == v);
    if !node.name.is_empty() && ready().all(|c| !c.ep.node_hints().is_empty()) && ready().any(|c| names(c.ep.node_hints(), &node.name)) {
        return Topology::SameNode;
    }
    let zone = node.zone.as_deref().unwrap_or_default();
    if !zone.is_empty() && ready().all(|c| !c.ep.zone_hints().is_empty()) && ready().any(|c| names(c.ep.zone_hints(), zone)) {
        return Topology::SameZone;
    }
    Topology::Any
}

fn categorize(cands: &[&Candidate], policy: Policy, node: &NodeInfo) -> Categorized {
    let mut out = Categorized::default();
    // Sorted, without duplicates.
    let set = |f: &dyn Fn(&Candidate) -> bool| -> Vec<Backend> {
        let mut v: Vec<Backend> = Vec::with_capacity(cands.len());
        v.extend(cands.iter().filter(|c| f(c)).map(|c| c.backend));
        v.sort_unstable();
        v.dedup();
        v
    };
    let serving_terminating = |c: &Candidate| c.ep.serving && c.ep.terminating;
    if policy.uses_cluster {
        let mode = topology_mode(cands, node);
        let in_topology = |c: &Candidate| match mode {
            Topology::Any => true,
            Topology::SameNode => c.ep.node_hints().iter().any(|n| **n == *node.name),
            Topology::SameZone => c.ep.zone_hints().iter().any(|z| Some(&**z) == node.zone.as_deref()),
        };
        let mut cluster = set(&|c| c.ep.ready && in_topology(c));
        if cluster.is_empty() {
            // No ready endpoint anywhere (topology never narrows to nothing): fall back to
            // the serving, terminating ones.
            cluster = set(&serving_terminating);
        }
        out.has_any = !cluster.is_empty();
        out.cluster = Some(cluster);
    }
    if policy.uses_local {
        out.has_any |= cands.iter().any(|c| c.ep.ready || serving_terminating(c));
        let mut local = set(&|c| c.local && c.ep.ready);
        if local.is_empty() {
            local = set(&|c| c.local && serving_terminating(c));
        }
        out.local = Some(local);
    }
    out
}

/// One endpoint address of a Service port, with what the selection rules need.
struct Candidate<'a> {
    backend: Backend,
    ep: &'a EndpointView,
    /// On this node (kube-proxy's `IsLocal`: the endpoint names this node).
    local: bool,
}

fn valid_port(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

/// Endpoint candidates for one Service port from all slices (merged; duplicates are resolved
/// by `categorize`).
fn endpoints_for<'a>(sp: &PortView, proto: Proto, slices: &[&'a SliceView], node: &NodeInfo, out: &mut Translated, key: &str) -> Vec<Candidate<'a>> {
    let mut cands = Vec::with_capacity(slices.iter().map(|s| s.endpoints.len()).sum());
    for slice in slices {
        // EndpointSlice ports are matched to Service ports by name (named targetPorts are
        // resolved by the EndpointSlice controller into the number here).
        let Some(port) = slice.ports.iter().find(|p| p.name == sp.name && p.proto == Ok(proto)) else {
            continue;
        };
        let Some(pn) = port.port.and_then(valid_port) else {
            out.problems.push(Problem::service(key, ProblemKind::Translate, format!("EndpointSlice {} port {:?} has no valid number", slice.name, sp.name)));
            continue;
        };
        cands.extend(slice.endpoints.iter().map(|ep| Candidate {
            // On another node only if both names are known (no nodeName: treated as local
            // for source NAT, which then leaves it alone).
            backend: Backend { addr: ep.addr, port: pn, remote: !node.name.is_empty() && ep.node.as_deref().is_some_and(|n| n != node.name) },
            ep,
            local: !node.name.is_empty() && ep.node.as_deref() == Some(node.name.as_str()),
        }));
    }
    cands
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

    /// A Service from YAML, digested as the sources do.
    pub fn svc(yaml: &str) -> ServiceView {
        ServiceView::from(&serde_yaml::from_str::<Service>(yaml).unwrap())
    }
    pub fn slice(yaml: &str) -> SliceView {
        SliceView::from(&serde_yaml::from_str::<EndpointSlice>(yaml).unwrap())
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
        NodeInfo { name: "n1".into(), addresses: vec!["192.0.2.10".parse().unwrap()], ..Default::default() }
    }

    fn fe(s: &str) -> Frontend {
        s.parse().unwrap()
    }
    /// Backends from "ADDR:PORT", with " remote" for one on another node.
    fn bes(v: &[&str]) -> Vec<Backend> {
        v.iter()
            .map(|s| match s.strip_suffix(" remote") {
                Some(a) => Backend { remote: true, ..a.parse().unwrap() },
                None => s.parse().unwrap(),
            })
            .collect()
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
        let b = slice(
            &SLICE
                .replace("web-abc", "web-def")
                .replace("10.0.0.3", "10.0.0.4")
                .replace("conditions: {ready: false, serving: true, terminating: true}", "conditions: {ready: true}"),
        );
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
        let mine =
            translate(&svc(&SVC.replace("namespace: demo}", "namespace: demo, labels: {service.kubernetes.io/service-proxy-name: gardenet}}")), &[], &node());
        assert!(mine.skipped.is_none());
    }

    #[test]
    fn bad_input_is_reported_and_the_rest_still_programmed() {
        let s = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  externalIPs: [nonsense]").replace(
            "- {name: dns, port: 53, protocol: UDP}",
            "- {name: dns, port: 53, protocol: UDP}\n  - {name: big, port: 70000}\n  - {name: s, port: 9, protocol: SCTP}",
        );
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

    #[test]
    fn load_balancer_ips_in_proxy_mode_are_left_to_the_load_balancer() {
        let s = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, nodePort: 30080}]
status:
  loadBalancer: {ingress: [{ip: 203.0.113.5, ipMode: Proxy}, {ip: 203.0.113.6, ipMode: VIP}, {ip: 203.0.113.7}]}
"#;
        let t = translate(&svc(s), &[&slice(SLICE)], &node());
        let fes: Vec<String> = t.frontends.iter().map(|(f, _)| f.to_string()).collect();
        assert_eq!(fes, ["10.96.0.10:80/tcp", "203.0.113.6:80/tcp", "203.0.113.7:80/tcp", "192.0.2.10:30080/tcp"]);
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
        NodeInfo { name: "n1".into(), addresses: vec!["192.0.2.10".parse().unwrap(), "2001:db8:1::10".parse().unwrap()], ..Default::default() }
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
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.1:8080", "10.0.0.2:8080 remote"]));
        assert_eq!(backends_of(&t, "192.0.2.10:30080/tcp"), bes(&["10.0.0.1:8080"]));
        assert!(t.frontends.iter().all(|(_, s)| !s.snat_remote), "Local policy keeps the client address");
        assert_eq!(t.health_check, Some(HealthCheck { port: 32000, namespace: "demo".into(), name: "web".into(), local_endpoints: 1 }));
        // Another node without local endpoints: external frontends have none, health says 0.
        let other = NodeInfo { name: "n3".into(), ..node() };
        let t = translate(&svc(LB_SVC), &[&slice(LOCAL_SLICE)], &other);
        assert!(backends_of(&t, "192.0.2.10:30080/tcp").is_empty());
        assert_eq!(t.health_check.unwrap().local_endpoints, 0);
    }

    #[test]
    fn external_frontends_of_cluster_policy_source_nat_remote_backends() {
        let t = translate(&svc(&LB_SVC.replace("externalTrafficPolicy: Local", "externalTrafficPolicy: Cluster")), &[&slice(LOCAL_SLICE)], &node());
        let snat: Vec<String> = t.frontends.iter().filter(|(_, s)| s.snat_remote).map(|(f, _)| f.to_string()).collect();
        assert_eq!(snat, ["192.0.2.10:30080/tcp"], "NodePort (external) yes, ClusterIP no");
        assert_eq!(backends_of(&t, "192.0.2.10:30080/tcp"), bes(&["10.0.0.1:8080", "10.0.0.2:8080 remote"]));
        // A kernel without source NAT support: DNAT only.
        let t = translate(
            &svc(&LB_SVC.replace("externalTrafficPolicy: Local", "externalTrafficPolicy: Cluster")),
            &[&slice(LOCAL_SLICE)],
            &NodeInfo { no_source_nat: true, ..node() },
        );
        assert!(t.frontends.iter().all(|(_, s)| !s.snat_remote));
        // Without a node name of our own nothing counts as remote.
        let t = translate(&svc(LB_SVC), &[&slice(LOCAL_SLICE)], &NodeInfo { name: String::new(), ..node() });
        assert!(t.frontends.iter().flat_map(|(_, s)| &s.backends).all(|b| !b.remote));
    }

    #[test]
    fn load_balancer_source_ranges_apply_to_load_balancer_ips_only() {
        let s = DUAL_SVC.replace("  ports:\n", "  loadBalancerSourceRanges: [198.51.100.0/24, \"2001:db8:77::/48\", 10.1.2.3/8, bogus]\n  ports:\n");
        let t = translate(&svc(&s), &[&slice(SLICE), &slice(SLICE6)], &dual_node());
        let ranges = |fe_s: &str| -> Vec<String> {
            t.frontends.iter().find(|(f, _)| f.to_string() == fe_s).unwrap().1.source_ranges.iter().map(|c| c.to_string()).collect()
        };
        assert_eq!(ranges("203.0.113.5:80/tcp"), ["10.0.0.0/8", "198.51.100.0/24"], "family's own, host bits cleared");
        assert_eq!(ranges("[2001:db8::5]:80/tcp"), ["2001:db8:77::/48"]);
        for other in ["10.96.0.10:80/tcp", "198.51.100.7:80/tcp", "192.0.2.10:30080/tcp"] {
            assert!(ranges(other).is_empty(), "{other}: ClusterIP, externalIPs and NodePorts are not restricted");
        }
        assert!(t.problems.iter().any(|p| p.message.contains("bogus")), "{:?}", t.problems);
    }

    #[test]
    fn local_policy_falls_back_to_local_serving_terminating() {
        let s = LOCAL_SLICE.replace("- {addresses: [10.0.0.1], nodeName: n1, hints: {forZones: [{name: z1}]}}\n", "");
        let t = translate(&svc(LB_SVC), &[&slice(&s)], &node());
        assert_eq!(backends_of(&t, "192.0.2.10:30080/tcp"), bes(&["10.0.0.3:8080"]));
    }

    #[test]
    fn internal_traffic_policy_local() {
        let s = SVC
            .replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local")
            .replace("  - {name: dns, port: 53, protocol: UDP}\n", "");
        let t = translate(&svc(&s), &[&slice(LOCAL_SLICE)], &node());
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.1:8080"]));
    }

    #[test]
    fn zone_hints_apply_without_the_annotation() {
        let with_zone = NodeInfo { zone: Some("z2".into()), ..node() };
        let plain = SVC.replace("  - {name: dns, port: 53, protocol: UDP}\n", "");
        // Hints alone decide (kube-proxy since 1.31; the annotation only makes the
        // EndpointSlice controller write them). The unready 10.0.0.3 takes no part.
        let t = translate(&svc(&plain), &[&slice(LOCAL_SLICE)], &with_zone);
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.2:8080 remote"]));
        // A ready endpoint without hints disables them for the whole Service.
        let partial = LOCAL_SLICE.replace(", hints: {forZones: [{name: z2}]}", "");
        let t = translate(&svc(&plain), &[&slice(&partial)], &with_zone);
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp").len(), 2);
        // No hint for our zone, or no zone label: all endpoints.
        let z9 = NodeInfo { zone: Some("z9".into()), ..node() };
        assert_eq!(backends_of(&translate(&svc(&plain), &[&slice(LOCAL_SLICE)], &z9), "10.96.0.10:80/tcp").len(), 2);
        assert_eq!(backends_of(&translate(&svc(&plain), &[&slice(LOCAL_SLICE)], &node()), "10.96.0.10:80/tcp").len(), 2);
    }

    #[test]
    fn prefer_same_node_hints_then_zone_then_all() {
        let plain = SVC.replace("  - {name: dns, port: 53, protocol: UDP}\n", "");
        let sl = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-n, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.0.0.1], nodeName: n1, hints: {forNodes: [{name: n1}], forZones: [{name: z1}]}}
- {addresses: [10.0.0.2], nodeName: n2, hints: {forNodes: [{name: n2}], forZones: [{name: z1}]}}
- {addresses: [10.0.0.4], nodeName: n4, hints: {forNodes: [{name: n4}], forZones: [{name: z2}]}}
"#;
        let n = |name: &str, zone: &str| NodeInfo { name: name.into(), zone: Some(zone.into()), ..node() };
        let got = |node: &NodeInfo, sl: &str| {
            backends_of(&translate(&svc(&plain), &[&slice(sl)], node), "10.96.0.10:80/tcp").iter().map(|b| b.addr.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(got(&n("n1", "z1"), sl), ["10.0.0.1"], "this node's endpoint");
        assert_eq!(got(&n("n3", "z1"), sl), ["10.0.0.1", "10.0.0.2"], "no endpoint for this node: same zone");
        assert_eq!(got(&n("n3", "z9"), sl), ["10.0.0.1", "10.0.0.2", "10.0.0.4"], "neither: all");
        let missing = sl.replace("forNodes: [{name: n4}], ", "");
        assert_eq!(got(&n("n1", "z1"), &missing), ["10.0.0.1", "10.0.0.2"], "one endpoint without a node hint: zone");
    }

    /// An endpoint for the `categorize` table: address, then flags in kube-proxy's terms.
    struct Ep {
        addr: &'static str,
        ready: bool,
        serving: bool,
        terminating: bool,
        local: bool,
        zones: &'static [&'static str],
        nodes: &'static [&'static str],
    }
    const EP: Ep = Ep { addr: "", ready: true, serving: true, terminating: false, local: false, zones: &[], nodes: &[] };
    const TERMINATING: Ep = Ep { ready: false, serving: true, terminating: true, ..EP };

    fn run_categorize(eps: &[Ep], itp_local: bool, etp_local: bool, externally: bool, node: &NodeInfo) -> (Option<Vec<String>>, Option<Vec<String>>, bool) {
        let views: Vec<EndpointView> = eps
            .iter()
            .map(|e| EndpointView {
                addr: e.addr.parse().unwrap(),
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                node: e.local.then(|| node.name.as_str().into()),
                hints: (!e.zones.is_empty() || !e.nodes.is_empty()).then(|| {
                    Box::new(crate::source::objects::Hints {
                        zones: e.zones.iter().map(|z| (*z).into()).collect(),
                        nodes: e.nodes.iter().map(|n| (*n).into()).collect(),
                    })
                }),
            })
            .collect();
        let cands: Vec<Candidate> = views.iter().map(|ep| Candidate { backend: Backend::new(ep.addr, 80), ep, local: ep.node.is_some() }).collect();
        let refs: Vec<&Candidate> = cands.iter().collect();
        let policy = Policy { uses_cluster: !itp_local || externally, uses_local: itp_local || (etp_local && externally) };
        let c = categorize(&refs, policy, node);
        let names = |v: Option<Vec<Backend>>| v.map(|v| v.iter().map(|b| b.addr.to_string()).collect());
        (names(c.cluster), names(c.local), c.has_any)
    }

    /// kube-proxy's `TestCategorizeEndpoints` (pkg/proxy/topology_test.go), every case a
    /// Service, EndpointSlices and a Node can express, with today's semantics (hints without
    /// annotations, terminating endpoints always on, `PreferSameNode`).
    #[test]
    fn categorize_endpoints_as_kube_proxy() {
        let za = NodeInfo { name: "n1".into(), zone: Some("zone-a".into()), ..Default::default() };
        let no_zone = NodeInfo { name: "n1".into(), ..Default::default() };
        let zc = NodeInfo { name: "n1".into(), zone: Some("zone-c".into()), ..Default::default() };
        let zb = NodeInfo { name: "n1".into(), zone: Some("zone-b".into()), ..Default::default() };
        let four = [
            Ep { addr: "10.1.2.3", zones: &["zone-a"], ..EP },
            Ep { addr: "10.1.2.4", zones: &["zone-b"], ..EP },
            Ep { addr: "10.1.2.5", zones: &["zone-c"], ..EP },
            Ep { addr: "10.1.2.6", zones: &["zone-a"], ..EP },
        ];
        type Case<'a> = (&'a str, &'a [Ep], bool, bool, bool, &'a NodeInfo, Option<&'a [&'a str]>, Option<&'a [&'a str]>, bool);
        let v = |x: &'static [&'static str]| Some(x);
        let cases: Vec<Case> = vec![
            ("hints used", &four, false, false, false, &za, v(&["10.1.2.3", "10.1.2.6"]), None, true),
            ("no zone label", &four[..1], false, false, false, &no_zone, v(&["10.1.2.3"]), None, true),
            ("node in another zone: no filtering", &four[..1], false, false, false, &zb, v(&["10.1.2.3"]), None, true),
            (
                "unready endpoint not chosen",
                &[
                    Ep { addr: "10.1.2.3", zones: &["zone-a"], ..EP },
                    Ep { addr: "10.1.2.4", zones: &["zone-b"], ..EP },
                    Ep { addr: "10.1.2.6", zones: &["zone-a"], ready: false, ..EP },
                ],
                false,
                false,
                false,
                &za,
                v(&["10.1.2.3"]),
                None,
                true,
            ),
            (
                "only unready endpoints in our zone: no filtering",
                &[
                    Ep { addr: "10.1.2.3", zones: &["zone-a"], ready: false, ..EP },
                    Ep { addr: "10.1.2.4", zones: &["zone-b"], ..EP },
                    Ep { addr: "10.1.2.5", zones: &["zone-c"], ..EP },
                ],
                false,
                false,
                false,
                &za,
                v(&["10.1.2.4", "10.1.2.5"]),
                None,
                true,
            ),
            (
                "missing hints: no filtering",
                &[Ep { addr: "10.1.2.3", zones: &["zone-a"], ..EP }, Ep { addr: "10.1.2.5", ..EP }],
                false,
                false,
                false,
                &za,
                v(&["10.1.2.3", "10.1.2.5"]),
                None,
                true,
            ),
            (
                "multiple hints per endpoint",
                &[
                    Ep { addr: "10.1.2.3", zones: &["zone-a", "zone-b", "zone-c"], ..EP },
                    Ep { addr: "10.1.2.4", zones: &["zone-b", "zone-c"], ..EP },
                    Ep { addr: "10.1.2.5", zones: &["zone-b", "zone-d"], ..EP },
                    Ep { addr: "10.1.2.6", zones: &["zone-c"], ..EP },
                ],
                false,
                false,
                false,
                &zc,
                v(&["10.1.2.3", "10.1.2.4", "10.1.2.6"]),
                None,
                true,
            ),
            (
                "eTP Local: topology ignored for local endpoints",
                &[
                    Ep { addr: "10.1.2.3", zones: &["zone-a"], local: true, ..EP },
                    Ep { addr: "10.1.2.4", zones: &["zone-b"], local: true, ..EP },
                    Ep { addr: "10.1.2.5", zones: &["zone-c"], ..EP },
                    Ep { addr: "10.1.2.6", zones: &["zone-a"], ..EP },
                ],
                false,
                true,
                true,
                &za,
                v(&["10.1.2.3", "10.1.2.6"]),
                v(&["10.1.2.3", "10.1.2.4"]),
                true,
            ),
            (
                "iTP Local: topology ignored for local endpoints",
                &[
                    Ep { addr: "10.1.2.3", zones: &["zone-a"], local: true, ..EP },
                    Ep { addr: "10.1.2.4", zones: &["zone-b"], local: true, ..EP },
                    Ep { addr: "10.1.2.5", zones: &["zone-c"], ..EP },
                    Ep { addr: "10.1.2.6", zones: &["zone-a"], ..EP },
                ],
                true,
                false,
                true,
                &za,
                v(&["10.1.2.3", "10.1.2.6"]),
                v(&["10.1.2.3", "10.1.2.4"]),
                true,
            ),
            ("iTP Local, no endpoints", &[], true, false, false, &za, None, v(&[]), false),
            ("iTP Local, all endpoints remote", &[Ep { addr: "10.0.0.0", ..EP }, Ep { addr: "10.0.0.1", ..EP }], true, false, false, &za, None, v(&[]), true),
            (
                "iTP Local, some endpoints local",
                &[Ep { addr: "10.0.0.0", local: true, ..EP }, Ep { addr: "10.0.0.1", ..EP }],
                true,
                false,
                false,
                &za,
                None,
                v(&["10.0.0.0"]),
                true,
            ),
            (
                "Cluster, endpoints not ready",
                &[Ep { addr: "10.0.0.0", ready: false, serving: false, ..EP }, Ep { addr: "10.0.0.1", ready: false, serving: false, ..EP }],
                false,
                false,
                false,
                &za,
                v(&[]),
                None,
                false,
            ),
            (
                "Cluster, some ready",
                &[Ep { addr: "10.0.0.0", ready: false, serving: false, ..EP }, Ep { addr: "10.0.0.1", ..EP }],
                false,
                false,
                false,
                &za,
                v(&["10.0.0.1"]),
                None,
                true,
            ),
            (
                "Cluster, all terminating",
                &[Ep { addr: "10.0.0.0", local: true, ..TERMINATING }, Ep { addr: "10.0.0.1", ..TERMINATING }],
                false,
                false,
                false,
                &za,
                v(&["10.0.0.0", "10.0.0.1"]),
                None,
                true,
            ),
            (
                "serving but not terminating is not a fallback",
                &[Ep { addr: "10.0.0.0", ready: false, serving: true, terminating: false, ..EP }],
                false,
                false,
                false,
                &za,
                v(&[]),
                None,
                false,
            ),
            (
                "iTP Local + eTP Local, all remote",
                &[Ep { addr: "10.0.0.0", ..EP }, Ep { addr: "10.0.0.1", ..EP }],
                true,
                true,
                true,
                &za,
                v(&["10.0.0.0", "10.0.0.1"]),
                v(&[]),
                true,
            ),
            (
                "iTP Local + eTP Local, all remote and terminating",
                &[Ep { addr: "10.0.0.0", ..TERMINATING }, Ep { addr: "10.0.0.1", ..TERMINATING }],
                true,
                true,
                true,
                &za,
                v(&["10.0.0.0", "10.0.0.1"]),
                v(&[]),
                true,
            ),
            (
                "eTP Local with terminating endpoints",
                &[
                    Ep { addr: "10.0.0.0", ..EP },
                    Ep { addr: "10.0.0.1", ready: false, serving: false, local: true, ..EP },
                    Ep { addr: "10.0.0.2", local: true, ..TERMINATING },
                    Ep { addr: "10.0.0.3", ..TERMINATING },
                ],
                false,
                true,
                true,
                &za,
                v(&["10.0.0.0"]),
                v(&["10.0.0.2"]),
                true,
            ),
            (
                "eTP ignored when not externally accessible",
                &[Ep { addr: "10.0.0.0", ..EP }, Ep { addr: "10.0.0.1", local: true, ..EP }],
                false,
                true,
                false,
                &za,
                v(&["10.0.0.0", "10.0.0.1"]),
                None,
                true,
            ),
            (
                "conflicting topology and localness",
                &[
                    Ep { addr: "10.0.0.0", zones: &["zone-a"], local: true, ..EP },
                    Ep { addr: "10.0.0.1", zones: &["zone-b"], local: true, ..EP },
                    Ep { addr: "10.0.0.2", zones: &["zone-a"], ..EP },
                    Ep { addr: "10.0.0.3", zones: &["zone-b"], ..EP },
                ],
                false,
                true,
                true,
                &za,
                v(&["10.0.0.0", "10.0.0.2"]),
                v(&["10.0.0.0", "10.0.0.1"]),
                true,
            ),
            (
                "PreferSameNode",
                &[Ep { addr: "10.0.0.0", nodes: &["n1"], zones: &["zone-a"], ..EP }, Ep { addr: "10.0.0.1", nodes: &["n2"], zones: &["zone-a"], ..EP }],
                false,
                false,
                false,
                &za,
                v(&["10.0.0.0"]),
                None,
                true,
            ),
            (
                "PreferSameNode, nothing for this node: zone",
                &[Ep { addr: "10.0.0.1", nodes: &["n2"], zones: &["zone-a"], ..EP }, Ep { addr: "10.0.0.2", nodes: &["n3"], zones: &["zone-b"], ..EP }],
                false,
                false,
                false,
                &za,
                v(&["10.0.0.1"]),
                None,
                true,
            ),
        ];
        for (name, eps, itp, etp, ext, node, cluster, local, has_any) in cases {
            let (c, l, h) = run_categorize(eps, itp, etp, ext, node);
            let want = |x: Option<&[&str]>| x.map(|x| x.iter().map(|s| s.to_string()).collect::<Vec<_>>());
            assert_eq!(c, want(cluster), "{name}: cluster endpoints");
            assert_eq!(l, want(local), "{name}: local endpoints");
            assert_eq!(h, has_any, "{name}: has any endpoints");
        }
    }

    #[test]
    fn no_endpoints_rejects_none_usable_here_drops() {
        let itp = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local");
        let spec = |t: &Translated, f: &str| t.frontends.iter().find(|(x, _)| *x == fe(f)).unwrap().1.clone();
        let t = translate(&svc(SVC), &[], &node());
        assert!(!spec(&t, "10.96.0.10:80/tcp").drop, "no endpoints at all: reject");
        let remote_only = LOCAL_SLICE.replace("nodeName: n1", "nodeName: n7");
        let t = translate(&svc(&itp), &[&slice(&remote_only)], &node());
        let s = spec(&t, "10.96.0.10:80/tcp");
        assert!(s.backends.is_empty() && s.drop, "iTP Local, endpoints only elsewhere: drop");
        // eTP Local on a node without local endpoints: outside traffic dropped, this node's
        // clients get the cluster endpoints through the second set.
        let t = translate(&svc(LB_SVC), &[&slice(LOCAL_SLICE)], &NodeInfo { name: "n3".into(), ..node() });
        let np = spec(&t, "192.0.2.10:30080/tcp");
        assert!(np.backends.is_empty() && np.drop && np.two_scopes);
        assert_eq!(spec(&t, "192.0.2.10:30080/tcp@this-node").backends, bes(&["10.0.0.1:8080 remote", "10.0.0.2:8080 remote"]));
        assert!(!spec(&t, "10.96.0.10:80/tcp").two_scopes, "ClusterIPs have one set");
    }

    #[test]
    fn external_local_short_circuit_for_every_external_frontend() {
        let s = LB_SVC.replace("  ports:", "  externalIPs: [198.51.100.7]\n  ports:") + "status: {loadBalancer: {ingress: [{ip: 203.0.113.5}]}}\n";
        let t = translate(&svc(&s), &[&slice(LOCAL_SLICE)], &node());
        let names: Vec<String> = t.frontends.iter().map(|(f, _)| f.to_string()).collect();
        for f in ["198.51.100.7:80/tcp", "203.0.113.5:80/tcp", "192.0.2.10:30080/tcp"] {
            assert!(names.contains(&format!("{f}@this-node")), "{f}: {names:?}");
            assert_eq!(backends_of(&t, f), bes(&["10.0.0.1:8080"]));
            assert_eq!(backends_of(&t, &format!("{f}@this-node")), bes(&["10.0.0.1:8080", "10.0.0.2:8080 remote"]));
        }
        // Cluster policy: one set, no second.
        let t = translate(&svc(&s.replace("externalTrafficPolicy: Local", "externalTrafficPolicy: Cluster")), &[&slice(LOCAL_SLICE)], &node());
        assert!(t.frontends.iter().all(|(f, s)| f.scope == crate::desired::Scope::All && !s.two_scopes));
    }

    #[test]
    fn external_ips_only_while_allowed() {
        let s = SVC.replace("  ports:", "  externalIPs: [198.51.100.7]\n  ports:");
        let has = |n: &NodeInfo| translate(&svc(&s), &[&slice(SLICE)], n).frontends.iter().any(|(f, _)| f.addr.to_string() == "198.51.100.7");
        assert!(has(&node()));
        assert!(!has(&NodeInfo { no_external_ips: true, ..node() }));
    }

    #[test]
    fn local_redirect_while_a_listener_is_there() {
        let mut n = node();
        let rule = LocalRedirect { service: "demo/web".into(), to: "169.254.20.10".parse().unwrap(), listening: BTreeSet::new() };
        n.local_redirects.push(rule);
        let t = translate(&svc(SVC), &[&slice(SLICE)], &n);
        assert_eq!(backends_of(&t, "10.96.0.10:53/udp"), bes(&["10.0.0.1:5353", "10.0.0.2:5353"]), "no listener: the endpoints");
        n.local_redirects[0].listening.insert((Proto::Udp, 53));
        let t = translate(&svc(SVC), &[&slice(SLICE)], &n);
        assert_eq!(backends_of(&t, "10.96.0.10:53/udp@this-node"), bes(&["169.254.20.10:53"]), "clients on this node: the listener");
        assert_eq!(backends_of(&t, "10.96.0.10:53/udp"), bes(&["10.0.0.1:5353", "10.0.0.2:5353"]), "traffic from the wire: the endpoints");
        assert!(t.frontends.iter().any(|(f, s)| *f == fe("10.96.0.10:53/udp") && s.two_scopes));
        assert_eq!(backends_of(&t, "10.96.0.10:80/tcp"), bes(&["10.0.0.1:8080", "10.0.0.2:8080"]), "only the listening protocol and port");
        assert!(!t.frontends.iter().any(|(f, _)| *f == fe("10.96.0.10:80/tcp@this-node")));
        n.local_redirects[0].service = "demo/other".into();
        assert_eq!(backends_of(&translate(&svc(SVC), &[&slice(SLICE)], &n), "10.96.0.10:53/udp").len(), 2, "other Services untouched");
    }

    #[test]
    fn client_ip_affinity_timeout() {
        let s = SVC
            .replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}");
        let t = translate(&svc(&s), &[], &node());
        assert!(t.frontends.iter().all(|(_, f)| f.affinity_timeout == 60));
        let d = SVC.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP");
        assert!(translate(&svc(&d), &[], &node()).frontends.iter().all(|(_, f)| f.affinity_timeout == DEFAULT_AFFINITY_TIMEOUT));
    }
}
