//! The shoot manifests: the agent DaemonSet, its ServiceAccount and RBAC, and its
//! NetworkConfig.
//!
//! The DaemonSet and RBAC start from `deploy/daemonset.yaml` and `deploy/rbac.yaml` (compiled
//! in), so the manifests operators apply by hand and those Gardener applies stay one design,
//! checked by the same tests. Rendering only adjusts what differs per shoot.

use std::collections::BTreeMap;

use gardenet_agent::gardener::config::NetworkConfig;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::core::v1::{ConfigMap, EnvVar};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::contract::Plan;
use crate::managed::content_hash;

const DAEMONSET_YAML: &str = include_str!("../../deploy/daemonset.yaml");
const RBAC_YAML: &str = include_str!("../../deploy/rbac.yaml");

/// Gardener keeps new nodes tainted `node.gardener.cloud/critical-components-not-ready`
/// until every DaemonSet pod carrying this label on them is ready.
pub const LABEL_CRITICAL_COMPONENT: &str = "node.gardener.cloud/critical-component";
/// Pod annotation with the config's hash: a config change rolls the agents.
pub const ANNOTATION_CONFIG_HASH: &str = "checksum/config";
/// The kube-proxy flag in `deploy/daemonset.yaml`, replaced per shoot.
const KUBE_PROXY_FLAG: &str = "--kube-proxy-enabled=";

/// Keys of the ManagedResource secret.
pub const KEY_RBAC: &str = "rbac.yaml";
pub const KEY_CONFIG: &str = "configmap.yaml";
pub const KEY_DAEMONSET: &str = "daemonset.yaml";

/// A compiled-in manifest that does not parse: a build defect, found by the unit tests.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("deploy/{file}: {source}")]
    Template { file: &'static str, source: serde_yaml::Error },
    #[error("deploy/{file}: no {kind}")]
    Missing { file: &'static str, kind: &'static str },
    #[error("serializing {what}: {source}")]
    Serialize { what: &'static str, source: serde_yaml::Error },
}

/// Everything rendering depends on besides the [`Plan`].
#[derive(Clone, Debug)]
pub struct Settings {
    /// The agent image.
    pub image: String,
}

/// The manifests, by secret key.
pub fn render(plan: &Plan, settings: &Settings) -> Result<BTreeMap<String, String>, RenderError> {
    let config = config_map(&plan.config)?;
    let config_hash = content_hash(&config.data.clone().unwrap_or_default());
    let daemonset = daemonset(plan, settings, &config_hash)?;
    let mut out = BTreeMap::new();
    out.insert(KEY_RBAC.to_owned(), rbac()?);
    out.insert(KEY_CONFIG.to_owned(), to_yaml("ConfigMap", &config)?);
    out.insert(KEY_DAEMONSET.to_owned(), to_yaml("DaemonSet", &daemonset)?);
    Ok(out)
}

fn to_yaml<T: serde::Serialize>(what: &'static str, obj: &T) -> Result<String, RenderError> {
    serde_yaml::to_string(obj).map_err(|source| RenderError::Serialize { what, source })
}

fn join(docs: Vec<String>) -> String {
    docs.iter().map(|d| format!("---\n{d}")).collect()
}

/// The documents of a compiled-in file whose `kind` is `kind`.
fn docs_of<T: DeserializeOwned>(file: &'static str, text: &str, kind: &'static str) -> Result<Vec<T>, RenderError> {
    let mut out = Vec::new();
    for de in serde_yaml::Deserializer::from_str(text) {
        let value = serde_yaml::Value::deserialize(de).map_err(|source| RenderError::Template { file, source })?;
        if value.get("kind").and_then(|k| k.as_str()) == Some(kind) {
            out.push(serde_yaml::from_value(value).map_err(|source| RenderError::Template { file, source })?);
        }
    }
    if out.is_empty() {
        return Err(RenderError::Missing { file, kind });
    }
    Ok(out)
}

fn config_map(config: &NetworkConfig) -> Result<ConfigMap, RenderError> {
    let text = to_yaml("NetworkConfig", config)?;
    Ok(ConfigMap {
        metadata: ObjectMeta {
            name: Some("gardenet-config".into()),
            namespace: Some("kube-system".into()),
            labels: Some(BTreeMap::from([("app.kubernetes.io/name".into(), "gardenet-agent".into())])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("config.yaml".into(), text)])),
        ..Default::default()
    })
}

fn daemonset(plan: &Plan, settings: &Settings, config_hash: &str) -> Result<DaemonSet, RenderError> {
    let file = "daemonset.yaml";
    let mut ds: DaemonSet = docs_of(file, DAEMONSET_YAML, "DaemonSet")?.remove(0);
    let critical = || (LABEL_CRITICAL_COMPONENT.to_owned(), "true".to_owned());
    ds.metadata.labels.get_or_insert_with(BTreeMap::new).extend([critical()]);
    let template = &mut ds.spec.template;
    let meta = template.metadata.get_or_insert_with(Default::default);
    meta.labels.get_or_insert_with(BTreeMap::new).extend([critical()]);
    meta.annotations.get_or_insert_with(BTreeMap::new).insert(ANNOTATION_CONFIG_HASH.to_owned(), config_hash.to_owned());
    let pod = template.spec.get_or_insert_with(Default::default);
    for c in pod.containers.iter_mut().chain(pod.init_containers.iter_mut().flatten()) {
        c.image = Some(settings.image.clone());
    }
    let agent = pod.containers.first_mut().ok_or(RenderError::Missing { file, kind: "container" })?;
    for arg in agent.args.iter_mut().flatten() {
        if arg.starts_with(KUBE_PROXY_FLAG) {
            *arg = format!("{KUBE_PROXY_FLAG}{}", plan.kube_proxy_enabled);
        }
    }
    if let Some(api) = &plan.api_server {
        let env = agent.env.get_or_insert_with(Vec::new);
        env.retain(|e| e.name != "KUBERNETES_SERVICE_HOST" && e.name != "KUBERNETES_SERVICE_PORT");
        for (name, value) in [("KUBERNETES_SERVICE_HOST", api.host.clone()), ("KUBERNETES_SERVICE_PORT", api.port.to_string())] {
            env.push(EnvVar { name: name.into(), value: Some(value), ..Default::default() });
        }
    }
    Ok(ds)
}

/// The agent's identity and access, minus the Network rules: in a shoot the agent never
/// writes the Network status (the extension does, and the shoot has no Networks).
fn rbac() -> Result<String, RenderError> {
    let file = "rbac.yaml";
    let sa: Vec<ServiceAccount> = docs_of(file, RBAC_YAML, "ServiceAccount")?;
    let mut roles: Vec<ClusterRole> = docs_of(file, RBAC_YAML, "ClusterRole")?;
    for role in &mut roles {
        if let Some(rules) = &mut role.rules {
            rules.retain(|r| !r.api_groups.iter().flatten().any(|g| g == "extensions.gardener.cloud"));
        }
    }
    let crb: Vec<ClusterRoleBinding> = docs_of(file, RBAC_YAML, "ClusterRoleBinding")?;
    let role: Vec<Role> = docs_of(file, RBAC_YAML, "Role")?;
    let rb: Vec<RoleBinding> = docs_of(file, RBAC_YAML, "RoleBinding")?;
    let mut docs = Vec::new();
    for d in sa {
        docs.push(to_yaml("ServiceAccount", &d)?);
    }
    for d in roles {
        docs.push(to_yaml("ClusterRole", &d)?);
    }
    for d in crb {
        docs.push(to_yaml("ClusterRoleBinding", &d)?);
    }
    for d in role {
        docs.push(to_yaml("Role", &d)?);
    }
    for d in rb {
        docs.push(to_yaml("RoleBinding", &d)?);
    }
    Ok(join(docs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ApiServerEndpoint;
    use gardenet_agent::gardener::config::ServiceRouting;
    use gardenet_agent::gardener::network::IpFamily;

    fn plan(kube_proxy_enabled: bool) -> Plan {
        Plan {
            config: NetworkConfig::default(),
            routing: if kube_proxy_enabled { ServiceRouting::Off } else { ServiceRouting::Required },
            kube_proxy_enabled,
            api_server: (!kube_proxy_enabled).then(|| ApiServerEndpoint { host: "api.example.com".into(), port: 443 }),
            ip_families: vec![IpFamily::IPv4],
        }
    }

    fn settings() -> Settings {
        Settings { image: "registry.example.com/gardenet-agent:v1".into() }
    }

    fn rendered_daemonset(p: &Plan) -> DaemonSet {
        let out = render(p, &settings()).unwrap();
        serde_yaml::from_str(&out[KEY_DAEMONSET]).unwrap()
    }

    #[test]
    fn daemonset_is_critical_and_points_at_the_api_server() {
        let ds = rendered_daemonset(&plan(false));
        assert_eq!(ds.metadata.labels.as_ref().unwrap()[LABEL_CRITICAL_COMPONENT], "true");
        let template = &ds.spec.template;
        assert_eq!(template.metadata.as_ref().unwrap().labels.as_ref().unwrap()[LABEL_CRITICAL_COMPONENT], "true");
        let pod = template.spec.as_ref().unwrap();
        assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
        let agent = &pod.containers[0];
        assert_eq!(agent.image.as_deref(), Some("registry.example.com/gardenet-agent:v1"));
        let args = agent.args.as_ref().unwrap();
        assert!(args.contains(&"--kube-proxy-enabled=false".to_owned()));
        // The agents in a shoot never write the Network status: no seed, no credentials for it.
        assert!(!args.iter().any(|a| a.starts_with("--network")), "{args:?}");
        let env: BTreeMap<_, _> = agent.env.iter().flatten().map(|e| (e.name.as_str(), e.value.clone())).collect();
        assert_eq!(env["KUBERNETES_SERVICE_HOST"].as_deref(), Some("api.example.com"));
        assert_eq!(env["KUBERNETES_SERVICE_PORT"].as_deref(), Some("443"));
        assert!(pod.init_containers.as_ref().unwrap().iter().all(|c| c.image == agent.image));
    }

    #[test]
    fn kube_proxy_enabled_keeps_the_service_route() {
        let ds = rendered_daemonset(&plan(true));
        let agent = &ds.spec.template.spec.unwrap().containers[0];
        assert!(agent.args.as_ref().unwrap().contains(&"--kube-proxy-enabled=true".to_owned()));
        assert!(!agent.env.iter().flatten().any(|e| e.name == "KUBERNETES_SERVICE_HOST"));
    }

    #[test]
    fn config_changes_change_the_pod_template() {
        let a = plan(false);
        let mut b = plan(false);
        b.config.socket_lb.host_namespace_only = true;
        let hash = |p: &Plan| rendered_daemonset(p).spec.template.metadata.unwrap().annotations.unwrap()[ANNOTATION_CONFIG_HASH].clone();
        assert_ne!(hash(&a), hash(&b));
        let out = render(&b, &settings()).unwrap();
        let cm: ConfigMap = serde_yaml::from_str(&out[KEY_CONFIG]).unwrap();
        let text = &cm.data.unwrap()["config.yaml"];
        assert_eq!(NetworkConfig::from_yaml_str(text).unwrap(), b.config);
    }

    #[test]
    fn shoot_rbac_has_no_network_access() {
        let out = render(&plan(false), &settings()).unwrap();
        assert!(!out[KEY_RBAC].contains("extensions.gardener.cloud"), "{}", out[KEY_RBAC]);
        assert!(out[KEY_RBAC].contains("nodes/status"));
        // Rendering is deterministic: the same plan gives the same secret name.
        assert_eq!(out, render(&plan(false), &settings()).unwrap());
    }
}
