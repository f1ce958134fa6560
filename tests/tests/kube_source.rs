//! The Kubernetes source (`gardenet_agent::source::kube`) against the API server double:
//! kube-rs runs unmodified over real list/watch HTTP on 127.0.0.1.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use gardenet_agent::source::{kube as kube_source, EventRx, SourceEvent};
use gardenet_tests::apiserver::{ApiServer, RecordedRequest};
use serde_json::{json, Value};
use tokio::{sync::mpsc, task::JoinHandle, time::timeout};

const NODE: &str = "node-a";
/// Upper bound for anything that should happen promptly (incl. one or two backoff delays).
const PATIENCE: Duration = Duration::from_secs(20);

fn service(ns: &str, name: &str, port: u16) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": port, "protocol": "TCP"}]},
    })
}

fn slice(name: &str, service: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"port": 8080, "protocol": "TCP"}],
    })
}

fn node(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "zone-1"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]},
    })
}

/// A running source wired to a double.
struct Harness {
    server: ApiServer,
    rx: EventRx,
    source: JoinHandle<anyhow::Result<()>>,
    dir: PathBuf,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.source.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Harness {
    /// Starts the source against `server` (already populated as the test wants).
    async fn start(server: ApiServer, test: &str) -> Harness {
        let dir = std::env::temp_dir().join(format!("gardenet-kube-source-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let kubeconfig = server.kubeconfig(&dir);
        let client = timeout(PATIENCE, kube_source::client_from_env(Some(kubeconfig)))
            .await
            .expect("client_from_env timed out")
            .expect("client from the double's kubeconfig");
        let (tx, rx) = mpsc::channel(1024);
        let source = tokio::spawn(kube_source::run(client, NODE.into(), tx));
        Harness { server, rx, source, dir }
    }

    async fn next(&mut self) -> String {
        let event = timeout(PATIENCE, self.rx.recv()).await.expect("timed out waiting for a source event").expect("the source stopped");
        describe(&event)
    }

    async fn take(&mut self, n: usize) -> Vec<String> {
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            events.push(self.next().await);
        }
        events
    }

    /// Everything that arrives until nothing has for `quiet`.
    async fn drain(&mut self, quiet: Duration) -> Vec<String> {
        let mut events = Vec::new();
        while let Ok(event) = timeout(quiet, self.rx.recv()).await {
            events.push(describe(&event.expect("the source stopped")));
        }
        events
    }

    async fn assert_quiet(&mut self, quiet: Duration) {
        assert_eq!(self.drain(quiet).await, Vec::<String>::new(), "expected no events");
    }

    /// Polls the double's request log (from index `since`) until `done` holds.
    async fn wait_for_requests(&self, since: usize, what: &str, done: impl Fn(&[RecordedRequest]) -> bool) {
        let start = Instant::now();
        while !done(&self.server.requests()[since..]) {
            assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn describe(event: &SourceEvent) -> String {
    let id = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.as_deref().unwrap_or_default()),
        None => m.name.clone().unwrap_or_default(),
    };
    match event {
        SourceEvent::ServiceApplied(o) => format!("+svc {}", o.key()),
        SourceEvent::ServiceDeleted(o) => format!("-svc {}", o.key()),
        SourceEvent::SliceApplied(o) => format!("+slice {}", o.key()),
        SourceEvent::SliceDeleted(o) => format!("-slice {}", o.key()),
        SourceEvent::NodeApplied(o) => format!("+node {}", id(&o.metadata)),
        SourceEvent::Resync => "resync".into(),
        SourceEvent::Synced => "synced".into(),
        SourceEvent::LocalRedirectChanged(r) => format!("redirect {}", r.service),
        SourceEvent::ServiceCidrApplied(o) => format!("+servicecidr {}", o.name),
        SourceEvent::ServiceCidrDeleted(o) => format!("-servicecidr {}", o.name),
    }
}

/// Splits events into `Resync`..`Synced` windows, checking that nothing lies outside one.
fn snapshots(events: &[String]) -> Vec<&[String]> {
    let mut windows = Vec::new();
    let mut rest = events;
    while !rest.is_empty() {
        assert_eq!(rest[0], "resync", "events outside a snapshot: {events:?}");
        let end = rest.iter().position(|e| e == "synced").unwrap_or_else(|| panic!("unfinished: {events:?}"));
        assert!(!rest[1..end].contains(&"resync".to_string()), "nested resync: {events:?}");
        windows.push(&rest[..=end]);
        rest = &rest[end + 1..];
    }
    windows
}

fn query(request: &RecordedRequest, key: &str) -> Option<String> {
    form_urlencoded::parse(request.query.as_bytes()).find(|(k, _)| k == key).map(|(_, v)| v.into_owned())
}

fn is_watch(request: &RecordedRequest) -> bool {
    query(request, "watch").as_deref() == Some("true")
}

const COLLECTIONS: [&str; 4] = [
    "/api/v1/services",
    "/apis/discovery.k8s.io/v1/endpointslices",
    "/api/v1/nodes",
    // Served by the double as by a 1.33+ API server, so the source watches ServiceCIDRs too.
    "/apis/networking.k8s.io/v1/servicecidrs",
];

#[tokio::test]
async fn initial_list_is_one_snapshot() {
    let server = ApiServer::start().await;
    server.apply(service("default", "b", 80));
    server.apply(service("default", "a", 80));
    server.apply(service("kube-system", "dns", 53));
    server.apply(slice("a-1", "a", "10.1.0.1"));
    server.apply(node(NODE));
    server.apply(node("node-b"));
    let mut h = Harness::start(server, "initial").await;

    assert_eq!(h.take(7).await, ["resync", "+svc default/a", "+svc default/b", "+svc kube-system/dns", "+slice default/a-1", "+node node-a", "synced",]);
    h.assert_quiet(Duration::from_millis(300)).await;

    // Only this agent's Node is asked for, and every resource across all namespaces.
    let requests = h.server.requests();
    let node_lists: Vec<_> = requests.iter().filter(|r| r.path == "/api/v1/nodes").collect();
    assert!(!node_lists.is_empty());
    for r in node_lists {
        assert_eq!(query(r, "fieldSelector").as_deref(), Some("metadata.name=node-a"), "{r:?}");
    }
    for path in COLLECTIONS {
        assert!(requests.iter().any(|r| r.path == path && is_watch(r)), "no watch on {path}");
    }
}

/// ServiceCIDRs (Kubernetes 1.33+) are part of the snapshot and followed like the rest.
#[tokio::test]
async fn service_cidrs_are_watched() {
    let server = ApiServer::start().await;
    server.apply(service("default", "a", 80));
    server.apply(node(NODE));
    server.apply(json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16"]}}));
    let mut h = Harness::start(server, "servicecidrs").await;
    assert_eq!(h.take(5).await, ["resync", "+svc default/a", "+node node-a", "+servicecidr kubernetes", "synced"]);
    h.server.apply(json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "extra"}, "spec": {"cidrs": ["10.97.0.0/24"]}}));
    assert_eq!(h.take(1).await, ["+servicecidr extra"]);
    h.server.delete("ServiceCIDR", None, "extra").expect("extra existed");
    assert_eq!(h.take(1).await, ["-servicecidr extra"]);
}

/// Large lists come in pages (the agent's memory budget rests on it) and still make one
/// snapshot with every object.
#[tokio::test]
async fn large_lists_are_paged_into_one_snapshot() {
    const N: usize = 1_200;
    let server = ApiServer::start().await;
    for i in 0..N {
        server.apply(slice(&format!("s-{i:04}"), "a", "10.1.0.1"));
    }
    server.apply(node(NODE));
    let mut h = Harness::start(server, "paged").await;
    let events = h.take(N + 3).await;
    assert_eq!(events[0], "resync");
    assert_eq!(events[1], "+slice default/s-0000");
    assert_eq!(events[N], format!("+slice default/s-{:04}", N - 1));
    assert_eq!(events[N + 1..], ["+node node-a", "synced"]);
    let pages: Vec<_> = h.server.requests().into_iter().filter(|r| r.path == "/apis/discovery.k8s.io/v1/endpointslices" && !is_watch(r)).collect();
    assert_eq!(pages.len(), 3, "1,200 slices in pages of 500: {pages:?}");
    assert!(pages.iter().all(|r| query(r, "limit").as_deref() == Some("500")), "{pages:?}");
    assert!(pages[1..].iter().all(|r| query(r, "continue").is_some()), "{pages:?}");
}

#[tokio::test]
async fn watch_changes_are_forwarded() {
    let server = ApiServer::start().await;
    server.apply(service("default", "a", 80));
    server.apply(node(NODE));
    let mut h = Harness::start(server, "watch").await;
    assert_eq!(h.take(4).await, ["resync", "+svc default/a", "+node node-a", "synced"]);

    h.server.apply(service("default", "b", 80));
    assert_eq!(h.next().await, "+svc default/b");

    h.server.apply(service("default", "a", 81));
    let event = timeout(PATIENCE, h.rx.recv()).await.unwrap().unwrap();
    let SourceEvent::ServiceApplied(svc) = event else { panic!("expected a Service, got {event:?}") };
    assert_eq!(svc.ports[0].port, 81, "the modified Service is forwarded");

    h.server.apply(slice("b-1", "b", "10.1.0.2"));
    assert_eq!(h.next().await, "+slice default/b-1");
    h.server.delete("EndpointSlice", Some("default"), "b-1").expect("slice existed");
    assert_eq!(h.next().await, "-slice default/b-1");
    h.server.delete("Service", Some("default"), "b").expect("service existed");
    assert_eq!(h.next().await, "-svc default/b");

    // Other nodes are not this agent's business; its own node's changes are.
    h.server.apply(node("node-b"));
    let mut changed = node(NODE);
    changed["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-2".into();
    h.server.apply(changed);
    assert_eq!(h.next().await, "+node node-a");
    h.assert_quiet(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn bookmark_is_silent_and_advances_the_watch() {
    let server = ApiServer::start().await;
    server.apply(service("default", "a", 80));
    server.apply(node(NODE));
    let mut h = Harness::start(server, "bookmark").await;
    assert_eq!(h.take(4).await, ["resync", "+svc default/a", "+node node-a", "synced"]);

    // Bookmarks only reach established watches (they are not replayed).
    h.wait_for_requests(0, "the three watches", |rs| rs.iter().filter(|r| is_watch(r)).count() >= 3).await;
    // A change no watch of the source sees moves the resourceVersion on; the bookmark carries it.
    h.server.apply(node("node-b"));
    let bookmarked = h.server.resource_version();
    h.server.bookmark();
    h.assert_quiet(Duration::from_millis(300)).await;

    // When the watches end, they resume from the bookmark, without a relist.
    let since = h.server.request_count();
    h.server.close_watches();
    h.wait_for_requests(since, "three re-watches", |rs| rs.iter().filter(|r| is_watch(r)).count() >= 3).await;
    let rewatches = h.server.requests()[since..].to_vec();
    for r in &rewatches {
        assert!(is_watch(r), "expected only watches, not a relist: {r:?}");
        assert_eq!(query(r, "resourceVersion"), Some(bookmarked.to_string()), "{r:?}");
    }
    h.server.apply(service("default", "c", 80));
    assert_eq!(h.next().await, "+svc default/c");
    h.assert_quiet(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn compaction_relists_and_drops_what_vanished() {
    let server = ApiServer::start().await;
    server.apply(service("default", "a", 80));
    server.apply(service("default", "b", 80));
    server.apply(slice("a-1", "a", "10.1.0.1"));
    server.apply(node(NODE));
    let mut h = Harness::start(server, "compaction").await;
    assert_eq!(h.take(6).await, ["resync", "+svc default/a", "+svc default/b", "+slice default/a-1", "+node node-a", "synced",]);

    // The watches drop; while they are away `b` goes, `c` comes, and the history is compacted,
    // so resuming gets 410 Expired and each resource must be relisted.
    h.server.set_unavailable(true);
    h.server.delete("Service", Some("default"), "b").expect("b existed");
    h.server.apply(service("default", "c", 80));
    h.server.compact();
    let since = h.server.request_count();
    h.server.set_unavailable(false);

    h.wait_for_requests(since, "a relist of every resource", |rs| COLLECTIONS.iter().all(|path| rs.iter().any(|r| r.path == *path && !is_watch(r)))).await;
    // The four relists may or may not overlap (their backoff has jitter), so there are one to
    // four snapshots, each complete as far as the source knew at the time (one sent before the
    // Services were relisted still has `b`). The last one is the current state.
    let current = ["resync", "+svc default/a", "+svc default/c", "+slice default/a-1", "+node node-a", "synced"];
    let mut events = Vec::new();
    while !events.ends_with(&current.map(String::from)) {
        events.push(h.next().await);
    }
    events.extend(h.drain(Duration::from_millis(500)).await);
    let windows = snapshots(&events);
    assert!((1..=4).contains(&windows.len()), "{events:?}");
    assert_eq!(windows.last().unwrap(), &current, "{events:?}");
    // Every watch that resumed from before the compaction was told 410.
    let expired = h.server.requests()[since..].iter().filter(|r| is_watch(r)).count();
    assert!(expired >= 3, "expected the resumed watches, got {expired}");
}

#[tokio::test]
async fn outage_backs_off_and_recovers() {
    let server = ApiServer::start().await;
    server.apply(service("default", "a", 80));
    server.apply(node(NODE));
    let mut h = Harness::start(server, "outage").await;
    assert_eq!(h.take(4).await, ["resync", "+svc default/a", "+node node-a", "synced"]);

    let connections = h.server.connection_count();
    h.server.set_unavailable(true);
    h.server.apply(service("default", "b", 80));
    h.assert_quiet(Duration::from_secs(3)).await;
    let attempts = h.server.connection_count() - connections;
    // Three watchers with exponential backoff (0.8 s, 1.6 s, ... plus jitter) try a couple of
    // times each in 3 s; a busy loop would make thousands of attempts.
    assert!((3..=15).contains(&attempts), "{attempts} connection attempts during a 3 s outage");

    // Back up: the watches resume where they were (no relist) and catch up on what they missed.
    h.server.set_unavailable(false);
    assert_eq!(h.next().await, "+svc default/b");
    h.server.apply(service("default", "c", 80));
    assert_eq!(h.next().await, "+svc default/c");
    h.assert_quiet(Duration::from_millis(300)).await;
}
