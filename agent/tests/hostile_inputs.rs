//! Property tests over everything the agent parses from outside: the dir source's YAML, the
//! NetworkConfig, and Services / EndpointSlices as the API server may send them, through
//! digest and translation. Nothing may panic; a bad object becomes problems on that object;
//! what translation produces stays consistent (a frontend only gets backends of its own
//! family, no frontend twice, ports in range). Runs in `cargo test` (bounded case counts).
use std::net::IpAddr;

use gardenet_agent::{
    gardener::config::NetworkConfig,
    source::dir::parse_manifests,
    source::objects::{ServiceView, SliceView},
    translate::{translate, NodeInfo},
};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proptest::prelude::*;
use serde_json::{json, Value};

const VALID_MANIFESTS: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
  nodeName: n1
  hints: {forZones: [{name: z1}], forNodes: [{name: n1}]}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16]}
";

const VALID_CONFIG: &str = "apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1
kind: NetworkConfig
kubeProxyReplacement: {enabled: true}
socketLB: {enabled: true}
nodePortAddresses: [primary, 10.0.0.0/8]
externalIPs: {enabled: false}
nodeLocalDNS: {enabled: true}
localRedirects: [{service: kube-system/other, address: 169.254.20.11}]
mapSizes: {services: 1024, backends: 1024, sockRevNat: 1024, conntrack: 1024}
";

/// `text` with a few bytes replaced, inserted or removed at the given positions.
fn mutate(text: &str, edits: &[(usize, u8, u8)]) -> String {
    let mut b = text.as_bytes().to_vec();
    for (pos, op, byte) in edits {
        if b.is_empty() {
            break;
        }
        let i = pos % b.len();
        match op % 3 {
            0 => b[i] = *byte,
            1 => b.insert(i, *byte),
            _ => {
                b.remove(i);
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

fn ip_string() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u8..=255, 0u8..=255).prop_map(|(a, b)| format!("10.96.{a}.{b}")),
        (0u16..=0xffff).prop_map(|a| format!("fd00::{a:x}")),
        Just("None".to_string()),
        Just("".to_string()),
        Just("999.1.1.1".to_string()),
        Just("::ffff:10.0.0.1".to_string()),
        "[a-z0-9:.]{0,12}",
    ]
}

fn port_value() -> impl Strategy<Value = Value> {
    // Mostly numbers (a wrong type fails the whole object's deserialization, which the API
    // client reports before translation ever sees it).
    prop_oneof![18 => (-5i64..70_000).prop_map(Value::from), 1 => Just(Value::Null), 1 => "[a-z]{1,6}".prop_map(Value::from)]
}

fn protocol() -> impl Strategy<Value = Value> {
    prop_oneof![Just(json!("TCP")), Just(json!("UDP")), Just(json!("SCTP")), Just(json!("tcp")), Just(Value::Null)]
}

/// A Service as the API could send it, with odd values mixed in.
fn service() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(ip_string(), 0..3),
        prop::collection::vec(ip_string(), 0..3),
        prop::collection::vec(ip_string(), 0..2),
        prop::collection::vec((port_value(), port_value(), protocol(), "[a-z]{0,3}"), 0..4),
        prop_oneof![Just("ClusterIP"), Just("NodePort"), Just("LoadBalancer"), Just("ExternalName"), Just("Bogus")],
        prop_oneof![Just("Local"), Just("Cluster"), Just("")],
        prop_oneof![Just("Local"), Just("Cluster"), Just("")],
        prop::collection::vec(prop_oneof![Just("IPv4"), Just("IPv6"), Just("IPv5")], 0..3),
        prop::collection::vec("[0-9./a-f:]{0,20}", 0..3),
        any::<bool>(),
    )
        .prop_map(|(cips, eips, lbs, ports, ty, etp, itp, fams, ranges, affinity)| {
            let ports: Vec<Value> = ports.into_iter().map(|(p, np, proto, name)| json!({"name": name, "port": p, "nodePort": np, "protocol": proto})).collect();
            json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "s", "namespace": "ns"},
                "spec": {
                    "type": ty, "clusterIPs": cips, "externalIPs": eips, "ports": ports,
                    "externalTrafficPolicy": etp, "internalTrafficPolicy": itp, "ipFamilies": fams,
                    "loadBalancerSourceRanges": ranges, "healthCheckNodePort": 32000,
                    "sessionAffinity": if affinity { "ClientIP" } else { "None" },
                },
                "status": {"loadBalancer": {"ingress": lbs.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}},
            })
        })
}

fn slice() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("IPv4"), Just("IPv6"), Just("FQDN")],
        prop::collection::vec((port_value(), protocol(), "[a-z]{0,3}"), 0..3),
        prop::collection::vec(
            (
                prop::collection::vec(ip_string(), 0..3),
                prop::option::of(any::<bool>()),
                prop::option::of(any::<bool>()),
                prop::option::of(any::<bool>()),
                prop::option::of("n[0-3]"),
                prop::collection::vec("z[0-2]", 0..2),
                prop::collection::vec("n[0-3]", 0..2),
            ),
            0..6,
        ),
    )
        .prop_map(|(at, ports, eps)| {
            let ports: Vec<Value> = ports.into_iter().map(|(p, proto, name)| json!({"name": name, "port": p, "protocol": proto})).collect();
            let eps: Vec<Value> = eps
                .into_iter()
                .map(|(addrs, ready, serving, terminating, node, zones, nodes)| {
                    json!({
                        "addresses": addrs,
                        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                        "nodeName": node,
                        "hints": {"forZones": zones.iter().map(|z| json!({"name": z})).collect::<Vec<_>>(), "forNodes": nodes.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()},
                    })
                })
                .collect();
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "s-1", "namespace": "ns", "labels": {"kubernetes.io/service-name": "s"}},
                "addressType": at, "ports": ports, "endpoints": eps,
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn dir_manifests_never_panic(edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..12)) {
        let text = mutate(VALID_MANIFESTS, &edits);
        let _ = parse_manifests(&text, "fuzz.yaml");
    }

    #[test]
    fn network_config_never_panics(edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..12)) {
        let text = mutate(VALID_CONFIG, &edits);
        if let Ok(c) = NetworkConfig::from_yaml_str(&text) {
            let _ = c.local_redirect_rules();
        }
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
        let _ = parse_manifests(&text, "fuzz.yaml");
        let _ = NetworkConfig::from_yaml_str(&text);
    }
}

static TRANSLATED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn services_and_slices_translate_consistently(svc in service(), slices in prop::collection::vec(slice(), 0..3), zone in prop::option::of("z[0-2]"), no_eips in any::<bool>()) {
        // What does not even deserialize is the API client's problem, not translation's.
        let Ok(s) = serde_json::from_value::<Service>(svc) else { return Ok(()) };
        TRANSLATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sv = ServiceView::from(&s);
        let views: Vec<SliceView> = slices.into_iter().filter_map(|v| serde_json::from_value::<EndpointSlice>(v).ok()).map(|e| SliceView::from(&e)).collect();
        let refs: Vec<&SliceView> = views.iter().collect();
        let node = NodeInfo {
            name: "n1".into(),
            addresses: vec!["192.0.2.10".parse().unwrap(), "2001:db8::10".parse().unwrap(), "127.0.0.1".parse().unwrap()],
            zone,
            no_external_ips: no_eips,
            ..Default::default()
        };
        let t = translate(&sv, &refs, &node);
        let mut seen = std::collections::BTreeSet::new();
        for (fe, spec) in &t.frontends {
            prop_assert!(seen.insert(*fe), "frontend {fe} twice");
            prop_assert!(fe.port != 0);
            for b in &spec.backends {
                prop_assert_eq!(b.addr.is_ipv4(), fe.addr.is_ipv4(), "{} -> {}: families differ", fe, b);
                prop_assert!(b.port != 0);
            }
            prop_assert!(spec.source_ranges.iter().all(|c| c.addr.is_ipv4() == fe.addr.is_ipv4()));
        }
        prop_assert!(t.problems.iter().all(|p| p.service == "ns/s"));
        if TRANSLATED.load(std::sync::atomic::Ordering::Relaxed).is_multiple_of(500) {
            eprintln!("translated {} generated Services so far", TRANSLATED.load(std::sync::atomic::Ordering::Relaxed));
        }
        if no_eips {
            prop_assert!(t.frontends.iter().all(|(fe, _)| !sv.external_ips.contains(&fe.addr) || sv.cluster_ips.contains(&fe.addr) || sv.lb_ips.contains(&fe.addr) || fe.addr == IpAddr::from([192, 0, 2, 10])));
        }
    }
}
