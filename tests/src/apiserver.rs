//! An in-process Kubernetes API server double for tests.
//!
//! It speaks the real list/watch wire format over plain HTTP/1.1 on 127.0.0.1, so kube-rs (or
//! any client) runs against it unmodified: lists carry `metadata.resourceVersion` and are
//! paged like the real server's (`limit`, `continue` tokens served from the first page's
//! snapshot, `410 Expired` once compacted), every change
//! bumps one global resourceVersion, watches replay from a version and then stream live
//! changes (with BOOKMARKs when asked for), and a watch from a compacted version gets an
//! `ERROR` event with a `410 Expired` Status. Objects of any kind can also be created, read,
//! replaced (with resourceVersion conflicts), patched (merge, JSON, and apply approximated as
//! merge; `/status` subresources) and deleted over HTTP, and every request is recorded.
//!
//! ```no_run
//! # async fn demo() {
//! use gardenet_tests::apiserver::ApiServer;
//! let server = ApiServer::start().await;
//! server.apply(serde_json::json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"},
//! }));
//! let kubeconfig = server.kubeconfig(&std::env::temp_dir());
//! # }
//! ```
mod http;
mod select;
mod semantics;
mod store;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use hyper::{server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::Value;
use tokio::{net::TcpListener, sync::broadcast, task::JoinHandle};

use store::{Change, Coll, Failure, Store};

/// One request as the double received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// The raw (still URL-encoded) query string.
    pub query: String,
    pub content_type: Option<String>,
    /// The body parsed as JSON (or a JSON string if it was not JSON); `None` if empty.
    pub body: Option<Value>,
}

/// What open watches are told.
#[derive(Clone, Debug)]
enum Signal {
    Change(Arc<Change>),
    Bookmark(u64),
    CloseWatches,
}

struct Shared {
    store: Mutex<Store>,
    signals: broadcast::Sender<Signal>,
    unavailable: AtomicBool,
    /// Bumped to drop every open connection.
    kill: tokio::sync::watch::Sender<u64>,
    requests: Mutex<Vec<RecordedRequest>>,
    connections: AtomicUsize,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unavailable(&self) -> bool {
        self.unavailable.load(SeqCst)
    }

    fn record(&self, request: RecordedRequest) {
        self.requests.lock().unwrap_or_else(|e| e.into_inner()).push(request);
    }

    /// Runs one store mutation and tells the watches, under the store lock so that watches
    /// being set up see each change exactly once. Returns the object after the change.
    fn commit(&self, f: impl FnOnce(&mut Store) -> Result<&Change, Failure>) -> Result<Value, Failure> {
        let mut store = self.store();
        let change = f(&mut store)?.clone();
        let obj = change.new.clone();
        // No receivers is fine: nobody is watching.
        let _ = self.signals.send(Signal::Change(Arc::new(change)));
        Ok(obj)
    }
}

/// A running API server double; stops (and drops its connections) when dropped.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: JoinHandle<()>,
}

impl ApiServer {
    /// Starts listening on an ephemeral port of 127.0.0.1. Needs a tokio runtime.
    pub async fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("listener address");
        let shared = Arc::new(Shared {
            store: Mutex::default(),
            signals: broadcast::channel(4096).0,
            unavailable: AtomicBool::new(false),
            kill: tokio::sync::watch::channel(0).0,
            requests: Mutex::default(),
            connections: AtomicUsize::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        ApiServer { shared, addr, accept }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes `dir/kubeconfig` pointing at this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: double\n\
             clusters:\n- name: double\n  cluster:\n    server: {}\n\
             contexts:\n- name: double\n  context:\n    cluster: double\n    user: double\n    namespace: default\n\
             users:\n- name: double\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(&path, config).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path
    }

    /// Creates or replaces `obj` (which needs `apiVersion`, `kind` and `metadata.name`;
    /// namespaced kinds default to namespace `default`). Returns it as stored, with its new
    /// resourceVersion.
    pub fn apply(&self, obj: impl Serialize) -> Value {
        let obj = serde_json::to_value(obj).expect("object serializes to JSON");
        let field = |f: &str| obj.get(f).and_then(Value::as_str).unwrap_or_else(|| panic!("object without {f}: {obj}"));
        let coll = Coll::of_object(field("apiVersion"), field("kind"));
        let ns = match store::namespace_of(&obj) {
            "" if coll.namespaced() => "default",
            ns => ns,
        }
        .to_owned();
        self.shared.commit(|store| Ok(store.put(&coll, &ns, obj))).expect("put cannot fail")
    }

    /// Deletes an object; `kind` may be qualified as `apiVersion/Kind`. Returns the deleted
    /// object, `None` if there was none.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let coll = Coll::of_kind(kind).unwrap_or_else(|| panic!("unknown kind {kind}"));
        self.shared.commit(|store| store.remove(&coll, namespace.unwrap_or_default(), name)).ok()
    }

    /// An object as stored; `kind` may be qualified as `apiVersion/Kind`.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let coll = Coll::of_kind(kind).unwrap_or_else(|| panic!("unknown kind {kind}"));
        self.shared.store().get(&coll, namespace.unwrap_or_default(), name).cloned()
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().resource_version()
    }

    /// Makes every resourceVersion handed out so far too old to watch from: the next watch
    /// from one gets `410 Expired` (and the client must relist). Open watches are not cut;
    /// combine with [`close_watches`](Self::close_watches) or an outage for that.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Ends every open watch cleanly, as the server's watch timeout would.
    pub fn close_watches(&self) {
        let _store = self.shared.store();
        let _ = self.shared.signals.send(Signal::CloseWatches);
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch that allows them.
    pub fn bookmark(&self) {
        let store = self.shared.store();
        let _ = self.shared.signals.send(Signal::Bookmark(store.resource_version()));
    }

    /// While unavailable, every open connection is dropped and new ones are closed as soon as
    /// they are accepted: to a client this is a transport error, like a refused connection,
    /// but the attempts still show in [`connection_count`](Self::connection_count).
    pub fn set_unavailable(&self, unavailable: bool) {
        // Flag first, then kill: a connection accepted in between sees one or the other.
        self.shared.unavailable.store(unavailable, SeqCst);
        if unavailable {
            self.shared.kill.send_modify(|generation| *generation += 1);
        }
    }

    /// TCP connections accepted so far, including those dropped while unavailable.
    pub fn connection_count(&self) -> usize {
        self.shared.connections.load(SeqCst)
    }

    /// HTTP requests served so far.
    pub fn request_count(&self) -> usize {
        self.shared.requests.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Every HTTP request served so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.kill.send_modify(|generation| *generation += 1);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(_) => {
                // E.g. out of file descriptors: don't spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        shared.connections.fetch_add(1, SeqCst);
        // Subscribe before checking the flag (see `set_unavailable`).
        let mut kill = shared.kill.subscribe();
        if shared.unavailable() {
            drop(tcp);
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| http::handle(shared.clone(), req));
            let conn = http1::Builder::new().serve_connection(TokioIo::new(tcp), service);
            // Kill first: once unavailable, not one more byte goes out.
            tokio::select! {
                biased;
                _ = kill.changed() => {}
                _ = conn => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::{
            coordination::v1::{Lease, LeaseSpec},
            core::v1::{Event, Node, ObjectReference},
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };
    use kube::{
        api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
        Client, Config,
    };
    use serde_json::json;

    use super::*;

    fn client(server: &ApiServer) -> Client {
        Client::try_from(Config::new(server.url().parse().unwrap())).unwrap()
    }

    fn api_code(result: kube::Result<impl std::fmt::Debug>) -> u16 {
        match result {
            Err(kube::Error::Api(status)) => status.code,
            other => panic!("expected an API error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn lists_are_paged_from_one_snapshot() {
        use kube::api::ListParams;
        let server = ApiServer::start().await;
        for i in 0..5 {
            server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": format!("n{i}")}}));
        }
        let nodes: Api<Node> = Api::all(client(&server));
        let first = nodes.list(&ListParams::default().limit(2)).await.unwrap();
        assert_eq!(first.items.len(), 2);
        assert_eq!(first.metadata.remaining_item_count, Some(3));
        let token = first.metadata.continue_.clone().expect("a continue token");
        // A change after the first page is not in the later pages (one consistent snapshot).
        server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n9"}}));
        let mut names: Vec<String> = first.items.iter().map(|n| n.metadata.name.clone().unwrap()).collect();
        let mut cont = Some(token);
        while let Some(c) = cont {
            let page = nodes.list(&ListParams::default().limit(2).continue_token(&c)).await.unwrap();
            assert_eq!(page.metadata.resource_version, first.metadata.resource_version);
            names.extend(page.items.iter().map(|n| n.metadata.name.clone().unwrap()));
            cont = page.metadata.continue_.filter(|c| !c.is_empty());
        }
        assert_eq!(names, ["n0", "n1", "n2", "n3", "n4"]);
        // Without a limit everything comes at once; a compacted token has expired.
        assert_eq!(nodes.list(&ListParams::default()).await.unwrap().items.len(), 6);
        let again = nodes.list(&ListParams::default().limit(1)).await.unwrap();
        server.compact();
        let c = again.metadata.continue_.unwrap();
        assert_eq!(api_code(nodes.list(&ListParams::default().limit(1).continue_token(&c)).await), 410);
    }

    #[tokio::test]
    async fn leases_use_optimistic_concurrency() {
        let server = ApiServer::start().await;
        let leases: Api<Lease> = Api::namespaced(client(&server), "kube-system");
        let pp = PostParams::default();
        let lease = Lease {
            metadata: ObjectMeta { name: Some("gardenet".into()), ..Default::default() },
            spec: Some(LeaseSpec { holder_identity: Some("a".into()), ..Default::default() }),
        };
        let created = leases.create(&pp, &lease).await.unwrap();
        assert_eq!(api_code(leases.create(&pp, &lease).await), 409);

        let mut taken = leases.get("gardenet").await.unwrap();
        taken.spec.as_mut().unwrap().holder_identity = Some("b".into());
        let taken = leases.replace("gardenet", &pp, &taken).await.unwrap();
        assert_ne!(taken.metadata.resource_version, created.metadata.resource_version);
        // Replacing from a stale copy loses.
        assert_eq!(api_code(leases.replace("gardenet", &pp, &created).await), 409);
        assert_eq!(api_code(leases.get("missing").await), 404);
    }

    #[tokio::test]
    async fn status_patches_touch_only_status_and_are_recorded() {
        let server = ApiServer::start().await;
        server.apply(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {"a": "1"}},
        }));
        let nodes: Api<Node> = Api::all(client(&server));
        let patch = json!({"metadata": {"labels": {"a": "2"}},
                           "status": {"conditions": [{"type": "NetworkUnavailable", "status": "False"}]}});
        let node = nodes.patch_status("n1", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
        assert_eq!(node.metadata.labels.unwrap()["a"], "1");
        assert_eq!(node.status.unwrap().conditions.unwrap()[0].type_, "NetworkUnavailable");

        let gvk = GroupVersionKind::gvk("extensions.gardener.cloud", "v1alpha1", "Network");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "networks");
        server.apply(json!({
            "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
            "metadata": {"name": "shoot", "namespace": "shoot--a--b"}, "spec": {"type": "gardenet"},
        }));
        let networks: Api<DynamicObject> = Api::namespaced_with(client(&server), "shoot--a--b", &resource);
        let apply = json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
                           "status": {"observedGeneration": 1}});
        networks.patch_status("shoot", &PatchParams::apply("gardenet").force(), &Patch::Apply(&apply)).await.unwrap();
        let stored = server.get("Network", Some("shoot--a--b"), "shoot").unwrap();
        assert_eq!(stored["status"]["observedGeneration"], 1);
        assert_eq!(stored["spec"]["type"], "gardenet");

        let patches: Vec<_> = server.requests().into_iter().filter(|r| r.method == "PATCH").collect();
        assert_eq!(patches.len(), 2);
        assert_eq!(patches[0].path, "/api/v1/nodes/n1/status");
        assert_eq!(patches[0].content_type.as_deref(), Some("application/merge-patch+json"));
        assert_eq!(patches[0].body.as_ref(), Some(&patch));
        assert_eq!(patches[1].path, "/apis/extensions.gardener.cloud/v1alpha1/namespaces/shoot--a--b/networks/shoot/status");
        assert_eq!(patches[1].content_type.as_deref(), Some("application/apply-patch+yaml"));
        assert!(patches[1].query.contains("fieldManager=gardenet"));
    }

    /// A custom resource with a status subresource behaves as on a real server: status only
    /// through `/status`, generation bumped by spec changes, finalizers holding a DELETE.
    #[tokio::test]
    async fn custom_resources_follow_status_generation_and_finalizers() {
        use kube::api::DeleteParams;
        let server = ApiServer::start().await;
        let gvk = GroupVersionKind::gvk("extensions.gardener.cloud", "v1alpha1", "Network");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "networks");
        let networks: Api<DynamicObject> = Api::namespaced_with(client(&server), "ns", &resource);
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
            "metadata": {"name": "n", "finalizers": ["f"]}, "spec": {"type": "a"}, "status": {"x": 1},
        }))
        .unwrap();
        let created = networks.create(&PostParams::default(), &obj).await.unwrap();
        assert_eq!(created.metadata.generation, Some(1));
        assert!(created.data.get("status").is_none(), "status dropped on create");

        let pp = PatchParams::default();
        let p = networks.patch("n", &pp, &Patch::Merge(json!({"spec": {"type": "b"}, "status": {"x": 2}}))).await.unwrap();
        assert_eq!(p.metadata.generation, Some(2));
        assert!(p.data.get("status").is_none(), "status ignored on the main resource");
        let p = networks.patch_status("n", &pp, &Patch::Merge(json!({"spec": {"type": "c"}, "status": {"x": 3}}))).await.unwrap();
        assert_eq!((p.data["status"]["x"].clone(), p.data["spec"]["type"].clone()), (json!(3), json!("b")));
        assert_eq!(p.metadata.generation, Some(2));

        networks.delete("n", &DeleteParams::default()).await.unwrap();
        let held = networks.get("n").await.unwrap();
        assert!(held.metadata.deletion_timestamp.is_some());
        let more = json!({"metadata": {"finalizers": ["f", "g"]}});
        assert_eq!(api_code(networks.patch("n", &pp, &Patch::Merge(more)).await), 422);
        networks.patch("n", &pp, &Patch::Merge(json!({"metadata": {"finalizers": []}}))).await.unwrap();
        assert_eq!(api_code(networks.get("n").await), 404);
    }

    #[tokio::test]
    async fn events_are_created_with_generated_names() {
        let server = ApiServer::start().await;
        let events: Api<Event> = Api::namespaced(client(&server), "default");
        let event = Event {
            metadata: ObjectMeta { generate_name: Some("svc.".into()), ..Default::default() },
            involved_object: ObjectReference { kind: Some("Service".into()), ..Default::default() },
            reason: Some("Programmed".into()),
            ..Default::default()
        };
        let created = events.create(&PostParams::default(), &event).await.unwrap();
        let name = created.metadata.name.unwrap();
        assert!(name.starts_with("svc."), "{name}");
        assert!(server.get("Event", Some("default"), &name).is_some());
    }
}
