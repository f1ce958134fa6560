//! Reporting: readiness to Kubernetes and Gardener, health and metrics over HTTP, Events.
//!
//! - [`node::NodeReporter`]: every agent keeps the `GardenetAgentReady` condition on its own
//!   Node current (on change, and as a heartbeat so a dead agent's `True` goes stale).
//! - [`lease::Elector`]: the agents elect one of them with a `coordination.k8s.io` Lease.
//! - [`network::NetworkReporter`]: the elected agent aggregates the Nodes' conditions into
//!   the Gardener `Network`'s status (possibly in another cluster: the seed).
//! - [`health`] (`/healthz`, `/readyz`, `/metrics` from [`metrics`]) and [`healthcheck`]
//!   (kube-proxy's per-Service `healthCheckNodePort` servers): what the agent serves over HTTP.
//! - [`events`]: Kubernetes Events for what could not be programmed.
//! - [`wiring`]: the flags and the start/stop of all of the above for `gardenet-agent run`.
//!
//! The decisions (which condition, which status) are pure functions in
//! [`crate::gardener::aggregate`]; this module only reads, writes and retries. Each writer
//! changes its own fields only and uses a precondition, so concurrent writers (kubelet,
//! Gardener, other extensions) never lose theirs.
//!
//! Every API call has a deadline ([`timed`]): a hung request must not keep a leader from
//! noticing that its lease ran out, nor a reporter from its next heartbeat.

pub mod events;
pub mod health;
pub mod healthcheck;
pub mod lease;
pub mod metrics;
pub mod network;
pub mod node;
pub mod wiring;

use std::{future::Future, time::Duration};

use anyhow::anyhow;
use tokio::sync::watch;

pub use lease::{Elector, Leadership, LeaseTiming};
pub use network::{NetworkRef, NetworkReporter, NetworkReporterConfig};
pub use node::{NodeReporter, NodeReporterConfig};
pub use wiring::{report_interfaces, serve_endpoints, serve_proxy_healthz, OptionalAddr, Reporting, StatusArgs};

/// Tells the reporters and the elector to stop (and release / report what they hold):
/// send `true`, or drop the sender.
pub type Shutdown = watch::Receiver<bool>;

pub fn shutdown_channel() -> (watch::Sender<bool>, Shutdown) {
    watch::channel(false)
}

/// Resolves once shutdown is requested (or the sender is gone).
async fn stopped(shutdown: &mut Shutdown) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// The outcome of one API call that had `limit` to complete: the outer error is the
/// deadline, the inner one what the API server (or transport) said.
async fn timed<T>(limit: Duration, what: &str, call: impl Future<Output = kube::Result<T>>) -> anyhow::Result<kube::Result<T>> {
    tokio::time::timeout(limit, call).await.map_err(|_| anyhow!("{what}: no answer within {limit:?}"))
}

/// The HTTP status code of an API error (`None` for transport and decoding errors).
fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}
