//! The kernel feature probe and the fallbacks it selects, on whatever kernel this runs on
//! (the host's, or one of the kernel matrix's VMs: `cargo xtask test --kernel all`).
use gardenet_agent::features::KernelFeatures;

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
