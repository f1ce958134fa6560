//! Privileged control-plane tests: restarts, NodePort from a second node, affinity, traffic
//! policies. Needs root; fails (does not skip) without it.
use std::{
    process::Stdio,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use gardenet_agent::links::pinned::AttachType;
use gardenet_tests::lab::{counts, node_yaml, service_yaml, slice_yaml, slice_yaml_on, Agent, AgentOpts, Lab, NODE_ADDR, NODE_NAME};

static LOCK: Mutex<()> = Mutex::new(());
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const VIP: &str = "198.19.0.10";

fn web() -> Vec<(&'static str, String)> {
    vec![("svc.yaml", service_yaml("web", VIP, 80, &["TCP"])), ("eps.yaml", slice_yaml("web", &[0, 1, 2], &["TCP"]))]
}

fn one_of_each(lab: &Lab) {
    assert_eq!(lab.node.tc_programs("nc0", AttachType::TcxIngress).unwrap(), ["gn_tc_ingress"]);
    assert_eq!(lab.node.tc_programs("nc0", AttachType::TcxEgress).unwrap(), ["gn_tc_egress"]);
    // Kernels without bpf_set_retval run the EPERM twins.
    let nr = if gardenet_agent::dataplane::features::KernelFeatures::probe().set_retval { "" } else { "_nr" };
    assert_eq!(lab.cgroup.programs(AttachType::Connect4).unwrap(), [format!("gn_connect4{nr}")]);
    assert_eq!(lab.cgroup.programs(AttachType::Sendmsg4).unwrap(), [format!("gn_sendmsg4{nr}")]);
    assert_eq!(lab.cgroup.programs(AttachType::Recvmsg4).unwrap(), ["gn_recvmsg4"]);
    assert_eq!(lab.cgroup.programs(AttachType::Getpeername4).unwrap(), ["gn_getpeername4"]);
}

#[test]
fn restart_keeps_established_connections_and_new_ones_work_meanwhile() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let mut agent = Agent::start(&lab, AgentOpts { socket_lb: true, tc: true, keep_links: true, ..Default::default() }, &web()).unwrap();
    agent.wait_backends(&format!("{VIP}:80/tcp"), 3).unwrap();
    one_of_each(&lab);
    let to = format!("{VIP}:80");
    // 8 MiB each way at ~3 MiB/s: the transfers span the restart.
    let bulk = |socket_lb: bool| {
        lab.client_cmd(socket_lb, &["bulk", "--to", &to, "--bytes", &(8u64 << 20).to_string(), "--pace-ms", "20"])
            .unwrap()
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let tc_bulk = bulk(false);
    let sock_bulk = bulk(true);
    std::thread::sleep(Duration::from_millis(500));
    agent.restart(&lab).unwrap();
    // New connections right after the restart, on both paths.
    for socket_lb in [true, false] {
        let v = lab.client_json(socket_lb, &["tcp", "--to", &to, "--count", "50"]).unwrap();
        assert_eq!(counts(&v).iter().map(|(_, n)| n).sum::<u64>(), 50, "socket_lb={socket_lb}: {v}");
    }
    for (what, child) in [("TC LB", tc_bulk), ("socket LB", sock_bulk)] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{what} transfer failed across the restart");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        eprintln!("{what} transfer across restart: {v}");
        assert_eq!(v["uploaded"], 8u64 << 20, "{v}");
        assert_eq!(v["downloaded"], 8u64 << 20, "{v}");
        assert_eq!(v["upload_backend"], v["download_backend"], "{v}");
    }
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("(Some(Updated))"), "the restarted agent must take over the pinned links:\n{log}");
    // Restarted twice: still exactly one gardenet program per hook.
    agent.restart(&lab).unwrap();
    one_of_each(&lab);
}

#[test]
fn detach_on_exit_leaves_nothing_attached() {
    let _g = serial();
    let lab = Lab::new(1).unwrap();
    let mut agent = Agent::start(&lab, AgentOpts { socket_lb: true, tc: true, ..Default::default() }, &web()).unwrap();
    one_of_each(&lab);
    agent.stop();
    assert!(lab.node.tc_programs("nc0", AttachType::TcxIngress).unwrap().is_empty());
    assert!(lab.node.tc_programs("nc0", AttachType::TcxEgress).unwrap().is_empty());
    assert!(lab.cgroup.programs(AttachType::Connect4).unwrap().is_empty());
}

fn nodeport_svc(policy: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: np, namespace: lab}}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.20\n  externalTrafficPolicy: {policy}\n  healthCheckNodePort: 32000\n  ports:\n  - {{name: p-tcp, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}\n"
    )
}

fn total(v: &serde_json::Value) -> u64 {
    counts(v).iter().map(|(_, n)| n).sum()
}

#[test]
fn node_port_from_a_second_node_and_from_local_clients() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", nodeport_svc("Cluster")), ("eps.yaml", slice_yaml("np", &[0, 1, 2], &["TCP"]))],
    )
    .unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 3).unwrap();
    // From another node: TC LB on the node's interface towards it.
    let v = lab.node2_json(&["tcp", "--to", &np, "--count", "150"]).unwrap();
    eprintln!("NodePort from node2: {v}");
    assert_eq!(counts(&v).len(), 3, "{v}");
    assert_eq!(total(&v), 150, "{v}");
    // From a local client: socket LB translates the NodePort too.
    let v = lab.client_json(true, &["tcp", "--to", &np, "--count", "60"]).unwrap();
    assert_eq!(total(&v), 60, "{v}");
}

#[test]
fn external_traffic_policy_local_and_its_health_check() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let on = [(0, NODE_NAME), (1, "other-node"), (2, "other-node")];
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", nodeport_svc("Local")), ("eps.yaml", slice_yaml_on("np", &on, &["TCP"]))],
    )
    .unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
    agent.wait_backends("198.19.0.20:80/tcp", 3).unwrap();
    let v = lab.node2_json(&["tcp", "--to", &np, "--count", "60"]).unwrap();
    assert_eq!(counts(&v), vec![("be1".to_string(), 60)], "external traffic stays on this node's endpoint: {v}");
    let v = lab.client_json(true, &["tcp", "--to", "198.19.0.20:80", "--count", "150"]).unwrap();
    assert_eq!(counts(&v).len(), 3, "the ClusterIP still uses every endpoint: {v}");
    let hc_to = format!("{NODE_ADDR}:32000");
    let h = lab.node2_json(&["http-get", "--to", &hc_to, "--path", "/healthz"]).unwrap();
    eprintln!("health check with a local endpoint: {h}");
    assert_eq!(h["status"], 200, "{h}");
    let body: serde_json::Value = serde_json::from_str(h["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["localEndpoints"], 1, "{h}");
    assert_eq!(body["service"]["name"], "np", "{h}");

    // The local endpoint goes away: the health check fails and the NodePort drops (kube-proxy's
    // DROP: the Service has endpoints, on other nodes; the load balancer steers away).
    agent.write("eps.yaml", &slice_yaml_on("np", &on[1..], &["TCP"])).unwrap();
    agent.wait_backends(&format!("{np}/tcp"), 0).unwrap();
    let mut h = serde_json::Value::Null;
    for _ in 0..50 {
        h = lab.node2_json(&["http-get", "--to", &hc_to, "--path", "/healthz"]).unwrap();
        if h["status"] == 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(h["status"], 503, "{h}");
    let c = lab.node2_json(&["connect", "--to", &np, "--timeout-ms", "700"]).unwrap();
    assert_eq!(c["outcome"], "TimedOut", "{c}");
}

#[test]
fn client_ip_affinity_on_both_paths() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let svc = service_yaml("web", VIP, 80, &["TCP"])
        .replace("spec:\n", "spec:\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n");
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("svc.yaml", svc), ("eps.yaml", slice_yaml("web", &[0, 1, 2], &["TCP"]))],
    )
    .unwrap();
    agent.wait_backends(&format!("{VIP}:80/tcp"), 3).unwrap();
    let to = format!("{VIP}:80");
    for socket_lb in [true, false] {
        let v = lab.client_json(socket_lb, &["tcp", "--to", &to, "--count", "60"]).unwrap();
        eprintln!("affinity, socket_lb={socket_lb}: {v}");
        let c = counts(&v);
        assert_eq!(c.len(), 1, "one client, one backend: {v}");
        assert_eq!(c[0].1, 60, "{v}");
        // The chosen backend leaves: the client moves to another one and sticks to it.
        let gone = c[0].0.clone();
        let keep: Vec<usize> = (0..3).filter(|i| format!("be{}", i + 1) != gone).collect();
        agent.write("eps.yaml", &slice_yaml("web", &keep, &["TCP"])).unwrap();
        agent.wait_backends(&format!("{VIP}:80/tcp"), 2).unwrap();
        let v = lab.client_json(socket_lb, &["tcp", "--to", &to, "--count", "30"]).unwrap();
        let c2 = counts(&v);
        assert_eq!(c2.len(), 1, "{v}");
        assert_ne!(c2[0].0, gone, "{v}");
        agent.write("eps.yaml", &slice_yaml("web", &[0, 1, 2], &["TCP"])).unwrap();
        agent.wait_backends(&format!("{VIP}:80/tcp"), 3).unwrap();
    }
}

#[test]
fn health_readiness_and_metrics_endpoints() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let extra = ["--health-addr", "127.0.0.1:9878", "--metrics-addr", "127.0.0.1:9878", "--proxy-healthz-addr", "127.0.0.1:10256"].map(String::from).to_vec();
    let agent = Agent::start(&lab, AgentOpts { socket_lb: true, tc: true, extra, ..Default::default() }, &web()).unwrap();
    agent.wait_backends(&format!("{VIP}:80/tcp"), 3).unwrap();
    let get_from = |addr: &str, path: &str| {
        let mut cmd = lab.node.command(&lab.netkit, None).unwrap();
        cmd.args(["http-get", "--to", addr, "--path", path]);
        let out = cmd.output().unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let get = |path: &str| get_from("127.0.0.1:9878", path);
    assert_eq!(get("/healthz")["status"], 200);
    let mut r = serde_json::Value::Null;
    for _ in 0..50 {
        r = get("/readyz");
        if r["status"] == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(r["status"], 200, "ready after the first sync with every selected interface attached: {r}");
    // kube-proxy's health check, as cloud load balancers probe it.
    let h = get_from("127.0.0.1:10256", "/healthz");
    assert_eq!(h["status"], 200, "{h}");
    let body: serde_json::Value = serde_json::from_str(h["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["nodeEligible"], true, "{body}");
    assert!(body["lastUpdated"].as_str().is_some_and(|t| !t.is_empty()), "{body}");
    // Some traffic, then the counters.
    lab.client_json(true, &["tcp", "--to", &format!("{VIP}:80"), "--count", "20"]).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let m = get("/metrics");
    let text = m["body"].as_str().unwrap();
    for needle in [
        "gardenet_frontends 1",
        "gardenet_backends 3",
        "gardenet_interface_attached{interface=\"nc0\"} 1",
        "gardenet_sync_duration_seconds",
        "gardenet_network_programming_latency_seconds",
        "gardenet_map_capacity",
    ] {
        assert!(text.contains(needle), "/metrics lacks {needle:?}:\n{text}");
    }
    assert!(text.contains("sock_translated"), "datapath counters exported:\n{text}");
    // The kernel facilities the agent found, as this test's own probe finds them.
    for f in gardenet_agent::dataplane::features::KernelFeatures::probe().list() {
        let line = format!("gardenet_kernel_feature{{feature=\"{}\"}} {}", f.name, u8::from(f.present));
        assert!(text.contains(&line), "/metrics lacks {line:?}:\n{text}");
    }
}

fn lb_svc(ranges: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: lab}}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.40\n{ranges}  ports:\n  - {{name: p-tcp, port: 80, targetPort: 8080, nodePort: 30090, protocol: TCP}}\nstatus:\n  loadBalancer: {{ingress: [{{ip: 198.19.100.1}}]}}\n"
    )
}

#[test]
fn load_balancer_source_ranges_admit_only_their_clients() {
    let _g = serial();
    let lab = Lab::new(1).unwrap();
    // node2 reaches the load-balancer IP through this node too.
    lab.node2.ip(&["route", "add", "198.19.100.0/24", "via", NODE_ADDR]).unwrap();
    let only_client = "  loadBalancerSourceRanges: [198.18.0.0/24]\n";
    let mut agent = Agent::start(
        &lab,
        AgentOpts { tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", lb_svc(only_client)), ("eps.yaml", slice_yaml("lb", &[0], &["TCP"]))],
    )
    .unwrap();
    let lb = "198.19.100.1:80";
    agent.wait_backends(&format!("{lb}/tcp"), 1).unwrap();
    let listed = agent.lb_list().unwrap();
    let fe = listed.as_array().unwrap().iter().find(|f| f["frontend"]["addr"] == "198.19.100.1").unwrap().clone();
    assert_eq!(fe["source_ranges"], serde_json::json!([{"addr": "198.18.0.0", "len": 24}]), "{fe}");
    let from_client = || lab.client_json(false, &["connect", "--to", lb, "--timeout-ms", "700"]).unwrap()["outcome"] == "Connected";
    let from_node2 = || lab.node2_json(&["connect", "--to", lb, "--timeout-ms", "700"]).unwrap()["outcome"] == "Connected";
    assert!(from_client(), "198.18.0.2 is in the range");
    assert!(!from_node2(), "198.18.2.2 is not");
    // The ClusterIP and NodePort of the same Service are not restricted.
    let np = format!("{NODE_ADDR}:30090");
    assert_eq!(lab.node2_json(&["connect", "--to", &np, "--timeout-ms", "700"]).unwrap()["outcome"], "Connected");

    // The ranges change: the other way round, then no restriction at all.
    agent.write("svc.yaml", &lb_svc("  loadBalancerSourceRanges: [198.18.2.0/24]\n")).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !from_node2() {
        assert!(std::time::Instant::now() < deadline, "node2 not admitted after the change");
    }
    assert!(!from_client(), "the client is no longer in the range");
    agent.write("svc.yaml", &lb_svc("")).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !from_client() {
        assert!(std::time::Instant::now() < deadline, "the client not admitted once the ranges are gone");
    }
    assert!(from_node2());
    let listed = agent.lb_list().unwrap();
    assert!(listed.as_array().unwrap().iter().all(|f| f.get("source_ranges").is_none()), "{listed}");
    agent.stop();
}

/// The agent's HTTP endpoints listen where the DaemonSet says (its `ports`, on the node's
/// addresses: the agent runs with hostNetwork and the defaults, as deploy/daemonset.yaml passes
/// no address flags) and nowhere else: no other listening TCP socket, no bound UDP socket.
#[test]
fn endpoints_listen_where_the_daemonset_says_and_nowhere_else() {
    let _g = serial();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml")).unwrap();
    let mut declared = std::collections::BTreeSet::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = <serde_yaml::Value as serde::Deserialize>::deserialize(doc).unwrap();
        if v["kind"] != "DaemonSet" {
            continue;
        }
        for c in v["spec"]["template"]["spec"]["containers"].as_sequence().unwrap() {
            let args: Vec<&str> = c["args"].as_sequence().into_iter().flatten().filter_map(|a| a.as_str()).collect();
            for flag in ["--health-addr", "--metrics-addr", "--proxy-healthz-addr"] {
                assert!(!args.iter().any(|a| a.starts_with(flag)), "the DaemonSet passes {flag}: use it here too");
            }
            for p in c["ports"].as_sequence().into_iter().flatten() {
                let proto = p["protocol"].as_str().unwrap_or("TCP").to_lowercase();
                declared.insert((proto, p["containerPort"].as_u64().unwrap() as u16));
            }
        }
    }
    assert_eq!(declared.len(), 3, "health, metrics, kube-proxy's health check: {declared:?}");

    let lab = Lab::new(3).unwrap();
    let agent = Agent::start(&lab, AgentOpts { socket_lb: true, tc: true, default_listen: true, ..Default::default() }, &web()).unwrap();
    agent.wait_backends(&format!("{VIP}:80/tcp"), 3).unwrap();
    let listening = agent.listening().unwrap();
    eprintln!("agent sockets: {listening:?}");
    let got: std::collections::BTreeSet<(String, u16)> = listening.iter().map(|(p, a)| (p.to_string(), a.port())).collect();
    assert_eq!(got, declared, "{listening:?}");
    assert!(listening.iter().all(|(_, a)| a.ip().is_unspecified()), "hostNetwork: every node address, as the DaemonSet's ports say: {listening:?}");
}

/// A services map too small for the cluster, on the kernel: the first full sync writes in
/// batches (`BPF_MAP_UPDATE_BATCH`); the batch that overflows is undone and its changes are
/// made one frontend at a time, so every frontend that fits is programmed whole and works,
/// every other one is reported on its own Service, and nothing half-written is left.
#[test]
fn a_services_map_too_small_programs_what_fits_and_reports_the_rest() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    // 20 Services x (1 master + 3 slots) = 80 entries for a 40-entry map.
    let mut manifests = Vec::new();
    for i in 0..20 {
        manifests.push((format!("svc{i:02}.yaml"), service_yaml(&format!("s{i:02}"), &format!("198.19.0.{}", 100 + i), 80, &["TCP"])));
        manifests.push((format!("eps{i:02}.yaml"), slice_yaml(&format!("s{i:02}"), &[0, 1, 2], &["TCP"])));
    }
    let refs: Vec<(&str, String)> = manifests.iter().map(|(f, y)| (f.as_str(), y.clone())).collect();
    let opts = AgentOpts { socket_lb: true, extra: vec!["--map-services=40".into()], ..Default::default() };
    let agent = Agent::start(&lab, opts, &refs).unwrap();
    let list = agent.lb_list().unwrap();
    let programmed: Vec<(String, usize)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["frontend"]["addr"].as_str().unwrap().to_owned(), f["backends"].as_array().map_or(0, |b| b.len())))
        .collect();
    let log = agent.log.lock().unwrap().join("\n");
    let full = log.lines().filter(|l| l.contains("map GN_SVC4 is full") && l.contains("kind=MapFull")).count();
    eprintln!("programmed {} of 20 frontends ({programmed:?}); {full} reported full", programmed.len());
    assert!(!programmed.is_empty() && programmed.len() < 20, "{programmed:?}");
    assert!(programmed.iter().all(|(_, n)| *n == 3), "every programmed frontend has all its backends: {programmed:?}");
    assert_eq!(programmed.len() + full, 20, "each frontend is programmed or reported once:\n{log}");
    for (vip, _) in &programmed {
        let v = lab.client_json(true, &["tcp", "--to", &format!("{vip}:80"), "--count", "30"]).unwrap();
        assert_eq!(counts(&v).iter().map(|(_, n)| n).sum::<u64>(), 30, "{vip}: {v}");
    }
}

/// A first sync large enough that the writer puts the new backends and the new slots into the
/// kernel maps from two threads at once (each group well over the 256 elements that takes):
/// every frontend ends with all its backends, and traffic through the ones with real backends
/// works. Each Service has the lab's three backends and one of its own, at an address nothing
/// answers and no test sends to (only the map contents are checked for it).
#[test]
fn a_large_first_sync_written_from_two_threads_programs_every_frontend_whole() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    let n = 600;
    let vip = |i: usize| format!("198.19.{}.{}", 10 + i / 250, i % 250 + 1);
    let own = |i: usize| format!("198.18.{}.{}", 100 + i / 250, i % 250 + 1);
    let mut manifests = Vec::new();
    for i in 0..n {
        let name = format!("s{i:03}");
        let eps: Vec<String> =
            (0..3).map(gardenet_tests::lab::backend_ip).chain([own(i)]).map(|a| format!("  - addresses: [{a}]\n    conditions: {{ready: true}}")).collect();
        let slice = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: lab, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports:\n  - {{name: p-tcp, port: {}, protocol: TCP}}\nendpoints:\n{}\n",
            gardenet_tests::lab::SERVER_PORT,
            eps.join("\n")
        );
        manifests.push((format!("svc{i:03}.yaml"), format!("{}---\n{slice}", service_yaml(&name, &vip(i), 80, &["TCP"]))));
    }
    // Three Services with only the lab's backends, to send traffic through.
    for (i, vip) in ["198.19.0.21", "198.19.0.22", "198.19.0.23"].iter().enumerate() {
        manifests.push((
            format!("real{i}.yaml"),
            format!("{}---\n{}", service_yaml(&format!("real{i}"), vip, 80, &["TCP"]), slice_yaml(&format!("real{i}"), &[0, 1, 2], &["TCP"])),
        ));
    }
    let refs: Vec<(&str, String)> = manifests.iter().map(|(f, y)| (f.as_str(), y.clone())).collect();
    let agent = Agent::start(&lab, AgentOpts { socket_lb: true, ..Default::default() }, &refs).unwrap();
    let list = agent.lb_list().unwrap();
    let mut backends: std::collections::BTreeMap<String, Vec<String>> = std::collections::BTreeMap::new();
    for f in list.as_array().unwrap() {
        let mut b: Vec<String> = f["backends"].as_array().into_iter().flatten().map(|b| b["addr"].as_str().unwrap_or_default().to_owned()).collect();
        b.sort();
        backends.insert(f["frontend"]["addr"].as_str().unwrap().to_owned(), b);
    }
    assert_eq!(backends.len(), n + 3, "every frontend programmed");
    for i in 0..n {
        let mut want: Vec<String> = (0..3).map(gardenet_tests::lab::backend_ip).chain([own(i)]).collect();
        want.sort();
        assert_eq!(backends[&vip(i)], want, "frontend {}", vip(i));
    }
    for vip in ["198.19.0.21", "198.19.0.22", "198.19.0.23"] {
        let v = lab.client_json(true, &["tcp", "--to", &format!("{vip}:80"), "--count", "30"]).unwrap();
        let c = counts(&v);
        assert_eq!(c.iter().map(|(_, n)| n).sum::<u64>(), 30, "{vip}: {v}");
        assert_eq!(c.len(), 3, "{vip} spreads over the three backends: {v}");
    }
}

/// A node whose ephemeral ports are widened ("1024 65535", a common tuning) would hand its own
/// connections NodePorts and source-NAT ports, whose replies TC LB translates: the agent
/// reserves the overlap (keeping what the node reserved), also when the range is widened while
/// it runs, and leaves Linux's default range alone.
#[test]
fn ports_tc_lb_translates_are_kept_from_the_nodes_own_connections() {
    let _g = serial();
    let lab = Lab::new(1).unwrap();
    lab.node.sysctl("net.ipv4.ip_local_port_range", "32768 60999").unwrap();
    lab.node.sysctl("net.ipv4.ip_local_reserved_ports", "8080").unwrap();
    let mut agent = Agent::start(
        &lab,
        AgentOpts { tc: true, ..Default::default() },
        &[("node.yaml", node_yaml()), ("svc.yaml", nodeport_svc("Cluster")), ("eps.yaml", slice_yaml("np", &[0], &["TCP"]))],
    )
    .unwrap();
    let np = format!("{NODE_ADDR}:30080");
    agent.wait_backends(&format!("{np}/tcp"), 1).unwrap();
    // The default range includes neither: nothing written (several 500 ms checks later).
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(lab.node.sysctl_value("net.ipv4.ip_local_reserved_ports").unwrap(), "8080");
    assert!(!agent.log.lock().unwrap().iter().any(|l| l.contains("reserved local ports")));

    // Widened while the agent runs: reserved within a check or two.
    lab.node.sysctl("net.ipv4.ip_local_port_range", "1024 65535").unwrap();
    let line = gardenet_tests::lab::wait_log(&agent, "reserved local ports", Duration::from_secs(10)).unwrap();
    eprintln!("{line}");
    let snat = gardenet_agent::dataplane::features::KernelFeatures::probe().fib_lookup_src;
    let want = if snat { "8080,30000-32767,61000-65535" } else { "8080,30000-32767" };
    assert_eq!(lab.node.sysctl_value("net.ipv4.ip_local_reserved_ports").unwrap(), want, "{line}");
    assert!(line.contains("30000-32767 (NodePorts)"), "{line}");
    assert_eq!(line.contains("61000-65535 (source NAT)"), snat, "{line}");
    // And TC LB still serves the NodePort.
    let v = lab.node2_json(&["tcp", "--to", &np, "--count", "20"]).unwrap();
    assert_eq!(total(&v), 20, "{v}");
    agent.stop();
    assert_eq!(agent.log.lock().unwrap().iter().filter(|l| l.contains("reserved local ports")).count(), 1, "reserved once");
}
