//! `gardenet-extension` against the API server double (the seed, and a second double as the
//! shoot): Networks created the way gardenlet creates them, reconciled, changed, deleted,
//! migrated and restored; a restart halfway and an API server outage; and the admission
//! webhook over real HTTPS on loopback.
use std::{
    future::Future,
    path::PathBuf,
    sync::{
        atomic::{AtomicUsize, Ordering::SeqCst},
        Arc,
    },
    time::Duration,
};

use gardenet_agent::gardener::{
    aggregate::NODE_CONDITION_AGENT_READY,
    network::{Network, ERR_CONFIGURATION_PROBLEM},
    PROVIDER_API_VERSION,
};
use gardenet_extension::{
    cluster::{Cluster, ClusterSpec},
    controller::{self, Settings},
    managed::{self, ManagedResource},
    metrics::Metrics,
    operation::{ANNOTATION_OPERATION, ANNOTATION_TIMESTAMP, FINALIZER},
    render, serve,
    shoot::SECRET_GARDENER_INTERNAL,
};
use gardenet_tests::apiserver::ApiServer;
use k8s_openapi::{
    api::{apps::v1::DaemonSet, core::v1::Secret},
    ByteString,
};
use kube::{
    api::{DeleteParams, Patch, PatchParams, PostParams},
    Api, Client, Config,
};
use serde_json::{json, Value};
use tokio::{sync::oneshot, task::JoinHandle};

const NS: &str = "shoot--core--test";
const SHOOT: &str = "test";
const PATIENCE: Duration = Duration::from_secs(20);
const API_HOST: &str = "api.test.example.com";

fn client(server: &ApiServer) -> Client {
    Client::try_from(Config::new(server.url().parse().expect("double URL"))).expect("client")
}

fn settings() -> Settings {
    Settings {
        image: "registry.example.com/gardenet-agent:test".into(),
        delete_timeout: Duration::from_secs(2),
        poll: Duration::from_millis(50),
        observe_every: Duration::from_millis(500),
        retry: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
    }
}

/// A running controller; stopped (gracefully) on drop.
struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Running {
    fn start(seed: &ApiServer) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let health = Arc::new(serve::Health::default());
        let task = tokio::spawn(controller::run(client(seed), settings(), Arc::new(Metrics::default()), health, async {
            let _ = stopped.await;
        }));
        Running { stop: Some(stop), task: Some(task) }
    }

    /// Stops and waits until the controller has stopped.
    async fn stop(mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(PATIENCE, task).await.expect("controller stops");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A Shoot as it sits in a Cluster.
fn shoot(kube_proxy_enabled: bool) -> Value {
    json!({
        "apiVersion": "core.gardener.cloud/v1beta1", "kind": "Shoot",
        "metadata": {"name": SHOOT, "namespace": "garden-core", "generation": 1},
        "spec": {
            "kubernetes": {"version": "1.33.0", "kubeProxy": {"enabled": kube_proxy_enabled}},
            "networking": {"type": "gardenet", "pods": "100.96.0.0/11", "services": "100.64.0.0/13", "nodes": "10.250.0.0/16"},
        },
        "status": {
            "observedGeneration": 1,
            "lastOperation": {"type": "Reconcile", "state": "Processing", "progress": 60},
            "advertisedAddresses": [{"name": "external", "url": format!("https://{API_HOST}")}],
        },
    })
}

fn provider_config(extra: Value) -> Value {
    let mut v = json!({"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig"});
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    v
}

fn now_stamp() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// What gardenlet does: the Cluster first, then the Network with the operation annotation.
async fn create_like_gardenlet(seed: &ApiServer, kube_proxy_enabled: bool, pc: Option<Value>) -> Network {
    let clusters: Api<Cluster> = Api::all(client(seed));
    let cluster = Cluster::new(NS, ClusterSpec { shoot: shoot(kube_proxy_enabled), ..Default::default() });
    clusters.create(&PostParams::default(), &cluster).await.expect("create Cluster");
    let networks: Api<Network> = Api::namespaced(client(seed), NS);
    let mut network: Network = serde_json::from_value(json!({
        "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": SHOOT, "namespace": NS,
                     "annotations": {ANNOTATION_OPERATION: "reconcile", ANNOTATION_TIMESTAMP: now_stamp()}},
        "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13", "ipFamilies": ["IPv4"]},
    }))
    .unwrap();
    network.spec.provider_config = pc;
    networks.create(&PostParams::default(), &network).await.expect("create Network")
}

fn stored_network(seed: &ApiServer) -> Option<Value> {
    seed.get("Network", Some(NS), SHOOT)
}

async fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    eventually_within(what, PATIENCE, move || std::future::ready(check())).await
}

async fn eventually_within<T, F: Future<Output = Option<T>>>(what: &str, limit: Duration, mut check: impl FnMut() -> F) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Network once its last operation is `type_`/`state`.
async fn until_operation(seed: &ApiServer, type_: &str, state: &str) -> Value {
    eventually(&format!("lastOperation {type_} {state}"), || {
        let n = stored_network(seed)?;
        let op = &n["status"]["lastOperation"];
        (op["type"] == type_ && op["state"] == state).then_some(n)
    })
    .await
}

fn mr(seed: &ApiServer) -> Option<Value> {
    seed.get("ManagedResource", Some(NS), managed::NAME)
}

fn mr_secret_name(seed: &ApiServer) -> String {
    mr(seed).expect("ManagedResource")["spec"]["secretRefs"][0]["name"].as_str().expect("secretRefs[0]").to_owned()
}

async fn secret_data(seed: &ApiServer, name: &str) -> (Secret, std::collections::BTreeMap<String, String>) {
    let secrets: Api<Secret> = Api::namespaced(client(seed), NS);
    let s = secrets.get(name).await.expect("secret");
    let data = s.data.clone().unwrap_or_default().into_iter().map(|(k, ByteString(v))| (k, String::from_utf8(v).unwrap())).collect();
    (s, data)
}

async fn annotate(seed: &ApiServer, operation: &str) {
    let networks: Api<Network> = Api::namespaced(client(seed), NS);
    let patch = json!({"metadata": {"annotations": {ANNOTATION_OPERATION: operation, ANNOTATION_TIMESTAMP: now_stamp()}}});
    networks.patch(SHOOT, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("annotate");
}

/// Holds the ManagedResource as gardener-resource-manager does while it cleans up.
async fn hold_managed_resource(seed: &ApiServer, hold: bool) {
    let mrs: Api<ManagedResource> = Api::namespaced(client(seed), NS);
    let finalizers: Vec<&str> = if hold { vec!["resources.gardener.cloud/gardener-resource-manager"] } else { vec![] };
    mrs.patch(managed::NAME, &PatchParams::default(), &Patch::Merge(&json!({"metadata": {"finalizers": finalizers}})))
        .await
        .expect("patch ManagedResource finalizers");
}

#[tokio::test]
async fn created_like_gardenlet_ends_succeeded_with_managed_resource_and_secret() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, false, None).await;
    // gardenlet's own status field must survive the extension's writes.
    let networks: Api<Network> = Api::namespaced(client(&seed), NS);
    networks.patch_status(SHOOT, &PatchParams::default(), &Patch::Merge(&json!({"status": {"state": {"kept": true}}}))).await.unwrap();
    let running = Running::start(&seed);

    let n = until_operation(&seed, "Create", "Succeeded").await;
    let status = &n["status"];
    assert_eq!(status["lastOperation"]["progress"], 100);
    assert_eq!(status["lastError"], Value::Null);
    assert_eq!(status["observedGeneration"], n["metadata"]["generation"]);
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(status["ipFamilies"], json!(["IPv4"]));
    assert_eq!(status["providerStatus"]["apiVersion"], PROVIDER_API_VERSION);
    assert_eq!(status["providerStatus"]["kind"], "NetworkStatus");
    assert_eq!(status["providerStatus"]["mode"], "replacement");
    assert_eq!(status["state"]["kept"], true);
    assert_eq!(status["lastOperation"]["description"], "Successfully reconciled Network");
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    let annotations = eventually("operation annotation removed", || {
        let n = stored_network(&seed)?;
        n["metadata"]["annotations"].get(ANNOTATION_OPERATION).is_none().then(|| n["metadata"]["annotations"].clone())
    })
    .await;
    assert!(annotations.get(ANNOTATION_TIMESTAMP).is_some());

    let mr = mr(&seed).expect("ManagedResource");
    assert!(mr["spec"].get("class").is_none_or(Value::is_null), "{mr}");
    assert_eq!(mr["spec"]["keepObjects"], false);
    assert_eq!(mr["metadata"]["labels"]["origin"], "gardenet");
    let secret_name = mr_secret_name(&seed);
    let (secret, data) = secret_data(&seed, &secret_name).await;
    assert_eq!(secret.immutable, Some(true));
    assert_eq!(secret.metadata.labels.unwrap()[managed::LABEL_GARBAGE_COLLECTABLE], "true");
    assert_eq!(secret_name, managed::secret_name(managed::NAME, &data));
    // The reference annotation keeps the garbage collector off the current Secret.
    assert_eq!(mr["metadata"]["annotations"][managed::reference_annotation_key(&secret_name)], secret_name.as_str());
    assert_eq!(status["providerStatus"]["secret"], secret_name);
    let ds: DaemonSet = serde_yaml::from_str(&data[render::KEY_DAEMONSET]).expect("DaemonSet");
    assert_eq!(ds.metadata.labels.unwrap()[render::LABEL_CRITICAL_COMPONENT], "true");
    let agent = &ds.spec.template.spec.unwrap().containers[0];
    assert_eq!(agent.image.as_deref(), Some("registry.example.com/gardenet-agent:test"));
    let host = agent.env.iter().flatten().find(|e| e.name == "KUBERNETES_SERVICE_HOST").and_then(|e| e.value.clone());
    assert_eq!(host.as_deref(), Some(API_HOST));
    // Shoot access is gardenlet's kubeconfig; the extension creates no Secret of its own for it.
    let secrets: Api<Secret> = Api::namespaced(client(&seed), NS);
    let names: Vec<String> = secrets.list(&Default::default()).await.unwrap().items.into_iter().filter_map(|s| s.metadata.name).collect();
    assert_eq!(names, std::slice::from_ref(&secret_name));
    running.stop().await;
}

#[tokio::test]
async fn provider_config_change_yields_a_new_secret() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, false, None).await;
    let _running = Running::start(&seed);
    until_operation(&seed, "Create", "Succeeded").await;
    let first = mr_secret_name(&seed);

    let networks: Api<Network> = Api::namespaced(client(&seed), NS);
    let patch = json!({
        "metadata": {"annotations": {ANNOTATION_OPERATION: "reconcile", ANNOTATION_TIMESTAMP: now_stamp()}},
        "spec": {"providerConfig": provider_config(json!({"socketLB": {"hostNamespaceOnly": true}}))},
    });
    let changed = networks.patch(SHOOT, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    assert_eq!(changed.metadata.generation, Some(2));
    let n = eventually("reconciled generation 2", || {
        let n = stored_network(&seed)?;
        (n["status"]["observedGeneration"] == 2 && n["status"]["lastOperation"]["state"] == "Succeeded").then_some(n)
    })
    .await;
    assert_eq!(n["status"]["lastOperation"]["type"], "Reconcile");
    let second = mr_secret_name(&seed);
    assert_ne!(first, second);
    let annotations = &mr(&seed).unwrap()["metadata"]["annotations"];
    assert_eq!(annotations[managed::reference_annotation_key(&second)], second.as_str());
    let (_, data) = secret_data(&seed, &second).await;
    assert!(data[render::KEY_CONFIG].contains("hostNamespaceOnly: true"), "{}", data[render::KEY_CONFIG]);
    // The old Secret is left for the resource manager's garbage collection.
    assert!(seed.get("Secret", Some(NS), &first).is_some());
}

#[tokio::test]
async fn unusable_provider_config_without_kube_proxy_is_a_configuration_problem() {
    let seed = ApiServer::start().await;
    let pc = provider_config(json!({"socketLB": {"enabled": false}, "interfaces": {"include": []}}));
    create_like_gardenlet(&seed, false, Some(pc)).await;
    let _running = Running::start(&seed);
    let n = until_operation(&seed, "Create", "Error").await;
    let err = &n["status"]["lastError"];
    assert_eq!(err["codes"], json!([ERR_CONFIGURATION_PROBLEM]));
    let text = err["description"].as_str().unwrap();
    assert!(text.contains("socketLB.enabled is false") && text.contains("interfaces.include"), "{text}");
    assert_eq!(n["status"]["observedGeneration"], 1);
    assert!(text.starts_with("Error reconciling Network: "), "{text}");
    assert!(mr(&seed).is_none(), "nothing deployed for an unusable config");
    // The request was removed when picked up (OperationAnnotationWrapper); gardenlet reads the
    // error. The failure is not retried in a hot loop.
    assert!(n["metadata"]["annotations"].get(ANNOTATION_OPERATION).is_none(), "{n}");
    let before = seed.requests().iter().filter(|r| r.path.ends_with("/status")).count();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = seed.requests().iter().filter(|r| r.path.ends_with("/status")).count();
    assert!(after - before <= 2, "{} status writes in 0.5 s", after - before);
    // A new request from gardenlet is answered at once, also right after a failure (the
    // throttle is 1 s here).
    let writes = || seed.requests().iter().filter(|r| r.path.ends_with("/status")).count();
    for _ in 0..2 {
        let before = writes();
        annotate(&seed, "reconcile").await;
        eventually_within("a new request answered at once", Duration::from_millis(400), || std::future::ready((writes() >= before + 2).then_some(()))).await;
    }
}

#[tokio::test]
async fn invalid_provider_config_names_the_field() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, true, Some(provider_config(json!({"xdp": {"mode": "turbo"}})))).await;
    let _running = Running::start(&seed);
    let n = until_operation(&seed, "Create", "Error").await;
    let text = n["status"]["lastError"]["description"].as_str().unwrap().to_owned();
    assert!(text.contains("spec.providerConfig.xdp.mode"), "{text}");
    assert_eq!(n["status"]["lastError"]["codes"], json!([ERR_CONFIGURATION_PROBLEM]));
}

#[tokio::test]
async fn failed_shoots_and_wait_for_state_are_left_alone() {
    let seed = ApiServer::start().await;
    let clusters: Api<Cluster> = Api::all(client(&seed));
    let mut failed = shoot(false);
    failed["status"]["lastOperation"]["state"] = json!("Failed");
    let cluster = Cluster::new(NS, ClusterSpec { shoot: failed, ..Default::default() });
    clusters.create(&PostParams::default(), &cluster).await.unwrap();
    let networks: Api<Network> = Api::namespaced(client(&seed), NS);
    let network: Network = serde_json::from_value(json!({
        "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": SHOOT, "namespace": NS, "annotations": {ANNOTATION_OPERATION: "reconcile", ANNOTATION_TIMESTAMP: now_stamp()}},
        "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13"},
    }))
    .unwrap();
    networks.create(&PostParams::default(), &network).await.unwrap();
    let _running = Running::start(&seed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let n = stored_network(&seed).unwrap();
    assert!(n.get("status").is_none() && n["metadata"].get("finalizers").is_none(), "a failed shoot was touched: {n}");

    // The shoot recovers (a new generation of it), but gardenlet is still moving state here.
    annotate(&seed, "wait-for-state").await;
    let recovered = Cluster::new(NS, ClusterSpec { shoot: shoot(false), ..Default::default() });
    let patch = json!({"spec": serde_json::to_value(&recovered.spec).unwrap()});
    clusters.patch(NS, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(stored_network(&seed).unwrap().get("status").is_none(), "acted during wait-for-state");
    annotate(&seed, "reconcile").await;
    until_operation(&seed, "Create", "Succeeded").await;
}

#[tokio::test]
async fn delete_waits_for_the_managed_resource_then_releases_the_network() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, false, None).await;
    let _running = Running::start(&seed);
    until_operation(&seed, "Create", "Succeeded").await;
    let secret_name = mr_secret_name(&seed);
    hold_managed_resource(&seed, true).await;

    let networks: Api<Network> = Api::namespaced(client(&seed), NS);
    networks.delete(SHOOT, &DeleteParams::default()).await.unwrap();
    assert!(stored_network(&seed).unwrap()["metadata"]["deletionTimestamp"].is_string(), "finalizer holds the Network");
    // The resource manager does not let go within the bounded wait: an error, and retried.
    let n = until_operation(&seed, "Delete", "Error").await;
    assert!(n["status"]["lastError"]["description"].as_str().unwrap().contains("still exists"), "{n}");
    assert!(mr(&seed).unwrap()["metadata"]["deletionTimestamp"].is_string());
    hold_managed_resource(&seed, false).await;
    eventually("Network gone", || stored_network(&seed).is_none().then_some(())).await;
    assert!(mr(&seed).is_none());
    assert!(seed.get("Secret", Some(NS), &secret_name).is_none());
}

#[tokio::test]
async fn migrate_keeps_the_shoot_objects_and_restore_reconciles() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, false, None).await;
    let _running = Running::start(&seed);
    until_operation(&seed, "Create", "Succeeded").await;
    hold_managed_resource(&seed, true).await;

    annotate(&seed, "migrate").await;
    let held = eventually("ManagedResource marked for deletion", || mr(&seed).filter(|m| m["metadata"]["deletionTimestamp"].is_string())).await;
    assert_eq!(held["spec"]["keepObjects"], true, "the shoot keeps its objects (and its Service routing)");
    hold_managed_resource(&seed, false).await;
    let n = until_operation(&seed, "Migrate", "Succeeded").await;
    let n = if n["metadata"]["finalizers"].as_array().is_some_and(|f| !f.is_empty()) {
        let released = |n: &Value| n["metadata"]["finalizers"].as_array().is_none_or(Vec::is_empty);
        eventually("finalizer removed", || stored_network(&seed).filter(released)).await
    } else {
        n
    };
    assert!(n["metadata"]["annotations"].get(ANNOTATION_OPERATION).is_none(), "{n}");
    assert!(mr(&seed).is_none());

    // A plain reconcile request is not honoured on the seed the shoot left...
    annotate(&seed, "reconcile").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stored_network(&seed).unwrap()["status"]["lastOperation"]["type"], "Migrate");
    // ...a restore is.
    annotate(&seed, "restore").await;
    let n = until_operation(&seed, "Restore", "Succeeded").await;
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    assert!(mr(&seed).is_some());
}

#[tokio::test]
async fn controller_restarted_halfway_converges() {
    let seed = ApiServer::start().await;
    create_like_gardenlet(&seed, false, None).await;
    // A first controller is killed (not stopped) as soon as it has written its first status.
    let mut first = Running::start(&seed);
    let status_path = format!("/apis/extensions.gardener.cloud/v1alpha1/namespaces/{NS}/networks/{SHOOT}/status");
    eventually("first status write", || seed.requests().iter().any(|r| r.method == "PATCH" && r.path == status_path).then_some(())).await;
    first.task.take().expect("task").abort();
    drop(first);
    let after_kill = stored_network(&seed).unwrap();
    assert_eq!(after_kill["metadata"]["finalizers"], json!([FINALIZER]));
    // Whatever step it reached, the next one finishes the operation.
    let _second = Running::start(&seed);
    let n = until_operation(&seed, "Create", "Succeeded").await;
    assert_eq!(n["metadata"]["finalizers"], json!([FINALIZER]));
    let name = mr_secret_name(&seed);
    assert!(seed.get("Secret", Some(NS), &name).is_some());
}

#[tokio::test]
async fn api_server_outage_is_ridden_out() {
    let seed = ApiServer::start().await;
    let _running = Running::start(&seed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    seed.set_unavailable(true);
    // gardenlet (with its own way in) creates the objects while the controller is cut off.
    let mut cluster = json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Cluster", "metadata": {"name": NS}});
    cluster["spec"] = json!({"shoot": shoot(false)});
    seed.apply(cluster);
    seed.apply(json!({
        "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": SHOOT, "namespace": NS, "generation": 1,
                     "annotations": {ANNOTATION_OPERATION: "reconcile", ANNOTATION_TIMESTAMP: now_stamp()}},
        "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13"},
    }));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(stored_network(&seed).unwrap().get("status").is_none());
    seed.set_unavailable(false);
    eventually_within("Succeeded after the outage", Duration::from_secs(60), || {
        std::future::ready(stored_network(&seed).filter(|n| n["status"]["lastOperation"]["state"] == "Succeeded"))
    })
    .await;
    assert!(mr(&seed).is_some());
}

static DIRS: AtomicUsize = AtomicUsize::new(0);

fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gardenet-ext-{what}-{}-{}", std::process::id(), DIRS.fetch_add(1, SeqCst)));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn service_routing_ready_names_the_nodes_that_are_not() {
    let seed = ApiServer::start().await;
    let shoot_api = ApiServer::start().await;
    let fresh = now_stamp();
    for (name, ready, message) in [("node-a", "True", "ok"), ("node-b", "False", "syncing Services")] {
        shoot_api.apply(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"conditions": [{"type": NODE_CONDITION_AGENT_READY, "status": ready, "reason": "AgentNotReady", "message": message,
                                       "lastHeartbeatTime": fresh, "lastTransitionTime": fresh}]},
        }));
    }
    // gardenlet's in-cluster kubeconfig for the shoot (here pointing at the shoot double).
    let dir = temp_dir("shoot");
    let kubeconfig = std::fs::read_to_string(shoot_api.kubeconfig(&dir)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let secrets: Api<Secret> = Api::namespaced(client(&seed), NS);
    let mut internal = Secret::default();
    internal.metadata.name = Some(SECRET_GARDENER_INTERNAL.into());
    internal.data = Some([("kubeconfig".to_owned(), ByteString(kubeconfig.into_bytes()))].into());
    secrets.create(&PostParams::default(), &internal).await.unwrap();
    create_like_gardenlet(&seed, false, None).await;
    let _running = Running::start(&seed);
    until_operation(&seed, "Create", "Succeeded").await;

    let cond = eventually("ServiceRoutingReady", || {
        let n = stored_network(&seed)?;
        n["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "ServiceRoutingReady").cloned()
    })
    .await;
    assert_eq!(cond["status"], "False", "{cond}");
    let message = cond["message"].as_str().unwrap();
    assert!(message.contains("node-b (syncing Services)") && !message.contains("node-a"), "{message}");
    let lists = shoot_api.requests().iter().filter(|r| r.path == "/api/v1/nodes").count();
    assert!(lists >= 1);
}

mod webhook {
    use super::*;
    use gardenet_extension::admission;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Webhook {
        addr: std::net::SocketAddr,
        ca: rustls::pki_types::CertificateDer<'static>,
        task: JoinHandle<()>,
    }

    impl Drop for Webhook {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// A fresh self-signed certificate for localhost, written to `dir`; returns it (DER).
    fn write_cert(dir: &std::path::Path) -> rustls::pki_types::CertificateDer<'static> {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        // Key first, then certificate: a reload in between sees a mismatched pair and keeps the old one.
        std::fs::write(dir.join("tls.key"), cert.key_pair.serialize_pem()).unwrap();
        std::fs::write(dir.join("tls.crt"), cert.cert.pem()).unwrap();
        cert.cert.der().clone()
    }

    async fn start(dir: &std::path::Path) -> Webhook {
        let ca = write_cert(dir);
        let acceptor = admission::tls_acceptor(&dir.join("tls.crt"), &dir.join("tls.key"), Duration::ZERO).expect("certificates from files");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(admission::serve(listener, acceptor));
        Webhook { addr, ca, task }
    }

    /// One HTTPS request; returns the status code and the body.
    async fn post(hook: &Webhook, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        post_trusting(hook, &hook.ca, path, body).await.expect("TLS handshake")
    }

    /// One HTTPS request trusting `ca`; `None` if the handshake fails.
    async fn post_trusting(hook: &Webhook, ca: &rustls::pki_types::CertificateDer<'static>, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(hook.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut tls = connector.connect(name, tcp).await.ok()?;
        let head =
            format!("POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        tls.write_all(head.as_bytes()).await.unwrap();
        tls.write_all(body).await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(PATIENCE, tls.read_to_end(&mut response)).await.expect("answer").ok();
        let text = String::from_utf8_lossy(&response).into_owned();
        let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.as_bytes().to_vec()).unwrap_or_default();
        Some((code, body))
    }

    fn review(shoot: Value) -> Vec<u8> {
        json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "3f1e", "kind": {"group": "core.gardener.cloud", "version": "v1beta1", "kind": "Shoot"},
                        "operation": "UPDATE", "object": shoot},
        })
        .to_string()
        .into_bytes()
    }

    fn answer(body: &[u8]) -> Value {
        serde_json::from_slice::<Value>(body).expect("JSON answer")["response"].clone()
    }

    #[tokio::test]
    async fn admission_reviews_over_https() {
        let dir = temp_dir("webhook");
        let hook = start(&dir).await;
        let path = admission::VALIDATE_PATH;

        let (code, body) = post(&hook, path, &review(shoot(false))).await;
        assert_eq!(code, 200);
        let r = answer(&body);
        assert_eq!((r["uid"].clone(), r["allowed"].clone()), (json!("3f1e"), json!(true)), "{r}");

        let mut bad = shoot(false);
        bad["spec"]["networking"]["providerConfig"] = provider_config(json!({"socketLB": {"enabled": false}, "interfaces": {"include": []}}));
        let r = answer(&post(&hook, path, &review(bad)).await.1);
        assert_eq!(r["allowed"], false);
        assert!(r["status"]["message"].as_str().unwrap().contains("socketLB.enabled is false"), "{r}");

        let mut typo = shoot(true);
        typo["spec"]["networking"]["providerConfig"] = provider_config(json!({"mapSizes": {"conntrak": 1}}));
        let r = answer(&post(&hook, path, &review(typo)).await.1);
        assert_eq!(r["allowed"], false);
        assert!(r["status"]["message"].as_str().unwrap().starts_with("spec.networking.providerConfig.mapSizes.conntrak"), "{r}");

        for garbage in [&b"\x00\x01garbage"[..], b"{\"kind\":\"AdmissionReview\",\"request\":42}", b""] {
            let (code, body) = post(&hook, path, garbage).await;
            assert_eq!(code, 200);
            let r = answer(&body);
            assert_eq!(r["allowed"], false, "{r}");
            assert_eq!(r["status"]["code"], 400);
        }
        // Not TLS at all: the connection is dropped, the server carries on.
        let mut plain = tokio::net::TcpStream::connect(hook.addr).await.unwrap();
        plain.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(PATIENCE, plain.read_to_end(&mut sink)).await;
        assert_eq!(post(&hook, "/nowhere", b"{}").await.0, 404);
        let (code, body) = post(&hook, path, &review(shoot(true))).await;
        assert_eq!((code, answer(&body)["allowed"].clone()), (200, json!(true)));

        // The certificate rotates on disk: new connections get the new one.
        let old_ca = hook.ca.clone();
        tokio::time::sleep(Duration::from_millis(20)).await; // a different modification time
        let new_ca = write_cert(&dir);
        let body = review(shoot(true));
        let (code, _) = eventually_within("rotated certificate served", PATIENCE, || post_trusting(&hook, &new_ca, path, &body)).await;
        assert_eq!(code, 200);
        assert!(post_trusting(&hook, &old_ca, path, &body).await.is_none(), "old certificate still served");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
