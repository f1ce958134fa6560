//! What a gardenet Network (or Shoot) must satisfy, and what the extension derives from it.
//!
//! Gardener's kube-proxy contract: when a Shoot disables kube-proxy, the network extension
//! routes Services, and if it cannot, that is a configuration problem reported in the
//! reconciliation (`ERR_CONFIGURATION_PROBLEM`). Every check here says what to change.
//! The same checks back the admission webhook, so most problems are refused before a
//! Network is ever written.

use std::fmt;
use std::net::IpAddr;

use gardenet_agent::gardener::aggregate::SUPPORTED_IP_FAMILIES;
use gardenet_agent::gardener::config::{ConfigError, NetworkConfig, ServiceRouting};
use gardenet_agent::gardener::network::{IpFamily, NetworkSpec};
use serde_json::Value;

use crate::cluster::{ApiServerEndpoint, Shoot};

/// One reason a configuration cannot be honoured. Always non-retryable: only a change of the
/// Shoot (or its providerConfig) fixes it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("{at}{}: {}", field_suffix(&.error.field), .error.message)]
    InvalidProviderConfig { at: &'static str, error: ConfigError },
    #[error(
        "kube-proxy is disabled (spec.kubernetes.kubeProxy.enabled: false), so gardenet must route Services, \
         but providerConfig.kubeProxyReplacement.enabled is false: remove that field or set it to true, or enable kube-proxy"
    )]
    ReplacementRefused,
    #[error(
        "gardenet must route Services ({why}), but the providerConfig turns off both paths: socketLB.enabled is false \
         and interfaces.include is empty (no TC LB); enable socketLB or list the node interfaces in interfaces.include"
    )]
    NoDataplane { why: &'static str },
    #[error(
        "{field}: {family} Service routing is not supported by gardenet (supported: {supported}); \
         remove {family} or keep kube-proxy enabled"
    )]
    UnsupportedIpFamily { field: &'static str, family: IpFamily, supported: String },
    #[error("{field}: {value:?} is not a CIDR ({reason})")]
    InvalidCidr { field: &'static str, value: String, reason: &'static str },
    #[error("{field}: {value} is an {family} CIDR, but the IP families are [{families}]")]
    CidrFamilyMismatch { field: &'static str, value: String, family: IpFamily, families: String },
    #[error("{a} {a_value} and {b} {b_value} overlap")]
    CidrsOverlap { a: &'static str, a_value: String, b: &'static str, b_value: String },
}

fn field_suffix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!(".{field}")
    }
}

/// All problems found, in the order of the checks; never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let texts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&texts.join("; "))
    }
}

impl std::error::Error for Problems {}

/// The providerConfig (or all defaults when absent), strictly parsed. `at` is where it sits
/// in the object the user edits, e.g. `spec.providerConfig`.
pub fn parse_config(provider_config: Option<&Value>, at: &'static str) -> Result<NetworkConfig, Problem> {
    match provider_config {
        None | Some(Value::Null) => Ok(NetworkConfig::default()),
        Some(v) => NetworkConfig::from_json_value(v).map_err(|error| Problem::InvalidProviderConfig { at, error }),
    }
}

/// The kube-proxy contract for one config.
pub fn check_routing(config: &NetworkConfig, kube_proxy_enabled: bool) -> Vec<Problem> {
    let routing = config.service_routing(kube_proxy_enabled);
    let mut problems = Vec::new();
    if routing == ServiceRouting::Refused {
        problems.push(Problem::ReplacementRefused);
    }
    if routing.active() && !config.socket_lb.enabled && config.interfaces.include.is_empty() {
        let why = if kube_proxy_enabled { "kubeProxyReplacement.enabled is true" } else { "kube-proxy is disabled" };
        problems.push(Problem::NoDataplane { why });
    }
    problems
}

/// IP families and CIDRs: each CIDR parses, belongs to one of the families, and pods and
/// Services do not overlap. Families gardenet cannot route are only a problem when it must.
pub fn check_network(families: &[IpFamily], cidrs: &[(&'static str, &str)], families_field: &'static str, routing_active: bool) -> Vec<Problem> {
    let families: Vec<IpFamily> = if families.is_empty() { vec![IpFamily::IPv4] } else { families.to_vec() };
    let listed = families.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    let mut problems = Vec::new();
    if routing_active {
        for family in families.iter().filter(|f| !SUPPORTED_IP_FAMILIES.contains(f)) {
            problems.push(Problem::UnsupportedIpFamily {
                field: families_field,
                family: family.clone(),
                supported: SUPPORTED_IP_FAMILIES.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            });
        }
    }
    let mut parsed = Vec::new();
    for (field, value) in cidrs.iter().filter(|(_, v)| !v.is_empty()) {
        match parse_cidr(value) {
            Err(reason) => problems.push(Problem::InvalidCidr { field, value: value.to_string(), reason }),
            Ok(cidr) => {
                let family = if cidr.addr.is_ipv4() { IpFamily::IPv4 } else { IpFamily::IPv6 };
                if !families.contains(&family) {
                    problems.push(Problem::CidrFamilyMismatch { field, value: value.to_string(), family, families: listed.clone() });
                }
                parsed.push((*field, value.to_string(), cidr));
            }
        }
    }
    for (i, (a, a_value, a_cidr)) in parsed.iter().enumerate() {
        for (b, b_value, b_cidr) in &parsed[i + 1..] {
            if a_cidr.overlaps(b_cidr) {
                problems.push(Problem::CidrsOverlap { a, a_value: a_value.clone(), b, b_value: b_value.clone() });
            }
        }
    }
    problems
}

/// An IP prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// The address left-aligned in 128 bits, so one mask works for both families.
    fn aligned(&self) -> u128 {
        match self.addr {
            IpAddr::V4(a) => u128::from(u32::from(a)) << 96,
            IpAddr::V6(a) => u128::from(a),
        }
    }

    pub fn overlaps(&self, other: &Cidr) -> bool {
        if self.addr.is_ipv4() != other.addr.is_ipv4() {
            return false;
        }
        let len = u32::from(self.len.min(other.len));
        let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
        self.aligned() & mask == other.aligned() & mask
    }
}

pub fn parse_cidr(text: &str) -> Result<Cidr, &'static str> {
    let (addr, len) = text.split_once('/').ok_or("no prefix length")?;
    let addr: IpAddr = addr.parse().map_err(|_| "invalid address")?;
    let len: u8 = len.parse().map_err(|_| "invalid prefix length")?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err("prefix length too long");
    }
    Ok(Cidr { addr, len })
}

/// Why a Network cannot be planned now.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Only a change of the configuration helps (`ERR_CONFIGURATION_PROBLEM`).
    #[error("{0}")]
    Configuration(#[from] Problems),
    /// Like the Cilium extension's "external address not found among advertised addresses":
    /// not a configuration problem, gardenlet advertises the address during the shoot's
    /// reconciliation, so the operation is retried.
    #[error(
        "kube-proxy is disabled, so the gardenet agents cannot reach the API server through the `kubernetes` Service \
         before they route it, and the Shoot has no advertised address named `external` (status.advertisedAddresses) \
         yet; set providerConfig.apiServer.host to use another address"
    )]
    NoApiServerAddress,
}

/// What a valid Network turns into.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub config: NetworkConfig,
    pub routing: ServiceRouting,
    pub kube_proxy_enabled: bool,
    /// Set when the agents must not depend on the `kubernetes` Service.
    pub api_server: Option<ApiServerEndpoint>,
    /// The families the shoot network uses (Gardener's default applied).
    pub ip_families: Vec<IpFamily>,
}

/// Validates a Network against its Shoot and derives the [`Plan`].
pub fn plan(spec: &NetworkSpec, shoot: &Shoot) -> Result<Plan, PlanError> {
    let kube_proxy_enabled = shoot.kube_proxy_enabled();
    let mut config = parse_config(spec.provider_config.as_ref(), "spec.providerConfig").map_err(|p| Problems(vec![p]))?;
    // A shoot with Gardener's node-local DNS needs the redirect: socket LB would otherwise
    // translate the kube-dns ClusterIP to a CoreDNS pod before the cache could see a query.
    if shoot.node_local_dns_enabled() {
        config.node_local_dns.enabled = true;
    }
    let routing = config.service_routing(kube_proxy_enabled);
    let mut problems = check_routing(&config, kube_proxy_enabled);
    problems.extend(check_network(
        &spec.ip_families,
        &[("spec.podCIDR", &spec.pod_cidr), ("spec.serviceCIDR", &spec.service_cidr)],
        "spec.ipFamilies",
        routing.active(),
    ));
    if !problems.is_empty() {
        return Err(Problems(problems).into());
    }
    // The providerConfig override first, then the advertised address (Cilium's order).
    let api_server = match &config.api_server {
        Some(a) => Some(ApiServerEndpoint { host: a.host.clone(), port: a.port }),
        None => shoot.api_server_endpoint(),
    };
    if !kube_proxy_enabled && api_server.is_none() {
        return Err(PlanError::NoApiServerAddress);
    }
    Ok(Plan {
        // With kube-proxy running, the agents keep using the `kubernetes` Service.
        api_server: if kube_proxy_enabled { None } else { api_server },
        config,
        routing,
        kube_proxy_enabled,
        ip_families: spec.effective_ip_families(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gardenet_agent::gardener::PROVIDER_API_VERSION;
    use serde_json::json;

    fn shoot(kube_proxy: bool, addresses: bool) -> Shoot {
        let mut s = json!({"spec": {"kubernetes": {"kubeProxy": {"enabled": kube_proxy}}}});
        if addresses {
            s["status"] = json!({"advertisedAddresses": [{"name": "external", "url": "https://api.example.com"}]});
        }
        serde_json::from_value(s).unwrap()
    }

    fn spec(pc: Option<Value>) -> NetworkSpec {
        NetworkSpec {
            type_: "gardenet".into(),
            provider_config: pc,
            pod_cidr: "100.96.0.0/11".into(),
            service_cidr: "100.64.0.0/13".into(),
            ..Default::default()
        }
    }

    fn pc(extra: Value) -> Value {
        let mut v = json!({"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig"});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    }

    #[test]
    fn node_local_dns_of_the_shoot_turns_on_the_redirect() {
        let mut s = json!({"spec": {"kubernetes": {"kubeProxy": {"enabled": false}}, "systemComponents": {"nodeLocalDNS": {"enabled": true}}}});
        s["status"] = json!({"advertisedAddresses": [{"name": "external", "url": "https://api.example.com"}]});
        let with: Shoot = serde_json::from_value(s).unwrap();
        let p = plan(&spec(None), &with).unwrap();
        assert!(p.config.node_local_dns.enabled);
        assert_eq!(p.config.local_redirect_rules().len(), 1);
        let p = plan(&spec(None), &shoot(false, true)).unwrap();
        assert!(!p.config.node_local_dns.enabled, "no node-local DNS in the shoot: no redirect");
    }

    #[test]
    fn kube_proxy_disabled_defaults_to_replacement_with_the_advertised_address() {
        let p = plan(&spec(None), &shoot(false, true)).unwrap();
        assert_eq!(p.routing, ServiceRouting::Required);
        assert_eq!(p.api_server, Some(ApiServerEndpoint { host: "api.example.com".into(), port: 443 }));
        assert_eq!(p.ip_families, vec![IpFamily::IPv4]);
        let p = plan(&spec(None), &shoot(true, true)).unwrap();
        assert_eq!(p.routing, ServiceRouting::Off);
        assert_eq!(p.api_server, None);
    }

    #[test]
    fn provider_config_override_wins_and_replaces_a_missing_address() {
        let s = spec(Some(pc(json!({"apiServer": {"host": "10.0.0.1", "port": 6443}}))));
        let p = plan(&s, &shoot(false, false)).unwrap();
        assert_eq!(p.api_server, Some(ApiServerEndpoint { host: "10.0.0.1".into(), port: 6443 }));
    }

    #[test]
    fn missing_address_is_a_retryable_error_only_without_kube_proxy() {
        let e = plan(&spec(None), &shoot(false, false)).unwrap_err();
        assert_eq!(e, PlanError::NoApiServerAddress);
        assert!(e.to_string().contains("providerConfig.apiServer.host"), "{e}");
        assert!(plan(&spec(None), &shoot(true, false)).is_ok());
    }

    fn problems(e: PlanError) -> Vec<Problem> {
        match e {
            PlanError::Configuration(p) => p.0,
            other => panic!("not a configuration problem: {other}"),
        }
    }

    #[test]
    fn unusable_dataplane_is_named() {
        let s = spec(Some(pc(json!({"socketLB": {"enabled": false}, "interfaces": {"include": []}}))));
        let e = plan(&s, &shoot(false, true)).unwrap_err();
        assert!(e.to_string().contains("socketLB.enabled is false"), "{e}");
        assert!(matches!(problems(e)[..], [Problem::NoDataplane { .. }]));
        // With kube-proxy routing, gardenet stays passive: no problem.
        assert!(plan(&s, &shoot(true, true)).is_ok());
        // Socket LB alone is enough.
        let s = spec(Some(pc(json!({"interfaces": {"include": []}}))));
        assert!(plan(&s, &shoot(false, true)).is_ok());
    }

    #[test]
    fn refused_replacement() {
        let s = spec(Some(pc(json!({"kubeProxyReplacement": {"enabled": false}}))));
        let e = plan(&s, &shoot(false, true)).unwrap_err();
        assert!(e.to_string().contains("kubeProxyReplacement.enabled is false"), "{e}");
        assert_eq!(problems(e), vec![Problem::ReplacementRefused]);
    }

    #[test]
    fn invalid_provider_config_names_the_field() {
        let s = spec(Some(pc(json!({"socketLB": {"enabld": true}}))));
        let e = plan(&s, &shoot(true, true)).unwrap_err();
        assert!(e.to_string().starts_with("spec.providerConfig.socketLB.enabld: unknown field"), "{e}");
    }

    #[test]
    fn families_and_cidrs() {
        let v4 = [IpFamily::IPv4];
        assert!(check_network(&v4, &[("a", "10.0.0.0/8"), ("b", "192.168.0.0/16")], "f", true).is_empty());
        let p = check_network(&v4, &[("a", "10.0.0.0/8"), ("b", "10.1.0.0/16")], "f", true);
        assert!(matches!(p[..], [Problem::CidrsOverlap { .. }]), "{p:?}");
        let p = check_network(&v4, &[("a", "fd00::/64")], "f", true);
        assert!(matches!(p[..], [Problem::CidrFamilyMismatch { .. }]), "{p:?}");
        let p = check_network(&v4, &[("a", "10.0.0.0")], "f", true);
        assert!(matches!(p[..], [Problem::InvalidCidr { reason: "no prefix length", .. }]), "{p:?}");
        let p = check_network(&v4, &[("a", "10.0.0.0/33")], "f", true);
        assert!(matches!(p[..], [Problem::InvalidCidr { .. }]), "{p:?}");
        assert!(check_network(&[], &[("a", "")], "f", true).is_empty());
        let v6 = [IpFamily::IPv6];
        assert!(check_network(&v6, &[("a", "fd00::/64")], "f", true).is_empty());
        // Dual stack, either order: CIDRs of both families fit.
        for dual in [[IpFamily::IPv4, IpFamily::IPv6], [IpFamily::IPv6, IpFamily::IPv4]] {
            assert!(check_network(&dual, &[("a", "10.0.0.0/8"), ("b", "fd00::/64"), ("c", "fd01::/108")], "f", true).is_empty());
        }
        let odd = [IpFamily::IPv4, IpFamily::Other("IPv7".into())];
        let p = check_network(&odd, &[], "f", true);
        assert!(matches!(&p[..], [Problem::UnsupportedIpFamily { .. }]), "{p:?}");
        assert!(check_network(&odd, &[], "f", false).is_empty());
        assert!(check_network(&v6, &[("a", "fd00::/64"), ("b", "fd01::/108")], "f", false).is_empty());
        assert!(parse_cidr("fd00::/64").unwrap().overlaps(&parse_cidr("fd00::1/128").unwrap()));
        assert!(!parse_cidr("fd00::/64").unwrap().overlaps(&parse_cidr("10.0.0.0/8").unwrap()));
        assert!(parse_cidr("0.0.0.0/0").unwrap().overlaps(&parse_cidr("10.0.0.0/8").unwrap()));
    }
}
