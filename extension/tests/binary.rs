//! The `gardenet-extension` binary as deployed: `run` against the API server double (leader
//! election, controller, `/readyz` and `/metrics`), killed at the end.
use std::process::Stdio;
use std::time::Duration;

use gardenet_tests::apiserver::ApiServer;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PATIENCE: Duration = Duration::from_secs(30);

/// A free loopback port (bound and released; good enough on a test machine).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    tcp.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await.ok()?.ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1)?.parse().ok()?;
    Some((code, text))
}

#[tokio::test]
async fn run_reconciles_as_the_elected_leader() {
    let seed = ApiServer::start().await;
    let dir = std::env::temp_dir().join(format!("gardenet-ext-binary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = seed.kubeconfig(&dir);
    let port = free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_gardenet-extension"))
        .args(["run", "--agent-image", "gardenet-agent:smoke", "--identity", "smoke-1", "--leader-election-namespace", "garden"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--health-addr")
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start gardenet-extension");

    seed.apply(json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Cluster", "metadata": {"name": "shoot--a--b"},
        "spec": {"shoot": {"metadata": {"name": "b"}, "spec": {"kubernetes": {"kubeProxy": {"enabled": true}}}}}}));
    seed.apply(json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
        "metadata": {"name": "b", "namespace": "shoot--a--b", "generation": 1, "annotations": {"gardener.cloud/operation": "reconcile"}},
        "spec": {"type": "gardenet", "podCIDR": "100.96.0.0/11", "serviceCIDR": "100.64.0.0/13"}}));

    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let n = seed.get("Network", Some("shoot--a--b"), "b").unwrap();
        if n["status"]["lastOperation"]["state"] == "Succeeded" {
            assert_eq!(n["status"]["providerStatus"]["mode"], "passive");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not reconciled: {n}");
        assert!(child.try_wait().unwrap().is_none(), "gardenet-extension exited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lease = seed.get("Lease", Some("garden"), "gardenet-extension-leader-election").expect("election Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "smoke-1");
    assert_eq!(http_get(port, "/readyz").await.map(|r| r.0), Some(200));
    let (code, metrics) = http_get(port, "/metrics").await.expect("metrics");
    assert_eq!(code, 200);
    assert!(metrics.contains("gardenet_extension_reconciles_total{operation=\"create\"} 1"), "{metrics}");
    // SIGTERM, as Kubernetes stops a pod: the controller stops and gives the Lease up.
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(PATIENCE, child.wait()).await.expect("exits on SIGTERM").unwrap();
    assert!(exit.success(), "{exit:?}");
    let lease = seed.get("Lease", Some("garden"), "gardenet-extension-leader-election").unwrap();
    assert!(lease["spec"]["holderIdentity"].is_null(), "Lease not released: {lease}");
    std::fs::remove_dir_all(&dir).unwrap();
}
