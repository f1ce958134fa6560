//! The `GardenetAgentReady` condition on the agent's own Node.
//!
//! How it is written, and why that way: `status.conditions` is a list, shared with the
//! kubelet and other node agents (node-problem-detector, CSI and CNI plugins).
//! - A JSON merge patch replaces lists whole: it would drop everybody else's conditions.
//! - A strategic merge patch merges `conditions` by `type` on a real API server (that is how
//!   the kubelet writes them), but only because the server knows the Node schema; anything
//!   in between that treats it as a plain merge (proxies, test doubles, a CRD-backed fake)
//!   silently turns it into the destructive case above.
//! - Read-modify-write of the whole list with a resourceVersion precondition is safe but
//!   conflicts with every unrelated Node change (heartbeats, labels, images), and retries.
//! - A JSON patch (RFC 6902) that addresses our entry by index and guards it with a `test`
//!   of its `type` touches exactly one list element and nothing else. If the list shifted
//!   under us, the `test` fails (422) and we re-read; appending a new entry is guarded by a
//!   `test` of the resourceVersion instead (it happens once per Node). That is what this
//!   module does: safe against every concurrent writer, and conflict-free in the common case.
//!
//! The condition is rewritten when it changes and, as a heartbeat, every
//! [`NodeReporterConfig::heartbeat`]: the aggregation treats a condition whose
//! `lastHeartbeatTime` is too old as "no agent", since a crashed agent cannot withdraw its
//! `True`. `lastTransitionTime` is kept unless the status flips.

use std::{sync::Arc, time::Duration};

use anyhow::{bail, Context};
use k8s_openapi::{
    api::core::v1::{Node, NodeCondition},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{Api, Client};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::{api_code, stopped, timed, Shutdown};
use crate::{
    gardener::{
        aggregate::{map_pressure_condition, node_condition},
        capability::CapabilityReport,
    },
    report::health::AgentState,
};

/// Message of the condition an agent leaves behind when it stops *and detaches its
/// programs* (`--detach-on-exit`): the node does not route Services until the next agent is
/// ready. An agent that leaves its pinned programs attached leaves its condition as it is:
/// Services keep working, and if no agent comes back the heartbeat goes stale.
pub const STOPPING_MESSAGE: &str = "gardenet agent is shutting down";

/// How many times a write is retried after losing a race to another writer.
const ATTEMPTS: usize = 3;

#[derive(Clone, Copy, Debug)]
pub struct NodeReporterConfig {
    /// The condition is rewritten at least this often. The aggregation's maximum heartbeat
    /// age ([`super::NetworkReporterConfig::node_max_age`]) must be a few times this.
    pub heartbeat: Duration,
    /// Changes within this window are written together (readiness can flap at start).
    pub min_interval: Duration,
    /// After a failed write, the next attempt comes this soon (not a full heartbeat later).
    pub retry: Duration,
    pub request_timeout: Duration,
    /// On shutdown, write a not-ready condition ([`STOPPING_MESSAGE`]). Set it when the
    /// programs detach on exit.
    pub report_stopping: bool,
}

impl Default for NodeReporterConfig {
    fn default() -> Self {
        NodeReporterConfig {
            heartbeat: Duration::from_secs(60),
            min_interval: Duration::from_secs(1),
            retry: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            report_stopping: false,
        }
    }
}

/// What one report did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    Written,
    /// The Node already says what we would write (and the heartbeat was not due).
    Unchanged,
}

pub struct NodeReporter {
    client: Client,
    nodes: Api<Node>,
    node: String,
    state: Arc<AgentState>,
    config: NodeReporterConfig,
}

/// Node names are DNS subdomains; anything else would address a different URL.
fn valid_node_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl NodeReporter {
    pub fn new(client: Client, node: &str, state: Arc<AgentState>, config: NodeReporterConfig) -> anyhow::Result<Self> {
        if !valid_node_name(node) {
            bail!("node name {node:?} is not a valid Kubernetes node name (set --node-name / NODE_NAME)");
        }
        Ok(NodeReporter { nodes: Api::all(client.clone()), client, node: node.to_owned(), state, config })
    }

    /// The condition the agent's state calls for now.
    pub fn desired(&self, stopping: bool) -> NodeCondition {
        let r = self.state.snapshot();
        let capability = CapabilityReport { missing: r.missing.clone() };
        let pending = r.pending();
        let now = Time(Timestamp::now());
        if stopping {
            return node_condition(false, &capability, Some(STOPPING_MESSAGE), &now);
        }
        let detail = (!pending.is_empty()).then(|| pending.join("; "));
        node_condition(pending.is_empty(), &capability, detail.as_deref(), &now)
    }

    /// The map pressure condition the agent's state calls for now.
    pub fn desired_pressure(&self) -> NodeCondition {
        map_pressure_condition(&self.state.snapshot().map_pressure, &Time(Timestamp::now()))
    }

    /// Writes `desired(stopping)` if it differs from the Node's condition, or always when
    /// `heartbeat` is set; then the map pressure condition, which is only added to a Node once
    /// it is True (a Node without it has no pressure).
    pub async fn report(&self, heartbeat: bool, stopping: bool) -> anyhow::Result<Report> {
        let ready = self.report_condition(|| self.desired(stopping), heartbeat, true).await?;
        let pressure = self.report_condition(|| self.desired_pressure(), heartbeat, false).await?;
        Ok(if ready == Report::Written || pressure == Report::Written { Report::Written } else { Report::Unchanged })
    }

    /// Writes one condition (`want().type_`) of the Node. `add_false`: add it also when it is
    /// False and the Node does not have it yet.
    async fn report_condition(&self, want: impl Fn() -> NodeCondition, heartbeat: bool, add_false: bool) -> anyhow::Result<Report> {
        let limit = self.config.request_timeout;
        for _ in 0..ATTEMPTS {
            let mut want = want();
            let kind = want.type_.clone();
            let node = timed(limit, "reading own Node", self.nodes.get(&self.node)).await?.with_context(|| format!("reading Node {}", self.node))?;
            let rv = node.metadata.resource_version.clone().unwrap_or_default();
            let status = node.status.as_ref();
            let conditions = status.and_then(|s| s.conditions.as_ref());
            let ours = conditions.and_then(|cs| cs.iter().position(|c| c.type_ == kind));
            if ours.is_none() && !add_false && want.status == "False" {
                return Ok(Report::Unchanged);
            }
            let ops = match (status, conditions, ours) {
                (_, Some(cs), Some(i)) => {
                    let have = &cs[i];
                    if have.status == want.status && have.last_transition_time.is_some() {
                        want.last_transition_time = have.last_transition_time.clone();
                    }
                    let same = have.status == want.status && have.reason == want.reason && have.message == want.message;
                    if same && !heartbeat {
                        return Ok(Report::Unchanged);
                    }
                    json!([
                        {"op": "test", "path": format!("/status/conditions/{i}/type"), "value": kind},
                        {"op": "replace", "path": format!("/status/conditions/{i}"), "value": want},
                    ])
                }
                (_, Some(_), None) => json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": "/status/conditions/-", "value": want},
                ]),
                (Some(_), None, _) => json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": "/status/conditions", "value": [want]},
                ]),
                (None, _, _) => json!([
                    {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": "/status", "value": {"conditions": [want]}},
                ]),
            };
            match timed(limit, "patching own Node status", self.json_patch_status(&ops)).await? {
                Ok(_) => return Ok(Report::Written),
                // 422: a `test` failed (the list moved); 409: a write conflict. Re-read.
                Err(e) if matches!(api_code(&e), Some(409 | 422)) => {
                    tracing::debug!(node = %self.node, "node condition write raced with another writer: {e}");
                }
                Err(e) => return Err(e).with_context(|| format!("patching the status of Node {}", self.node)),
            }
        }
        bail!("patching the status of Node {}: lost {ATTEMPTS} races with other writers", self.node)
    }

    /// `Api::patch_status` with `Patch::Json` needs kube's `jsonpatch` feature; a raw
    /// request does the same without it.
    async fn json_patch_status(&self, ops: &Value) -> kube::Result<Node> {
        let body = serde_json::to_vec(ops).map_err(kube::Error::SerdeError)?;
        let request = http::Request::patch(format!("/api/v1/nodes/{}/status", self.node))
            .header(http::header::CONTENT_TYPE, "application/json-patch+json")
            .header(http::header::ACCEPT, "application/json")
            .body(body)
            .map_err(kube::Error::HttpError)?;
        self.client.request(request).await
    }

    /// Reports on readiness changes and every heartbeat until `shutdown`; then, with
    /// [`NodeReporterConfig::report_stopping`], leaves a "shutting down" condition behind.
    pub async fn run(self, mut shutdown: Shutdown) {
        let mut changes = self.state.subscribe();
        let mut next_heartbeat = Instant::now();
        let mut backoff = self.config.retry;
        loop {
            // Before reading the state: a change during the write wakes the next round.
            changes.mark_unchanged();
            let heartbeat = Instant::now() >= next_heartbeat;
            match self.report(heartbeat, false).await {
                Ok(_) => {
                    backoff = self.config.retry;
                    if heartbeat {
                        next_heartbeat = Instant::now() + self.config.heartbeat;
                    }
                }
                Err(e) => {
                    tracing::warn!(retry_in = ?backoff, "reporting node readiness: {e:#}");
                    // Retry as a heartbeat (the write is what failed), backing off while it
                    // keeps failing (e.g. the Node does not exist): never a busy loop.
                    next_heartbeat = Instant::now() + backoff;
                    backoff = (backoff * 2).min(self.config.heartbeat);
                }
            }
            tokio::select! {
                () = tokio::time::sleep_until(next_heartbeat) => {}
                // The sender lives in `self.state`: this never errs while we run.
                Ok(()) = changes.changed() => {
                    // Let a burst of changes settle into one write.
                    tokio::select! {
                        () = tokio::time::sleep(self.config.min_interval) => {}
                        () = stopped(&mut shutdown) => break,
                    }
                }
                () = stopped(&mut shutdown) => break,
            }
        }
        if self.config.report_stopping {
            if let Err(e) = self.report(true, true).await {
                tracing::warn!("reporting node shutdown: {e:#}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names() {
        assert!(valid_node_name("ip-10-0-1-2.eu-west-1.compute.internal"));
        for bad in ["", "a/b", "A", "n?x=1", "a b"] {
            assert!(!valid_node_name(bad), "{bad:?}");
        }
    }
}
