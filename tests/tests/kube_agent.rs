//! The whole agent on the Kubernetes path: `gardenet-agent run --source kube` against the API
//! server double (real list/watch over HTTP), carrying real traffic in the namespace lab, and
//! telling the cluster about a Service it cannot program. Needs root.
//!
//! The agent runs in the test's own network namespace so it can reach the double on
//! 127.0.0.1; interface selection is pinned to nothing (`--interface-include '^$'`) so no
//! program touches this machine's interfaces, and socket LB attaches only to the lab's cgroup.
use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use gardenet_tests::{
    apiserver::ApiServer,
    lab::{backend_ip, counts, Lab, SERVER_PORT},
    netns::{sibling_binary, Proc},
};
use serde_json::json;

fn service(name: &str, vip: &str, port: i64) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "lab"},
           "spec": {"clusterIP": vip, "clusterIPs": [vip], "ports": [{"name": "p-tcp", "port": port, "targetPort": SERVER_PORT, "protocol": "TCP"}]}})
}

fn slice(svc: &str, backends: &[usize]) -> serde_json::Value {
    let eps: Vec<_> = backends.iter().map(|i| json!({"addresses": [backend_ip(*i)], "conditions": {"ready": true}})).collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{svc}-1"), "namespace": "lab", "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4", "ports": [{"name": "p-tcp", "port": SERVER_PORT, "protocol": "TCP"}], "endpoints": eps})
}

/// This lab's Node as the API server holds it.
fn lab_node() -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "lab-node"},
           "status": {"addresses": [{"type": "InternalIP", "address": "198.18.2.1"}]}})
}

/// The test's scratch: a directory with a kubeconfig for the API server double in it, and the
/// agent's bpffs directory. Both go when the test ends, also on failure (the pins would keep
/// the programs' links alive).
struct Scratch {
    dir: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
    bpffs: std::path::PathBuf,
}

impl Scratch {
    fn new(lab: &Lab, api: &ApiServer, suffix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-kube", lab.tag));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = api.kubeconfig(&dir);
        Scratch { dir, kubeconfig, bpffs: std::path::PathBuf::from("/sys/fs/bpf").join(format!("{}{suffix}", lab.tag)) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.bpffs);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `gardenet-agent run --source kube` against the scratch's kubeconfig, pinning in its bpffs,
/// socket LB on the lab's cgroup, no interface selected; `extra` flags are appended. Returns the process and its log lines.
fn spawn_agent(lab: &Lab, scratch: &Scratch, extra: &[&str]) -> (Proc, mpsc::Receiver<String>) {
    let mut cmd = Command::new(sibling_binary("gardenet-agent").unwrap());
    cmd.args(["run", "--source", "kube", "--node-name", "lab-node", "--pod-network=off"])
        .arg("--kubeconfig")
        .arg(&scratch.kubeconfig)
        .arg(format!("--bpffs={}", scratch.bpffs.display()))
        .arg(format!("--cgroup={}", lab.cgroup.path.display()))
        .arg(format!("--state-dir={}", scratch.dir.join("state").display()))
        .args(["--interface-include", "^$", "--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    if !extra.contains(&"--proxy-healthz-addr") {
        cmd.args(["--proxy-healthz-addr", "127.0.0.1:0"]);
    }
    let mut agent = Proc::spawn(cmd, "gardenet-agent (kube)").unwrap();
    let stderr = agent.child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("    agent| {l}");
            let _ = tx.send(l);
        }
    });
    (agent, rx)
}

/// Log lines up to and including the first that contains `needle` (90 s at most: a bound for
/// a hung agent, generous for the kernel matrix's emulated VMs on a busy machine).
fn wait_for(rx: &mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !log.iter().any(|l: &String| l.contains(needle)) {
        log.push(rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap_or_else(|_| panic!("no {needle:?} in:\n{}", log.join("\n"))));
    }
    log
}

/// The first Event the agent posted that `matches`, waiting up to 10 s for it.
async fn posted_event(api: &ApiServer, matches: impl Fn(&serde_json::Value) -> bool) -> Option<serde_json::Value> {
    for _ in 0..100 {
        let found = api.requests().into_iter().filter(|r| r.method == "POST" && r.path.contains("events")).find_map(|r| r.body.filter(|b| matches(b)));
        if found.is_some() {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The status line of `GET /healthz` on 127.0.0.1:`port`, polled until something answers
/// (40 s at most: the agent tries a taken port again after pauses doubling up to 30 s).
async fn healthz_status(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for _ in 0..400 {
        if let Ok(mut c) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.ok()?;
            let mut out = String::new();
            tokio::time::timeout(Duration::from_secs(5), c.read_to_string(&mut out)).await.ok()?.ok()?;
            return out.lines().next().map(str::to_owned);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_the_api_server_and_reports_bad_services() {
    let lab = Lab::new(3).unwrap();
    let api = ApiServer::start().await;
    let scratch = Scratch::new(&lab, &api, "k");
    api.apply(service("web", "198.19.0.10", 80));
    api.apply(slice("web", &[0, 1, 2]));
    // Two Services claiming one frontend: the second cannot be programmed.
    api.apply(service("zz-clash", "198.19.0.10", 80));
    // A slice whose Service does not exist.
    api.apply(slice("ghost", &[1]));
    api.apply(lab_node());
    // kube-proxy still holds its health check port and a Service's healthCheckNodePort (a
    // node moving from kube-proxy to gardenet): each is a Warning Event as kube-proxy raises
    // it, and each is served once free.
    let proxy_holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = proxy_holder.local_addr().unwrap().port();
    let hc_holder = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let hc_port = hc_holder.local_addr().unwrap().port();
    let mut local = service("local", "198.19.0.11", 80);
    local["spec"]["type"] = json!("LoadBalancer");
    local["spec"]["externalTrafficPolicy"] = json!("Local");
    local["spec"]["healthCheckNodePort"] = json!(hc_port);
    api.apply(local);
    let mut local_slice = slice("local", &[0]);
    local_slice["endpoints"][0]["nodeName"] = json!("lab-node");
    api.apply(local_slice);

    let proxy_addr = format!("127.0.0.1:{proxy_port}");
    let (mut agent, rx) = spawn_agent(
        &lab,
        &scratch,
        &["--reset", "--detach-on-exit", "--kube-proxy-enabled", "false", "--xdp-mode", "off", "--proxy-healthz-addr", &proxy_addr],
    );
    wait_for(&rx, "ready:");

    let to = "198.19.0.10:80";
    let v = tokio::task::block_in_place(|| lab.client_json(true, &["tcp", "--to", to, "--count", "150"])).unwrap();
    assert_eq!(counts(&v).len(), 3, "{v}");

    // A watch event removes be2: new connections stop reaching it.
    api.apply(slice("web", &[0, 2]));
    let mut ok = false;
    for _ in 0..50 {
        let v = tokio::task::block_in_place(|| lab.client_json(true, &["tcp", "--to", to, "--count", "60"])).unwrap();
        if counts(&v).iter().all(|(n, _)| n != "be2") {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the watch update reached the datapath");

    // The clash is reported as an Event on the Service that lost.
    let body = posted_event(&api, |b| b.to_string().contains("zz-clash")).await.expect("an Event for the Service that could not be programmed");
    assert_eq!(body["reason"], "ServiceNotProgrammed", "{body}");
    assert!(body["note"].as_str().unwrap().contains("already used by service lab/web"), "{body}");
    // The slice without a Service is reported on the EndpointSlice (after a grace period:
    // a slice may arrive before its Service).
    let body = posted_event(&api, |b| b["regarding"]["kind"] == "EndpointSlice").await.expect("an Event for the slice without a Service");
    assert_eq!(body["regarding"]["name"], "ghost-1", "{body}");
    assert!(body["note"].as_str().unwrap().contains("Service lab/ghost, which does not exist"), "{body}");

    let body = posted_event(&api, |b| b["reason"] == "FailedToStartServiceHealthcheck").await.expect("an Event for the healthCheckNodePort that is taken");
    assert_eq!((&body["regarding"]["kind"], &body["regarding"]["name"], &body["type"]), (&json!("Service"), &json!("local"), &json!("Warning")), "{body}");
    let note = body["note"].as_str().unwrap();
    assert!(note.starts_with(&format!("node lab-node failed to start healthcheck \"lab/local\" on port {hc_port}: ")), "{body}");
    let body =
        posted_event(&api, |b| b["reason"] == "FailedToStartProxierHealthcheck").await.expect("an Event for kube-proxy's health check port that is taken");
    assert_eq!((&body["regarding"]["kind"], &body["regarding"]["name"]), (&json!("Node"), &json!("lab-node")), "{body}");
    assert!(body["note"].as_str().unwrap().contains(&proxy_addr), "{body}");
    drop((proxy_holder, hc_holder));
    let status = healthz_status(hc_port).await;
    assert_eq!(status.as_deref(), Some("HTTP/1.1 200 OK"), "the healthCheckNodePort (one local endpoint) once free");
    let status = healthz_status(proxy_port).await;
    assert_eq!(status.as_deref(), Some("HTTP/1.1 200 OK"), "kube-proxy's health check once free");
    agent.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_reads_its_network_config_from_the_network_object() {
    let lab = Lab::new(1).unwrap();
    let api = ApiServer::start().await;
    let scratch = Scratch::new(&lab, &api, "n");
    api.apply(json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": "net", "namespace": "shoot--lab", "generation": 1},
        "spec": {"type": "gardenet", "podCIDR": "100.64.0.0/12", "serviceCIDR": "198.19.0.0/16", "ipFamilies": ["IPv4"],
                 "providerConfig": {"apiVersion": "gardenet.networking.extensions.gardener.cloud/v1alpha1", "kind": "NetworkConfig",
                                    "socketLB": {"enabled": false}, "xdp": {"mode": "off"}}}}));
    let (mut agent, rx) = spawn_agent(&lab, &scratch, &["--reset", "--detach-on-exit", "--network", "shoot--lab/net", "--kube-proxy-enabled", "false"]);
    let log = wait_for(&rx, "ready:");
    agent.terminate();
    let log = log.join("\n");
    assert!(log.contains("NetworkConfig read from Network shoot--lab/net"), "{log}");
    assert!(!log.contains("socket LB attached"), "providerConfig socketLB.enabled=false must be honoured:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_stays_passive_while_kube_proxy_routes_services() {
    let lab = Lab::new(1).unwrap();
    let api = ApiServer::start().await;
    let scratch = Scratch::new(&lab, &api, "p");
    api.apply(service("web", "198.19.0.10", 80));
    let (mut agent, rx) = spawn_agent(&lab, &scratch, &["--kube-proxy-enabled", "true"]);
    wait_for(&rx, "stays passive");
    std::thread::sleep(Duration::from_millis(500));
    assert!(lab.cgroup.programs(gardenet_agent::links::pinned::AttachType::Connect4).unwrap().is_empty(), "nothing attached while kube-proxy routes");
    assert!(!scratch.bpffs.exists(), "nothing loaded or pinned");
    agent.terminate();
}

/// Issue 14: a restarted agent whose API server is unreachable deletes nothing and keeps
/// serving what the pinned maps hold until its watches have synced; then it catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_while_the_api_server_is_unreachable_loses_nothing() {
    let lab = Lab::new(3).unwrap();
    let api = ApiServer::start().await;
    let scratch = Scratch::new(&lab, &api, "k");
    api.apply(service("web", "198.19.0.10", 80));
    api.apply(slice("web", &[0, 1, 2]));
    api.apply(lab_node());
    let flags = ["--kube-proxy-enabled", "false", "--xdp-mode", "off"];
    let (mut agent, rx) = spawn_agent(&lab, &scratch, &[&["--reset"][..], &flags[..]].concat());
    wait_for(&rx, "ready:");
    let to = "198.19.0.10:80";
    let v = tokio::task::block_in_place(|| lab.client_json(true, &["tcp", "--to", to, "--count", "60"])).unwrap();
    assert_eq!(counts(&v).len(), 3, "{v}");

    // The API server goes away, the agent restarts (as in an upgrade: pins and links stay),
    // and while it cannot list, be2 leaves the Service.
    api.set_unavailable(true);
    agent.terminate();
    api.apply(slice("web", &[0, 2]));
    let (mut agent, rx) = spawn_agent(&lab, &scratch, &flags);
    let t0 = Instant::now();
    let (mut failed, mut rounds) = (0u64, 0u32);
    let mut served: std::collections::BTreeMap<String, u64> = Default::default();
    while t0.elapsed() < Duration::from_secs(10) {
        let v = tokio::task::block_in_place(|| lab.client_json(true, &["tcp", "--to", to, "--count", "20", "--timeout-ms", "1000"])).unwrap();
        for (n, c) in counts(&v) {
            *served.entry(n).or_default() += c;
        }
        failed += v["errors"].as_object().map_or(0, |e| e.values().filter_map(|n| n.as_u64()).sum());
        rounds += 1;
    }
    eprintln!("API server unreachable for 10 s after the restart: served {served:?}, {failed} failed, {rounds} rounds");
    assert_eq!(failed, 0);
    // Nothing was deleted or changed before the sync: be2 still gets its share.
    assert_eq!(served.len(), 3, "the restarted agent keeps what the pins hold until it has synced: {served:?}");

    // The API server returns: the agent syncs and be2 stops getting new connections.
    api.set_unavailable(false);
    wait_for(&rx, "ready:");
    let mut gone = false;
    for _ in 0..50 {
        let v = tokio::task::block_in_place(|| lab.client_json(true, &["tcp", "--to", to, "--count", "60"])).unwrap();
        if counts(&v).iter().all(|(n, _)| n != "be2") && counts(&v).len() == 2 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "after the sync the change made while the agent was blind is programmed");
    agent.terminate();
    // Detach what the agents left attached (no --detach-on-exit above: pins had to survive).
    let (mut cleanup, rx) = spawn_agent(&lab, &scratch, &[&["--detach-on-exit"][..], &flags[..]].concat());
    wait_for(&rx, "ready:");
    cleanup.terminate();
}
