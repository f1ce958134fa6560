//! Status reporting (`gardenet_agent::report`) against the API server double: the Node
//! condition each agent writes, the Lease election, and the Network status the leader writes.
use std::{
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc,
    },
    time::{Duration, Instant},
};

use gardenet_agent::{
    gardener::{
        aggregate::{NODE_CONDITION_AGENT_READY, NODE_CONDITION_MAP_PRESSURE},
        network::Network,
        PROVIDER_API_VERSION,
    },
    report::health::AgentState,
    report::{
        network::Outcome, node::Report, shutdown_channel, Elector, Leadership, LeaseTiming, NetworkRef, NetworkReporter, NetworkReporterConfig, NodeReporter,
        NodeReporterConfig,
    },
};
use gardenet_tests::apiserver::ApiServer;
use kube::{Api, Client, Config};
use serde_json::{json, Value};
use tokio::time::timeout;

/// Upper bound for anything that should happen promptly.
const PATIENCE: Duration = Duration::from_secs(10);
const NETWORK_NS: &str = "shoot--core--test";
const NETWORK_NAME: &str = "test";
const NETWORK_STATUS_PATH: &str = "/apis/extensions.gardener.cloud/v1alpha1/namespaces/shoot--core--test/networks/test/status";

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    timeout(PATIENCE, f).await.unwrap_or_else(|_| panic!("{what}: timed out"))
}

fn client(server: &ApiServer) -> Client {
    Client::try_from(Config::new(server.url().parse().expect("double URL"))).expect("client")
}

fn node(name: &str, unschedulable: bool, conditions: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name},
        "spec": {"unschedulable": unschedulable},
        "status": {"conditions": conditions},
    })
}

fn network(status: Option<Value>) -> Value {
    let mut n = json!({
        "apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": NETWORK_NAME, "namespace": NETWORK_NS, "generation": 2},
        "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13"},
    });
    if let Some(s) = status {
        n["status"] = s;
    }
    n
}

/// An agent state as the run loop leaves it once everything is programmed.
fn ready_state() -> Arc<AgentState> {
    let state = AgentState::default();
    state.set_programs_loaded(true);
    state.set_interface("eth0", true, None);
    state.set_synced(true);
    Arc::new(state)
}

/// Writes `node`'s condition from `state` once, as its agent would.
async fn report_node(server: &ApiServer, node: &str, state: Arc<AgentState>) {
    let reporter = NodeReporter::new(client(server), node, state, NodeReporterConfig::default()).expect("reporter");
    let report = within("node report", reporter.report(true, false)).await.expect("node report");
    assert_eq!(report, Report::Written);
}

/// Leadership won for real through the Lease in `server`.
async fn lead(server: &ApiServer) -> Leadership {
    let mut elector = Elector::gardenet(client(server), "agent-a", LeaseTiming::default()).expect("elector");
    assert!(within("election", elector.try_acquire_or_renew()).await.expect("election"));
    elector.leadership()
}

fn reporter(nodes: &ApiServer, networks: &ApiServer, leadership: Leadership, kube_proxy_enabled: bool) -> NetworkReporter {
    let config = NetworkReporterConfig { kube_proxy_enabled, ..Default::default() };
    let network = NetworkRef { namespace: NETWORK_NS.into(), name: NETWORK_NAME.into() };
    NetworkReporter::new(client(nodes), client(networks), &network, leadership, config)
}

/// Replaces every timestamp with `"T"` (after checking it is one), so statuses compare exactly.
fn without_times(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(map) => {
                for (k, v) in map.iter_mut() {
                    if k.ends_with("Time") && v.is_string() {
                        let t = v.as_str().unwrap_or_default();
                        assert!(t.parse::<k8s_openapi::jiff::Timestamp>().is_ok(), "{k}: {t:?} is not a time");
                        *v = "T".into();
                    } else {
                        walk(v);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

fn stored_network_status(server: &ApiServer) -> Value {
    server.get("Network", Some(NETWORK_NS), NETWORK_NAME).expect("network")["status"].clone()
}

fn patches_to(server: &ApiServer, path: &str) -> Vec<gardenet_tests::apiserver::RecordedRequest> {
    server.requests().into_iter().filter(|r| r.method == "PATCH" && r.path == path).collect()
}

#[tokio::test]
async fn all_ready_with_the_network_in_another_cluster() {
    let shoot = ApiServer::start().await;
    let seed = ApiServer::start().await;
    shoot.apply(node("n1", false, json!([])));
    shoot.apply(node("n2", false, json!([])));
    seed.apply(network(None));
    report_node(&shoot, "n1", ready_state()).await;
    report_node(&shoot, "n2", ready_state()).await;

    let reporter = reporter(&shoot, &seed, lead(&shoot).await, false);
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Written);
    let message = "gardenet agents ready on all 2 schedulable nodes";
    assert_eq!(
        without_times(stored_network_status(&seed)),
        json!({
            "conditions": [{
                "type": "ServiceRoutingReady", "status": "True", "reason": "AgentReady", "message": message,
                "lastTransitionTime": "T", "lastUpdateTime": "T",
            }],
            "lastOperation": {
                "description": format!("Service routing reconciled: {message}"),
                "lastUpdateTime": "T", "progress": 100, "state": "Succeeded", "type": "Reconcile",
            },
            "observedGeneration": 2,
            "ipFamilies": ["IPv4"],
            "providerStatus": {
                "apiVersion": PROVIDER_API_VERSION, "kind": "NetworkStatus",
                "mode": "replacement", "readyNodes": 2, "totalNodes": 2,
            },
        })
    );
    let patches = patches_to(&seed, NETWORK_STATUS_PATH);
    assert_eq!(patches.len(), 1);
    assert_eq!(patches[0].content_type.as_deref(), Some("application/merge-patch+json"));
    // The precondition: the resourceVersion the status was computed from.
    assert!(patches[0].body.as_ref().unwrap()["metadata"]["resourceVersion"].is_string());

    // Nothing changed: nothing is written.
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Unchanged);
    assert_eq!(patches_to(&seed, NETWORK_STATUS_PATH).len(), 1);
    // The Lease lives in the shoot, next to the Nodes.
    assert!(shoot.get("Lease", Some("kube-system"), "gardenet-agent").is_some());
}

#[tokio::test]
async fn some_nodes_not_ready() {
    let server = ApiServer::start().await;
    for (name, cordoned) in [("n1", false), ("n2", false), ("n3", false), ("n4", true)] {
        server.apply(node(name, cordoned, json!([])));
    }
    server.apply(network(None));
    report_node(&server, "n1", ready_state()).await;
    let syncing = ready_state();
    syncing.update(|r| r.synced = false);
    report_node(&server, "n2", syncing).await;
    // n3: no agent; n4: cordoned, not counted.

    let reporter = reporter(&server, &server, lead(&server).await, false);
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Written);
    let message = "2 of 3 schedulable nodes not ready: \
                   n2 (first full sync of Services and EndpointSlices is not programmed yet), n3 (no gardenet agent)";
    assert_eq!(
        without_times(stored_network_status(&server)),
        json!({
            "conditions": [{
                "type": "ServiceRoutingReady", "status": "False", "reason": "AgentNotReady", "message": message,
                "lastTransitionTime": "T", "lastUpdateTime": "T",
            }],
            "lastOperation": {
                "description": format!("Waiting for gardenet agents: {message}"),
                "lastUpdateTime": "T", "progress": 33, "state": "Processing", "type": "Reconcile",
            },
            "observedGeneration": 2,
            "ipFamilies": ["IPv4"],
            "providerStatus": {
                "apiVersion": PROVIDER_API_VERSION, "kind": "NetworkStatus",
                "mode": "replacement", "readyNodes": 1, "totalNodes": 3,
            },
        })
    );
}

#[tokio::test]
async fn kube_proxy_disabled_but_routing_impossible() {
    let server = ApiServer::start().await;
    server.apply(node("n1", false, json!([])));
    server.apply(node("n2", false, json!([])));
    server.apply(network(None));
    report_node(&server, "n1", ready_state()).await;
    let incapable = AgentState::default();
    incapable.set_missing(vec!["bpf() is not permitted (EPERM)".into()]);
    report_node(&server, "n2", Arc::new(incapable)).await;
    let n2 = server.get("Node", None, "n2").unwrap();
    assert_eq!(n2["status"]["conditions"][0]["reason"], "DataplaneUnavailable");

    let reporter = reporter(&server, &server, lead(&server).await, false);
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Written);
    let message = "kube-proxy is disabled, so gardenet must route Services, but cannot: node n2: bpf() is not permitted (EPERM)";
    assert_eq!(
        without_times(stored_network_status(&server)),
        json!({
            "conditions": [{
                "type": "ServiceRoutingReady", "status": "False", "reason": "DataplaneUnavailable",
                "message": message, "codes": ["ERR_CONFIGURATION_PROBLEM"],
                "lastTransitionTime": "T", "lastUpdateTime": "T",
            }],
            "lastError": {"description": message, "codes": ["ERR_CONFIGURATION_PROBLEM"], "lastUpdateTime": "T"},
            "lastOperation": {
                "description": message, "lastUpdateTime": "T", "progress": 50, "state": "Error", "type": "Reconcile",
            },
            "observedGeneration": 2,
            "ipFamilies": ["IPv4"],
            "providerStatus": {
                "apiVersion": PROVIDER_API_VERSION, "kind": "NetworkStatus",
                "mode": "replacement", "readyNodes": 1, "totalNodes": 2,
            },
        })
    );

    // Fixed: the error is cleared (lastError: null in the merge patch removes it).
    report_node(&server, "n2", ready_state()).await;
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Written);
    let status = stored_network_status(&server);
    assert!(status.get("lastError").is_none(), "{status}");
    assert_eq!(status["lastOperation"]["state"], "Succeeded");
}

fn foreign_condition(kind: &str) -> Value {
    json!({
        "type": kind, "status": "True", "lastTransitionTime": "2024-05-01T09:00:00Z", "lastUpdateTime": null,
        "reason": "Other", "message": "someone else's", "futureField": {"x": 1},
    })
}

#[tokio::test]
async fn network_status_write_keeps_other_writers_fields() {
    let server = ApiServer::start().await;
    server.apply(node("n1", false, json!([])));
    report_node(&server, "n1", ready_state()).await;
    let resources = json!([{"name": "r", "resourceRef": {"apiVersion": "v1", "kind": "Secret", "name": "s"}}]);
    server.apply(network(Some(json!({
        "conditions": [foreign_condition("HealthCheck")],
        "providerStatus": {"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkStatus", "foreignField": "kept"},
        "state": {"opaque": true},
        "resources": resources,
    }))));
    let leadership = lead(&server).await;
    let reporter = reporter(&server, &server, leadership, false);

    // A stale read loses against a concurrent writer instead of overwriting its condition.
    let networks: Api<Network> = Api::namespaced(client(&server), NETWORK_NS);
    let stale = within("get", networks.get(NETWORK_NAME)).await.unwrap();
    let mut current = server.get("Network", Some(NETWORK_NS), NETWORK_NAME).unwrap();
    current["status"]["conditions"].as_array_mut().unwrap().push(foreign_condition("Other"));
    server.apply(current);
    assert_eq!(within("write", reporter.write(&stale)).await.unwrap(), Outcome::Conflict);
    assert_eq!(stored_network_status(&server)["conditions"].as_array().unwrap().len(), 2);

    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Written);
    let status = stored_network_status(&server);
    let conditions = status["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 3, "{status}");
    assert_eq!(conditions[0], foreign_condition("HealthCheck"));
    assert_eq!(conditions[1], foreign_condition("Other"));
    assert_eq!(conditions[2]["type"], "ServiceRoutingReady");
    assert_eq!(conditions[2]["status"], "True");
    assert_eq!(status["state"], json!({"opaque": true}));
    assert_eq!(status["resources"], resources);
    assert_eq!(status["providerStatus"]["foreignField"], "kept");
    assert_eq!(status["providerStatus"]["readyNodes"], 1);

    // The foreign providerStatus field makes the typed statuses differ, but the merge
    // patch would change nothing: no write.
    let before = patches_to(&server, NETWORK_STATUS_PATH).len();
    assert_eq!(within("reconcile", reporter.reconcile()).await.unwrap(), Outcome::Unchanged);
    assert_eq!(patches_to(&server, NETWORK_STATUS_PATH).len(), before);
}

#[tokio::test]
async fn only_the_leader_writes_and_never_into_other_networks() {
    let server = ApiServer::start().await;
    server.apply(network(None));
    let follower = reporter(&server, &server, Leadership::default(), false);
    assert_eq!(within("reconcile", follower.reconcile()).await.unwrap(), Outcome::NotLeader);

    let mut calico = network(None);
    calico["spec"]["type"] = "calico".into();
    server.apply(calico);
    let leader = reporter(&server, &server, lead(&server).await, false);
    let err = within("reconcile", leader.reconcile()).await.unwrap_err();
    assert!(err.to_string().contains("calico"), "{err}");
    assert!(patches_to(&server, NETWORK_STATUS_PATH).is_empty());
}

#[tokio::test]
async fn node_condition_write_keeps_other_conditions() {
    let server = ApiServer::start().await;
    let kubelet = json!([
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
         "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"},
        {"type": "NetworkUnavailable", "status": "False", "reason": "RouteCreated", "message": "routes created",
         "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"},
    ]);
    server.apply(node("n1", false, kubelet.clone()));
    let state = ready_state();
    let reporter = NodeReporter::new(client(&server), "n1", state.clone(), NodeReporterConfig::default()).unwrap();
    let conditions = |server: &ApiServer| server.get("Node", None, "n1").unwrap()["status"]["conditions"].clone();

    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Written);
    let after = conditions(&server);
    assert_eq!(after.as_array().unwrap().len(), 3);
    assert_eq!(after[0], kubelet[0]);
    assert_eq!(after[1], kubelet[1]);
    assert_eq!(after[2]["type"], NODE_CONDITION_AGENT_READY);
    assert_eq!(after[2]["status"], "True");

    // Unchanged and no heartbeat due: no write.
    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Unchanged);

    // A change rewrites exactly our entry, guarded by a test of its type.
    state.set_interface("eth1", false, Some("no such device".into()));
    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Written);
    let after = conditions(&server);
    assert_eq!(after[0], kubelet[0]);
    assert_eq!(after[1], kubelet[1]);
    assert_eq!(after[2]["status"], "False");
    assert_eq!(after[2]["reason"], "AgentNotReady");
    assert_eq!(after[2]["message"], "interface eth1: not attached: no such device");
    let patch = server.requests().into_iter().rfind(|r| r.method == "PATCH").unwrap();
    assert_eq!(patch.path, "/api/v1/nodes/n1/status");
    assert_eq!(patch.content_type.as_deref(), Some("application/json-patch+json"));
    assert_eq!(patch.body.unwrap()[0], json!({"op": "test", "path": "/status/conditions/2/type", "value": NODE_CONDITION_AGENT_READY}));

    // The kubelet's list moved under us: our index is re-read, nothing of theirs is lost.
    let mut n = server.get("Node", None, "n1").unwrap();
    n["status"]["conditions"].as_array_mut().unwrap().remove(0);
    server.apply(n);
    state.remove_interface("eth1");
    assert_eq!(within("report", reporter.report(true, false)).await.unwrap(), Report::Written);
    let after = conditions(&server);
    assert_eq!(after.as_array().unwrap().len(), 2);
    assert_eq!(after[0], kubelet[1]);
    assert_eq!(after[1]["status"], "True");
    // A heartbeat without a status flip keeps the transition time.
    let mut n = server.get("Node", None, "n1").unwrap();
    n["status"]["conditions"][1]["lastTransitionTime"] = "2025-01-01T00:00:00Z".into();
    server.apply(n);
    assert_eq!(within("report", reporter.report(true, false)).await.unwrap(), Report::Written);
    let after = conditions(&server);
    assert_eq!(after[1]["lastTransitionTime"], "2025-01-01T00:00:00Z");
    assert_ne!(after[1]["lastHeartbeatTime"], "2025-01-01T00:00:00Z");

    // Shutting down leaves a not-ready condition behind.
    assert_eq!(within("report", reporter.report(true, true)).await.unwrap(), Report::Written);
    assert_eq!(conditions(&server)[1]["message"], "gardenet agent is shutting down");
}

/// A map at 90% puts `GardenetMapPressure=True` on the Node (next to, not instead of, the
/// readiness condition, which stays True); below again it turns False. A Node that never had
/// pressure gets no such condition.
#[tokio::test]
async fn map_pressure_condition_appears_under_pressure_and_clears() {
    let server = ApiServer::start().await;
    server.apply(node("n1", false, json!([])));
    let state = ready_state();
    let reporter = NodeReporter::new(client(&server), "n1", state.clone(), NodeReporterConfig::default()).unwrap();
    let conditions = |server: &ApiServer| server.get("Node", None, "n1").unwrap()["status"]["conditions"].clone();
    let find = |cs: &Value, kind: &str| cs.as_array().unwrap().iter().find(|c| c["type"] == kind).cloned();

    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Written);
    assert!(find(&conditions(&server), NODE_CONDITION_MAP_PRESSURE).is_none(), "no pressure, no condition: {}", conditions(&server));

    state.set_map_pressure(vec!["conntrack map 93% full (3809 of 4096 entries)".into()]);
    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Written);
    let cs = conditions(&server);
    let p = find(&cs, NODE_CONDITION_MAP_PRESSURE).expect("pressure condition");
    assert_eq!(p["status"], "True");
    assert_eq!(p["reason"], "MapPressure");
    assert!(p["message"].as_str().unwrap().starts_with("conntrack map 93% full (3809 of 4096 entries); raise"), "{p}");
    assert_eq!(find(&cs, NODE_CONDITION_AGENT_READY).unwrap()["status"], "True", "pressure is not unreadiness");
    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Unchanged);

    state.set_map_pressure(Vec::new());
    assert_eq!(within("report", reporter.report(false, false)).await.unwrap(), Report::Written);
    let p = find(&conditions(&server), NODE_CONDITION_MAP_PRESSURE).unwrap();
    assert_eq!(p["status"], "False");
    assert_eq!(p["reason"], "MapsHaveRoom");
    assert_eq!(conditions(&server).as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn node_reporter_runs_on_change_and_stops_cleanly() {
    let server = ApiServer::start().await;
    server.apply(node("n1", false, json!([])));
    let state = Arc::new(AgentState::default());
    let config = NodeReporterConfig { min_interval: Duration::from_millis(10), report_stopping: true, ..Default::default() };
    let reporter = NodeReporter::new(client(&server), "n1", state.clone(), config).unwrap();
    let (stop, shutdown) = shutdown_channel();
    let task = tokio::spawn(reporter.run(shutdown));
    let status_of = |server: &ApiServer| server.get("Node", None, "n1").unwrap()["status"]["conditions"][0]["status"].as_str().map(str::to_owned);
    let wait_for = |want: &'static str| {
        let server = &server;
        async move {
            while status_of(server).as_deref() != Some(want) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    within("first report", wait_for("False")).await;
    state.set_programs_loaded(true);
    state.set_synced(true);
    within("report on change", wait_for("True")).await;
    stop.send(true).unwrap();
    within("reporter stops", task).await.unwrap();
    let node = server.get("Node", None, "n1").unwrap();
    assert_eq!(node["status"]["conditions"][0]["message"], "gardenet agent is shutting down");
}

fn fast_timing(lease_ms: u64, deadline_ms: u64) -> LeaseTiming {
    LeaseTiming {
        lease_duration: Duration::from_millis(lease_ms),
        renew_deadline: Duration::from_millis(deadline_ms),
        retry_period: Duration::from_millis(100),
        request_timeout: Duration::from_millis(500),
    }
}

/// Samples both leaderships until dropped; `overlap` is set if both ever led at once.
fn watch_for_two_leaders(a: Leadership, b: Leadership) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    let overlap = Arc::new(AtomicBool::new(false));
    let flag = overlap.clone();
    let task = tokio::spawn(async move {
        loop {
            if a.is_leader() && b.is_leader() {
                flag.store(true, SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    (overlap, task)
}

async fn until_leader(l: &Leadership) {
    while !l.is_leader() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn lease(server: &ApiServer) -> Value {
    server.get("Lease", Some("kube-system"), "gardenet-agent").expect("lease")
}

#[tokio::test]
async fn lease_handover_after_expiry_never_two_leaders() {
    let server = ApiServer::start().await;
    let timing = fast_timing(2000, 1200);
    let a = Elector::gardenet(client(&server), "agent-a", timing).unwrap();
    let b = Elector::gardenet(client(&server), "agent-b", timing).unwrap();
    let (la, lb) = (a.leadership(), b.leadership());
    let (overlap, sampler) = watch_for_two_leaders(la.clone(), lb.clone());

    let (_stop_a, shutdown_a) = shutdown_channel();
    let task_a = tokio::spawn(a.run(shutdown_a));
    within("A leads", until_leader(&la)).await;
    let (stop_b, shutdown_b) = shutdown_channel();
    let task_b = tokio::spawn(b.run(shutdown_b));

    // A keeps renewing: B never takes over, however long it waits past the lease duration.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert!(la.is_leader() && !lb.is_leader());
    assert_eq!(lease(&server)["spec"]["holderIdentity"], "agent-a");

    // A hangs (stops renewing, releases nothing). B waits out the lease, then takes over.
    task_a.abort();
    let stopped_at = Instant::now();
    within("B takes over", until_leader(&lb)).await;
    let waited = stopped_at.elapsed();
    // A's last renewal was at most one retry period (plus a request) before it stopped.
    assert!(waited >= Duration::from_millis(2000 - 100 - 100), "took over after {waited:?}");
    assert!(!la.is_leader());
    let spec = lease(&server)["spec"].clone();
    assert_eq!(spec["holderIdentity"], "agent-b");
    assert_eq!(spec["leaseTransitions"], 1);
    assert_eq!(spec["leaseDurationSeconds"], 2);

    stop_b.send(true).unwrap();
    within("B stops", task_b).await.unwrap().unwrap();
    sampler.abort();
    assert!(!overlap.load(SeqCst), "two agents led at the same time");
    // B released on shutdown.
    assert!(lease(&server)["spec"].get("holderIdentity").is_none_or(Value::is_null));
}

#[tokio::test]
async fn released_lease_is_taken_over_without_waiting_for_expiry() {
    let server = ApiServer::start().await;
    let timing = fast_timing(5000, 3000);
    let a = Elector::gardenet(client(&server), "agent-a", timing).unwrap();
    let b = Elector::gardenet(client(&server), "agent-b", timing).unwrap();
    let (la, lb) = (a.leadership(), b.leadership());
    let (overlap, sampler) = watch_for_two_leaders(la.clone(), lb.clone());

    let (stop_a, shutdown_a) = shutdown_channel();
    let task_a = tokio::spawn(a.run(shutdown_a));
    within("A leads", until_leader(&la)).await;
    let (_stop_b, shutdown_b) = shutdown_channel();
    let task_b = tokio::spawn(b.run(shutdown_b));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!lb.is_leader());

    stop_a.send(true).unwrap();
    let released_at = Instant::now();
    within("A releases", task_a).await.unwrap().unwrap();
    assert!(!la.is_leader());
    within("B takes over", until_leader(&lb)).await;
    assert!(released_at.elapsed() < Duration::from_millis(3000), "{:?}", released_at.elapsed());
    task_b.abort();
    sampler.abort();
    assert!(!overlap.load(SeqCst), "two agents led at the same time");
    assert_eq!(lease(&server)["spec"]["holderIdentity"], "agent-b");
}

#[tokio::test]
async fn simultaneous_candidates_elect_exactly_one() {
    let server = ApiServer::start().await;
    let timing = fast_timing(2000, 1200);
    let mut a = Elector::gardenet(client(&server), "agent-a", timing).unwrap();
    let mut b = Elector::gardenet(client(&server), "agent-b", timing).unwrap();
    for _ in 0..5 {
        let (ra, rb) = within("round", async { tokio::join!(a.try_acquire_or_renew(), b.try_acquire_or_renew()) }).await;
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert!(ra ^ rb, "exactly one leads: a={ra} b={rb}");
    }
    let holder = lease(&server)["spec"]["holderIdentity"].as_str().map(str::to_owned).unwrap();
    let leader = if a.leadership().is_leader() { a.identity() } else { b.identity() };
    assert_eq!(holder, leader);
}
