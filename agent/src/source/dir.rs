//! `--source dir:PATH`: Services and EndpointSlices from ordinary (multi-document) Kubernetes
//! YAML manifests in a directory, followed as the files change.
//!
//! The directory is re-read when a file's size or mtime changes (checked every `interval`),
//! and the difference to the previous read is sent as events. A file that fails to parse
//! keeps contributing what it had last time, so a half-written file never deletes Services.
use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use super::{EventTx, SourceEvent};
use crate::source::objects::{ServiceCidrView, ServiceView, SliceView};

#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(Arc<ServiceView>),
    Slice(Arc<SliceView>),
    /// Only this agent's own Node is kept (its addresses serve NodePorts).
    Node(Arc<Node>),
    ServiceCidr(Arc<ServiceCidrView>),
}

impl Object {
    fn applied(&self) -> SourceEvent {
        match self {
            Object::Service(s) => SourceEvent::ServiceApplied(s.clone()),
            Object::Slice(s) => SourceEvent::SliceApplied(s.clone()),
            Object::Node(n) => SourceEvent::NodeApplied(n.clone()),
            Object::ServiceCidr(c) => SourceEvent::ServiceCidrApplied(c.clone()),
        }
    }
    fn deleted(&self) -> Option<SourceEvent> {
        match self {
            Object::Service(s) => Some(SourceEvent::ServiceDeleted(s.clone())),
            Object::Slice(s) => Some(SourceEvent::SliceDeleted(s.clone())),
            // The node's addresses stay as they were (the kube source behaves alike).
            Object::Node(_) => None,
            Object::ServiceCidr(c) => Some(SourceEvent::ServiceCidrDeleted(c.clone())),
        }
    }
}

/// (kind, namespace, name)
pub type ObjKey = (&'static str, String, String);

/// Parses one file's documents. Documents of other kinds are ignored; a document that is a
/// Service or EndpointSlice but does not parse is an error naming the file and document.
pub fn parse_manifests(text: &str, origin: &str) -> Result<Vec<(ObjKey, Object)>> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let v = serde_yaml::Value::deserialize(doc).with_context(|| format!("{origin}: document {}: invalid YAML", i + 1))?;
        if v.is_null() {
            continue;
        }
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        let what = format!("{origin}: document {} ({kind})", i + 1);
        fn typed<K: serde::de::DeserializeOwned>(v: serde_yaml::Value, what: &str) -> Result<K> {
            serde_yaml::from_value(v).with_context(|| what.to_owned())
        }
        let name_of = |m: &ObjectMeta| m.name.clone().with_context(|| format!("{what}: metadata.name is missing"));
        let ns_of = |m: &ObjectMeta| m.namespace.clone().unwrap_or_else(|| "default".into());
        // Services and slices are digested right away (see `crate::source::objects`).
        let (kind, ns, name, obj) = match kind {
            "Service" => {
                let o: Service = typed(v, &what)?;
                ("Service", ns_of(&o.metadata), name_of(&o.metadata)?, Object::Service(Arc::new(ServiceView::from(&o))))
            }
            "EndpointSlice" => {
                let o: EndpointSlice = typed(v, &what)?;
                ("EndpointSlice", ns_of(&o.metadata), name_of(&o.metadata)?, Object::Slice(Arc::new(SliceView::from(&o))))
            }
            "ServiceCIDR" => {
                let o: ServiceCIDR = typed(v, &what)?;
                ("ServiceCIDR", String::new(), name_of(&o.metadata)?, Object::ServiceCidr(Arc::new(ServiceCidrView::from(&o))))
            }
            "Node" => {
                let o: Node = typed(v, &what)?;
                ("Node", String::new(), name_of(&o.metadata)?, Object::Node(Arc::new(o)))
            }
            _ => continue,
        };
        out.push(((kind, ns, name), obj));
    }
    Ok(out)
}

type Signature = Vec<(PathBuf, u64, Option<SystemTime>)>;

fn signature(dir: &Path) -> Result<Signature> {
    let mut sig = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        let p = e.path();
        let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
        if !matches!(ext, "yaml" | "yml" | "json") {
            continue;
        }
        let md = e.metadata()?;
        if md.is_file() {
            sig.push((p, md.len(), md.modified().ok()));
        }
    }
    sig.sort();
    Ok(sig)
}

/// The directory's state between reads.
#[derive(Default)]
pub struct DirState {
    per_file: HashMap<PathBuf, Vec<(ObjKey, Object)>>,
    current: BTreeMap<ObjKey, Object>,
    /// Nodes other than this one are ignored.
    pub node_name: String,
}

impl DirState {
    /// Re-reads `files` and returns the events that turn the previous state into the new one.
    pub fn reload(&mut self, files: &[PathBuf]) -> Vec<SourceEvent> {
        let mut per_file = HashMap::new();
        for f in files {
            let parsed =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display())).and_then(|t| parse_manifests(&t, &f.display().to_string()));
            match parsed {
                Ok(mut objs) => {
                    objs.retain(|((kind, _, name), _)| *kind != "Node" || *name == self.node_name);
                    per_file.insert(f.clone(), objs);
                }
                Err(e) => {
                    tracing::warn!("{e:#}; keeping what this file had before");
                    if let Some(prev) = self.per_file.get(f) {
                        per_file.insert(f.clone(), prev.clone());
                    }
                }
            }
        }
        let mut next: BTreeMap<ObjKey, Object> = BTreeMap::new();
        let mut names: Vec<&PathBuf> = per_file.keys().collect();
        names.sort();
        for f in names {
            for (k, o) in &per_file[f] {
                if next.insert(k.clone(), o.clone()).is_some() {
                    tracing::warn!("{} {}/{} is defined more than once; the last definition ({}) wins", k.0, k.1, k.2, f.display());
                }
            }
        }
        let mut events = Vec::new();
        for (k, o) in &self.current {
            if !next.contains_key(k) {
                events.extend(o.deleted());
            }
        }
        for (k, o) in &next {
            if self.current.get(k) != Some(o) {
                events.push(o.applied());
            }
        }
        self.per_file = per_file;
        self.current = next;
        events
    }
}

/// Runs until `tx` is closed.
pub async fn run(dir: PathBuf, interval: Duration, node_name: String, tx: EventTx) -> Result<()> {
    let mut state = DirState { node_name, ..Default::default() };
    let mut last: Option<Signature> = None;
    let mut first = true;
    loop {
        match signature(&dir) {
            Ok(sig) if last.as_ref() != Some(&sig) => {
                let files: Vec<PathBuf> = sig.iter().map(|(p, _, _)| p.clone()).collect();
                for ev in state.reload(&files) {
                    if tx.send(ev).await.is_err() {
                        return Ok(());
                    }
                }
                if first {
                    first = false;
                    if tx.send(SourceEvent::Synced).await.is_err() {
                        return Ok(());
                    }
                }
                last = Some(sig);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("{e:#}; keeping the last state"),
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: demo}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\n";

    #[test]
    fn multi_document_files_and_unrelated_kinds() {
        let text = format!("{SVC}---\n{SLICE}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n---\n");
        let objs = parse_manifests(&text, "t").unwrap();
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[0].0, ("Service", "demo".into(), "web".into()));
        assert_eq!(objs[1].0, ("EndpointSlice", "demo".into(), "web-1".into()));
    }

    #[test]
    fn only_this_nodes_node_object_is_used() {
        let dir = std::env::temp_dir().join(format!("gardenet-dir-node-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("nodes.yaml");
        let node =
            |n: &str, ip: &str| format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {n}}}\nstatus: {{addresses: [{{type: InternalIP, address: {ip}}}]}}\n");
        std::fs::write(&f, format!("{}---\n{}", node("n1", "192.0.2.1"), node("n2", "192.0.2.2"))).unwrap();
        let mut st = DirState { node_name: "n2".into(), ..Default::default() };
        let ev = st.reload(std::slice::from_ref(&f));
        assert!(matches!(ev.as_slice(), [SourceEvent::NodeApplied(n)] if n.metadata.name.as_deref() == Some("n2")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_documents_name_file_and_document() {
        let bad = SVC.replace("ports: [{port: 80}]", "ports: [{port: eighty}]");
        let e = parse_manifests(&format!("{SLICE}---\n{bad}"), "svc.yaml").unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("svc.yaml: document 2 (Service)"), "{msg}");
    }

    #[test]
    fn reload_sends_only_differences_and_keeps_broken_files() {
        let dir = std::env::temp_dir().join(format!("gardenet-dir-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.yaml");
        std::fs::write(&f, format!("{SVC}---\n{SLICE}")).unwrap();
        let mut st = DirState::default();
        let ev = st.reload(std::slice::from_ref(&f));
        assert_eq!(ev.len(), 2);
        assert!(st.reload(std::slice::from_ref(&f)).is_empty());
        std::fs::write(&f, format!("{SVC}---\n{}", SLICE.replace("10.0.0.1", "10.0.0.2"))).unwrap();
        let ev = st.reload(std::slice::from_ref(&f));
        assert!(matches!(ev.as_slice(), [SourceEvent::SliceApplied(_)]));
        std::fs::write(&f, "kind: Service\nmetadata: [broken").unwrap();
        assert!(st.reload(std::slice::from_ref(&f)).is_empty(), "a broken file keeps its objects");
        std::fs::write(&f, SVC).unwrap();
        let ev = st.reload(std::slice::from_ref(&f));
        assert!(matches!(ev.as_slice(), [SourceEvent::SliceDeleted(_)]));
        assert!(matches!(st.reload(&[]).as_slice(), [SourceEvent::ServiceDeleted(_)]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
