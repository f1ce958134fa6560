//! Privileged control-plane tests: restarts, NodePort from a second node, affinity, traffic
//! policies. Needs root; fails (does not skip) without it.
use std::{
    process::Stdio,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use gardenet_agent::pinned_link::AttachType;
use gardenet_tests::lab::{counts, service_yaml, slice_yaml, Agent, AgentOpts, Lab};

static LOCK: Mutex<()> = Mutex::new(());
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const VIP: &str = "198.19.0.10";

fn web() -> Vec<(&'static str, String)> {
    vec![("svc.yaml", service_yaml("web", VIP, 80, &["TCP"])), ("eps.yaml", slice_yaml("web", &[0, 1, 2], &["TCP"]))]
}

fn one_of_each(lab: &Lab) {
    assert_eq!(lab.node.tcx_programs("nc0", AttachType::TcxIngress).unwrap(), ["gn_tc_ingress"]);
    assert_eq!(lab.node.tcx_programs("nc0", AttachType::TcxEgress).unwrap(), ["gn_tc_egress"]);
    assert_eq!(lab.cgroup.programs(AttachType::Connect4).unwrap(), ["gn_connect4"]);
    assert_eq!(lab.cgroup.programs(AttachType::Sendmsg4).unwrap(), ["gn_sendmsg4"]);
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
    assert!(lab.node.tcx_programs("nc0", AttachType::TcxIngress).unwrap().is_empty());
    assert!(lab.cgroup.programs(AttachType::Connect4).unwrap().is_empty());
}
