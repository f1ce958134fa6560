//! gardenet's provider config: `gardenet.networking.extensions.gardener.cloud/v1alpha1`,
//! `kind: NetworkConfig`, found in a Network's `spec.providerConfig` or in a file (the
//! DaemonSet mounts one from a ConfigMap).
//!
//! Parsing is strict: unknown fields, wrong types and invalid values are errors that name
//! the field (`socketLB.enabled: invalid type: ...`). A typo in a networking config that is
//! silently ignored shows up much later as a routing outage; failing at start is cheaper.
//! Every block is optional and defaults as documented on the fields.
//!
//! ```yaml
//! apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1
//! kind: NetworkConfig
//! kubeProxyReplacement: {enabled: true}
//! interfaces: {include: ["^((en|wl|ww|sl|ib)[opsx].*|(eth|wlan|wwan).*)$", "^bond"], exclude: ["^enP"]}
//! socketLB: {enabled: true, hostNamespaceOnly: false}
//! xdp: {mode: "off"}
//! sessionAffinity: {defaultTimeoutSeconds: 10800}
//! mapSizes: {services: 262144, backends: 131072, sockRevNat: 262144, conntrack: 262144}
//! externalIPs: {enabled: true}
//! nodePortAddresses: [primary]
//! localRedirects: []          # e.g. [{service: kube-system/kube-dns, address: 169.254.20.10}]
//! nodeLocalDNS: {enabled: false, address: 169.254.20.10, service: kube-system/kube-dns}
//! ipam: {type: host-local, cidr: usePodCIDR}   # pod addresses from the Node's spec.podCIDRs
//! mtu: 1450                   # pods' MTU (default: the node's InternalIP interface's)
//! masquerade: {enabled: true, nonMasqueradeCIDRs: []}
//! ```

use std::{fmt, net::IpAddr, str::FromStr};

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::network::Network;
use super::{NETWORK_TYPE, PROVIDER_API_VERSION};
use crate::desired::Cidr;

/// `kind` of gardenet's provider config.
pub const KIND: &str = "NetworkConfig";

/// Largest accepted map size. BPF maps are preallocated kernel memory charged to the agent's
/// cgroup; beyond 16Mi entries a value is far more likely a typo than a plan.
pub const MAX_MAP_ENTRIES: u32 = 1 << 24;

/// Upper bound of `sessionAffinity.defaultTimeoutSeconds`, the same as Kubernetes allows for
/// `service.spec.sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86_400;

/// A config that could not be used; `field` is the dotted path of the offending field
/// (empty when the document as a whole is wrong, e.g. not YAML).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid NetworkConfig: {}", self.message)
        } else {
            write!(f, "invalid NetworkConfig: {}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }

    /// Prefixes the field path, e.g. with `spec.providerConfig` when the config came from a
    /// Network, so the message points at the right place in the object the user edits.
    fn within(mut self, parent: &str) -> Self {
        self.field = if self.field.is_empty() { parent.to_owned() } else { format!("{parent}.{}", self.field) };
        self
    }

    fn from_path<E: fmt::Display>(err: serde_path_to_error::Error<E>) -> Self {
        let path = err.path().to_string();
        // serde_path_to_error renders the root as ".".
        let field = if path == "." { String::new() } else { path };
        Self::new(field, err.into_inner().to_string())
    }
}

/// gardenet's `NetworkConfig`. Construct with [`NetworkConfig::from_yaml_str`],
/// [`NetworkConfig::from_network`] or [`Default`] (all defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkConfig {
    /// Must be [`PROVIDER_API_VERSION`].
    pub api_version: String,
    /// Must be [`KIND`].
    pub kind: String,
    /// Whether gardenet routes Services (see [`ServiceRouting`]).
    #[serde(default)]
    pub kube_proxy_replacement: KubeProxyReplacement,
    /// Which interfaces get the TC (and XDP) programs.
    #[serde(default)]
    pub interfaces: Interfaces,
    /// Socket-level load balancing (cgroup `connect`/`sendmsg` hooks).
    #[serde(default, rename = "socketLB")]
    pub socket_lb: SocketLb,
    #[serde(default)]
    pub xdp: Xdp,
    #[serde(default)]
    pub session_affinity: SessionAffinity,
    #[serde(default)]
    pub map_sizes: MapSizes,
    /// Whether `spec.externalIPs` of Services are routed.
    #[serde(default, rename = "externalIPs")]
    pub external_ips: ExternalIps,
    /// Which node addresses NodePorts are served on (kube-proxy's `--nodeport-addresses`).
    /// Default `[primary]`; never loopback.
    #[serde(default = "default_node_port_addresses")]
    pub node_port_addresses: Vec<NodePortAddress>,
    /// Services whose ClusterIP traffic goes to a listener on the node while it is there.
    #[serde(default)]
    pub local_redirects: Vec<LocalRedirectRule>,
    /// Gardener's node-local DNS: when enabled, adds the local redirect of `service` to
    /// `address`.
    #[serde(default, rename = "nodeLocalDNS")]
    pub node_local_dns: NodeLocalDns,
    /// Where the agents reach the shoot's API server while the `kubernetes` Service is not
    /// routed yet (kube-proxy disabled). Read by `gardenet-extension`, which otherwise takes
    /// it from the Shoot's advertised addresses; the agent itself ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_server: Option<ApiServer>,
    /// Pod addresses: `{type: host-local, cidr: usePodCIDR}` (the default, and the only
    /// form): each node hands out addresses from its Node's `spec.podCIDRs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<Ipam>,
    /// Pods' interface MTU; default: the MTU of the node's interface that holds its
    /// InternalIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Pods' traffic that leaves the cluster is source-NATed to the node's address.
    #[serde(default)]
    pub masquerade: Masquerade,
}

/// `masquerade`: pods' traffic to destinations outside the pod network (not to pod CIDRs,
/// the node's addresses or `nonMasqueradeCIDRs`) leaves with the node's address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Masquerade {
    /// Default `true`.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Destinations pods reach with their own address, e.g. the cluster's pod, node and
    /// Service CIDRs, or a peered network.
    #[serde(default, rename = "nonMasqueradeCIDRs")]
    pub non_masquerade_cidrs: Vec<String>,
}

impl Default for Masquerade {
    fn default() -> Self {
        Self { enabled: true, non_masquerade_cidrs: Vec::new() }
    }
}

/// Smallest accepted pod MTU: IPv6's minimum link MTU (RFC 8200), as every family may be
/// in use.
pub const MIN_POD_MTU: u32 = 1280;

/// `ipam`: where pod addresses come from (Gardener's example for gardenet).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ipam {
    /// `host-local`: the reference plugin, delegated to by gardenet's CNI plugin.
    #[serde(rename = "type")]
    pub type_: String,
    /// `usePodCIDR`: the ranges are the Node's `spec.podCIDRs`.
    pub cidr: String,
}

impl Default for Ipam {
    fn default() -> Self {
        Self { type_: "host-local".into(), cidr: "usePodCIDR".into() }
    }
}

/// `apiServer`: an API server endpoint override (`host` without scheme, `port` default 443).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiServer {
    pub host: String,
    #[serde(default = "default_api_server_port")]
    pub port: u16,
}

fn default_api_server_port() -> u16 {
    443
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            api_version: PROVIDER_API_VERSION.to_owned(),
            kind: KIND.to_owned(),
            kube_proxy_replacement: KubeProxyReplacement::default(),
            interfaces: Interfaces::default(),
            socket_lb: SocketLb::default(),
            xdp: Xdp::default(),
            session_affinity: SessionAffinity::default(),
            map_sizes: MapSizes::default(),
            external_ips: ExternalIps::default(),
            node_port_addresses: default_node_port_addresses(),
            local_redirects: Vec::new(),
            node_local_dns: NodeLocalDns::default(),
            api_server: None,
            ipam: None,
            mtu: None,
            masquerade: Masquerade::default(),
        }
    }
}

/// `kubeProxyReplacement`: whether gardenet takes over Service routing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeProxyReplacement {
    /// Unset (default): follow kube-proxy, i.e. route Services exactly when the shoot has
    /// kube-proxy disabled (Gardener's contract). `true`: route Services even while
    /// kube-proxy runs. `false`: never route Services (a configuration problem when
    /// kube-proxy is disabled, because then nothing routes them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

/// What gardenet does about Services, given the config and whether kube-proxy runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceRouting {
    /// kube-proxy is disabled: gardenet must route Services (Gardener's contract).
    Required,
    /// kube-proxy runs, but the config asks gardenet to take over anyway.
    Requested,
    /// kube-proxy routes Services; gardenet stays out of the way.
    Off,
    /// kube-proxy is disabled and the config forbids gardenet to route: nothing routes
    /// Services. Reported as a configuration problem.
    Refused,
}

impl ServiceRouting {
    /// Whether gardenet's dataplane should handle Services in this mode.
    pub fn active(self) -> bool {
        matches!(self, Self::Required | Self::Requested)
    }
}

/// `interfaces`: regular expressions over interface names. An interface is selected when it
/// matches any `include` pattern and no `exclude` pattern. Patterns are unanchored (use `^`/`$`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Interfaces {
    /// Default: [`DEFAULT_DATA_INTERFACES`] and `^bond` (bond ports are skipped as enslaved,
    /// so the bond itself must be selected).
    #[serde(default = "default_include")]
    pub include: Vec<Pattern>,
    /// Default: `^enP`, Azure accelerated-networking VFs. They are enslaved to a synthetic
    /// NIC that already carries the traffic; programs on the VF break the node's networking
    /// (the problem Calico's docs describe for `bpfDataIfacePattern`).
    #[serde(default = "default_exclude")]
    pub exclude: Vec<Pattern>,
}

impl Default for Interfaces {
    fn default() -> Self {
        Self { include: default_include(), exclude: default_exclude() }
    }
}

impl Interfaces {
    /// Whether programs should be attached to interface `name`.
    pub fn selects(&self, name: &str) -> bool {
        self.include.iter().any(|p| p.is_match(name)) && !self.exclude.iter().any(|p| p.is_match(name))
    }
}

/// The usual data interfaces (Calico's `bpfDataIfacePattern` default without its tunnel
/// devices). `enP...` (Azure accelerated-networking VFs) does not match it, and is excluded
/// explicitly as well.
pub const DEFAULT_DATA_INTERFACES: &str = "^((en|wl|ww|sl|ib)[opsx].*|(eth|wlan|wwan).*)$";

fn default_include() -> Vec<Pattern> {
    [DEFAULT_DATA_INTERFACES, "^bond"].into_iter().map(Pattern::builtin).collect()
}

fn default_exclude() -> Vec<Pattern> {
    vec![Pattern::builtin("^enP")]
}

/// A compiled regular expression that (de)serializes as its source string; invalid
/// expressions fail deserialization, so the error carries the field path.
#[derive(Clone, Debug)]
pub struct Pattern(regex::Regex);

impl Pattern {
    pub fn new(source: &str) -> Result<Self, regex::Error> {
        regex::Regex::new(source).map(Self)
    }

    /// For the hard-coded defaults, which are known to compile.
    fn builtin(source: &str) -> Self {
        Self::new(source).unwrap_or_else(|e| unreachable!("built-in pattern {source:?}: {e}"))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    pub fn is_match(&self, haystack: &str) -> bool {
        self.0.is_match(haystack)
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Serialize for Pattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Pattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let source = String::deserialize(d)?;
        Pattern::new(&source).map_err(|e| de::Error::custom(format!("invalid regular expression {source:?}: {e}")))
    }
}

/// `socketLB`: translate Service addresses at `connect()`/`sendmsg()` time (cgroup hooks),
/// so pod-to-Service traffic never needs per-packet NAT.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SocketLb {
    /// Default `true`. Needs cgroup v2.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Default `false`. When `true`, only sockets in the host network namespace are
    /// translated; pods are served by the interface (TC) path instead. Needed with service
    /// meshes (Istio, Linkerd) whose sidecars must see the original Service address, like
    /// Cilium's `bpfSocketLBHostnsOnly`.
    #[serde(default)]
    pub host_namespace_only: bool,
}

impl Default for SocketLb {
    fn default() -> Self {
        Self { enabled: true, host_namespace_only: false }
    }
}

fn yes() -> bool {
    true
}

/// `xdp`: whether NodePort/LoadBalancer traffic is also handled at XDP.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Xdp {
    /// Default `off`.
    #[serde(default)]
    pub mode: XdpMode,
}

/// `xdp.mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// No XDP program.
    Off,
    /// Generic (skb) XDP: works on every driver, no speed-up; mostly for testing.
    Generic,
    /// Driver (native) XDP; attaching fails on drivers without support.
    Native,
    /// Native where the driver supports it, generic otherwise (the default).
    #[default]
    Auto,
}

impl<'de> Deserialize<'de> for XdpMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ModeVisitor;
        impl Visitor<'_> for ModeVisitor {
            type Value = XdpMode;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("one of \"off\", \"generic\", \"native\", \"auto\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<XdpMode, E> {
                match v {
                    "off" => Ok(XdpMode::Off),
                    "generic" => Ok(XdpMode::Generic),
                    "native" => Ok(XdpMode::Native),
                    "auto" => Ok(XdpMode::Auto),
                    _ => Err(E::unknown_variant(v, &["off", "generic", "native", "auto"])),
                }
            }
            // kubectl parses YAML 1.1, where an unquoted `off` is the boolean false; a
            // Network written as `mode: off` therefore reaches us as `false`.
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<XdpMode, E> {
                if v {
                    Err(E::invalid_value(de::Unexpected::Bool(true), &self))
                } else {
                    Ok(XdpMode::Off)
                }
            }
        }
        d.deserialize_any(ModeVisitor)
    }
}

/// `sessionAffinity`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionAffinity {
    /// Timeout for `sessionAffinity: ClientIP` Services that do not set one. Default 10800
    /// (Kubernetes' own default), 1..=86400.
    #[serde(default = "default_affinity_timeout")]
    pub default_timeout_seconds: u32,
}

impl Default for SessionAffinity {
    fn default() -> Self {
        Self { default_timeout_seconds: default_affinity_timeout() }
    }
}

fn default_affinity_timeout() -> u32 {
    10_800
}

/// `mapSizes`: `max_entries` of the BPF maps, 1..=[`MAX_MAP_ENTRIES`]. Defaults are the
/// compiled-in sizes from `gardenet-common`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MapSizes {
    /// Service map (frontends plus one slot per backend), default 262144.
    #[serde(default = "default_services")]
    pub services: u32,
    /// Backend map, default 131072.
    #[serde(default = "default_backends")]
    pub backends: u32,
    /// Socket reverse-NAT map (socket LB), default 262144.
    #[serde(default = "default_sock_rev_nat")]
    pub sock_rev_nat: u32,
    /// Connection-tracking map (interface path), default 262144.
    #[serde(default = "default_conntrack")]
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self { services: default_services(), backends: default_backends(), sock_rev_nat: default_sock_rev_nat(), conntrack: default_conntrack() }
    }
}

fn default_services() -> u32 {
    gardenet_common::DEFAULT_SERVICES_MAX
}
fn default_backends() -> u32 {
    gardenet_common::DEFAULT_BACKENDS_MAX
}
fn default_sock_rev_nat() -> u32 {
    gardenet_common::DEFAULT_SOCK_REVNAT_MAX
}
fn default_conntrack() -> u32 {
    gardenet_common::DEFAULT_CT_MAX
}

/// `externalIPs`: Kubernetes deprecates `spec.externalIPs` (any user who may create a Service
/// can claim any address with them, CVE-2020-8554); operators may turn them off.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExternalIps {
    /// Default `true`. `false`: `spec.externalIPs` are ignored.
    #[serde(default = "yes")]
    pub enabled: bool,
}

impl Default for ExternalIps {
    fn default() -> Self {
        Self { enabled: true }
    }
}

/// One entry of `nodePortAddresses`, as kube-proxy's `--nodeport-addresses`: `primary`, the
/// node's primary addresses (the first `InternalIP` of each family in the Node's
/// `status.addresses`, or the first `ExternalIP` of a family without one), or a CIDR, every
/// `InternalIP`/`ExternalIP` of the Node inside it. Loopback addresses are never used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Primary,
    Cidr(Cidr),
}

impl NodePortAddress {
    /// Whether `ip` is inside this CIDR (`primary` contains nothing by itself: it needs the
    /// Node's address list).
    pub fn cidr_contains(&self, ip: IpAddr) -> bool {
        match self {
            Self::Primary => false,
            Self::Cidr(c) => Cidr::new(ip, c.len).is_some_and(|n| n == *c),
        }
    }
}

impl fmt::Display for NodePortAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Primary => f.write_str("primary"),
            Self::Cidr(c) => write!(f, "{c}"),
        }
    }
}

impl FromStr for NodePortAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "primary" {
            return Ok(Self::Primary);
        }
        if !s.contains('/') {
            return Err(format!("{s:?} is neither \"primary\" nor a CIDR (ADDRESS/LENGTH)"));
        }
        s.parse::<Cidr>().map(Self::Cidr)
    }
}

impl Serialize for NodePortAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NodePortAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

fn default_node_port_addresses() -> Vec<NodePortAddress> {
    vec![NodePortAddress::Primary]
}

/// One `localRedirects` entry: ClusterIP traffic of `service` goes to a listener on this node
/// at `address` (same port), for each protocol and port something listens on there; the
/// Service's endpoints otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalRedirectRule {
    /// `namespace/name` of the Service.
    pub service: String,
    /// The local listener's address, IPv4 or IPv6 (not loopback, unspecified or multicast).
    pub address: IpAddr,
}

impl LocalRedirectRule {
    /// Checks `service` and `address`; errors name the field within the rule.
    fn check(&self) -> Result<(), ConfigError> {
        check_service_name(&self.service).map_err(|m| ConfigError::new("service", m))?;
        let a = self.address;
        if a.is_unspecified() || a.is_loopback() || a.is_multicast() {
            return Err(ConfigError::new("address", format!("is {a}, expected a unicast address of the node (a loopback address would be each pod's own)")));
        }
        Ok(())
    }
}

/// `SERVICE=ADDRESS`, as `--local-redirect` takes it.
impl FromStr for LocalRedirectRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (service, address) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAMESPACE/NAME=ADDRESS"))?;
        let rule = LocalRedirectRule { service: service.to_owned(), address: address.parse().map_err(|_| format!("{s:?}: {address:?} is not an IP address"))? };
        rule.check().map_err(|e| format!("{s:?}: {} {}", e.field, e.message))?;
        Ok(rule)
    }
}

/// `namespace/name`, both DNS labels (lower-case alphanumerics and `-`, at most 63).
fn check_service_name(s: &str) -> Result<(), String> {
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    match s.split_once('/') {
        Some((ns, name)) if label(ns) && label(name) => Ok(()),
        _ => Err(format!("is {s:?}, expected NAMESPACE/NAME of a Service")),
    }
}

/// `nodeLocalDNS`: Gardener's node-local DNS cache listens on a link-local address on every
/// node; with this enabled, cluster DNS traffic goes there while it listens (a local
/// redirect of `service` to `address`), and to the DNS Service's pods otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeLocalDns {
    /// Default `false`.
    #[serde(default)]
    pub enabled: bool,
    /// Default `169.254.20.10`.
    #[serde(default = "default_node_local_dns_address")]
    pub address: IpAddr,
    /// Default `kube-system/kube-dns`.
    #[serde(default = "default_node_local_dns_service")]
    pub service: String,
}

impl Default for NodeLocalDns {
    fn default() -> Self {
        Self { enabled: false, address: default_node_local_dns_address(), service: default_node_local_dns_service() }
    }
}

/// Gardener's (and the upstream node-local-dns addon's) listen address.
pub const NODE_LOCAL_DNS_ADDRESS: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(169, 254, 20, 10));

fn default_node_local_dns_address() -> IpAddr {
    NODE_LOCAL_DNS_ADDRESS
}

fn default_node_local_dns_service() -> String {
    "kube-system/kube-dns".to_owned()
}

impl NetworkConfig {
    /// Parses and validates a NetworkConfig document (a file, or a ConfigMap value).
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        if text.trim().is_empty() {
            return Err(ConfigError::new("", "empty document; expected a NetworkConfig"));
        }
        let de = serde_yaml::Deserializer::from_str(text);
        let cfg: Self = serde_path_to_error::deserialize(de).map_err(ConfigError::from_path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates a NetworkConfig given as JSON (e.g. a `providerConfig` value).
    pub fn from_json_value(value: &serde_json::Value) -> Result<Self, ConfigError> {
        let cfg: Self = serde_path_to_error::deserialize(value).map_err(ConfigError::from_path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The config of a Network of type `gardenet`: its `spec.providerConfig`, or all
    /// defaults when it has none. Errors name fields as `spec.providerConfig.<field>`.
    pub fn from_network(network: &Network) -> Result<Self, ConfigError> {
        if network.spec.type_ != NETWORK_TYPE {
            return Err(ConfigError::new("spec.type", format!("is {:?}, but gardenet handles {NETWORK_TYPE:?}", network.spec.type_)));
        }
        match &network.spec.provider_config {
            None | Some(serde_json::Value::Null) => Ok(Self::default()),
            Some(value) => Self::from_json_value(value).map_err(|e| e.within("spec.providerConfig")),
        }
    }

    /// Checks what the types alone cannot: type meta and value ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.api_version != PROVIDER_API_VERSION {
            return Err(ConfigError::new("apiVersion", format!("is {:?}, expected {PROVIDER_API_VERSION:?}", self.api_version)));
        }
        if self.kind != KIND {
            return Err(ConfigError::new("kind", format!("is {:?}, expected {KIND:?}", self.kind)));
        }
        let m = &self.map_sizes;
        for (name, size) in [("services", m.services), ("backends", m.backends), ("sockRevNat", m.sock_rev_nat), ("conntrack", m.conntrack)] {
            if size == 0 || size > MAX_MAP_ENTRIES {
                return Err(ConfigError::new(format!("mapSizes.{name}"), format!("is {size}, must be between 1 and {MAX_MAP_ENTRIES}")));
            }
        }
        if let Some(api) = &self.api_server {
            let host = api.host.as_str();
            if host.is_empty() || host.contains("://") || host.contains('/') || host.chars().any(char::is_whitespace) {
                return Err(ConfigError::new("apiServer.host", format!("is {host:?}, expected a host name or address without scheme or path")));
            }
            if api.port == 0 {
                return Err(ConfigError::new("apiServer.port", "must be between 1 and 65535"));
            }
        }
        let t = self.session_affinity.default_timeout_seconds;
        if t == 0 || t > MAX_AFFINITY_TIMEOUT_SECONDS {
            return Err(ConfigError::new("sessionAffinity.defaultTimeoutSeconds", format!("is {t}, must be between 1 and {MAX_AFFINITY_TIMEOUT_SECONDS}")));
        }
        if self.node_port_addresses.is_empty() {
            return Err(ConfigError::new("nodePortAddresses", "is empty; list \"primary\" or CIDRs (\"0.0.0.0/0\" and \"::/0\" for every node address)"));
        }
        let mut seen: Vec<&LocalRedirectRule> = Vec::new();
        for (i, r) in self.local_redirects.iter().enumerate() {
            r.check().map_err(|e| e.within(&format!("localRedirects[{i}]")))?;
            if let Some(o) = seen.iter().find(|o| o.service == r.service) {
                return Err(ConfigError::new(format!("localRedirects[{i}].service"), format!("{} is already redirected to {}", r.service, o.address)));
            }
            seen.push(r);
        }
        if let Some(ipam) = &self.ipam {
            if ipam.type_ != "host-local" {
                return Err(ConfigError::new("ipam.type", format!("is {:?}; gardenet supports \"host-local\"", ipam.type_)));
            }
            if ipam.cidr != "usePodCIDR" {
                return Err(ConfigError::new("ipam.cidr", format!("is {:?}; gardenet supports \"usePodCIDR\" (the Node's spec.podCIDRs)", ipam.cidr)));
            }
        }
        for (i, c) in self.masquerade.non_masquerade_cidrs.iter().enumerate() {
            if !c.contains('/') || c.parse::<Cidr>().is_err() {
                return Err(ConfigError::new(format!("masquerade.nonMasqueradeCIDRs[{i}]"), format!("{c:?} is not a CIDR")));
            }
        }
        if let Some(mtu) = self.mtu {
            if !(MIN_POD_MTU..=65535).contains(&mtu) {
                return Err(ConfigError::new("mtu", format!("is {mtu}, must be between {MIN_POD_MTU} and 65535")));
            }
        }
        let dns = &self.node_local_dns;
        let dns_rule = LocalRedirectRule { service: dns.service.clone(), address: dns.address };
        dns_rule.check().map_err(|e| e.within("nodeLocalDNS"))?;
        if dns.enabled {
            if let Some(o) = seen.iter().find(|o| o.service == dns.service && o.address != dns.address) {
                return Err(ConfigError::new("nodeLocalDNS.address", format!("is {}, but localRedirects sends {} to {}", dns.address, o.service, o.address)));
            }
        }
        Ok(())
    }

    /// The local-redirect rules in effect: `localRedirects`, plus `nodeLocalDNS`'s when it is
    /// enabled (once, if `localRedirects` already has the same rule).
    pub fn local_redirect_rules(&self) -> Vec<LocalRedirectRule> {
        let mut rules = self.local_redirects.clone();
        let dns = &self.node_local_dns;
        if dns.enabled && !rules.iter().any(|r| r.service == dns.service) {
            rules.push(LocalRedirectRule { service: dns.service.clone(), address: dns.address });
        }
        rules
    }

    /// What gardenet does about Services, given whether the shoot runs kube-proxy
    /// (`spec.kubernetes.kubeProxy.enabled` of the Shoot).
    pub fn service_routing(&self, kube_proxy_enabled: bool) -> ServiceRouting {
        match (kube_proxy_enabled, self.kube_proxy_replacement.enabled) {
            (false, None | Some(true)) => ServiceRouting::Required,
            (false, Some(false)) => ServiceRouting::Refused,
            (true, Some(true)) => ServiceRouting::Requested,
            (true, None | Some(false)) => ServiceRouting::Off,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gardener::network::NetworkSpec;

    const FULL: &str = r#"
apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1
kind: NetworkConfig
kubeProxyReplacement:
  enabled: true
interfaces:
  include: ["^eth0$", "^ens"]
  exclude: ["^enP"]
socketLB:
  enabled: true
  hostNamespaceOnly: true
xdp:
  mode: native
sessionAffinity:
  defaultTimeoutSeconds: 600
mapSizes:
  services: 1024
  backends: 2048
  sockRevNat: 4096
  conntrack: 8192
externalIPs:
  enabled: false
nodePortAddresses: [primary, 10.250.0.0/16, "2001:db8::/64"]
localRedirects:
- {service: kube-system/kube-dns, address: 169.254.20.10}
- {service: obs/collector, address: "fd00::10"}
nodeLocalDNS:
  enabled: true
"#;

    fn err(text: &str) -> ConfigError {
        NetworkConfig::from_yaml_str(text).expect_err("config should be rejected")
    }

    fn header() -> String {
        format!("apiVersion: {PROVIDER_API_VERSION}\nkind: NetworkConfig\n")
    }

    #[test]
    fn parses_full_config() {
        let c = NetworkConfig::from_yaml_str(FULL).unwrap();
        assert_eq!(c.kube_proxy_replacement.enabled, Some(true));
        assert!(c.interfaces.selects("eth0"));
        assert!(!c.interfaces.selects("eth1"));
        assert!(c.interfaces.selects("ens5"));
        assert!(c.socket_lb.enabled && c.socket_lb.host_namespace_only);
        assert_eq!(c.xdp.mode, XdpMode::Native);
        assert_eq!(c.session_affinity.default_timeout_seconds, 600);
        assert_eq!(c.map_sizes, MapSizes { services: 1024, backends: 2048, sock_rev_nat: 4096, conntrack: 8192 });
        assert!(!c.external_ips.enabled);
        assert_eq!(
            c.node_port_addresses,
            [NodePortAddress::Primary, NodePortAddress::Cidr("10.250.0.0/16".parse().unwrap()), NodePortAddress::Cidr("2001:db8::/64".parse().unwrap()),]
        );
        // nodeLocalDNS names the same rule as localRedirects[0]: in effect once.
        let rules: Vec<String> = c.local_redirect_rules().iter().map(|r| format!("{}={}", r.service, r.address)).collect();
        assert_eq!(rules, ["kube-system/kube-dns=169.254.20.10", "obs/collector=fd00::10"]);
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = NetworkConfig::from_yaml_str(&header()).unwrap();
        assert_eq!(c, NetworkConfig::default());
        assert_eq!(c.kube_proxy_replacement.enabled, None);
        assert!(c.socket_lb.enabled && !c.socket_lb.host_namespace_only);
        assert_eq!(c.xdp.mode, XdpMode::Auto);
        assert_eq!(c.session_affinity.default_timeout_seconds, 10_800);
        assert_eq!(c.map_sizes.services, gardenet_common::DEFAULT_SERVICES_MAX);
        assert_eq!(c.map_sizes.conntrack, gardenet_common::DEFAULT_CT_MAX);
        assert!(c.external_ips.enabled);
        assert_eq!(c.node_port_addresses, [NodePortAddress::Primary]);
        assert!(c.local_redirects.is_empty());
        assert!(!c.node_local_dns.enabled);
        assert_eq!(c.node_local_dns.address.to_string(), "169.254.20.10");
        assert_eq!(c.node_local_dns.service, "kube-system/kube-dns");
        assert!(c.local_redirect_rules().is_empty());
    }

    #[test]
    fn external_ips_switch() {
        let c = NetworkConfig::from_yaml_str(&format!("{}externalIPs: {{enabled: false}}\n", header())).unwrap();
        assert!(!c.external_ips.enabled);
        assert_eq!(serde_json::to_value(&c).unwrap()["externalIPs"]["enabled"], false);
        let e = err(&format!("{}externalIps: {{enabled: false}}\n", header()));
        assert!(e.message.contains("unknown field `externalIps`"), "{e}");
        let e = err(&format!("{}externalIPs: {{enabled: no}}\n", header()));
        assert_eq!(e.field, "externalIPs.enabled");
    }

    #[test]
    fn node_port_addresses_take_primary_or_cidrs() {
        let c = NetworkConfig::from_yaml_str(&format!("{}nodePortAddresses: [\"0.0.0.0/0\", \"::/0\"]\n", header())).unwrap();
        assert_eq!(c.node_port_addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["0.0.0.0/0", "::/0"]);
        // Host bits are dropped, as net.ParseCIDR does.
        assert_eq!("10.1.2.3/8".parse::<NodePortAddress>().unwrap().to_string(), "10.0.0.0/8");
        let e = err(&format!("{}nodePortAddresses: [primary, 10.0.0.0/33]\n", header()));
        assert_eq!(e.field, "nodePortAddresses[1]");
        assert!(e.message.contains("10.0.0.0/33"), "{e}");
        let e = err(&format!("{}nodePortAddresses: [10.0.0.1]\n", header()));
        assert_eq!(e.field, "nodePortAddresses[0]");
        assert!(e.message.contains("neither \"primary\" nor a CIDR"), "{e}");
        let e = err(&format!("{}nodePortAddresses: [Primary]\n", header()));
        assert_eq!(e.field, "nodePortAddresses[0]");
        let e = err(&format!("{}nodePortAddresses: []\n", header()));
        assert_eq!(e.field, "nodePortAddresses");
        let e = err(&format!("{}nodePortAddresses: primary\n", header()));
        assert_eq!(e.field, "nodePortAddresses");
    }

    #[test]
    fn node_port_cidrs_contain_their_family_only() {
        let v4: NodePortAddress = "10.250.0.0/16".parse().unwrap();
        assert!(v4.cidr_contains("10.250.3.4".parse().unwrap()));
        assert!(!v4.cidr_contains("10.251.0.1".parse().unwrap()));
        assert!(!v4.cidr_contains("::ffff:10.250.3.4".parse().unwrap()));
        let all6: NodePortAddress = "::/0".parse().unwrap();
        assert!(all6.cidr_contains("2001:db8::1".parse().unwrap()));
        assert!(!all6.cidr_contains("10.0.0.1".parse().unwrap()));
        assert!(!NodePortAddress::Primary.cidr_contains("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn local_redirects_are_checked() {
        let c = NetworkConfig::from_yaml_str(&format!("{}localRedirects: [{{service: kube-system/kube-dns, address: 169.254.20.10}}]\n", header())).unwrap();
        assert_eq!(c.local_redirect_rules(), [LocalRedirectRule { service: "kube-system/kube-dns".into(), address: NODE_LOCAL_DNS_ADDRESS }]);
        for (rule, field) in [
            ("{service: kube-dns, address: 169.254.20.10}", "localRedirects[0].service"),
            ("{service: a/b/c, address: 169.254.20.10}", "localRedirects[0].service"),
            ("{service: Kube-System/dns, address: 169.254.20.10}", "localRedirects[0].service"),
            ("{service: /dns, address: 169.254.20.10}", "localRedirects[0].service"),
            ("{service: a/b, address: 169.254.20}", "localRedirects[0].address"),
            ("{service: a/b, address: 127.0.0.1}", "localRedirects[0].address"),
            ("{service: a/b, address: \"::\"}", "localRedirects[0].address"),
            ("{service: a/b}", "localRedirects[0]"),
            ("{service: a/b, address: 169.254.20.10, port: 53}", "localRedirects[0].port"),
        ] {
            let e = err(&format!("{}localRedirects: [{rule}]\n", header()));
            assert_eq!(e.field, field, "{rule}: {e}");
        }
        let e = err(&format!("{}localRedirects: [{{service: a/b, address: 10.0.0.1}}, {{service: a/b, address: 10.0.0.2}}]\n", header()));
        assert_eq!(e.field, "localRedirects[1].service");
        assert!(e.message.contains("already redirected to 10.0.0.1"), "{e}");
    }

    #[test]
    fn node_local_dns_adds_its_rule() {
        let c = NetworkConfig::from_yaml_str(&format!("{}nodeLocalDNS: {{enabled: true}}\n", header())).unwrap();
        assert_eq!(c.local_redirect_rules(), [LocalRedirectRule { service: "kube-system/kube-dns".into(), address: NODE_LOCAL_DNS_ADDRESS }]);
        let c = NetworkConfig::from_yaml_str(&format!("{}nodeLocalDNS: {{enabled: true, address: \"fd00::a\", service: dns/coredns}}\n", header())).unwrap();
        assert_eq!(c.local_redirect_rules(), [LocalRedirectRule { service: "dns/coredns".into(), address: "fd00::a".parse().unwrap() }]);
        // Disabled: no rule, but still checked (a typo shows up before it is switched on).
        let c = NetworkConfig::from_yaml_str(&format!("{}nodeLocalDNS: {{address: 169.254.0.1}}\n", header())).unwrap();
        assert!(c.local_redirect_rules().is_empty());
        let e = err(&format!("{}nodeLocalDNS: {{service: kube-dns}}\n", header()));
        assert_eq!(e.field, "nodeLocalDNS.service");
        let e = err(&format!("{}nodeLocalDNS: {{address: nowhere}}\n", header()));
        assert_eq!(e.field, "nodeLocalDNS.address");
        let e = err(&format!("{}nodeLocalDNS: {{enabled: true}}\nlocalRedirects: [{{service: kube-system/kube-dns, address: 10.0.0.53}}]\n", header()));
        assert_eq!(e.field, "nodeLocalDNS.address");
        assert!(e.message.contains("10.0.0.53"), "{e}");
        let e = err(&format!("{}nodeLocalDns: {{enabled: true}}\n", header()));
        assert!(e.message.contains("unknown field `nodeLocalDns`"), "{e}");
    }

    #[test]
    fn local_redirect_flag_syntax() {
        let r: LocalRedirectRule = "kube-system/kube-dns=169.254.20.10".parse().unwrap();
        assert_eq!(r, LocalRedirectRule { service: "kube-system/kube-dns".into(), address: NODE_LOCAL_DNS_ADDRESS });
        let r: LocalRedirectRule = "a/b=fd00::53".parse().unwrap();
        assert_eq!(r.address.to_string(), "fd00::53");
        for bad in ["kube-system/kube-dns", "kube-dns=169.254.20.10", "a/b=x", "a/b=127.0.0.1"] {
            assert!(bad.parse::<LocalRedirectRule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn partial_block_defaults_the_rest() {
        let c = NetworkConfig::from_yaml_str(&format!("{}socketLB:\n  hostNamespaceOnly: true\n", header())).unwrap();
        assert!(c.socket_lb.enabled);
        assert!(c.socket_lb.host_namespace_only);
    }

    #[test]
    fn default_interfaces_skip_azure_vfs_and_virtual_devices() {
        let i = Interfaces::default();
        for name in ["eth0", "ens5", "enp0s3", "eno1", "bond0"] {
            assert!(i.selects(name), "{name} should be selected");
        }
        for name in ["enP12345s1", "lo", "veth1234", "cali123", "docker0", "tunl0"] {
            assert!(!i.selects(name), "{name} should not be selected");
        }
    }

    #[test]
    fn round_trips_through_serialization() {
        let c = NetworkConfig::from_yaml_str(FULL).unwrap();
        let text = serde_yaml::to_string(&c).unwrap();
        assert_eq!(NetworkConfig::from_yaml_str(&text).unwrap(), c);
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["socketLB"]["hostNamespaceOnly"], true);
        assert_eq!(json["xdp"]["mode"], "native");
        assert_eq!(json["nodePortAddresses"], serde_json::json!(["primary", "10.250.0.0/16", "2001:db8::/64"]));
        assert_eq!(json["localRedirects"][1]["address"], "fd00::10");
        assert_eq!(json["nodeLocalDNS"]["enabled"], true);
    }

    #[test]
    fn unknown_top_level_field_is_named() {
        let e = err(&format!("{}overlay:\n  enabled: true\n", header()));
        assert!(e.to_string().contains("unknown field `overlay`"), "{e}");
    }

    #[test]
    fn unknown_nested_field_is_named_with_its_block() {
        let e = err(&format!("{}socketLB:\n  enabld: true\n", header()));
        assert_eq!(e.field, "socketLB.enabld");
        assert!(e.message.contains("unknown field `enabld`"), "{e}");
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = err(&format!("{}socketLB:\n  enabled: \"yes\"\n", header()));
        assert_eq!(e.field, "socketLB.enabled");
        assert!(e.message.contains("invalid type"), "{e}");

        let e = err(&format!("{}mapSizes:\n  services: -1\n", header()));
        assert_eq!(e.field, "mapSizes.services");

        let e = err(&format!("{}interfaces:\n  include: eth0\n", header()));
        assert_eq!(e.field, "interfaces.include");
    }

    #[test]
    fn invalid_regex_names_the_element() {
        let e = err(&format!("{}interfaces:\n  exclude: [\"^ok\", \"(unclosed\"]\n", header()));
        assert_eq!(e.field, "interfaces.exclude[1]");
        assert!(e.message.contains("invalid regular expression"), "{e}");
    }

    #[test]
    fn xdp_mode_values() {
        for (text, mode) in [("off", XdpMode::Off), ("generic", XdpMode::Generic), ("native", XdpMode::Native), ("auto", XdpMode::Auto)] {
            let c = NetworkConfig::from_yaml_str(&format!("{}xdp:\n  mode: {text}\n", header())).unwrap();
            assert_eq!(c.xdp.mode, mode);
        }
        let e = err(&format!("{}xdp:\n  mode: turbo\n", header()));
        assert_eq!(e.field, "xdp.mode");
        assert!(e.message.contains("turbo"), "{e}");
        // YAML 1.1 `off` as produced by kubectl.
        let v = serde_json::json!({"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig", "xdp": {"mode": false}});
        assert_eq!(NetworkConfig::from_json_value(&v).unwrap().xdp.mode, XdpMode::Off);
        let v = serde_json::json!({"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig", "xdp": {"mode": true}});
        assert_eq!(NetworkConfig::from_json_value(&v).unwrap_err().field, "xdp.mode");
    }

    #[test]
    fn range_checks_name_the_field() {
        let e = err(&format!("{}mapSizes:\n  conntrack: 0\n", header()));
        assert_eq!(e.field, "mapSizes.conntrack");
        let e = err(&format!("{}mapSizes:\n  backends: {}\n", header(), MAX_MAP_ENTRIES + 1));
        assert_eq!(e.field, "mapSizes.backends");
        let e = err(&format!("{}sessionAffinity:\n  defaultTimeoutSeconds: 0\n", header()));
        assert_eq!(e.field, "sessionAffinity.defaultTimeoutSeconds");
        let e = err(&format!("{}sessionAffinity:\n  defaultTimeoutSeconds: 86401\n", header()));
        assert_eq!(e.field, "sessionAffinity.defaultTimeoutSeconds");
    }

    #[test]
    fn api_server_override() {
        let c = NetworkConfig::from_yaml_str(&format!("{}apiServer:\n  host: api.example.com\n", header())).unwrap();
        assert_eq!(c.api_server, Some(ApiServer { host: "api.example.com".into(), port: 443 }));
        let e = err(&format!("{}apiServer:\n  host: https://api.example.com\n", header()));
        assert_eq!(e.field, "apiServer.host");
        let e = err(&format!("{}apiServer:\n  host: a\n  port: 0\n", header()));
        assert_eq!(e.field, "apiServer.port");
    }

    #[test]
    fn type_meta_is_required_and_checked() {
        let e = err("kind: NetworkConfig\n");
        assert!(e.message.contains("apiVersion"), "{e}");
        let e = err("apiVersion: calico.networking.extensions.gardener.cloud/v1alpha1\nkind: NetworkConfig\n");
        assert_eq!(e.field, "apiVersion");
        let e = err(&format!("apiVersion: {PROVIDER_API_VERSION}\nkind: NetworkStatus\n"));
        assert_eq!(e.field, "kind");
        let e = err("   \n");
        assert_eq!(e.field, "");
        let e = err("- a\n- b\n");
        assert!(e.message.contains("invalid type"), "{e}");
    }

    fn network(type_: &str, provider_config: Option<serde_json::Value>) -> Network {
        Network::new(
            "shoot",
            NetworkSpec { type_: type_.into(), provider_config, pod_cidr: "100.96.0.0/11".into(), service_cidr: "100.64.0.0/13".into(), ..Default::default() },
        )
    }

    #[test]
    fn from_network() {
        assert_eq!(NetworkConfig::from_network(&network("gardenet", None)).unwrap(), NetworkConfig::default());

        let pc = serde_json::json!({
            "apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig",
            "kubeProxyReplacement": {"enabled": false},
        });
        let c = NetworkConfig::from_network(&network("gardenet", Some(pc))).unwrap();
        assert_eq!(c.kube_proxy_replacement.enabled, Some(false));

        let pc = serde_json::json!({
            "apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig", "socketLB": {"enabled": 1},
        });
        let e = NetworkConfig::from_network(&network("gardenet", Some(pc))).unwrap_err();
        assert_eq!(e.field, "spec.providerConfig.socketLB.enabled");

        let e = NetworkConfig::from_network(&network("calico", None)).unwrap_err();
        assert_eq!(e.field, "spec.type");
    }

    #[test]
    fn service_routing_follows_the_contract() {
        let mut c = NetworkConfig::default();
        assert_eq!(c.service_routing(false), ServiceRouting::Required);
        assert_eq!(c.service_routing(true), ServiceRouting::Off);
        c.kube_proxy_replacement.enabled = Some(true);
        assert_eq!(c.service_routing(false), ServiceRouting::Required);
        assert_eq!(c.service_routing(true), ServiceRouting::Requested);
        c.kube_proxy_replacement.enabled = Some(false);
        assert_eq!(c.service_routing(false), ServiceRouting::Refused);
        assert_eq!(c.service_routing(true), ServiceRouting::Off);
        assert!(ServiceRouting::Required.active() && ServiceRouting::Requested.active());
        assert!(!ServiceRouting::Off.active() && !ServiceRouting::Refused.active());
    }

    #[test]
    fn gardeners_ipam_example_and_an_mtu_parse_and_other_values_are_refused_by_field() {
        let head = "apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1\nkind: NetworkConfig\n";
        let c = NetworkConfig::from_yaml_str(&format!("{head}ipam:\n  cidr: usePodCIDR\n  type: host-local\nmtu: 1450\n")).unwrap();
        assert_eq!((c.ipam, c.mtu), (Some(Ipam::default()), Some(1450)));
        assert!(c.masquerade.enabled && c.masquerade.non_masquerade_cidrs.is_empty());
        let c = NetworkConfig::from_yaml_str(&format!("{head}masquerade: {{enabled: false, nonMasqueradeCIDRs: [100.64.0.0/10, \"fd00::/8\"]}}\n")).unwrap();
        assert_eq!(c.masquerade, Masquerade { enabled: false, non_masquerade_cidrs: vec!["100.64.0.0/10".into(), "fd00::/8".into()] });
        for (doc, field) in [
            ("ipam: {type: calico-ipam, cidr: usePodCIDR}", "ipam.type"),
            ("ipam: {type: host-local, cidr: 10.0.0.0/8}", "ipam.cidr"),
            ("ipam: {type: host-local}", "ipam"),
            ("ipam: {type: host-local, cidr: usePodCIDR, subnet: x}", "ipam.subnet"),
            ("mtu: 1000", "mtu"),
            ("mtu: 70000", "mtu"),
            ("mtu: big", "mtu"),
            ("masquerade: {nonMasqueradeCIDRs: [10.0.0.0/8, nonsense]}", "masquerade.nonMasqueradeCIDRs[1]"),
            ("masquerade: {nonMasqueradeCIDRs: [10.0.0.1]}", "masquerade.nonMasqueradeCIDRs[0]"),
            ("masquerade: {enabled: maybe}", "masquerade.enabled"),
        ] {
            let e = NetworkConfig::from_yaml_str(&format!("{head}{doc}\n")).unwrap_err();
            assert_eq!(e.field, field, "{doc}: {e}");
        }
    }
}
