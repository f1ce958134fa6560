//! Leader election with a `coordination.k8s.io/v1` Lease, the way client-go does it.
//!
//! Safety (never two leaders) rests on two rules:
//! - Every write is a create or a replace carrying the resourceVersion that was read, so of
//!   two agents racing for the Lease exactly one write succeeds.
//! - Time is only ever compared on one clock. A candidate considers the holder's lease
//!   expired when it has seen no change of the Lease (its resourceVersion) for the lease
//!   duration, measured on the candidate's monotonic clock from when it *observed* the last
//!   change; wall-clock `renewTime`s of other nodes are never trusted (clock skew). The
//!   holder in turn considers itself leader only until `renew_deadline` after it *sent* its
//!   last successful renewal, also on its own monotonic clock. The server applied that
//!   renewal after it was sent, and a candidate observed it after that, so with
//!   `renew_deadline < lease_duration` the holder has stopped leading before any candidate
//!   may take over (assuming the clocks run at about the same rate, as client-go does).

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    api::{Api, PostParams},
    Client,
};
use tokio::sync::watch;

use super::{api_code, stopped, timed, Shutdown};
use crate::gardener::{LEASE_NAME, LEASE_NAMESPACE};

/// Election timing. The defaults are client-go's usual ones for a small fleet: renew every
/// 2 s, lease valid 15 s, a leader that could not renew for 10 s steps down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a lease is valid after the holder's last renewal, as seen by candidates.
    pub lease_duration: Duration,
    /// How long after its last successful renewal the holder keeps acting as leader.
    pub renew_deadline: Duration,
    /// How often the holder renews and candidates look at the Lease.
    pub retry_period: Duration,
    /// Deadline of one API request.
    pub request_timeout: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        LeaseTiming {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
        }
    }
}

impl LeaseTiming {
    /// The orderings the safety argument (module docs) needs.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.retry_period.is_zero() || self.request_timeout.is_zero() {
            bail!("lease timing: retry period and request timeout must be positive: {self:?}");
        }
        if self.renew_deadline >= self.lease_duration {
            bail!("lease timing: renew deadline must be shorter than the lease duration: {self:?}");
        }
        if self.retry_period >= self.renew_deadline {
            bail!("lease timing: retry period must be shorter than the renew deadline: {self:?}");
        }
        Ok(())
    }

    /// `spec.leaseDurationSeconds`: whole seconds, rounded up so others never wait less.
    fn lease_duration_seconds(&self) -> i32 {
        let d = self.lease_duration;
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
    }
}

/// Whether this agent currently leads; cheap to clone and to ask from any task.
#[derive(Clone)]
pub struct Leadership(Arc<LeadershipInner>);

struct LeadershipInner {
    /// Leading until this instant (see the module docs); `None`: not leading.
    until: Mutex<Option<Instant>>,
    /// A hint for tasks that want to act as soon as leadership is won or lost.
    changes: watch::Sender<bool>,
}

impl Default for Leadership {
    fn default() -> Self {
        Leadership(Arc::new(LeadershipInner { until: Mutex::new(None), changes: watch::channel(false).0 }))
    }
}

impl Leadership {
    /// The authority: true only within the renew deadline of the last successful renewal,
    /// even if the elector task is stuck.
    pub fn is_leader(&self) -> bool {
        self.until().is_some_and(|until| Instant::now() < until)
    }

    /// Wakes when leadership is won or lost. The value may lag (a lease that ran out while
    /// the elector was stuck); ask [`is_leader`](Self::is_leader).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.0.changes.subscribe()
    }

    fn until(&self) -> Option<Instant> {
        *self.0.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, until: Option<Instant>) {
        *self.0.until.lock().unwrap_or_else(|e| e.into_inner()) = until;
        let leading = self.is_leader();
        self.0.changes.send_if_modified(|v| std::mem::replace(v, leading) != leading);
    }
}

/// Competes for one Lease under one identity.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: LeaseTiming,
    leadership: Leadership,
    /// The Lease's resourceVersion when last read, and when (on our clock) it was first
    /// seen with that version.
    observed: Option<(String, Instant)>,
}

impl Elector {
    /// gardenet's election: `kube-system/gardenet-agent`. `identity` must be unique per agent
    /// *process* (two pods on one node during a rolling update must not share it).
    pub fn gardenet(client: Client, identity: impl Into<String>, timing: LeaseTiming) -> anyhow::Result<Self> {
        Self::new(client, LEASE_NAMESPACE, LEASE_NAME, identity, timing)
    }

    pub fn new(client: Client, namespace: &str, name: &str, identity: impl Into<String>, timing: LeaseTiming) -> anyhow::Result<Self> {
        timing.validate()?;
        let identity = identity.into();
        if identity.is_empty() {
            bail!("leader election needs a non-empty identity");
        }
        Ok(Elector { api: Api::namespaced(client, namespace), name: name.to_owned(), identity, timing, leadership: Leadership::default(), observed: None })
    }

    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// One round: create the Lease, renew it, or take it over when it expired. Returns
    /// whether this agent leads afterwards. Losing a race (409) is not an error.
    pub async fn try_acquire_or_renew(&mut self) -> anyhow::Result<bool> {
        let result = self.round().await;
        // Refresh the hint: leadership may also have run out by time alone.
        let until = self.leadership.until();
        self.leadership.set(until);
        result.map(|()| self.leadership.is_leader())
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        let limit = self.timing.request_timeout;
        // Sent-time of this round: the conservative start of a leadership it may win.
        let start = Instant::now();
        let current = timed(limit, "reading the election Lease", self.api.get_opt(&self.name)).await?.context("reading the election Lease")?;

        let Some(lease) = current else {
            let lease = Lease { metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() }, spec: Some(self.acquired(None)) };
            let created = timed(limit, "creating the election Lease", self.api.create(&PostParams::default(), &lease)).await?;
            return self.settle(created, start, "creating the election Lease");
        };

        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != rv) {
            self.observed = Some((rv, start));
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
        let next_spec = if holder == Some(self.identity.as_str()) {
            LeaseSpec { renew_time: Some(now()), lease_duration_seconds: Some(self.timing.lease_duration_seconds()), ..spec }
        } else {
            // Someone else holds it (or held it): we do not lead, whatever we thought.
            self.leadership.set(None);
            if holder.is_some() {
                let declared = spec.lease_duration_seconds.and_then(|s| u64::try_from(s).ok()).map_or(Duration::ZERO, Duration::from_secs);
                // The longer of ours and the holder's: a holder configured with a longer
                // lease must not be cut short.
                let valid_for = self.timing.lease_duration.max(declared);
                let seen_at = self.observed.as_ref().map_or(start, |(_, at)| *at);
                if start < seen_at + valid_for {
                    return Ok(());
                }
                tracing::info!(previous = holder, "election Lease expired; taking over");
            }
            self.acquired(Some(spec))
        };
        // `lease` carries the resourceVersion read above: a concurrent writer makes this 409.
        let next = Lease { spec: Some(next_spec), ..lease };
        let replaced = timed(limit, "writing the election Lease", self.api.replace(&self.name, &PostParams::default(), &next)).await?;
        self.settle(replaced, start, "writing the election Lease")
    }

    /// The spec of a Lease this agent takes: from scratch, or over from `previous` (held by
    /// someone else, or released). A change of holder is a transition, as in client-go.
    fn acquired(&self, previous: Option<LeaseSpec>) -> LeaseSpec {
        let transitions = previous.as_ref().map_or(0, |p| p.lease_transitions.unwrap_or(0).saturating_add(1));
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.timing.lease_duration_seconds()),
            acquire_time: Some(now()),
            renew_time: Some(now()),
            lease_transitions: Some(transitions),
            ..previous.unwrap_or_default()
        }
    }

    fn settle(&mut self, written: kube::Result<Lease>, start: Instant, what: &str) -> anyhow::Result<()> {
        match written {
            Ok(lease) => {
                // Our own write is a change we have seen.
                if let Some(rv) = lease.metadata.resource_version {
                    self.observed = Some((rv, start));
                }
                self.leadership.set(Some(start + self.timing.renew_deadline));
                Ok(())
            }
            // Someone else wrote first; the next round reads what they wrote. A leader keeps
            // its (time-bounded) leadership: the conflict may be a foreign annotation.
            Err(e) if api_code(&e) == Some(409) => Ok(()),
            Err(e) => Err(e).context(what.to_owned()),
        }
    }

    /// Gives the Lease up, so a successor need not wait for it to expire. Stops leading
    /// first: from here on this agent must not act as leader, whatever the write does.
    pub async fn release(&mut self) -> anyhow::Result<()> {
        self.leadership.set(None);
        let limit = self.timing.request_timeout;
        let Some(lease) = timed(limit, "reading the election Lease", self.api.get_opt(&self.name)).await?.context("reading the election Lease")? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.clone() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        let next = Lease { spec: Some(LeaseSpec { holder_identity: None, lease_duration_seconds: Some(1), renew_time: Some(now()), ..spec }), ..lease };
        match timed(limit, "releasing the election Lease", self.api.replace(&self.name, &PostParams::default(), &next)).await? {
            Ok(_) => {
                tracing::info!("released the election Lease");
                Ok(())
            }
            // Taken over meanwhile: nothing left to release.
            Err(e) if api_code(&e) == Some(409) => Ok(()),
            Err(e) => Err(e).context("releasing the election Lease"),
        }
    }

    /// Competes until `shutdown`, then releases the Lease if held.
    pub async fn run(mut self, mut shutdown: Shutdown) -> anyhow::Result<()> {
        let mut leading = false;
        loop {
            match self.try_acquire_or_renew().await {
                Ok(now_leading) => {
                    if now_leading != leading {
                        tracing::info!(identity = %self.identity, "{}", if now_leading { "became leader" } else { "lost leadership" });
                    }
                    leading = now_leading;
                }
                Err(e) => {
                    leading = self.leadership.is_leader();
                    tracing::warn!("leader election: {e:#}");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.timing.retry_period) => {}
                () = stopped(&mut shutdown) => break,
            }
        }
        self.release().await
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_must_be_ordered() {
        assert!(LeaseTiming::default().validate().is_ok());
        let bad = LeaseTiming { renew_deadline: Duration::from_secs(15), ..Default::default() };
        assert!(bad.validate().is_err());
        let bad = LeaseTiming { retry_period: Duration::from_secs(10), ..Default::default() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn lease_seconds_round_up() {
        let t = |ms| LeaseTiming { lease_duration: Duration::from_millis(ms), ..Default::default() };
        assert_eq!(t(15_000).lease_duration_seconds(), 15);
        assert_eq!(t(1_200).lease_duration_seconds(), 2);
        assert_eq!(t(300).lease_duration_seconds(), 1);
    }

    #[test]
    fn leadership_runs_out_by_itself() {
        let l = Leadership::default();
        let mut rx = l.subscribe();
        assert!(!l.is_leader());
        l.set(Some(Instant::now() + Duration::from_secs(60)));
        assert!(l.is_leader());
        assert!(rx.has_changed().unwrap() && *rx.borrow_and_update());
        l.set(Some(Instant::now()));
        assert!(!l.is_leader());
        assert!(!*rx.borrow_and_update());
    }
}
