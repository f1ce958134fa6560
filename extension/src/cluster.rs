//! The `Cluster` extension resource (`extensions.gardener.cloud/v1alpha1`, cluster-scoped,
//! named like the shoot's namespace in the seed) and the Shoot fields gardenet reads from its
//! `spec.shoot`, which is a raw `core.gardener.cloud/v1beta1` Shoot.
//!
//! Like the agent's Network type, reading is lenient: the Shoot is Gardener's, and a newer
//! Gardener must not make the extension unable to read it.

use gardenet_agent::gardener::network::{IpFamily, LastOperationState};
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `spec` of a Cluster: the CloudProfile, Seed and Shoot as raw objects.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(group = "extensions.gardener.cloud", version = "v1alpha1", kind = "Cluster", plural = "clusters", schema = "disabled")]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    #[serde(default)]
    pub cloud_profile: Value,
    #[serde(default)]
    pub seed: Value,
    #[serde(default)]
    pub shoot: Value,
}

impl Cluster {
    /// The Shoot in `spec.shoot`. Fields gardenet does not know are ignored.
    pub fn shoot(&self) -> Result<Shoot, serde_json::Error> {
        serde_json::from_value(self.spec.shoot.clone())
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shoot {
    #[serde(default)]
    pub metadata: ShootMeta,
    #[serde(default)]
    pub spec: ShootSpec,
    #[serde(default)]
    pub status: ShootStatus,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShootMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub generation: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShootSpec {
    #[serde(default)]
    pub kubernetes: Kubernetes,
    #[serde(default)]
    pub networking: Option<Networking>,
    #[serde(default)]
    pub hibernation: Option<Hibernation>,
    #[serde(default)]
    pub dns: Option<Dns>,
    #[serde(default)]
    pub system_components: Option<SystemComponents>,
}

/// `spec.systemComponents`: only `nodeLocalDNS` matters to gardenet.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemComponents {
    #[serde(default, rename = "nodeLocalDNS")]
    pub node_local_dns: Option<Enabled>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Enabled {
    #[serde(default)]
    pub enabled: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Dns {
    #[serde(default)]
    pub domain: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Kubernetes {
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub kube_proxy: Option<KubeProxy>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct KubeProxy {
    #[serde(default)]
    pub enabled: Option<bool>,
}

/// `spec.networking` of a Shoot.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Networking {
    #[serde(rename = "type", default)]
    pub type_: Option<String>,
    #[serde(default)]
    pub provider_config: Option<Value>,
    #[serde(default)]
    pub pods: Option<String>,
    #[serde(default)]
    pub services: Option<String>,
    #[serde(default)]
    pub nodes: Option<String>,
    #[serde(default)]
    pub ip_families: Vec<IpFamily>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Hibernation {
    #[serde(default)]
    pub enabled: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShootStatus {
    #[serde(default)]
    pub advertised_addresses: Vec<AdvertisedAddress>,
    #[serde(default)]
    pub last_operation: Option<ShootLastOperation>,
    #[serde(default)]
    pub observed_generation: i64,
    #[serde(default)]
    pub is_hibernated: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct AdvertisedAddress {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub url: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ShootLastOperation {
    pub state: LastOperationState,
}

/// Where the agents reach the shoot's API server without the `kubernetes` Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiServerEndpoint {
    pub host: String,
    pub port: u16,
}

/// The advertised address the agents use, as the Cilium extension picks it
/// (`getK8sServiceHost`): the public name, which resolves and routes from the nodes.
const ADDRESS_EXTERNAL: &str = "external";

impl Shoot {
    /// Gardener's default: kube-proxy runs unless disabled explicitly.
    pub fn kube_proxy_enabled(&self) -> bool {
        self.spec.kubernetes.kube_proxy.as_ref().and_then(|k| k.enabled).unwrap_or(true)
    }

    /// The shoot runs Gardener's node-local DNS cache (`spec.systemComponents.nodeLocalDNS`).
    pub fn node_local_dns_enabled(&self) -> bool {
        self.spec.system_components.as_ref().and_then(|c| c.node_local_dns.as_ref()).is_some_and(|d| d.enabled)
    }

    /// Gardener's `IsShootFailed` (`extensions/pkg/controller/shoot.go`): the shoot's last
    /// operation failed. Extension controllers leave such shoots alone entirely.
    pub fn is_failed(&self) -> bool {
        self.status.last_operation.as_ref().is_some_and(|op| op.state == LastOperationState::Failed)
    }

    /// Gardener's `IsHibernationEnabled`: hibernation is requested in the spec.
    pub fn is_hibernation_enabled(&self) -> bool {
        self.spec.hibernation.as_ref().and_then(|h| h.enabled).unwrap_or(false)
    }

    /// Gardener's `IsHibernated`: requested and complete.
    pub fn is_hibernated(&self) -> bool {
        self.is_hibernation_enabled() && self.status.is_hibernated
    }

    /// Hibernated, hibernating or waking up (`IsHibernated` or `IsHibernatingOrWakingUp`):
    /// the nodes are gone or going, so there is nobody to ask about readiness.
    pub fn nodes_away(&self) -> bool {
        self.is_hibernation_enabled() || self.status.is_hibernated
    }

    /// The API server endpoint for agents that cannot use the `kubernetes` Service, as the
    /// Cilium extension derives its `k8sServiceHost`: the host of the advertised address named
    /// `external`. `None` until gardenlet has advertised it. The port is the URL's, else 443.
    pub fn api_server_endpoint(&self) -> Option<ApiServerEndpoint> {
        let addr = self.status.advertised_addresses.iter().find(|a| a.name == ADDRESS_EXTERNAL)?;
        parse_https_url(&addr.url)
    }
}

/// `https://host[:port][/...]` -> host and port (443 by default). Anything else: `None`.
pub fn parse_https_url(url: &str) -> Option<ApiServerEndpoint> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        // An IPv6 literal without a port ("[::1]") has colons but ends with ']'.
        Some((h, p)) if !p.ends_with(']') => (h, p.parse().ok()?),
        _ => (authority, 443),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty() && port != 0).then(|| ApiServerEndpoint { host: host.to_owned(), port })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shoot(v: Value) -> Shoot {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn kube_proxy_defaults_to_enabled() {
        assert!(shoot(json!({})).kube_proxy_enabled());
        assert!(shoot(json!({"spec": {"kubernetes": {"kubeProxy": {}}}})).kube_proxy_enabled());
        assert!(!shoot(json!({"spec": {"kubernetes": {"kubeProxy": {"enabled": false}}}})).kube_proxy_enabled());
    }

    #[test]
    fn failed_is_the_last_operation_state_alone() {
        let s = shoot(json!({"metadata": {"generation": 3}, "status": {"observedGeneration": 3, "lastOperation": {"state": "Failed"}}}));
        assert!(s.is_failed());
        // IsShootFailed does not look at generations: a newer spec does not un-fail a shoot.
        let s = shoot(json!({"metadata": {"generation": 4}, "status": {"observedGeneration": 3, "lastOperation": {"state": "Failed"}}}));
        assert!(s.is_failed());
        let s = shoot(json!({"status": {"lastOperation": {"state": "Succeeded"}}}));
        assert!(!s.is_failed());
        assert!(!shoot(json!({})).is_failed());
    }

    #[test]
    fn api_server_from_the_external_advertised_address() {
        let s = shoot(json!({"status": {"advertisedAddresses": [
            {"name": "internal", "url": "https://api.foo.internal.example.com:8443"},
            {"name": "external", "url": "https://api.foo.example.com"},
            {"name": "service-account-issuer", "url": "https://issuer.example.com"},
        ]}}));
        assert_eq!(s.api_server_endpoint(), Some(ApiServerEndpoint { host: "api.foo.example.com".into(), port: 443 }));
        // Like Cilium: no other address and no guess from spec.dns.domain.
        let s = shoot(json!({"spec": {"dns": {"domain": "foo.core.example.com"}},
                             "status": {"advertisedAddresses": [{"name": "internal", "url": "https://api.foo.internal.example.com"}]}}));
        assert_eq!(s.api_server_endpoint(), None);
        assert_eq!(shoot(json!({})).api_server_endpoint(), None);
        assert_eq!(parse_https_url("http://x"), None);
        assert_eq!(parse_https_url("https://[2001:db8::1]:6443/"), Some(ApiServerEndpoint { host: "2001:db8::1".into(), port: 6443 }));
        assert_eq!(parse_https_url("https://[2001:db8::1]").unwrap().port, 443);
        assert_eq!(parse_https_url("https://:443"), None);
    }

    #[test]
    fn hibernation() {
        let hibernating = shoot(json!({"spec": {"hibernation": {"enabled": true}}}));
        assert!(hibernating.is_hibernation_enabled() && !hibernating.is_hibernated() && hibernating.nodes_away());
        let hibernated = shoot(json!({"spec": {"hibernation": {"enabled": true}}, "status": {"isHibernated": true}}));
        assert!(hibernated.is_hibernated() && hibernated.nodes_away());
        let waking = shoot(json!({"spec": {"hibernation": {"enabled": false}}, "status": {"isHibernated": true}}));
        assert!(!waking.is_hibernated() && waking.nodes_away());
        assert!(!shoot(json!({"spec": {"hibernation": {"enabled": false}}})).nodes_away());
    }
}
