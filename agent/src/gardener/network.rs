//! The Gardener `Network` extension resource (`extensions.gardener.cloud/v1alpha1`, namespaced).
//!
//! Field names and JSON shapes follow Gardener's Go types (`NetworkSpec`/`NetworkStatus` in
//! `pkg/apis/extensions/v1alpha1`, `DefaultSpec`/`DefaultStatus`, and `Condition`,
//! `LastOperation`, `LastError` from `pkg/apis/core/v1beta1`), so a Gardener-managed object
//! round-trips through these types. Deserialization is deliberately lenient (unknown fields
//! ignored, unknown enum strings kept): the object belongs to Gardener, and a newer Gardener
//! must not make the agent unable to read it. Strictness applies to *our* provider config
//! only (see [`super::config`]).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// API group of the Network resource.
pub const GROUP: &str = "extensions.gardener.cloud";
/// API version (within [`GROUP`]) of the Network resource.
pub const VERSION: &str = "v1alpha1";
/// Kind of the Network resource.
pub const KIND: &str = "Network";
/// Plural (resource) name of the Network resource.
pub const PLURAL: &str = "networks";

/// Gardener's `ErrorCode` for non-retryable configuration problems; the contract's way of
/// saying "gardenet was told to route Services and cannot".
pub const ERR_CONFIGURATION_PROBLEM: &str = "ERR_CONFIGURATION_PROBLEM";

/// Declares a string enum that keeps values it does not know (`Other`) instead of failing:
/// Gardener's Go types are string aliases whose value sets grow over time.
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
            /// A value this version of gardenet does not know; kept verbatim.
            Other(String),
        }

        impl $name {
            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $text,)+
                    Self::Other(s) => s,
                }
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                match s.as_str() {
                    $($text => Self::$variant,)+
                    _ => Self::Other(s),
                }
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self::from(s.to_owned())
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                match v {
                    $name::Other(s) => s,
                    other => other.as_str().to_owned(),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum! {
    /// IP protocol version of the shoot network (Gardener `IPFamily`).
    IpFamily { IPv4 => "IPv4", IPv6 => "IPv6" }
}

string_enum! {
    /// Status of a condition (Gardener `ConditionStatus`).
    ConditionStatus {
        True => "True",
        False => "False",
        Unknown => "Unknown",
        Progressing => "Progressing",
    }
}

string_enum! {
    /// Gardener `LastOperationState`.
    LastOperationState {
        Processing => "Processing",
        Succeeded => "Succeeded",
        Error => "Error",
        Failed => "Failed",
        Pending => "Pending",
        Aborted => "Aborted",
    }
}

string_enum! {
    /// Gardener `LastOperationType`.
    LastOperationType {
        Create => "Create",
        Reconcile => "Reconcile",
        Delete => "Delete",
        Migrate => "Migrate",
        Restore => "Restore",
        LiveMigrate => "LiveMigrate",
    }
}

/// `spec` of a Network: Gardener's `DefaultSpec` (type, class, providerConfig) inlined with
/// the pod/service CIDRs and IP families.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "extensions.gardener.cloud",
    version = "v1alpha1",
    kind = "Network",
    plural = "networks",
    namespaced,
    status = "NetworkStatus",
    // The CRD in deploy/ is a copy of Gardener's (the authority on Gardener clusters); no
    // schema is generated from these intentionally lenient types.
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    /// The network extension responsible for this Network; gardenet handles `gardenet`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Extension class (`shoot`, `seed`, `garden`); absent means `shoot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Extension-specific configuration; for gardenet a [`super::config::NetworkConfig`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_config: Option<Value>,
    /// CIDR used for pods.
    #[serde(rename = "podCIDR", default)]
    pub pod_cidr: String,
    /// CIDR used for Services.
    #[serde(rename = "serviceCIDR", default)]
    pub service_cidr: String,
    /// IP families of the shoot network; Gardener defaults an empty list to `[IPv4]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_families: Vec<IpFamily>,
}

impl NetworkSpec {
    /// The requested IP families with Gardener's default applied (empty means IPv4 only).
    pub fn effective_ip_families(&self) -> Vec<IpFamily> {
        if self.ip_families.is_empty() {
            vec![IpFamily::IPv4]
        } else {
            self.ip_families.clone()
        }
    }
}

/// `status` of a Network: Gardener's `DefaultStatus` inlined with `ipFamilies`.
///
/// `state` and `resources` are not written by gardenet; they are kept as raw JSON so a read
/// status can be compared and re-serialized without loss.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatus {
    /// Extension-specific status; gardenet writes an [`super::aggregate::ProviderStatus`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_operation: Option<LastOperation>,
    /// Go `int64` with `omitempty`: 0 is not written.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub observed_generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<Value>,
    /// IP families actually in use (may differ from the spec during a dual-stack migration).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_families: Vec<IpFamily>,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// Gardener `Condition` (core/v1beta1), not the metav1 one: it has `lastUpdateTime` and `codes`.
///
/// The times are optional on read because Go serializes a zero `metav1.Time` as `null`;
/// gardenet always sets them on the conditions it writes. Fields unknown to this version are
/// kept in `extra`, because the whole `conditions` list is written back when gardenet
/// updates its own condition, and other writers' conditions must survive that untouched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: ConditionStatus,
    #[serde(default)]
    pub last_transition_time: Option<Time>,
    #[serde(default)]
    pub last_update_time: Option<Time>,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// Gardener `LastOperation`: what the extension did last, and how far it got.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastOperation {
    #[serde(default)]
    pub description: String,
    /// Last time the operation state transitioned (optional on read, see [`Condition`]).
    #[serde(default)]
    pub last_update_time: Option<Time>,
    /// Progress in percent, 0..=100.
    #[serde(default)]
    pub progress: i32,
    pub state: LastOperationState,
    #[serde(rename = "type")]
    pub type_: LastOperationType,
}

/// Gardener `LastError`: the last error of an operation, with well-defined error codes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastError {
    pub description: String,
    #[serde(rename = "taskID", default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update_time: Option<Time>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    const GARDENER_NETWORK: &str = r#"
apiVersion: extensions.gardener.cloud/v1alpha1
kind: Network
metadata:
  name: my-network
  namespace: shoot--core--test-01
  generation: 3
spec:
  type: gardenet
  podCIDR: 100.244.0.0/16
  serviceCIDR: 100.32.0.0/13
  ipFamilies: [IPv4]
  providerConfig:
    apiVersion: gardenet.networking.extensions.gardener.cloud/v1alpha1
    kind: NetworkConfig
status:
  lastOperation:
    description: Successfully reconciled network
    lastUpdateTime: "2024-05-01T10:00:00Z"
    progress: 100
    state: Succeeded
    type: Reconcile
  observedGeneration: 1
  conditions:
  - type: SomeoneElses
    status: "True"
    lastTransitionTime: "2024-05-01T09:00:00Z"
    lastUpdateTime: null
    reason: Fine
    message: all good
    futureField: {x: 1}
  providerStatus:
    apiVersion: calico.networking.extensions.gardener.cloud/v1alpha1
    kind: NetworkStatus
  state: {opaque: true}
  ipFamilies: [IPv4, IPv7]
"#;

    #[test]
    fn resource_identity_matches_constants() {
        assert_eq!(Network::group(&()), GROUP);
        assert_eq!(Network::version(&()), VERSION);
        assert_eq!(Network::kind(&()), KIND);
        assert_eq!(Network::plural(&()), PLURAL);
        assert_eq!(Network::api_version(&()), "extensions.gardener.cloud/v1alpha1");
    }

    #[test]
    fn parses_gardener_shaped_network() {
        let n: Network = serde_yaml::from_str(GARDENER_NETWORK).unwrap();
        assert_eq!(n.spec.type_, "gardenet");
        assert_eq!(n.spec.pod_cidr, "100.244.0.0/16");
        assert_eq!(n.spec.service_cidr, "100.32.0.0/13");
        assert_eq!(n.spec.ip_families, vec![IpFamily::IPv4]);
        assert_eq!(n.metadata.generation, Some(3));
        let st = n.status.as_ref().unwrap();
        let op = st.last_operation.as_ref().unwrap();
        assert_eq!(op.state, LastOperationState::Succeeded);
        assert_eq!(op.type_, LastOperationType::Reconcile);
        assert_eq!(op.progress, 100);
        assert_eq!(st.observed_generation, 1);
        assert_eq!(st.conditions[0].last_update_time, None);
        assert_eq!(st.ip_families[1], IpFamily::Other("IPv7".into()));
    }

    #[test]
    fn status_round_trips_without_loss() {
        let n: Network = serde_yaml::from_str(GARDENER_NETWORK).unwrap();
        let st = n.status.unwrap();
        let json = serde_json::to_value(&st).unwrap();
        // Unknown condition fields, unknown enum values and opaque state survive.
        assert_eq!(json["conditions"][0]["futureField"]["x"], 1);
        assert_eq!(json["ipFamilies"][1], "IPv7");
        assert_eq!(json["state"]["opaque"], true);
        assert_eq!(json["lastOperation"]["lastUpdateTime"], "2024-05-01T10:00:00Z");
        let back: NetworkStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, st);
    }

    #[test]
    fn empty_ip_families_default_to_ipv4() {
        let spec = NetworkSpec { type_: "gardenet".into(), ..Default::default() };
        assert_eq!(spec.effective_ip_families(), vec![IpFamily::IPv4]);
    }
}
