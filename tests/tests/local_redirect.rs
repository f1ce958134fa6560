//! Node-local DNS through a local redirect (NetworkConfig `localRedirects` / `nodeLocalDNS`,
//! here `--local-redirect`): a DNS cache on the node listens on 169.254.20.10; queries a pod
//! sends to the kube-dns ClusterIP reach it while it is there, and the Service's endpoints
//! while it is not (restarting, absent). Needs root; fails (does not skip) without it.
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gardenet_tests::{
    lab::{backend_ip, counts, Agent, AgentOpts, Lab, NODE_IP, SERVER_PORT},
    netns::Proc,
};
use serde_json::Value;

const CACHE_ADDR: &str = "169.254.20.10";
const DNS_VIP: &str = "198.19.0.53";

fn kube_dns() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: kube-dns, namespace: lab}}\nspec:\n  clusterIP: {DNS_VIP}\n  ports:\n  - {{name: dns, port: 53, targetPort: {SERVER_PORT}, protocol: UDP}}\n  - {{name: dns-tcp, port: 53, targetPort: {SERVER_PORT}, protocol: TCP}}\n"
    )
}

fn kube_dns_slice() -> String {
    let eps: Vec<String> = (0..2).map(|i| format!("- addresses: [{}]\n  conditions: {{ready: true}}", backend_ip(i))).collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: kube-dns-1, namespace: lab, labels: {{kubernetes.io/service-name: kube-dns}}}}\naddressType: IPv4\nports:\n- {{name: dns, port: {SERVER_PORT}, protocol: UDP}}\n- {{name: dns-tcp, port: {SERVER_PORT}, protocol: TCP}}\nendpoints:\n{}\n",
        eps.join("\n")
    )
}

fn start_cache(lab: &Lab) -> Proc {
    let mut cmd = lab.node.command(&lab.netkit, None).unwrap();
    cmd.args(["serve", "--name", "cache", "--port", "53", "--addr", CACHE_ADDR]);
    Proc::spawn(cmd, "node-local DNS cache").unwrap()
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()
}

/// Polls until `lb list` shows the UDP frontend going where `pred` wants.
fn wait_programmed(agent: &Agent, pred: impl Fn(&[String]) -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = agent.programmed(&format!("{DNS_VIP}:53/udp")).unwrap().unwrap_or_default();
        if pred(&got) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: programmed {got:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn dns_to_the_cluster_ip_goes_to_the_node_local_cache_while_it_is_there() {
    let lab = Lab::new(2).expect("lab");
    lab.node.ip(&["addr", "add", &format!("{CACHE_ADDR}/32"), "dev", "lo"]).unwrap();
    lab.client.ip(&["route", "add", &format!("{CACHE_ADDR}/32"), "via", NODE_IP]).unwrap();
    let mut cache = start_cache(&lab);
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, extra: vec!["--local-redirect".into(), format!("lab/kube-dns={CACHE_ADDR}")], ..Default::default() },
        &[("svc.yaml", kube_dns()), ("eps.yaml", kube_dns_slice())],
    )
    .expect("agent");
    let to_cache = |b: &[String]| b == [format!("{CACHE_ADDR}:53")];
    wait_programmed(&agent, to_cache, "cache up");

    // UDP and TCP from a pod (socket LB), and UDP on the TC path, all reach the cache.
    let query =
        |socket_lb: bool, proto: &str| lab.client_json(socket_lb, &[proto, "--to", &format!("{DNS_VIP}:53"), "--count", "10", "--timeout-ms", "1000"]).unwrap();
    for (socket_lb, proto) in [(true, "udp"), (true, "tcp"), (false, "udp")] {
        let v = query(socket_lb, proto);
        assert_eq!(counts(&v), [("cache".to_string(), 10)], "socket LB {socket_lb}, {proto}: {v}");
    }

    // The cache goes away (and comes back, as in a rolling update of its DaemonSet) while a
    // pod keeps resolving: every 10 ms a query from a fresh socket, as resolvers send them.
    let client = {
        let mut cmd = lab
            .client_cmd(
                true,
                &["udp", "--to", &format!("{DNS_VIP}:53"), "--count", "700", "--fresh-socket", "--timeout-ms", "150", "--interval-ms", "10", "--trace"],
            )
            .unwrap();
        cmd.stdout(std::process::Stdio::piped());
        cmd.spawn().unwrap()
    };
    std::thread::sleep(Duration::from_millis(800));
    let stopped = now_ms();
    cache.terminate();
    wait_programmed(&agent, |b| b.len() == 2, "cache gone: the Service's endpoints");
    let gone = now_ms();
    std::thread::sleep(Duration::from_millis(1000));
    let restarted = now_ms();
    let _cache = start_cache(&lab);
    wait_programmed(&agent, to_cache, "cache back");
    let back_programmed = now_ms();
    let out = client.wait_with_output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let trace: Vec<(u128, String)> =
        v["trace"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap() as u128, e[1].as_str().unwrap().to_owned())).collect();

    let first = |after: u128, pred: &dyn Fn(&str) -> bool| trace.iter().find(|(t, a)| *t >= after && pred(a)).map(|(t, _)| t - after);
    let to_endpoints = first(stopped, &|a| a.starts_with("be")).expect("queries reached the Service's endpoints after the cache stopped");
    let back = first(restarted, &|a| a == "cache").expect("queries reached the cache again");
    let lost: Vec<u128> = trace.iter().filter(|(_, a)| a == "-").map(|(t, _)| *t).collect();
    let lost_after_stop = lost.iter().filter(|t| **t >= stopped && **t < restarted).count();
    eprintln!(
        "local redirect: {} queries: {:?}; first endpoint answer {to_endpoints} ms after the cache stopped, first cache answer {back} ms after it restarted; lost {} ({} after the stop, before the restart)",
        trace.len(),
        counts(&v),
        lost.len(),
        lost_after_stop
    );
    // Queries before the stop (and not in flight at it: 150 ms timeout) all went to the cache,
    // those sent once the maps held the endpoints went to them, and those sent once the maps
    // held the cache again went to the cache. Anchored on when the maps changed, not on a
    // fixed delay: how long the agent takes to notice depends on the machine (1.2 s for the
    // restarted cache on 5.10 under emulation, 2026-11-27).
    assert!(trace.iter().filter(|(t, _)| *t + 200 < stopped).all(|(_, a)| a == "cache"), "{v}");
    assert!(trace.iter().filter(|(t, _)| *t > gone + 200 && *t < restarted).all(|(_, a)| a.starts_with("be")), "{v}");
    let after_restart: Vec<&String> = trace.iter().filter(|(t, _)| *t > back_programmed + 200).map(|(_, a)| a).collect();
    assert!(!after_restart.is_empty() && after_restart.iter().all(|a| *a == "cache"), "back on the cache after the restart: {v}");
    // The switch follows the socket's close (sock_diag destroy notification), so at most the
    // queries in flight at that moment can be lost.
    assert!(lost.len() <= 3, "lost queries at {lost:?} (stop at {stopped}, restart at {restarted})");
}
