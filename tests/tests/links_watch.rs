//! Privileged: interface selection and live link tracking against a real kernel.
//!
//! Everything happens in a throwaway network namespace `gnl-<pid>`: the links are created
//! there with `ip -n`, and the dump, the watcher and the manager run in a thread that
//! entered it with `setns` (netlink sockets belong to the netns of the thread that creates
//! them). That thread also gets a private mount namespace with its own sysfs, so the VF and
//! driver probe reads the test netns, not the host's. The namespace is deleted by a Drop
//! guard, also when an assertion fails. Nothing outside it is touched.
//!
//! Needs root and iproute2; skipped (with a message) otherwise.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gardenet_agent::gardener::config::Pattern;
use gardenet_agent::links::{self, Attacher, LinkEvent, LinkInfo, LinkManager, LinkWatcher, Selector, WatchOptions};

/// The bound from the issue: a new matching interface is attached within one second.
const ATTACH_WITHIN: Duration = Duration::from_secs(1);

/// Runs `ip -n <ns> args...`, failing the test with ip's stderr when it fails.
fn ip(ns: &str, args: &[&str]) {
    let out = Command::new("ip").arg("-n").arg(ns).args(args).output().expect("running ip");
    assert!(out.status.success(), "ip -n {ns} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
}

/// Owns the test namespace; deletes it on drop (including during a panic).
struct Netns {
    name: String,
}

impl Netns {
    fn create(name: String) -> Self {
        // A namespace of this name can only be left over from a killed run with the same
        // pid: it is ours to replace.
        if Path::new("/run/netns").join(&name).exists() {
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
        let out = Command::new("ip").args(["netns", "add", &name]).output().expect("running ip netns add");
        assert!(out.status.success(), "ip netns add {name}: {}", String::from_utf8_lossy(&out.stderr).trim());
        Self { name }
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Moves the calling thread into the namespace at `path`.
fn enter_netns(path: &Path) {
    let f = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    // SAFETY: setns(2) on a valid fd; affects only the calling thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

/// Gives the calling thread a private mount namespace with a sysfs of its current netns
/// mounted at `dir`; returns its `class/net`, or `None` (probe disabled) if that fails.
fn private_sysfs(dir: &Path) -> Option<PathBuf> {
    let c = |s: &str| CString::new(s).unwrap();
    std::fs::create_dir_all(dir).ok()?;
    let target = c(dir.to_str()?);
    // SAFETY: plain unshare/mount calls with valid NUL-terminated strings. unshare only
    // affects this thread; making "/" private first keeps the sysfs mount from propagating
    // back to the host's mount namespace.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return None;
        }
        let root = c("/");
        if libc::mount(std::ptr::null(), root.as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0 {
            return None;
        }
        let sysfs = c("sysfs");
        if libc::mount(sysfs.as_ptr(), target.as_ptr(), sysfs.as_ptr(), 0, std::ptr::null()) != 0 {
            return None;
        }
    }
    Some(dir.join("class/net"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Attach(u32, String),
    Detach(u32, String),
    Forget(u32, String),
}

/// Records what the manager asks for; always succeeds.
#[derive(Default)]
struct Recorder {
    calls: Vec<Call>,
}

impl Attacher for Recorder {
    fn attach(&mut self, l: &LinkInfo) -> anyhow::Result<Vec<String>> {
        self.calls.push(Call::Attach(l.index, l.name.clone()));
        Ok(vec!["tc/ingress".into(), "tc/egress".into()])
    }
    fn detach(&mut self, l: &LinkInfo) -> anyhow::Result<()> {
        self.calls.push(Call::Detach(l.index, l.name.clone()));
        Ok(())
    }
    fn forget(&mut self, l: &LinkInfo) {
        self.calls.push(Call::Forget(l.index, l.name.clone()));
    }
}

fn calls(m: &mut LinkManager<Recorder>) -> Vec<Call> {
    std::mem::take(&mut m.attacher_mut().calls)
}

fn find<'a>(links: &'a [LinkInfo], name: &str) -> &'a LinkInfo {
    links.iter().find(|l| l.name == name).unwrap_or_else(|| panic!("{name} not in the dump: {links:#?}"))
}

/// Feeds events to the manager until one matches `pred`; fails after `within`.
async fn wait_for(w: &mut LinkWatcher, m: &mut LinkManager<Recorder>, within: Duration, what: &str, pred: impl Fn(&LinkEvent) -> bool) -> LinkEvent {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.recv()).await {
            Ok(Some(ev)) => {
                m.handle(ev.clone(), Instant::now());
                if pred(&ev) {
                    return ev;
                }
                seen.push(ev);
            }
            Ok(None) => panic!("watcher stopped while waiting for {what}; seen {seen:#?}"),
            Err(_) => panic!("no {what} within {within:?}; seen {seen:#?}"),
        }
    }
}

async fn scenario(ns: String, sysfs: Option<PathBuf>) {
    if let Some(net) = &sysfs {
        // The private sysfs shows this namespace (the host has no p-eth1).
        assert!(net.join("p-eth1").exists(), "{} is not the test netns' sysfs", net.display());
    }
    let probing = sysfs.is_some();
    let (initial, mut watcher) = links::watch(WatchOptions { sysfs }).await.expect("watching links");

    // --- the dump ---
    let lo = find(&initial, "lo");
    assert!(lo.is_loopback);
    let eth1 = find(&initial, "eth1").clone();
    assert_eq!(eth1.kind.as_deref(), Some("veth"));
    assert!(eth1.oper_up, "eth1 and its peer are up: {eth1:?}");
    assert!(!find(&initial, "ens5").oper_up);
    let br = find(&initial, "br-acc").clone();
    assert_eq!(br.kind.as_deref(), Some("bridge"));
    let enp1 = find(&initial, "enP1s2").clone();
    assert_eq!(enp1.master, Some((br.index, "br-acc".to_owned())));
    assert_eq!(find(&initial, "docker0").kind.as_deref(), Some("bridge"));
    if probing {
        // veths have no `device` in sysfs: no driver, not a VF.
        for l in &initial {
            assert!(!l.is_vf && l.driver.is_none(), "{l:?}");
        }
    }

    // --- the decisions ---
    let sel = Selector::default();
    let reason = |name: &str| {
        let d = sel.decide(find(&initial, name));
        (d.attach, d.reason)
    };
    assert_eq!(reason("lo"), (false, "loopback".into()));
    let data = gardenet_agent::gardener::config::DEFAULT_DATA_INTERFACES;
    assert_eq!(reason("eth1"), (true, format!("included by pattern {data}")));
    assert_eq!(reason("ens5"), (true, format!("included by pattern {data}; down, attached anyway (programs run once it is up)")));
    assert_eq!(reason("enP30832s1"), (false, "excluded by pattern ^enP".into()));
    assert_eq!(reason("enP1s2"), (false, "excluded by pattern ^enP".into()));
    for name in ["docker0", "vethabc", "br-acc", "p-eth1"] {
        assert_eq!(reason(name), (false, "not matched by any include pattern".into()), "{name}");
    }
    // Without the name rule, the master still keeps programs off the port.
    let match_all = Selector::new(vec![Pattern::new(".*").unwrap()], vec![], vec![]);
    assert_eq!(match_all.decide(&enp1).reason, "enslaved to br-acc");
    assert!(!match_all.decide(&enp1).attach);
    let forced = Selector::new(sel.include().to_vec(), sel.exclude().to_vec(), vec!["enP1s2".into()]);
    let d = forced.decide(&enp1);
    assert!(d.attach);
    assert_eq!(d.reason, "forced (otherwise: excluded by pattern ^enP); down, attached anyway (programs run once it is up)");

    // --- the manager on the dump ---
    let mut m = LinkManager::new(sel, Recorder::default());
    m.sync(initial.clone(), Instant::now());
    // The manager works in ifindex order.
    let ens5 = find(&initial, "ens5").index;
    let mut want = vec![Call::Attach(ens5, "ens5".into()), Call::Attach(eth1.index, "eth1".into())];
    want.sort_by_key(|c| match c {
        Call::Attach(i, _) | Call::Detach(i, _) | Call::Forget(i, _) => *i,
    });
    assert_eq!(calls(&mut m), want);

    // --- a new interface is attached within a second ---
    ip(&ns, &["link", "add", "eth2", "type", "veth", "peer", "name", "p-eth2"]);
    let t0 = Instant::now();
    let ev = wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Added(eth2)", |e| matches!(e, LinkEvent::Added(l) if l.name == "eth2")).await;
    let eth2 = ev.index();
    assert!(calls(&mut m).contains(&Call::Attach(eth2, "eth2".into())), "eth2 not attached");
    assert!(t0.elapsed() < ATTACH_WITHIN, "took {:?}", t0.elapsed());

    // --- renames are re-evaluated (renaming needs the link down; new veths are) ---
    ip(&ns, &["link", "set", "eth2", "name", "enP9s9"]);
    let ev = wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Changed(enP9s9)", |e| matches!(e, LinkEvent::Changed(l) if l.name == "enP9s9")).await;
    assert_eq!(ev.index(), eth2, "a rename keeps the index");
    assert_eq!(calls(&mut m), vec![Call::Detach(eth2, "enP9s9".into())]);

    let vethabc = find(&initial, "vethabc").index;
    ip(&ns, &["link", "set", "vethabc", "name", "eth7"]);
    wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Changed(eth7)", |e| matches!(e, LinkEvent::Changed(l) if l.name == "eth7" && l.index == vethabc)).await;
    assert_eq!(calls(&mut m), vec![Call::Attach(vethabc, "eth7".into())]);

    // --- newly enslaved: detached, and the reason names the master ---
    ip(&ns, &["link", "set", "eth1", "master", "br-acc"]);
    wait_for(
        &mut watcher,
        &mut m,
        ATTACH_WITHIN,
        "Changed(eth1 enslaved)",
        |e| matches!(e, LinkEvent::Changed(l) if l.index == eth1.index && l.master.is_some()),
    )
    .await;
    assert_eq!(calls(&mut m), vec![Call::Detach(eth1.index, "eth1".into())]);
    let status = |m: &LinkManager<Recorder>, index: u32| m.snapshot().into_iter().find(|s| s.index == index).expect("link in snapshot");
    assert_eq!(status(&m, eth1.index).reason, "enslaved to br-acc");

    // --- renaming the master re-reports its ports with the new name ---
    ip(&ns, &["link", "set", "br-acc", "name", "br-x"]);
    wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Changed(eth1 under br-x)", |e| {
        matches!(e, LinkEvent::Changed(l)
            if l.index == eth1.index && l.master.as_ref().is_some_and(|(_, n)| n == "br-x"))
    })
    .await;
    assert_eq!(status(&m, eth1.index).reason, "enslaved to br-x");

    // --- leaving a bridge is a change, not a removal (the bridge's AF_BRIDGE DELLINK) ---
    ip(&ns, &["link", "set", "eth1", "nomaster"]);
    wait_for(
        &mut watcher,
        &mut m,
        ATTACH_WITHIN,
        "Changed(eth1 released)",
        |e| matches!(e, LinkEvent::Changed(l) if l.index == eth1.index && l.master.is_none()),
    )
    .await;
    assert_eq!(calls(&mut m), vec![Call::Attach(eth1.index, "eth1".into())]);

    // --- removal: forgotten, never detached (the kernel dropped the programs) ---
    ip(&ns, &["link", "del", "eth7"]);
    let ev = wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Removed(eth7)", |e| matches!(e, LinkEvent::Removed { name, .. } if name == "eth7")).await;
    assert_eq!(ev, LinkEvent::Removed { index: vethabc, name: "eth7".into() });
    assert_eq!(calls(&mut m), vec![Call::Forget(vethabc, "eth7".into())]);
    // The peer goes too; let its event arrive and make sure nothing was attempted for it.
    wait_for(&mut watcher, &mut m, ATTACH_WITHIN, "Removed(p-vethabc)", |e| matches!(e, LinkEvent::Removed { name, .. } if name == "p-vethabc")).await;
    assert!(calls(&mut m).is_empty());

    let snap = m.snapshot();
    assert!(snap.iter().all(|s| s.index != vethabc));
    assert!(snap.iter().all(|s| s.error.is_none()), "{snap:#?}");
    let attached: Vec<&str> = snap.iter().filter(|s| !s.hooks.is_empty()).map(|s| s.name.as_str()).collect();
    assert_eq!(attached, ["eth1", "ens5"]);

    // The one-shot dump (for `gardenet-agent links`) agrees with the watcher.
    let explained = links::explain(m.selector(), &WatchOptions { sysfs: None }).await.expect("explain");
    let e = explained.iter().find(|s| s.name == "enP9s9").unwrap();
    assert_eq!(e.reason, "excluded by pattern ^enP");
}

#[test]
fn links_watch_in_a_namespace() {
    // Fails loudly without root: a skipped privileged test would prove nothing in CI.
    gardenet_tests::netns::require_root();
    let ns = Netns::create(format!("gnl-{}", std::process::id()));
    let n = ns.name.as_str();
    for (dev, peer) in [("eth1", "p-eth1"), ("ens5", "p-ens5"), ("enP30832s1", "p-enP3"), ("enP1s2", "p-enP1"), ("vethabc", "p-vethabc")] {
        ip(n, &["link", "add", dev, "type", "veth", "peer", "name", peer]);
    }
    ip(n, &["link", "add", "br-acc", "type", "bridge"]);
    ip(n, &["link", "set", "enP1s2", "master", "br-acc"]);
    ip(n, &["link", "add", "docker0", "type", "bridge"]);
    ip(n, &["link", "set", "eth1", "up"]);
    ip(n, &["link", "set", "p-eth1", "up"]);

    let sysfs_dir = std::env::temp_dir().join(format!("gnl-sysfs-{}", std::process::id()));
    let path = ns.path();
    let name = ns.name.clone();
    let dir = sysfs_dir.clone();
    let worker = std::thread::spawn(move || {
        enter_netns(&path);
        let sysfs = private_sysfs(&dir);
        if sysfs.is_none() {
            eprintln!("no private sysfs ({}); VF/driver probe disabled", std::io::Error::last_os_error());
        }
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime").block_on(scenario(name, sysfs));
    });
    let res = worker.join();
    // The thread's mount namespace, and with it the sysfs mount, ended with the thread.
    let _ = std::fs::remove_dir(&sysfs_dir);
    drop(ns);
    if let Err(panic) = res {
        std::panic::resume_unwind(panic);
    }
}
