//! Access to the shoot, the way Gardener gives it to extensions: the extension asks for a
//! token by creating a "shoot access" Secret in the shoot namespace (labelled for the
//! resource manager's token requestor, which creates the ServiceAccount in the shoot and
//! writes a rotating token into the Secret), and combines that token with the
//! `generic-token-kubeconfig` Secret gardenlet keeps next to it. No shoot credentials ever
//! go into the shoot manifests.

use std::collections::BTreeMap;

use gardenet_agent::gardener::aggregate::{node_readiness, NodeReadiness};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use crate::cluster::Cluster;
use crate::render::EXTENSION_SHOOT_ACCOUNT;

/// The Secret the token requestor fills with the token of `gardenet-extension` in the shoot.
pub const ACCESS_SECRET: &str = "shoot-access-gardenet-extension";
/// Cluster annotation naming the generic token kubeconfig Secret.
pub const ANNOTATION_GENERIC_KUBECONFIG: &str = "generic-token-kubeconfig.secret.gardener.cloud/name";
pub const DEFAULT_GENERIC_KUBECONFIG: &str = "generic-token-kubeconfig";
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

/// The shoot access Secret, as the token requestor expects it.
pub fn access_secret(namespace: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(ACCESS_SECRET.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                ("resources.gardener.cloud/purpose".into(), "token-requestor".into()),
                ("resources.gardener.cloud/class".into(), "shoot".into()),
            ])),
            annotations: Some(BTreeMap::from([
                ("serviceaccount.resources.gardener.cloud/name".into(), EXTENSION_SHOOT_ACCOUNT.into()),
                ("serviceaccount.resources.gardener.cloud/namespace".into(), "kube-system".into()),
            ])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// Creates the shoot access Secret if it does not exist (never overwrites the token in it).
pub async fn ensure_access_secret(seed: &Client, namespace: &str) -> Result<(), kube::Error> {
    let api: Api<Secret> = Api::namespaced(seed.clone(), namespace);
    match api.create(&PostParams::default(), &access_secret(namespace)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

fn secret_text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .filter(|s| !s.is_empty())
}

/// A client for the shoot of `cluster`, from the generic kubeconfig and the requested token.
pub async fn client(seed: &Client, namespace: &str, cluster: &Cluster) -> Result<Client, ShootAccessError> {
    let api: Api<Secret> = Api::namespaced(seed.clone(), namespace);
    let kubeconfig_name = cluster
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_GENERIC_KUBECONFIG))
        .cloned()
        .unwrap_or_else(|| DEFAULT_GENERIC_KUBECONFIG.to_owned());
    let get = |name: String| {
        let api = api.clone();
        async move { api.get_opt(&name).await?.ok_or(ShootAccessError::NotYet(name)) }
    };
    let generic = get(kubeconfig_name.clone()).await?;
    let access = get(ACCESS_SECRET.to_owned()).await?;
    let invalid = |secret: &str, what: &str| ShootAccessError::Invalid { secret: secret.to_owned(), what: what.to_owned() };
    let text = secret_text(&generic, "kubeconfig").ok_or_else(|| invalid(&kubeconfig_name, "no kubeconfig key"))?;
    let token = secret_text(&access, "token").ok_or_else(|| ShootAccessError::NotYet(format!("{ACCESS_SECRET} (token)")))?;
    let mut kubeconfig = Kubeconfig::from_yaml(&text).map_err(|e| invalid(&kubeconfig_name, &e.to_string()))?;
    // The generic kubeconfig points at a token file mounted into shoot-namespace pods; the
    // extension runs elsewhere and uses the token directly.
    for user in &mut kubeconfig.auth_infos {
        if let Some(auth) = &mut user.auth_info {
            auth.token_file = None;
            auth.token = Some(token.clone().into());
        }
    }
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| invalid(&kubeconfig_name, &e.to_string()))?;
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
