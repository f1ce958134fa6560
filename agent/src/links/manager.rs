//! Keeps the attachments in line with the links and the selector.
//!
//! The manager holds, per ifindex, the latest [`LinkInfo`], its [`Decision`] and what is
//! attached, and reconciles on every event: attach newly selected links, detach deselected
//! ones (renamed to an excluded name, newly enslaved), forget removed ones. Failures are
//! recorded on the link and retried with exponential backoff from [`LinkManager::tick`] and
//! later events, never in a tight loop.
//!
//! Attachments are keyed by ifindex, not name: tc/tcx programs stay on a device across a
//! rename, so a rename that keeps the link selected changes nothing in the kernel.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::select::{Decision, LinkInfo, Selector};
use super::watch::LinkEvent;

/// Puts gardenet's programs on a device and takes them off.
///
/// Implementations should key what they hold by `link.index` (the name can change while
/// programs stay attached) and leave nothing half-attached when `attach` fails, since the
/// manager retries the whole call.
pub trait Attacher {
    /// Attaches and returns the hook names, e.g. `["tc/ingress", "tc/egress"]`.
    fn attach(&mut self, link: &LinkInfo) -> anyhow::Result<Vec<String>>;
    /// Detaches from a device that still exists.
    fn detach(&mut self, link: &LinkInfo) -> anyhow::Result<()>;
    /// The device is gone and the kernel has already dropped its tcx links/filters: release
    /// whatever is held for it (link handles) without syscalls that would fail.
    fn forget(&mut self, _link: &LinkInfo) {}
}

/// Retry delays after failed attaches/detaches: `initial`, doubling, at most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial: Duration::from_secs(1), max: Duration::from_secs(60) }
    }
}

impl Backoff {
    /// Delay after the `failures`-th consecutive failure (1-based).
    pub fn delay(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(16);
        self.initial.saturating_mul(1 << shift).min(self.max)
    }
}

/// One link as `gardenet-agent links` and the metrics show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStatus {
    pub index: u32,
    pub name: String,
    pub kind: Option<String>,
    pub master: Option<String>,
    pub oper_up: bool,
    /// Whether the selector wants programs on it.
    pub selected: bool,
    pub reason: String,
    /// Hooks currently attached (empty when not attached).
    pub hooks: Vec<String>,
    /// The last attach/detach error, while the link is not in the wanted state.
    pub error: Option<String>,
}

struct Tracked {
    info: LinkInfo,
    decision: Decision,
    /// `Some` while attached (the hooks the attacher reported, possibly empty).
    hooks: Option<Vec<String>>,
    error: Option<String>,
    failures: u32,
    retry_at: Option<Instant>,
}

pub struct LinkManager<A> {
    selector: Selector,
    attacher: A,
    backoff: Backoff,
    links: BTreeMap<u32, Tracked>,
}

impl<A: Attacher> LinkManager<A> {
    pub fn new(selector: Selector, attacher: A) -> Self {
        Self { selector, attacher, backoff: Backoff::default(), links: BTreeMap::new() }
    }

    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    pub fn attacher(&self) -> &A {
        &self.attacher
    }

    pub fn attacher_mut(&mut self) -> &mut A {
        &mut self.attacher
    }

    pub fn selector(&self) -> &Selector {
        &self.selector
    }

    /// Takes the full list of links (the initial dump): links not in it are forgotten, the
    /// others added or updated and reconciled.
    pub fn sync(&mut self, links: Vec<LinkInfo>, now: Instant) {
        let present: std::collections::BTreeSet<u32> = links.iter().map(|l| l.index).collect();
        let gone: Vec<u32> = self.links.keys().filter(|i| !present.contains(i)).copied().collect();
        for index in gone {
            self.remove(index);
        }
        for link in links {
            self.upsert(link, now);
        }
        self.retry_due(now);
    }

    /// Applies one watcher event, then retries whatever else is due.
    pub fn handle(&mut self, event: LinkEvent, now: Instant) {
        match event {
            LinkEvent::Added(link) | LinkEvent::Changed(link) => self.upsert(link, now),
            LinkEvent::Removed { index, .. } => self.remove(index),
        }
        self.retry_due(now);
    }

    /// Periodic call (e.g. every second): retries failed attaches/detaches whose backoff
    /// has expired.
    pub fn tick(&mut self, now: Instant) {
        self.retry_due(now);
    }

    /// When the next retry is due, for callers that sleep instead of ticking.
    pub fn next_retry(&self) -> Option<Instant> {
        self.links.values().filter_map(|t| t.retry_at).min()
    }

    /// Replaces the selector (config reload) and re-decides every link.
    pub fn set_selector(&mut self, selector: Selector, now: Instant) {
        self.selector = selector;
        let indexes: Vec<u32> = self.links.keys().copied().collect();
        for index in indexes {
            if let Some(t) = self.links.get_mut(&index) {
                let decision = self.selector.decide(&t.info);
                if decision != t.decision {
                    t.decision = decision;
                    self.reconcile(index, now, true);
                }
            }
        }
        self.retry_due(now);
    }

    /// The current links, decisions and attachments, by ifindex.
    pub fn snapshot(&self) -> Vec<LinkStatus> {
        self.links
            .values()
            .map(|t| LinkStatus {
                index: t.info.index,
                name: t.info.name.clone(),
                kind: t.info.kind.clone(),
                master: t.info.master.as_ref().map(|(_, n)| n.clone()),
                oper_up: t.info.oper_up,
                selected: t.decision.attach,
                reason: t.decision.reason.clone(),
                hooks: t.hooks.clone().unwrap_or_default(),
                error: t.error.clone(),
            })
            .collect()
    }

    fn upsert(&mut self, info: LinkInfo, now: Instant) {
        let decision = self.selector.decide(&info);
        let index = info.index;
        match self.links.get_mut(&index) {
            Some(t) => {
                if t.info == info && t.decision == decision {
                    return; // a duplicate (e.g. the initial dump again): nothing new to try
                }
                if t.info.name != info.name {
                    tracing::info!(index, from = %t.info.name, to = %info.name, "interface renamed");
                }
                t.info = info;
                t.decision = decision;
            }
            None => {
                self.links.insert(index, Tracked { info, decision, hooks: None, error: None, failures: 0, retry_at: None });
            }
        }
        // Something about the link changed, which may be what a failed attempt was waiting
        // for (it came up, a driver bound): try now rather than at the end of the backoff.
        self.reconcile(index, now, true);
    }

    fn remove(&mut self, index: u32) {
        let Some(t) = self.links.remove(&index) else {
            return;
        };
        // The kernel dropped the device's programs with it: no detach, just release handles.
        if t.hooks.is_some() {
            tracing::info!(index, name = %t.info.name, "interface removed; its attachment went with it");
            self.attacher.forget(&t.info);
        }
    }

    fn retry_due(&mut self, now: Instant) {
        let due: Vec<u32> = self.links.iter().filter(|(_, t)| t.retry_at.is_some_and(|at| at <= now)).map(|(i, _)| *i).collect();
        for index in due {
            self.reconcile(index, now, false);
        }
    }

    /// Brings one link's attachment to what its decision wants. `eager` ignores a pending
    /// backoff (the link changed since the last failure).
    fn reconcile(&mut self, index: u32, now: Instant, eager: bool) {
        let Some(t) = self.links.get_mut(&index) else {
            return;
        };
        let want = t.decision.attach;
        if want == t.hooks.is_some() {
            // In the wanted state: any earlier error is history.
            t.error = None;
            t.failures = 0;
            t.retry_at = None;
            return;
        }
        if !eager && t.retry_at.is_some_and(|at| at > now) {
            return;
        }
        let result = if want {
            self.attacher.attach(&t.info).map(|hooks| {
                tracing::info!(index, name = %t.info.name, hooks = %hooks.join(","), reason = %t.decision.reason, "attached");
                t.hooks = Some(hooks);
            })
        } else {
            self.attacher.detach(&t.info).map(|()| {
                tracing::info!(index, name = %t.info.name, reason = %t.decision.reason, "detached");
                t.hooks = None;
            })
        };
        match result {
            Ok(()) => {
                t.error = None;
                t.failures = 0;
                t.retry_at = None;
            }
            Err(e) => {
                t.failures = t.failures.saturating_add(1);
                let delay = self.backoff.delay(t.failures);
                let op = if want { "attach" } else { "detach" };
                tracing::warn!(index, name = %t.info.name, failures = t.failures, retry_in = ?delay, "{op} failed: {e:#}");
                t.error = Some(format!("{op} failed: {e:#}"));
                t.retry_at = Some(now + delay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gardener::config::Pattern;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Attach(u32, String),
        Detach(u32, String),
        Forget(u32, String),
    }

    /// Records calls; fails attaches while `fail_attach` is set.
    #[derive(Default)]
    struct Fake {
        calls: Vec<Call>,
        fail_attach: bool,
    }

    impl Attacher for Fake {
        fn attach(&mut self, l: &LinkInfo) -> anyhow::Result<Vec<String>> {
            self.calls.push(Call::Attach(l.index, l.name.clone()));
            if self.fail_attach {
                anyhow::bail!("EBUSY");
            }
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

    fn manager() -> LinkManager<Fake> {
        LinkManager::new(Selector::default(), Fake::default())
    }

    fn take(m: &mut LinkManager<Fake>) -> Vec<Call> {
        std::mem::take(&mut m.attacher_mut().calls)
    }

    fn status(m: &LinkManager<Fake>, index: u32) -> LinkStatus {
        m.snapshot().into_iter().find(|s| s.index == index).unwrap()
    }

    #[test]
    fn initial_sync_attaches_selected_only() {
        let mut m = manager();
        let now = Instant::now();
        m.sync(
            vec![
                LinkInfo { is_loopback: true, ..LinkInfo::named(1, "lo") },
                LinkInfo::named(2, "eth0"),
                LinkInfo::named(3, "enP30832s1"),
                LinkInfo::named(4, "docker0"),
            ],
            now,
        );
        assert_eq!(take(&mut m), vec![Call::Attach(2, "eth0".into())]);
        let s = status(&m, 2);
        assert_eq!(s.hooks, ["tc/ingress", "tc/egress"]);
        assert!(s.selected && s.error.is_none());
        assert_eq!(status(&m, 3).reason, "excluded by pattern ^enP");
        assert!(status(&m, 3).hooks.is_empty());
        // The same dump again changes nothing.
        m.sync(vec![LinkInfo { is_loopback: true, ..LinkInfo::named(1, "lo") }, LinkInfo::named(2, "eth0")], now);
        assert!(take(&mut m).is_empty());
        assert_eq!(m.snapshot().len(), 2);
    }

    #[test]
    fn rename_keeps_or_drops_the_attachment() {
        let mut m = manager();
        let now = Instant::now();
        m.handle(LinkEvent::Added(LinkInfo::named(5, "eth1")), now);
        assert_eq!(take(&mut m), vec![Call::Attach(5, "eth1".into())]);
        // Still selected under the new name: programs stay (they follow the ifindex).
        m.handle(LinkEvent::Changed(LinkInfo::named(5, "eth9")), now);
        assert!(take(&mut m).is_empty());
        assert_eq!(status(&m, 5).name, "eth9");
        // Renamed to an excluded name: detached.
        m.handle(LinkEvent::Changed(LinkInfo::named(5, "enP9s9")), now);
        assert_eq!(take(&mut m), vec![Call::Detach(5, "enP9s9".into())]);
        assert_eq!(status(&m, 5).reason, "excluded by pattern ^enP");
        // And back.
        m.handle(LinkEvent::Changed(LinkInfo::named(5, "ens5")), now);
        assert_eq!(take(&mut m), vec![Call::Attach(5, "ens5".into())]);
    }

    #[test]
    fn newly_enslaved_link_is_detached() {
        let mut m = manager();
        let now = Instant::now();
        m.handle(LinkEvent::Added(LinkInfo::named(6, "eth2")), now);
        take(&mut m);
        let port = LinkInfo { master: Some((7, "br0".into())), ..LinkInfo::named(6, "eth2") };
        m.handle(LinkEvent::Changed(port), now);
        assert_eq!(take(&mut m), vec![Call::Detach(6, "eth2".into())]);
        assert_eq!(status(&m, 6).reason, "enslaved to br0");
    }

    #[test]
    fn removal_forgets_without_detaching() {
        let mut m = manager();
        let now = Instant::now();
        m.handle(LinkEvent::Added(LinkInfo::named(8, "eth3")), now);
        m.handle(LinkEvent::Added(LinkInfo::named(9, "vethx")), now);
        take(&mut m);
        m.handle(LinkEvent::Removed { index: 8, name: "eth3".into() }, now);
        m.handle(LinkEvent::Removed { index: 9, name: "vethx".into() }, now);
        // Unknown index: ignored.
        m.handle(LinkEvent::Removed { index: 99, name: "ghost".into() }, now);
        assert_eq!(take(&mut m), vec![Call::Forget(8, "eth3".into())]);
        assert!(m.snapshot().is_empty());
        // Nothing left to retry.
        m.tick(now + Duration::from_secs(600));
        assert!(take(&mut m).is_empty());
    }

    #[test]
    fn failed_attach_is_retried_with_backoff() {
        let mut m = manager().with_backoff(Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(4) });
        let t0 = Instant::now();
        m.attacher_mut().fail_attach = true;
        m.handle(LinkEvent::Added(LinkInfo::named(2, "eth0")), t0);
        assert_eq!(take(&mut m).len(), 1);
        let s = status(&m, 2);
        assert_eq!(s.error.as_deref(), Some("attach failed: EBUSY"));
        assert!(s.hooks.is_empty());
        assert_eq!(m.next_retry(), Some(t0 + Duration::from_secs(1)));

        // Before the backoff: neither a tick nor an unrelated event retries.
        m.tick(t0 + Duration::from_millis(500));
        m.handle(LinkEvent::Added(LinkInfo::named(3, "docker0")), t0 + Duration::from_millis(600));
        assert!(take(&mut m).is_empty());

        // Due: retried, fails again, next delay doubles (1s, 2s, 4s, 4s).
        m.tick(t0 + Duration::from_secs(1));
        assert_eq!(take(&mut m).len(), 1);
        assert_eq!(m.next_retry(), Some(t0 + Duration::from_secs(3)));
        m.tick(t0 + Duration::from_secs(3));
        assert_eq!(m.next_retry(), Some(t0 + Duration::from_secs(7)));
        m.tick(t0 + Duration::from_secs(7));
        assert_eq!(m.next_retry(), Some(t0 + Duration::from_secs(11)));
        take(&mut m);

        // A change to the link itself retries at once and, succeeding, clears the error.
        m.attacher_mut().fail_attach = false;
        let down = LinkInfo { oper_up: false, ..LinkInfo::named(2, "eth0") };
        m.handle(LinkEvent::Changed(down), t0 + Duration::from_secs(8));
        assert_eq!(take(&mut m), vec![Call::Attach(2, "eth0".into())]);
        let s = status(&m, 2);
        assert!(s.error.is_none() && !s.hooks.is_empty());
        assert_eq!(m.next_retry(), None);
    }

    #[test]
    fn deselecting_a_failing_link_clears_its_error() {
        let mut m = manager();
        let now = Instant::now();
        m.attacher_mut().fail_attach = true;
        m.handle(LinkEvent::Added(LinkInfo::named(2, "eth0")), now);
        m.handle(LinkEvent::Changed(LinkInfo::named(2, "enP1")), now);
        let s = status(&m, 2);
        assert!(s.error.is_none() && !s.selected);
        assert_eq!(m.next_retry(), None);
    }

    #[test]
    fn selector_change_re_decides_everything() {
        let mut m = manager();
        let now = Instant::now();
        m.sync(vec![LinkInfo::named(2, "eth0"), LinkInfo::named(3, "docker0")], now);
        take(&mut m);
        let sel = Selector::new(vec![Pattern::new("^docker").unwrap()], vec![], vec![]);
        m.set_selector(sel, now);
        let mut calls = take(&mut m);
        calls.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(calls, vec![Call::Attach(3, "docker0".into()), Call::Detach(2, "eth0".into())]);
    }

    #[test]
    fn backoff_caps() {
        let b = Backoff { initial: Duration::from_millis(500), max: Duration::from_secs(30) };
        assert_eq!(b.delay(1), Duration::from_millis(500));
        assert_eq!(b.delay(2), Duration::from_secs(1));
        assert_eq!(b.delay(100), Duration::from_secs(30));
    }
}
