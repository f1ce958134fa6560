//! The kernel feature probe and the fallbacks it selects, on whatever kernel this runs on
//! (the host's, or one of the kernel matrix's VMs: `cargo xtask test --kernel all`).
use gardenet_agent::dataplane::features::KernelFeatures;

#[test]
fn probe_agrees_with_the_kernel_release() {
    let f = KernelFeatures::probe();
    let v: Vec<u32> = f.release.split(['.', '-', '+']).take(2).filter_map(|p| p.parse().ok()).collect();
    let at_least = |maj: u32, min: u32| (v[0], v[1]) >= (maj, min);
    println!("{}", f.summary());
    // Every kernel has what its upstream release brought...
    assert!(!at_least(6, 7) || f.fib_lookup_src, "BPF_FIB_LOOKUP_SRC");
    // ...and, for these, nothing more: Debian backports none of them (its 6.1 does carry
    // BPF_FIB_LOOKUP_SRC, which is why the agent probes instead of reading the release;
    // nodeport_snat checks that source NAT then really works).
    assert_eq!(f.tcx, at_least(6, 6), "tcx");
    assert_eq!(f.set_retval, at_least(5, 18), "bpf_set_retval");
    // Debian builds every kernel of the matrix with CONFIG_INET_DIAG_DESTROY.
    assert!(f.sock_destroy, "sock_diag SOCK_DESTROY of UDP sockets");
    assert!(f.btf && f.cgroup_link && f.getpeername_hooks, "the floor (5.10) has these: {f:?}");
    assert_eq!(f.missing_required(), None);
}

/// Every program loads on this kernel (socket LB, TC LB, native XDP on the lab's veth), and the
/// instructions the verifier processed for each are printed (`bpf_prog_info.verified_insns`,
/// Linux 5.16+; 0 before): the figures docs/benchmarks.md records before and after changes
/// to `ebpf/` (run with `--nocapture`).
#[test]
fn every_program_loads_and_its_verifier_count_is_printed() {
    use gardenet_tests::lab::{service_yaml, slice_yaml, Agent, AgentOpts, Lab};
    let lab = Lab::new(3).unwrap();
    let opts = AgentOpts { socket_lb: true, tc: true, extra: vec!["--xdp-mode=native".into()], ..Default::default() };
    let manifests = [("svc.yaml", service_yaml("web", "198.19.0.10", 80, &["TCP", "UDP"])), ("eps.yaml", slice_yaml("web", &[0, 1, 2], &["TCP", "UDP"]))];
    let _agent = Agent::start(&lab, opts, &manifests).unwrap();
    let mut by_name = std::collections::BTreeMap::new();
    for p in gardenet_tests::bpfstats::programs("gn_").unwrap().into_values() {
        by_name.insert(p.name, p.verified_insns);
    }
    let mut table = String::from("| program | instructions |\n|---|---:|\n");
    for (name, n) in &by_name {
        table.push_str(&format!("| {name} | {n} |\n"));
    }
    eprintln!("verifier, Linux {}:\n{table}", KernelFeatures::probe().release);
    // Kernels without bpf_set_retval run the `_nr` twins of connect/sendmsg.
    for want in [
        "gn_connect4",
        "gn_connect6",
        "gn_sendmsg4",
        "gn_sendmsg6",
        "gn_recvmsg4",
        "gn_recvmsg6",
        "gn_getpeername4",
        "gn_getpeername6",
        "gn_tc_ingress",
        "gn_tc_egress",
        "gn_xdp",
    ] {
        assert!(by_name.keys().any(|n| n == want || n.strip_suffix("_nr") == Some(want)), "{want} is not loaded:\n{table}");
    }
}
