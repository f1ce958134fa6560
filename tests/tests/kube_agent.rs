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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_the_api_server_and_reports_bad_services() {
    let lab = Lab::new(3).unwrap();
    let api = ApiServer::start().await;
    let dir = std::env::temp_dir().join(format!("{}-kube", lab.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir);
    api.apply(service("web", "198.19.0.10", 80));
    api.apply(slice("web", &[0, 1, 2]));
    // Two Services claiming one frontend: the second cannot be programmed.
    api.apply(service("zz-clash", "198.19.0.10", 80));
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "lab-node"},
                     "status": {"addresses": [{"type": "InternalIP", "address": "198.18.2.1"}]}}));

    let bpffs = std::path::PathBuf::from("/sys/fs/bpf").join(format!("{}k", lab.tag));
    let mut cmd = Command::new(sibling_binary("gardenet-agent").unwrap());
    cmd.args(["run", "--source", "kube", "--node-name", "lab-node", "--reset", "--detach-on-exit", "--kube-proxy-enabled", "false"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg(format!("--bpffs={}", bpffs.display()))
        .arg(format!("--cgroup={}", lab.cgroup.path.display()))
        .arg(format!("--state-dir={}", dir.join("state").display()))
        .args(["--interface-include", "^$", "--xdp-mode", "off"])
        .args(["--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    let mut agent = Proc::spawn(cmd, "gardenet-agent (kube)").unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = agent.child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("    agent| {l}");
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("agent ready");
        if l.contains("ready:") {
            break;
        }
    }

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
    let mut event = None;
    for _ in 0..50 {
        event = api.requests().into_iter().find(|r| {
            r.method == "POST" && r.path.contains("events") && r.body.as_ref().is_some_and(|b| b.to_string().contains("zz-clash"))
        });
        if event.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let event = event.expect("an Event for the Service that could not be programmed");
    let body = event.body.unwrap();
    assert_eq!(body["reason"], "ServiceNotProgrammed", "{body}");
    assert!(body["note"].as_str().unwrap().contains("already used by service lab/web"), "{body}");
    agent.terminate();
    let _ = std::fs::remove_dir_all(&bpffs);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_reads_its_network_config_from_the_network_object() {
    let lab = Lab::new(1).unwrap();
    let api = ApiServer::start().await;
    let dir = std::env::temp_dir().join(format!("{}-kube", lab.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir);
    api.apply(json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": "net", "namespace": "shoot--lab", "generation": 1},
        "spec": {"type": "gardenet", "podCIDR": "100.64.0.0/12", "serviceCIDR": "198.19.0.0/16", "ipFamilies": ["IPv4"],
                 "providerConfig": {"apiVersion": "gardenet.networking.extensions.gardener.cloud/v1alpha1", "kind": "NetworkConfig",
                                    "socketLB": {"enabled": false}, "xdp": {"mode": "off"}}}}));
    let bpffs = std::path::PathBuf::from("/sys/fs/bpf").join(format!("{}n", lab.tag));
    let mut cmd = Command::new(sibling_binary("gardenet-agent").unwrap());
    cmd.args(["run", "--source", "kube", "--node-name", "lab-node", "--reset", "--detach-on-exit", "--network", "shoot--lab/net", "--kube-proxy-enabled", "false"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg(format!("--bpffs={}", bpffs.display()))
        .arg(format!("--cgroup={}", lab.cgroup.path.display()))
        .arg(format!("--state-dir={}", dir.join("state").display()))
        .args(["--interface-include", "^$", "--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    let mut agent = Proc::spawn(cmd, "gardenet-agent (network config)").unwrap();
    let stderr = agent.child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("    agent| {l}");
            let _ = tx.send(l);
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log.iter().any(|l: &String| l.contains("ready:")) {
        log.push(rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("agent ready"));
    }
    agent.terminate();
    let log = log.join("\n");
    assert!(log.contains("NetworkConfig read from Network shoot--lab/net"), "{log}");
    assert!(!log.contains("socket LB attached"), "providerConfig socketLB.enabled=false must be honoured:\n{log}");
    let _ = std::fs::remove_dir_all(&bpffs);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_stays_passive_while_kube_proxy_routes_services() {
    let lab = Lab::new(1).unwrap();
    let api = ApiServer::start().await;
    let dir = std::env::temp_dir().join(format!("{}-kube", lab.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir);
    api.apply(service("web", "198.19.0.10", 80));
    let bpffs = std::path::PathBuf::from("/sys/fs/bpf").join(format!("{}p", lab.tag));
    let mut cmd = Command::new(sibling_binary("gardenet-agent").unwrap());
    cmd.args(["run", "--source", "kube", "--node-name", "lab-node", "--kube-proxy-enabled", "true", "--interface-include", "^$"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg(format!("--bpffs={}", bpffs.display()))
        .arg(format!("--cgroup={}", lab.cgroup.path.display()))
        .args(["--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    let mut agent = Proc::spawn(cmd, "gardenet-agent (passive)").unwrap();
    let stderr = agent.child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("    agent| {l}");
            let _ = tx.send(l);
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log.iter().any(|l: &String| l.contains("stays passive")) {
        log.push(rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("passive line"));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(lab.cgroup.programs(gardenet_agent::pinned_link::AttachType::Connect4).unwrap().is_empty(), "nothing attached while kube-proxy routes");
    assert!(!bpffs.exists(), "nothing loaded or pinned");
    agent.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}
