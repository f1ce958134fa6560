//! Validates `deploy/`: every YAML document must parse into its Kubernetes API type with no
//! field left over (a misspelt or misplaced field is silently dropped by the API server, so
//! it must fail here), and the properties the deployment relies on are asserted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use gardenet_agent::gardener::{aggregate, config::NetworkConfig, network};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// One YAML document of a file in deploy/.
struct Doc {
    origin: String,
    api_version: String,
    kind: String,
    value: serde_yaml::Value,
}

fn docs() -> Vec<Doc> {
    docs_in(&deploy_dir())
}

/// Every object in the YAML files directly in `dir`.
fn docs_in(dir: &Path) -> Vec<Doc> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());

    let mut out = Vec::new();
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let found = docs_of_text(&name, &text);
        assert!(!found.is_empty(), "{name} holds no object");
        out.extend(found);
    }
    out
}

/// The objects of one multi-document YAML text.
fn docs_of_text(name: &str, text: &str) -> Vec<Doc> {
    let mut out = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let origin = format!("{name}#{i}");
        let value = serde_yaml::Value::deserialize(de).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
        if value.is_null() {
            continue; // an empty document, e.g. before the first `---`
        }
        let field = |k: &str| value.get(k).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("{origin}: no {k}")).to_owned();
        let (api_version, kind) = (field("apiVersion"), field("kind"));
        out.push(Doc { origin, api_version, kind, value });
    }
    out
}

/// Deserializes `doc` into `T`, failing on type errors (with the path) and on any field `T`
/// does not know (k8s-openapi's types skip unknown fields; `serde_ignored` sees them).
fn try_strict<T: DeserializeOwned>(doc: &Doc) -> Result<T, String> {
    let mut ignored = Vec::new();
    let mut record = |path: serde_ignored::Path<'_>| ignored.push(path.to_string());
    let de = serde_ignored::Deserializer::new(doc.value.clone(), &mut record);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(de);
    let value = parsed.map_err(|e| format!("{}: {}: {}", doc.origin, e.path(), e.inner()))?;
    // kube-derive's custom resource types leave apiVersion/kind to the caller; docs()
    // already read both (and k8s-openapi's types check them).
    ignored.retain(|p| p != "apiVersion" && p != "kind");
    if !ignored.is_empty() {
        return Err(format!("{} ({}): unknown fields {ignored:?}", doc.origin, doc.kind));
    }
    Ok(value)
}

fn strict<T: DeserializeOwned>(doc: &Doc) -> T {
    try_strict(doc).unwrap_or_else(|e| panic!("{e}"))
}

fn one<T: DeserializeOwned>(kind: &str) -> T {
    let all = docs();
    let mut matching = all.iter().filter(|d| d.kind == kind);
    let doc = matching.next().unwrap_or_else(|| panic!("no {kind} in deploy/"));
    assert!(matching.next().is_none(), "more than one {kind} in deploy/");
    strict(doc)
}

#[test]
fn every_manifest_parses_strictly() {
    let mut kinds = BTreeSet::new();
    for doc in docs() {
        match (doc.api_version.as_str(), doc.kind.as_str()) {
            ("v1", "ConfigMap") => drop(strict::<ConfigMap>(&doc)),
            ("v1", "ServiceAccount") => drop(strict::<ServiceAccount>(&doc)),
            ("apps/v1", "DaemonSet") => drop(strict::<DaemonSet>(&doc)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => drop(strict::<ClusterRole>(&doc)),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => drop(strict::<ClusterRoleBinding>(&doc)),
            ("rbac.authorization.k8s.io/v1", "Role") => drop(strict::<Role>(&doc)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => drop(strict::<RoleBinding>(&doc)),
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => drop(strict::<CustomResourceDefinition>(&doc)),
            ("extensions.gardener.cloud/v1alpha1", "Network") => drop(strict::<network::Network>(&doc)),
            (api, kind) => panic!("{}: no type to check {api} {kind} against; add it here", doc.origin),
        }
        kinds.insert(doc.kind);
    }
    for kind in ["ConfigMap", "ServiceAccount", "DaemonSet", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "CustomResourceDefinition", "Network"]
    {
        assert!(kinds.contains(kind), "deploy/ has no {kind}");
    }
}

#[test]
fn strict_parsing_catches_misplaced_fields() {
    // Guard for the guard: a field in the wrong place must be reported, not dropped.
    let value: serde_yaml::Value =
        serde_yaml::from_str("apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {}\n  hostNetwork: true\n  template: {}\n")
            .unwrap();
    let doc = Doc { origin: "inline".into(), api_version: "apps/v1".into(), kind: "DaemonSet".into(), value };
    let msg = try_strict::<DaemonSet>(&doc).expect_err("misplaced field accepted");
    assert!(msg.contains("hostNetwork"), "{msg}");
}

fn containers(ds: &DaemonSet) -> (Vec<Container>, Vec<Container>) {
    let pod = ds.spec.template.spec.as_ref().unwrap();
    (pod.containers.clone(), pod.init_containers.clone().unwrap_or_default())
}

#[test]
fn daemonset_properties() {
    check_daemonset(&one("DaemonSet"));
}

/// What the agent DaemonSet must be, in deploy/ and as the extension renders it for shoots.
fn check_daemonset(ds: &DaemonSet) {
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let spec = &ds.spec;
    let pod = spec.template.spec.as_ref().unwrap();

    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(pod.service_account_name.as_deref(), Some("gardenet-agent"));
    let tolerations = pod.tolerations.as_ref().expect("tolerations");
    assert!(
        tolerations.iter().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()),
        "must tolerate every taint: {tolerations:?}"
    );

    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(strategy.rolling_update.as_ref().unwrap().max_unavailable, Some(IntOrString::Int(1)));

    // Selector matches the template.
    let selector = spec.selector.match_labels.as_ref().unwrap();
    let labels = spec.template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    for (k, v) in selector {
        assert_eq!(labels.get(k), Some(v), "template lacks selector label {k}");
    }

    let (main, init) = containers(ds);
    assert_eq!(main.len(), 1);
    let agent = &main[0];
    assert_eq!(
        agent.args.as_deref().unwrap(),
        [
            "run",
            "--source",
            "kube",
            "--node-name",
            "$(NODE_NAME)",
            "--bpffs",
            "/sys/fs/bpf/gardenet",
            "--cgroup",
            "/run/gardenet/cgroupv2",
            "--config",
            "/etc/gardenet/config.yaml",
            "--host-proc",
            "/hostproc",
            "--kube-proxy-enabled=false"
        ]
    );
    let node_name = agent.env.as_ref().unwrap().iter().find(|e| e.name == "NODE_NAME").expect("NODE_NAME");
    let field_ref = node_name.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).expect("NODE_NAME from fieldRef");
    assert_eq!(field_ref.field_path, "spec.nodeName");

    // Capabilities instead of privileged.
    for c in main.iter().chain(&init) {
        let sc = c.security_context.as_ref().unwrap_or_else(|| panic!("{}: no securityContext", c.name));
        assert_ne!(sc.privileged, Some(true), "{} is privileged", c.name);
        let caps = sc.capabilities.as_ref().unwrap();
        assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]), "{} must drop ALL", c.name);
    }
    let caps: BTreeSet<&str> =
        agent.security_context.as_ref().unwrap().capabilities.as_ref().unwrap().add.as_ref().unwrap().iter().map(String::as_str).collect();
    assert_eq!(caps, BTreeSet::from(["BPF", "NET_ADMIN", "SYS_ADMIN", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE"]));

    // Probes on the health port.
    let port = |name: &str| agent.ports.as_ref().unwrap().iter().find(|p| p.name.as_deref() == Some(name)).map(|p| p.container_port);
    assert_eq!(port("health"), Some(9878));
    assert_eq!(port("metrics"), Some(9879));
    assert_eq!(port("proxy-healthz"), Some(10256), "kube-proxy's health check port, as the agent's default");
    for (probe, path) in [(&agent.readiness_probe, "/readyz"), (&agent.liveness_probe, "/healthz")] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).unwrap_or_else(|| panic!("no {path} probe"));
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::String("health".into()));
    }

    // Host mounts: bpffs and cgroup2 where --bpffs/--cgroup point, and the config file.
    let volumes = pod.volumes.as_ref().unwrap();
    let host_path = |volume: &str| volumes.iter().find(|v| v.name == volume).and_then(|v| v.host_path.as_ref()).map(|h| h.path.clone());
    let mount = |path: &str| agent.volume_mounts.as_ref().unwrap().iter().find(|m| m.mount_path == path).map(|m| m.name.clone());
    let bpffs = mount("/sys/fs/bpf").expect("bpffs mount");
    assert_eq!(host_path(&bpffs).as_deref(), Some("/sys/fs/bpf"));
    let cgroup = mount("/run/gardenet/cgroupv2").expect("cgroup2 mount");
    assert_eq!(host_path(&cgroup).as_deref(), Some("/run/gardenet/cgroupv2"));
    let proc = mount("/hostproc").expect("the node's /proc, for --host-proc");
    assert_eq!(host_path(&proc).as_deref(), Some("/proc"));
    // The pod network: the defaults of --cni-bin-dir, --cni-conf-dir and --cni-state-dir
    // are the node's own directories.
    for dir in ["/opt/cni/bin", "/etc/cni/net.d", "/run/gardenet/cni"] {
        let m = mount(dir).unwrap_or_else(|| panic!("{dir} mount"));
        assert_eq!(host_path(&m).as_deref(), Some(dir), "{dir} from the node");
    }
    let config = mount("/etc/gardenet").expect("config mount");
    let cm = volumes.iter().find(|v| v.name == config).and_then(|v| v.config_map.as_ref()).expect("config from a ConfigMap");
    let configmap: ConfigMap = one("ConfigMap");
    assert_eq!(Some(&cm.name), configmap.metadata.name.as_ref());

    // The init container mounts bpffs and cgroup2 on the node.
    assert_eq!(init.len(), 1);
    let script = init[0].command.as_ref().unwrap().join(" ");
    assert!(script.contains("mount -t bpf"), "{script}");
    assert!(script.contains("mount -t cgroup2"), "{script}");
}

fn rules_of(rules: &Option<Vec<PolicyRule>>) -> Vec<PolicyRule> {
    rules.clone().unwrap_or_default()
}

fn allows(rules: &[PolicyRule], group: &str, resource: &str, verb: &str) -> bool {
    rules.iter().any(|r| {
        r.api_groups.as_ref().is_some_and(|g| g.iter().any(|g| g == group))
            && r.resources.as_ref().is_some_and(|rs| rs.iter().any(|r| r == resource))
            && r.verbs.iter().any(|v| v == verb)
    })
}

#[test]
fn rbac_is_least_privilege() {
    let sa: ServiceAccount = one("ServiceAccount");
    let cr: ClusterRole = one("ClusterRole");
    let role: Role = one("Role");
    let crb: ClusterRoleBinding = one("ClusterRoleBinding");
    let rb: RoleBinding = one("RoleBinding");

    let cluster_rules = rules_of(&cr.rules);
    let role_rules = rules_of(&role.rules);
    for r in cluster_rules.iter().chain(&role_rules) {
        for word in r.verbs.iter().chain(r.resources.iter().flatten()).chain(r.api_groups.iter().flatten()) {
            assert_ne!(word, "*", "wildcard in {r:?}");
        }
        for verb in &r.verbs {
            assert!(["get", "list", "watch", "create", "update", "patch"].contains(&verb.as_str()), "unexpected verb {verb} in {r:?}");
        }
        assert!(r.non_resource_urls.is_none(), "{r:?}");
    }

    for (group, resource, verb) in [
        ("", "services", "list"),
        ("", "services", "watch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("networking.k8s.io", "servicecidrs", "list"),
        ("networking.k8s.io", "servicecidrs", "watch"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("", "nodes/status", "patch"),
        ("extensions.gardener.cloud", "networks", "get"),
        ("extensions.gardener.cloud", "networks/status", "patch"),
        ("events.k8s.io", "events", "create"),
    ] {
        assert!(allows(&cluster_rules, group, resource, verb), "ClusterRole lacks {verb} {group}/{resource}");
    }
    // Read-only where the agent only reads; no write on Nodes, Networks themselves or Secrets.
    for (group, resource, verb) in [
        ("", "services", "patch"),
        ("", "nodes", "patch"),
        ("", "nodes", "update"),
        ("extensions.gardener.cloud", "networks", "patch"),
        ("", "secrets", "get"),
        ("", "secrets", "list"),
    ] {
        assert!(!allows(&cluster_rules, group, resource, verb), "ClusterRole allows {verb} {group}/{resource}");
    }
    assert!(!cluster_rules.iter().any(|r| r.resources.iter().flatten().any(|x| x == "leases")), "leases only in the Role");

    // Leases: namespaced, and only the election Lease may be changed.
    assert_eq!(role.metadata.namespace.as_deref(), Some(gardenet_agent::gardener::LEASE_NAMESPACE));
    assert!(allows(&role_rules, "coordination.k8s.io", "leases", "create"));
    for r in &role_rules {
        if r.verbs.iter().any(|v| v == "update" || v == "patch" || v == "get") {
            assert_eq!(r.resource_names.as_deref(), Some(&[gardenet_agent::gardener::LEASE_NAME.to_owned()][..]), "{r:?}");
        }
    }

    // The bindings bind this ServiceAccount to these roles.
    let sa_name = sa.metadata.name.as_deref().unwrap();
    let sa_ns = sa.metadata.namespace.as_deref().unwrap();
    assert_eq!(sa_ns, "kube-system");
    assert_eq!(crb.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&crb.role_ref.name), cr.metadata.name.as_ref());
    assert_eq!(rb.role_ref.kind, "Role");
    assert_eq!(Some(&rb.role_ref.name), role.metadata.name.as_ref());
    assert_eq!(rb.metadata.namespace, role.metadata.namespace);
    for subjects in [crb.subjects.as_ref().unwrap(), rb.subjects.as_ref().unwrap()] {
        assert_eq!(subjects.len(), 1);
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(subjects[0].name, sa_name);
        assert_eq!(subjects[0].namespace.as_deref(), Some(sa_ns));
    }
    let ds: DaemonSet = one("DaemonSet");
    let pod = ds.spec.template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa_name));
}

#[test]
fn configmap_holds_a_valid_network_config() {
    let cm: ConfigMap = one("ConfigMap");
    let text = cm.data.as_ref().and_then(|d| d.get("config.yaml")).expect("config.yaml key");
    let config = NetworkConfig::from_yaml_str(text).unwrap_or_else(|e| panic!("configmap.yaml: {e}"));
    // The example documents the defaults; keep it in sync with them.
    assert_eq!(config, NetworkConfig::default(), "configmap.yaml should show the defaults");
}

fn crd() -> CustomResourceDefinition {
    one("CustomResourceDefinition")
}

fn crd_schema() -> JSONSchemaProps {
    let crd = crd();
    let version = crd.spec.versions.iter().find(|v| v.name == network::VERSION).expect("v1alpha1");
    version.schema.clone().and_then(|s| s.open_api_v3_schema).expect("openAPIV3Schema")
}

/// A small structural-schema check: what the API server would reject or prune.
fn check_schema(value: &Value, schema: &JSONSchemaProps, path: &str, errors: &mut Vec<String>) {
    let ty = schema.type_.as_deref();
    match (ty, value) {
        (Some("object"), Value::Object(map)) => {
            for req in schema.required.iter().flatten() {
                if map.get(req).is_none_or(Value::is_null) {
                    errors.push(format!("{path}.{req}: required"));
                }
            }
            let preserve = schema.x_kubernetes_preserve_unknown_fields == Some(true);
            let props = schema.properties.clone().unwrap_or_default();
            for (k, v) in map {
                if path.is_empty() && k == "metadata" {
                    continue; // validated by the API server itself, not by the CRD schema
                }
                match props.get(k) {
                    Some(s) => check_schema(v, s, &format!("{path}.{k}"), errors),
                    None if preserve => {}
                    // A map: every value has the additionalProperties schema.
                    None => match &schema.additional_properties {
                        Some(JSONSchemaPropsOrBool::Schema(s)) => check_schema(v, s, &format!("{path}.{k}"), errors),
                        Some(JSONSchemaPropsOrBool::Bool(true)) => {}
                        _ => errors.push(format!("{path}.{k}: not in the schema (would be pruned)")),
                    },
                }
            }
        }
        (Some("array"), Value::Array(items)) => {
            if let Some(JSONSchemaPropsOrArray::Schema(s)) = &schema.items {
                for (i, v) in items.iter().enumerate() {
                    check_schema(v, s, &format!("{path}[{i}]"), errors);
                }
            }
        }
        (Some("string"), Value::String(s)) => {
            if schema.format.as_deref() == Some("date-time") && s.parse::<k8s_openapi::jiff::Timestamp>().is_err() {
                errors.push(format!("{path}: {s:?} is not a date-time"));
            }
        }
        (Some("integer"), Value::Number(n)) if n.is_i64() => {}
        (Some("boolean"), Value::Bool(_)) => {}
        (None, _) => {}
        (Some(t), v) => errors.push(format!("{path}: expected {t}, got {v}")),
    }
}

fn assert_conforms(value: &Value, what: &str) {
    let mut errors = Vec::new();
    check_schema(value, &crd_schema(), "", &mut errors);
    assert!(errors.is_empty(), "{what} does not fit crd-network.yaml: {errors:#?}");
}

#[test]
fn crd_matches_the_agents_network_type() {
    let crd = crd();
    assert_eq!(crd.metadata.name.as_deref(), Some("networks.extensions.gardener.cloud"));
    assert_eq!(crd.spec.group, network::GROUP);
    assert_eq!(crd.spec.names.kind, network::KIND);
    assert_eq!(crd.spec.names.plural, network::PLURAL);
    assert_eq!(crd.spec.scope, "Namespaced");
    let version = crd.spec.versions.iter().find(|v| v.name == network::VERSION).expect("v1alpha1");
    assert!(version.served && version.storage);
    assert!(version.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some(), "status subresource");

    let schema = crd_schema();
    let props = schema.properties.as_ref().unwrap();
    let spec = &props["spec"];
    assert_eq!(spec.properties.as_ref().unwrap()["providerConfig"].x_kubernetes_preserve_unknown_fields, Some(true));
    let status = props["status"].properties.as_ref().unwrap();
    assert_eq!(status["providerStatus"].x_kubernetes_preserve_unknown_fields, Some(true));
}

/// What the aggregating agent writes must be accepted by the CRD.
#[test]
fn status_written_by_the_agent_fits_the_crd() {
    use aggregate::{aggregate, merge, AggregateInput, NodeReadiness};
    let spec = network::NetworkSpec { type_: "gardenet".into(), pod_cidr: "100.96.0.0/11".into(), service_cidr: "100.64.0.0/13".into(), ..Default::default() };
    let config = NetworkConfig::default();
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2024-05-01T10:00:00Z".parse().unwrap());
    let broken =
        NodeReadiness { name: "n1".into(), schedulable: true, agent_ready: Some(false), reason: None, missing: vec!["bpf() is not permitted (EPERM)".into()] };
    let nodes = [broken];
    let desired = aggregate(&AggregateInput { generation: 4, spec: &spec, config: &config, kube_proxy_enabled: false, nodes: &nodes, now });
    let status = merge(None, &desired);
    let object = serde_json::json!({
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "Network",
        "metadata": {"name": "n", "namespace": "kube-system"},
        "spec": serde_json::to_value(&spec).unwrap(),
        "status": serde_json::to_value(&status).unwrap(),
    });
    assert_conforms(&object, "the aggregated status");
    assert_eq!(object["status"]["lastError"]["codes"][0], network::ERR_CONFIGURATION_PROBLEM);
}

#[test]
fn network_example_is_a_valid_gardenet_network() {
    let all = docs();
    let doc = all.iter().find(|d| d.kind == "Network").expect("a Network in deploy/");
    let net: network::Network = strict(doc);
    assert_eq!(net.spec.type_, gardenet_agent::gardener::NETWORK_TYPE);
    let config = NetworkConfig::from_network(&net).unwrap_or_else(|e| panic!("{}: {e}", doc.origin));
    assert_eq!(config.kube_proxy_replacement.enabled, Some(true));
    let json: Value = serde_json::to_value(&doc.value).unwrap();
    assert_conforms(&json, &doc.origin);
}

#[test]
fn dockerfile_is_multi_stage_and_embeds_the_ebpf_object() {
    let text = std::fs::read_to_string(deploy_dir().join("Dockerfile")).expect("deploy/Dockerfile");
    let stages = text.lines().filter(|l| l.trim_start().to_ascii_uppercase().starts_with("FROM ")).count();
    assert!(stages >= 2, "Dockerfile should be multi-stage");
    let build_ebpf = text.find("cargo xtask build-ebpf").expect("builds the eBPF object with xtask");
    let build_agent = text.find("-p gardenet-agent").expect("builds the agent");
    assert!(build_ebpf < build_agent, "the eBPF object must exist before the agent embeds it");
    assert!(text.contains("COPY --from="), "final stage copies the binary only");
}

#[test]
fn readme_describes_every_manifest() {
    let readme = std::fs::read_to_string(deploy_dir().join("README.md")).expect("deploy/README.md");
    let mut names: BTreeMap<String, bool> = BTreeMap::new();
    for entry in std::fs::read_dir(deploy_dir()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_dir() {
            // A directory is described as `dir/`, and each file in it as `dir/file`.
            names.insert(format!("{name}/"), readme.contains(&format!("`{name}/`")));
            for file in std::fs::read_dir(entry.path()).unwrap() {
                let file = file.unwrap().file_name().to_string_lossy().into_owned();
                let path = format!("{name}/{file}");
                let described = readme.contains(&format!("`{path}`")) || readme.contains(&format!("`{path}/`"));
                names.insert(path, described);
            }
        } else if name != "README.md" {
            names.insert(name.clone(), readme.contains(&format!("`{name}`")));
        }
    }
    let missing: Vec<_> = names.iter().filter(|(_, found)| !**found).map(|(n, _)| n).collect();
    assert!(missing.is_empty(), "README.md does not describe {missing:?}");
    assert!(readme.contains("privileged: true"), "README.md documents the privileged fallback");
}

// --- gardenet-extension: deploy/extension/ and the manifests it renders into shoots ---

fn extension_docs() -> Vec<Doc> {
    let mut docs = docs_in(&deploy_dir().join("extension"));
    docs.extend(chart_docs());
    docs
}

/// The controller chart rendered as Helm would with its default values. The templates only
/// substitute values (no logic), so plain replacement is Helm's result.
fn chart_docs() -> Vec<Doc> {
    let chart = deploy_dir().join("extension/chart");
    let values: BTreeMap<String, serde_yaml::Value> = serde_yaml::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap()).unwrap();
    let meta: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(chart.join("Chart.yaml")).unwrap()).unwrap();
    assert_eq!(meta["apiVersion"].as_str(), Some("v2"));
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(chart.join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let mut text = std::fs::read_to_string(&path).unwrap();
        text = text.replace("{{ .Release.Namespace }}", "extension-gardenet");
        for (key, value) in &values {
            let value = serde_yaml::to_string(value).unwrap();
            text = text.replace(&format!("{{{{ .Values.{key} }}}}"), value.trim_end());
        }
        assert!(!text.contains("{{"), "{}: template logic beyond value substitution", path.display());
        docs.extend(docs_of_text(&format!("chart/templates/{}", path.file_name().unwrap().to_string_lossy()), &text));
    }
    docs
}

/// Parses a document of any kind deploy/ uses into its type; panics on kinds without one.
fn check_strictly(doc: &Doc) {
    match (doc.api_version.as_str(), doc.kind.as_str()) {
        ("v1", "Namespace") => drop(strict::<Namespace>(doc)),
        ("v1", "ServiceAccount") => drop(strict::<ServiceAccount>(doc)),
        ("v1", "Service") => drop(strict::<Service>(doc)),
        ("v1", "ConfigMap") => drop(strict::<ConfigMap>(doc)),
        ("apps/v1", "Deployment") => drop(strict::<Deployment>(doc)),
        ("apps/v1", "DaemonSet") => drop(strict::<DaemonSet>(doc)),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => drop(strict::<ClusterRole>(doc)),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => drop(strict::<ClusterRoleBinding>(doc)),
        ("rbac.authorization.k8s.io/v1", "Role") => drop(strict::<Role>(doc)),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => drop(strict::<RoleBinding>(doc)),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => drop(strict::<CustomResourceDefinition>(doc)),
        ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration") => drop(strict::<ValidatingWebhookConfiguration>(doc)),
        // Gardener's own types: no Rust types here; their fields are asserted below.
        ("core.gardener.cloud/v1beta1", "ControllerRegistration") | ("core.gardener.cloud/v1", "ControllerDeployment") => {}
        (api, kind) => panic!("{}: no type to check {api} {kind} against; add it here", doc.origin),
    }
}

fn find<'a>(docs: &'a [Doc], kind: &str) -> &'a Doc {
    let mut matching = docs.iter().filter(|d| d.kind == kind);
    let doc = matching.next().unwrap_or_else(|| panic!("no {kind}"));
    assert!(matching.next().is_none(), "more than one {kind}");
    doc
}

fn json_of(doc: &Doc) -> Value {
    serde_json::to_value(&doc.value).unwrap()
}

#[test]
fn extension_manifests_parse_strictly() {
    let docs = extension_docs();
    for doc in &docs {
        check_strictly(doc);
    }
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d.kind.as_str()).collect();
    for kind in ["Deployment", "ClusterRole", "ValidatingWebhookConfiguration", "ControllerRegistration", "ControllerDeployment"] {
        assert!(kinds.contains(kind), "deploy/extension has no {kind}");
    }
    let crds: BTreeSet<String> =
        docs.iter().filter(|d| d.kind == "CustomResourceDefinition").map(|d| strict::<CustomResourceDefinition>(d).metadata.name.unwrap()).collect();
    assert_eq!(crds, BTreeSet::from(["clusters.extensions.gardener.cloud".to_owned(), "managedresources.resources.gardener.cloud".to_owned()]));
}

#[test]
fn controller_registration_names_the_network_type() {
    let docs = extension_docs();
    let reg = json_of(find(&docs, "ControllerRegistration"));
    let dep = json_of(find(&docs, "ControllerDeployment"));
    // The API versions Gardener serves them in (ControllerDeployment moved to core/v1).
    assert_eq!(reg["apiVersion"], "core.gardener.cloud/v1beta1");
    assert_eq!(dep["apiVersion"], "core.gardener.cloud/v1");
    assert_eq!(reg["spec"]["resources"], serde_json::json!([{"kind": "Network", "type": "gardenet", "primary": true}]));
    assert_eq!(reg["spec"]["deployment"]["deploymentRefs"][0]["name"], dep["metadata"]["name"]);
    assert!(dep["helm"]["ociRepository"]["ref"].is_string() || dep["helm"]["rawChart"].is_string());
}

#[test]
fn extension_rbac_is_what_the_controller_uses() {
    let docs = chart_docs();
    let cr: ClusterRole = strict(find(&docs, "ClusterRole"));
    let role: Role = strict(find(&docs, "Role"));
    let rules = rules_of(&cr.rules);
    for r in rules.iter().chain(&rules_of(&role.rules)) {
        for word in r.verbs.iter().chain(r.resources.iter().flatten()).chain(r.api_groups.iter().flatten()) {
            assert_ne!(word, "*", "wildcard in {r:?}");
        }
    }
    for (group, resource, verbs) in [
        ("extensions.gardener.cloud", "networks", &["get", "list", "watch", "patch"][..]),
        ("extensions.gardener.cloud", "networks/status", &["patch"]),
        ("extensions.gardener.cloud", "clusters", &["get", "list", "watch"]),
        ("resources.gardener.cloud", "managedresources", &["get", "create", "patch", "delete"]),
        ("", "secrets", &["get", "list", "create", "delete"]),
    ] {
        for verb in verbs {
            assert!(allows(&rules, group, resource, verb), "ClusterRole lacks {verb} {group}/{resource}");
        }
    }
    for (group, resource, verb) in [
        ("extensions.gardener.cloud", "networks", "delete"),
        ("extensions.gardener.cloud", "clusters", "patch"),
        ("", "secrets", "update"),
        ("", "nodes", "list"),
        ("", "pods", "list"),
        ("coordination.k8s.io", "leases", "get"),
    ] {
        assert!(!allows(&rules, group, resource, verb), "ClusterRole allows {verb} {group}/{resource}");
    }
    let deployment: Deployment = strict(find(&docs, "Deployment"));
    // Gardener's seed network policies let only labelled pods reach the shoots' API servers.
    let labels = deployment.spec.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
    for label in [
        "networking.gardener.cloud/to-runtime-apiserver",
        "networking.gardener.cloud/to-dns",
        "networking.resources.gardener.cloud/to-all-shoots-kube-apiserver-tcp-443",
    ] {
        assert_eq!(labels.get(label).map(String::as_str), Some("allowed"), "pod label {label}");
    }
    let pod = deployment.spec.template.spec.unwrap();
    let sa: ServiceAccount = strict(find(&docs, "ServiceAccount"));
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let args = pod.containers[0].args.clone().unwrap();
    assert_eq!(args[0], "run");
    assert_eq!(pod.containers[0].image.as_deref(), Some("gardenet-agent:latest"), "image from values.yaml");
    assert!(args.contains(&"gardenet-agent:latest".to_owned()), "agent image from values.yaml: {args:?}");
    let lease = args.iter().skip_while(|a| *a != "--leader-election-name").nth(1).expect("lease name");
    assert_eq!(role.rules.unwrap()[1].resource_names.as_deref(), Some(&[lease.clone()][..]));
}

#[test]
fn webhook_selects_shoots_of_type_gardenet() {
    let docs = extension_docs();
    let config: ValidatingWebhookConfiguration = strict(find(&docs, "ValidatingWebhookConfiguration"));
    let hook = &config.webhooks.unwrap()[0];
    assert_eq!(
        hook.object_selector.as_ref().and_then(|s| s.match_labels.clone()),
        Some(BTreeMap::from([("networking.extensions.gardener.cloud/gardenet".to_owned(), "true".to_owned())]))
    );
    let rule = &hook.rules.as_ref().unwrap()[0];
    assert_eq!(rule.resources.as_deref(), Some(&["shoots".to_owned()][..]));
    assert_eq!(rule.operations.as_deref(), Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..]));
    let service = hook.client_config.service.as_ref().unwrap();
    assert_eq!(service.path.as_deref(), Some(gardenet_extension::admission::VALIDATE_PATH));
    assert_eq!(hook.admission_review_versions, ["v1"]);
}

/// What the extension decides for a shoot with kube-proxy off and the default NetworkConfig.
fn replacement_plan() -> gardenet_extension::contract::Plan {
    use gardenet_agent::gardener::config::ServiceRouting;
    use gardenet_extension::cluster::ApiServerEndpoint;
    gardenet_extension::contract::Plan {
        config: NetworkConfig::default(),
        routing: ServiceRouting::Required,
        kube_proxy_enabled: false,
        api_server: Some(ApiServerEndpoint { host: "api.example.com".into(), port: 443 }),
        ip_families: vec![network::IpFamily::IPv4],
    }
}

#[test]
fn rendered_shoot_manifests_parse_strictly_and_keep_the_daemonset_properties() {
    use gardenet_extension::render;
    let plan = replacement_plan();
    let rendered = render::render(&plan, &render::Settings { image: "gardenet-agent:test".into() }).unwrap();
    let mut docs = Vec::new();
    for (key, text) in &rendered {
        docs.extend(docs_of_text(key, text));
    }
    for doc in &docs {
        check_strictly(doc);
    }
    let ds: DaemonSet = strict(find(&docs, "DaemonSet"));
    check_daemonset(&ds);
    let cm: ConfigMap = strict(find(&docs, "ConfigMap"));
    assert_eq!(NetworkConfig::from_yaml_str(&cm.data.unwrap()["config.yaml"]).unwrap(), plan.config);
    // The shoot never gets access to seed or garden objects.
    for doc in docs.iter().filter(|d| d.kind == "ClusterRole") {
        let role: ClusterRole = strict(doc);
        assert!(!allows(&rules_of(&role.rules), "extensions.gardener.cloud", "networks/status", "patch"), "{}", doc.origin);
    }
}

/// What the extension writes must be accepted by the CRDs: the Network status of each
/// outcome, and the ManagedResource.
#[test]
fn objects_written_by_the_extension_fit_the_crds() {
    use gardenet_agent::gardener::network::LastOperationType;
    use gardenet_extension::{managed, status};
    let plan = replacement_plan();
    let at = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2025-05-01T10:00:00Z".parse().unwrap());
    let t = LastOperationType::Reconcile;
    let patches = [
        status::processing(&t, &at),
        status::succeeded(&t, 2, Some((&plan, status::provider_status(&plan, "managedresource-x-0123abcd"))), &at),
        status::error(&t, 2, "kube-proxy is disabled ...", true, &at),
    ];
    for patch in patches {
        let mut object = serde_json::json!({
            "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
            "metadata": {"name": "n", "namespace": "shoot--a--b"},
            "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13"},
        });
        // A merge patch's nulls delete; the stored object has none.
        let mut status = patch["status"].clone();
        status.as_object_mut().unwrap().retain(|_, v| !v.is_null());
        object["status"] = status;
        assert_conforms(&object, &format!("the extension's status {}", patch["status"]["lastOperation"]["state"]));
    }

    let docs = extension_docs();
    let crd: CustomResourceDefinition = strict(
        docs.iter()
            .find(|d| d.kind == "CustomResourceDefinition" && d.value["spec"]["names"]["kind"].as_str() == Some("ManagedResource"))
            .expect("ManagedResource CRD"),
    );
    let schema = crd.spec.versions[0].schema.clone().and_then(|s| s.open_api_v3_schema).unwrap();
    let mr = serde_json::to_value(managed::managed_resource("shoot--a--b", managed::NAME, "managedresource-x-0123abcd", true)).unwrap();
    let mut errors = Vec::new();
    check_schema(&mr, &schema, "", &mut errors);
    assert!(errors.is_empty(), "ManagedResource does not fit its CRD: {errors:#?}");
}
