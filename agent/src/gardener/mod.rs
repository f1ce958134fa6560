//! Gardener integration: the `Network` extension resource, gardenet's `NetworkConfig`
//! (the Network's `spec.providerConfig`), the node-readiness aggregation that one elected
//! agent writes into the Network status, and the node capability probe that decides whether
//! this node can route Services at all.
//!
//! Everything here is pure (no API calls): the caller fetches objects, feeds them in and
//! patches what comes out. That keeps the Gardener contract testable without a cluster.
//!
//! - [`network`]: `extensions.gardener.cloud/v1alpha1` `Network`, shaped like Gardener's Go types.
//! - [`config`]: `gardenet.networking.extensions.gardener.cloud/v1alpha1` `NetworkConfig`.
//! - [`aggregate`]: node readiness -> desired Network status, and the merge into the current one.
//! - [`capability`]: can this node run the dataplane (kernel, bpffs, cgroup2, bpf())?

pub mod aggregate;
pub mod capability;
pub mod config;
pub mod network;

/// The `spec.type` of Networks handled by gardenet.
pub const NETWORK_TYPE: &str = "gardenet";

/// API group of gardenet's provider config and provider status.
pub const PROVIDER_GROUP: &str = "gardenet.networking.extensions.gardener.cloud";

/// `apiVersion` of gardenet's provider config (`NetworkConfig`) and status (`NetworkStatus`).
pub const PROVIDER_API_VERSION: &str = "gardenet.networking.extensions.gardener.cloud/v1alpha1";

/// Name of the Lease (in `kube-system`) the agents use to elect the one that aggregates
/// node readiness into the Network status. `deploy/rbac.yaml` grants access to this name only.
pub const LEASE_NAME: &str = "gardenet-agent";

/// Namespace of the election Lease (and of the DaemonSet).
pub const LEASE_NAMESPACE: &str = "kube-system";
