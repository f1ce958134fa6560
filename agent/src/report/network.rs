//! The elected agent's job: Node conditions -> the Gardener `Network`'s status.
//!
//! The Network may live in another cluster than the Nodes (Gardener keeps it in the seed,
//! the agents run in the shoot), so the reporter takes two `Api`s, built from two clients
//! if need be. It writes a JSON merge patch to the `status` subresource carrying only
//! gardenet's fields ([`crate::gardener::aggregate::status_patch`]): maps merge key by key,
//! so other writers' `state`, `resources` and unknown fields survive; `conditions` is a list
//! and is sent whole, which is safe because it is computed from the list just read and the
//! patch carries that read's resourceVersion (409 on any change in between: re-read).

use std::{fmt, str::FromStr, time::Duration};

use anyhow::{bail, Context};
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    api::{ListParams, Patch, PatchParams},
    Api, Client,
};
use serde_json::Value;

use super::{api_code, lease::Leadership, stopped, timed, Shutdown};
use crate::gardener::{
    aggregate::{node_readiness, status_update, NodeReadiness},
    config::NetworkConfig,
    network::Network,
    NETWORK_TYPE,
};

/// How many times one reconcile re-reads after losing a write race.
const ATTEMPTS: usize = 3;

/// `NAMESPACE/NAME` of the Network, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkRef {
    pub namespace: String,
    pub name: String,
}

impl FromStr for NetworkRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let ok = |p: &str| !p.is_empty() && !p.contains(['/', '?', '#', '%', ' ']);
        match s.split_once('/') {
            Some((ns, name)) if ok(ns) && ok(name) => Ok(NetworkRef { namespace: ns.into(), name: name.into() }),
            _ => Err(format!("{s:?}: expected NAMESPACE/NAME")),
        }
    }
}

impl fmt::Display for NetworkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug)]
pub struct NetworkReporterConfig {
    /// How often the leader recomputes the status (it also does on becoming leader).
    pub interval: Duration,
    /// A node condition whose heartbeat is older than this counts as "no agent"; a few
    /// times [`super::NodeReporterConfig::heartbeat`].
    pub node_max_age: Duration,
    /// From the Shoot's `spec.kubernetes.kubeProxy.enabled` (passed by the extension).
    pub kube_proxy_enabled: bool,
    /// Used when the Network has an unusable `providerConfig` (its own errors are logged).
    pub fallback_config: NetworkConfig,
    pub request_timeout: Duration,
}

impl Default for NetworkReporterConfig {
    fn default() -> Self {
        NetworkReporterConfig {
            interval: Duration::from_secs(15),
            node_max_age: Duration::from_secs(180),
            kube_proxy_enabled: false,
            fallback_config: NetworkConfig::default(),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// What one reconcile did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Written,
    /// The status already is what gardenet wants: no write.
    Unchanged,
    /// Not (or no longer) the leader: nothing was written.
    NotLeader,
    /// The Network changed since it was read (409): re-read and try again.
    Conflict,
}

pub struct NetworkReporter {
    networks: Api<Network>,
    nodes: Api<Node>,
    name: String,
    leadership: Leadership,
    config: NetworkReporterConfig,
}

impl NetworkReporter {
    /// `network_client` talks to the cluster holding the Network (the seed, or the same
    /// cluster as `node_client`).
    pub fn new(node_client: Client, network_client: Client, network: &NetworkRef, leadership: Leadership, config: NetworkReporterConfig) -> Self {
        NetworkReporter {
            networks: Api::namespaced(network_client, &network.namespace),
            nodes: Api::all(node_client),
            name: network.name.clone(),
            leadership,
            config,
        }
    }

    /// Reads the Network and writes its status if needed, re-reading after lost races.
    pub async fn reconcile(&self) -> anyhow::Result<Outcome> {
        for _ in 0..ATTEMPTS {
            if !self.leadership.is_leader() {
                return Ok(Outcome::NotLeader);
            }
            let network = timed(self.config.request_timeout, "reading the Network", self.networks.get(&self.name))
                .await?
                .with_context(|| format!("reading Network {}", self.name))?;
            match self.write(&network).await? {
                Outcome::Conflict => {
                    tracing::debug!(network = %self.name, "Network changed while writing its status; re-reading")
                }
                outcome => return Ok(outcome),
            }
        }
        Ok(Outcome::Conflict)
    }

    /// One attempt from a Network as read: computes the status from the current Nodes and
    /// writes it if it changes anything.
    pub async fn write(&self, network: &Network) -> anyhow::Result<Outcome> {
        if network.spec.type_ != NETWORK_TYPE {
            // Not ours: never write into another extension's Network.
            bail!("Network {} has type {:?}, not {NETWORK_TYPE:?}", self.name, network.spec.type_);
        }
        let config = NetworkConfig::from_network(network).unwrap_or_else(|e| {
            tracing::warn!(network = %self.name, "{e}; using the agent's own config");
            self.config.fallback_config.clone()
        });
        let nodes = self.node_readiness().await?;
        let now = Time(Timestamp::now());
        let Some(patch) = status_update(network, &config, self.config.kube_proxy_enabled, &nodes, now) else {
            return Ok(Outcome::Unchanged);
        };
        // `status_update` compares typed statuses; fields it does not model (say, a foreign
        // key inside providerStatus) make them differ forever although the merge patch
        // would change nothing. Don't write (and wake every watcher) for nothing.
        let current = network.status.as_ref().and_then(|s| serde_json::to_value(s).ok()).unwrap_or(Value::Null);
        if merge_patch_is_noop(&current, &patch["status"]) {
            return Ok(Outcome::Unchanged);
        }
        // Leadership may have run out while we listed Nodes.
        if !self.leadership.is_leader() {
            return Ok(Outcome::NotLeader);
        }
        let written = timed(
            self.config.request_timeout,
            "patching the Network status",
            self.networks.patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await?;
        match written {
            Ok(_) => Ok(Outcome::Written),
            Err(e) if api_code(&e) == Some(409) => Ok(Outcome::Conflict),
            Err(e) => Err(e).with_context(|| format!("patching the status of Network {}", self.name)),
        }
    }

    async fn node_readiness(&self) -> anyhow::Result<Vec<NodeReadiness>> {
        let nodes = timed(self.config.request_timeout, "listing Nodes", self.nodes.list(&ListParams::default())).await?.context("listing Nodes")?;
        let now = Time(Timestamp::now());
        let max_age = i64::try_from(self.config.node_max_age.as_secs()).unwrap_or(i64::MAX);
        Ok(nodes.items.iter().map(|n| node_readiness(n, &now, max_age)).collect())
    }

    /// Reconciles every interval and on leadership changes, while leading, until `shutdown`.
    pub async fn run(self, mut shutdown: Shutdown) {
        let mut leader = self.leadership.subscribe();
        let mut hint_alive = true;
        loop {
            if self.leadership.is_leader() {
                match self.reconcile().await {
                    Ok(Outcome::Written) => {
                        tracing::info!(network = %self.name, "Network status updated")
                    }
                    Ok(outcome) => {
                        tracing::debug!(network = %self.name, "Network status: {outcome:?}")
                    }
                    Err(e) => {
                        tracing::warn!(network = %self.name, "reporting Network status: {e:#}")
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.config.interval) => {}
                changed = leader.changed(), if hint_alive => hint_alive = changed.is_ok(),
                () = stopped(&mut shutdown) => break,
            }
        }
    }
}

/// RFC 7386: applies `patch` to `target`.
fn json_merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    if let Value::Object(map) = target {
        for (k, v) in patch {
            if v.is_null() {
                map.remove(k);
            } else {
                json_merge(map.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Whether applying merge `patch` to `current` leaves it as it is.
fn merge_patch_is_noop(current: &Value, patch: &Value) -> bool {
    let mut patched = current.clone();
    json_merge(&mut patched, patch);
    patched == *current
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn network_refs() {
        assert_eq!("shoot--a--b/shoot".parse::<NetworkRef>(), Ok(NetworkRef { namespace: "shoot--a--b".into(), name: "shoot".into() }));
        for bad in ["shoot", "/x", "x/", "a/b/c", "a/b?c"] {
            assert!(bad.parse::<NetworkRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn merge_patch_semantics() {
        let current = json!({"a": {"x": 1, "foreign": 2}, "list": [1, 2], "gone": 1});
        assert!(merge_patch_is_noop(&current, &json!({"a": {"x": 1}, "list": [1, 2]})));
        assert!(merge_patch_is_noop(&current, &json!({"missing": null})));
        assert!(!merge_patch_is_noop(&current, &json!({"gone": null})));
        assert!(!merge_patch_is_noop(&current, &json!({"list": [1]})));
        assert!(!merge_patch_is_noop(&Value::Null, &json!({"a": 1})));
    }
}
