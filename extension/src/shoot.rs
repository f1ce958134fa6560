//! Access to the shoot, the way Gardener's extension library gives it to extension
//! controllers (`util.NewClientForShoot`, `extensions/pkg/util/shoot_clients.go`): the
//! kubeconfig in the `gardener-internal` Secret of the shoot namespace (the in-cluster
//! address `kube-apiserver.<namespace>.svc`, reachable from the extension's own namespace),
//! else the `gardener` Secret (the external address); only `gardener` when
//! `GARDENER_SHOOT_CLIENT=external`. gardenlet keeps both, and their tokens, current. No
//! shoot credentials ever go into the shoot manifests.
//!
//! (The `generic-token-kubeconfig` with a `shoot-access-*` token is for pods running in the
//! shoot namespace: its server is the namespace-relative `kube-apiserver`.)

use gardenet_agent::gardener::aggregate::{node_readiness, NodeReadiness};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

/// The Secrets holding gardenlet's kubeconfig for the shoot (`SecretNameGardenerInternal`,
/// `SecretNameGardener`), and the key of the kubeconfig in them.
pub const SECRET_GARDENER_INTERNAL: &str = "gardener-internal";
pub const SECRET_GARDENER: &str = "gardener";
const KEY_KUBECONFIG: &str = "kubeconfig";
/// `external`: use only the `gardener` Secret (the extension runs outside the seed).
pub const ENV_SHOOT_CLIENT: &str = "GARDENER_SHOOT_CLIENT";
/// Agents refresh their Node condition more often than this (the agent's default heartbeat
/// is well below); an older one counts as a dead agent.
pub const MAX_HEARTBEAT_AGE_SECONDS: i64 = 120;

#[derive(Debug, thiserror::Error)]
pub enum ShootAccessError {
    #[error("secret {0} not found yet")]
    NotYet(String),
    #[error("secret {secret}: {what}")]
    Invalid { secret: String, what: String },
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

/// The Secrets to try, in order, as `NewClientForShoot` does.
pub fn kubeconfig_secrets(shoot_client_env: Option<&str>) -> &'static [&'static str] {
    if shoot_client_env == Some("external") {
        &[SECRET_GARDENER]
    } else {
        &[SECRET_GARDENER_INTERNAL, SECRET_GARDENER]
    }
}

/// A client for the shoot whose control plane lives in `namespace`.
pub async fn client(seed: &Client, namespace: &str) -> Result<Client, ShootAccessError> {
    let api: Api<Secret> = Api::namespaced(seed.clone(), namespace);
    let env = std::env::var(ENV_SHOOT_CLIENT).ok();
    let mut found = None;
    for name in kubeconfig_secrets(env.as_deref()) {
        if let Some(secret) = api.get_opt(name).await? {
            found = Some((*name, secret));
            break;
        }
    }
    let Some((name, secret)) = found else {
        return Err(ShootAccessError::NotYet(kubeconfig_secrets(env.as_deref()).join(" or ")));
    };
    let invalid = |what: &str| ShootAccessError::Invalid { secret: name.to_owned(), what: what.to_owned() };
    let text = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KEY_KUBECONFIG))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| invalid("no kubeconfig key"))?;
    let kubeconfig = Kubeconfig::from_yaml(&text).map_err(|e| invalid(&e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.map_err(|e| invalid(&e.to_string()))?;
    Ok(Client::try_from(config)?)
}

/// Pages of Nodes read at most (500 each): the condition names at most a few nodes anyway,
/// and a bounded read keeps one reconcile bounded on any shoot.
const MAX_NODE_PAGES: usize = 20;

/// Every Node's gardenet readiness.
pub async fn node_readiness_all(shoot: &Client, now: &Time) -> Result<Vec<NodeReadiness>, kube::Error> {
    let nodes: Api<Node> = Api::all(shoot.clone());
    let mut out = Vec::new();
    let mut params = ListParams::default().limit(500);
    for _ in 0..MAX_NODE_PAGES {
        let page = nodes.list(&params).await?;
        out.extend(page.items.iter().map(|n| node_readiness(n, now, MAX_HEARTBEAT_AGE_SECONDS)));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = ListParams::default().limit(500).continue_token(&token),
            None => break,
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_kubeconfig_first_unless_external_is_asked_for() {
        assert_eq!(kubeconfig_secrets(None), ["gardener-internal", "gardener"]);
        assert_eq!(kubeconfig_secrets(Some("internal")), ["gardener-internal", "gardener"]);
        assert_eq!(kubeconfig_secrets(Some("external")), ["gardener"]);
    }
}
