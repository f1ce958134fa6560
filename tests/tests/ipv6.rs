//! Privileged dual-stack tests: an `ipFamilies: [IPv4, IPv6]` Service whose IPv6 ClusterIP is
//! served by the IPv6 socket-LB hooks (connect6/sendmsg6/recvmsg6/getpeername6) and by TC LB
//! for clients outside the cgroup. Needs root; fails (does not skip) without it.
use std::sync::{Mutex, MutexGuard};

use gardenet_tests::{
    cases::{self, assert_spread},
    lab::{
        assert_connected_udp_leaves_departed_backend, assert_idle_tcp_leaves_departed_backend, assert_udp_flow_leaves_departed_backend, backend_ip6, counts,
        node_yaml_dual, service_yaml_dual, slice_yaml, slice_yaml6, Agent, AgentOpts, Lab, NODE_ADDR6, SERVER_PORT,
    },
};

static LOCK: Mutex<()> = Mutex::new(());
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const VIP4: &str = "198.19.0.10";
const VIP6: &str = "fd00:19::10";
const PORT: u16 = 80;

fn vip6() -> String {
    format!("[{VIP6}]:{PORT}")
}

fn vip4() -> String {
    format!("{VIP4}:{PORT}")
}

fn setup(opts: AgentOpts, backends: &[usize]) -> (Lab, Agent) {
    let lab = Lab::new(3).expect("lab");
    lab.wait_servers6().expect("IPv6 servers");
    let protos = ["TCP", "UDP"];
    let agent = Agent::start(
        &lab,
        opts,
        &[
            ("svc.yaml", service_yaml_dual("web", VIP4, VIP6, PORT, &protos)),
            ("eps.yaml", slice_yaml("web", backends, &protos)),
            ("eps6.yaml", slice_yaml6("web", backends, &protos)),
        ],
    )
    .expect("agent");
    for fe in [vip6(), vip4()] {
        agent.wait_backends(&format!("{fe}/tcp"), backends.len()).unwrap();
        agent.wait_backends(&format!("{fe}/udp"), backends.len()).unwrap();
    }
    (lab, agent)
}

#[test]
fn dual_stack_service_is_listed_with_v6_frontends_and_backends() {
    let _g = serial();
    let (_lab, agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    let got = agent.programmed(&format!("{}/tcp", vip6())).unwrap().unwrap();
    let want: Vec<String> = (0..3).map(|i| format!("[{}]:{SERVER_PORT}", backend_ip6(i))).collect();
    assert_eq!(got, want);
}

#[test]
fn tcp_v6_via_socket_lb_reaches_all_backends() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::tcp_spreads(&lab, true, &vip6(), 300);
    // The IPv4 ClusterIP of the same Service keeps working next to it.
    cases::tcp_spreads(&lab, true, &vip4(), 60);
}

#[test]
fn udp_v6_via_socket_lb_replies_come_from_the_vip() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::udp_replies_come_from_the_vip(&lab, true, &vip6(), 300, true);
}

#[test]
fn getpeername_v6_returns_the_vip() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    cases::getpeername_returns_the_vip(&lab, &vip6());
}

#[test]
fn tc_lb_v6_translates_traffic_that_socket_lb_does_not_see() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, tc: true, ..Default::default() }, &[0, 1, 2]);
    cases::tcp_spreads(&lab, false, &vip6(), 300);
    cases::udp_replies_come_from_the_vip(&lab, false, &vip6(), 60, false);
    cases::bulk_stays_on_one_backend(&lab, &vip6(), 1 << 20);

    // With a destination options header before TCP the L4 header sits further in: still
    // translated (handshake, then a request and its answer).
    for _ in 0..10 {
        let c = lab.client_json(false, &["connect", "--to", &vip6(), "--ipv6-dstopts", "--hello"]).unwrap();
        assert_eq!(c["outcome"], "Connected", "{c}");
        assert!(c["backend"].as_str().is_some_and(|b| b.starts_with("be")), "{c}");
    }
}

#[test]
fn zero_backends_v6_refuse_at_once() {
    let _g = serial();
    // XDP forced: the lab's interfaces are veths, where `auto` attaches none.
    let (lab, mut agent) = setup(AgentOpts { socket_lb: true, tc: true, extra: vec!["--xdp-mode=native".into()], ..Default::default() }, &[]);
    // Other IPv6 traffic to the empty frontend is dropped by XDP on the wire side.
    cases::refuses_at_once(&lab, &vip6());
    agent.stop();
    let log = agent.log.lock().unwrap().join("\n");
    assert!(log.contains("xdp_drop_no_backend=5"), "{log}");
    assert!(log.contains("tc_no_backend_reset=1"), "the v6 SYN was answered by TC: {log}");
    assert!(log.contains("sock_no_backend=1"), "{log}");
}

#[test]
fn dual_stack_socket_dialling_a_v4_mapped_vip_is_balanced_too() {
    let _g = serial();
    let (lab, _agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    // An AF_INET6 socket connecting to ::ffff:198.19.0.10 runs only the connect6 hook.
    let mapped = format!("[::ffff:{VIP4}]:{PORT}");
    let v = lab.client_json(true, &["tcp", "--to", &mapped, "--count", "150", "--timeout-ms", "500"]).unwrap();
    eprintln!("socket LB, 150 TCP connections to {mapped}: {v}");
    assert_spread(&v, 150);
    for udp in [false, true] {
        let mut args = vec!["peername", "--to", &mapped];
        if udp {
            args.push("--udp");
        }
        let p = lab.client_json(true, &args).unwrap();
        assert_eq!(p["peer"], mapped, "udp={udp}: {p}");
    }
    let u = lab.client_json(true, &["udp", "--to", &mapped, "--count", "60"]).unwrap();
    let sources = u["sources"].as_object().unwrap();
    assert_eq!(sources.len(), 1, "{u}");
    assert_eq!(sources[&mapped], 60, "{u}");
}

#[test]
fn node_port_v6_from_a_second_node() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    lab.wait_servers6().unwrap();
    let svc = service_yaml_dual("np", "198.19.0.20", "fd00:19::20", 80, &["TCP"])
        .replace("spec:\n", "spec:\n  type: NodePort\n")
        .replace("protocol: TCP}", "protocol: TCP, nodePort: 30080}");
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[
            ("node.yaml", node_yaml_dual()),
            ("svc.yaml", svc),
            ("eps.yaml", slice_yaml("np", &[0, 1, 2], &["TCP"])),
            ("eps6.yaml", slice_yaml6("np", &[0, 1, 2], &["TCP"])),
        ],
    )
    .unwrap();
    let np = format!("[{NODE_ADDR6}]:30080");
    agent.wait_backends(&format!("{np}/tcp"), 3).unwrap();
    let v = lab.node2_json(&["tcp", "--to", &np, "--count", "150", "--timeout-ms", "500"]).unwrap();
    eprintln!("v6 NodePort from node2: {v}");
    assert_spread(&v, 150);
}

#[test]
fn client_ip_affinity_v6_on_both_paths() {
    let _g = serial();
    let lab = Lab::new(3).unwrap();
    lab.wait_servers6().unwrap();
    let svc = service_yaml_dual("web", VIP4, VIP6, PORT, &["TCP"])
        .replace("spec:\n", "spec:\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n");
    let agent = Agent::start(
        &lab,
        AgentOpts { socket_lb: true, tc: true, ..Default::default() },
        &[("svc.yaml", svc), ("eps.yaml", slice_yaml("web", &[0, 1, 2], &["TCP"])), ("eps6.yaml", slice_yaml6("web", &[0, 1, 2], &["TCP"]))],
    )
    .unwrap();
    let fe = format!("{}/tcp", vip6());
    agent.wait_backends(&fe, 3).unwrap();
    for socket_lb in [true, false] {
        let v = lab.client_json(socket_lb, &["tcp", "--to", &vip6(), "--count", "60"]).unwrap();
        eprintln!("v6 affinity, socket_lb={socket_lb}: {v}");
        let c = counts(&v);
        assert_eq!(c.len(), 1, "one client, one backend: {v}");
        assert_eq!(c[0].1, 60, "{v}");
        // The chosen backend leaves: the client moves to another one and sticks to it.
        let gone = c[0].0.clone();
        let keep: Vec<usize> = (0..3).filter(|i| format!("be{}", i + 1) != gone).collect();
        agent.write("eps6.yaml", &slice_yaml6("web", &keep, &["TCP"])).unwrap();
        agent.wait_backends(&fe, 2).unwrap();
        let v = lab.client_json(socket_lb, &["tcp", "--to", &vip6(), "--count", "30"]).unwrap();
        let c2 = counts(&v);
        assert_eq!(c2.len(), 1, "{v}");
        assert_ne!(c2[0].0, gone, "{v}");
        agent.write("eps6.yaml", &slice_yaml6("web", &[0, 1, 2], &["TCP"])).unwrap();
        agent.wait_backends(&fe, 3).unwrap();
    }
}

/// IPv6 twin of the dataplane test: a long-lived UDP flow on the TC path leaves a backend
/// that left the Service.
#[test]
fn udp_v6_flows_move_off_a_departed_backend() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { tc: true, ..Default::default() }, &[0, 1, 2]);
    assert_udp_flow_leaves_departed_backend(&lab, &agent, &vip6(), "eps6.yaml", |rest| slice_yaml6("web", rest, &["TCP", "UDP"]), 41006);
}

/// The dataplane test's resolver, over IPv6: its connected socket is destroyed when its
/// backend leaves, and it reconnects to a remaining one.
#[test]
fn connected_udp_v6_sockets_leave_a_departed_backend_socket_lb() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0]);
    assert_connected_udp_leaves_departed_backend(&lab, &agent, &vip6(), "eps6.yaml", |b| slice_yaml6("web", b, &["TCP", "UDP"]));
}

/// The dataplane test's idle TCP connections, over IPv6.
#[test]
fn idle_tcp_v6_sockets_leave_a_backend_gone_from_the_service_socket_lb() {
    let _g = serial();
    let (lab, agent) = setup(AgentOpts { socket_lb: true, ..Default::default() }, &[0, 1, 2]);
    assert_idle_tcp_leaves_departed_backend(&lab, &agent, &vip6(), "eps6.yaml", &backend_ip6(0), |b| slice_yaml6("web", b, &["TCP", "UDP"]));
}
