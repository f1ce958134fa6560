//! `healthCheckNodePort` servers for `externalTrafficPolicy: Local` Services: like kube-proxy,
//! answer 200 while this node has local endpoints and 503 otherwise, so external load
//! balancers only send traffic to nodes that can serve it locally.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, RwLock},
};

use http_body_util::Full;
use hyper::{body::Bytes, Response, StatusCode};
use tokio::task::JoinHandle;

use crate::{report::events::Warnings, translate::HealthCheck};

type Shared = Arc<RwLock<BTreeMap<u16, HealthCheck>>>;

/// The set of health-check listeners, reconciled against the Services after every flush.
#[derive(Default)]
pub struct HealthCheckServers {
    state: Shared,
    tasks: BTreeMap<u16, JoinHandle<()>>,
    /// Where a port that cannot be bound is reported (on the Service, as kube-proxy does).
    warnings: Option<Warnings>,
}

/// The body kube-proxy serves.
pub fn body(hc: &HealthCheck) -> String {
    serde_json::json!({
        "service": {"namespace": hc.namespace, "name": hc.name},
        "localEndpoints": hc.local_endpoints,
        "serviceProxyHealthy": true,
    })
    .to_string()
}

/// kube-proxy's Event reason and message for a healthCheckNodePort it cannot listen on.
pub const FAILED_TO_START: &str = "FailedToStartServiceHealthcheck";

pub fn failed_to_start_note(node: &str, hc: &HealthCheck, err: &std::io::Error) -> String {
    format!("node {node} failed to start healthcheck \"{}/{}\" on port {}: {err}", hc.namespace, hc.name, hc.port)
}

impl HealthCheckServers {
    pub fn new(warnings: Option<Warnings>) -> Self {
        HealthCheckServers { state: Shared::default(), tasks: BTreeMap::new(), warnings }
    }

    pub fn update(&mut self, checks: BTreeMap<u16, HealthCheck>) {
        for (port, t) in &self.tasks {
            if !checks.contains_key(port) {
                t.abort();
            }
        }
        self.tasks.retain(|p, _| checks.contains_key(p));
        for (port, hc) in &checks {
            if !self.tasks.contains_key(port) {
                self.tasks.insert(*port, tokio::spawn(serve(hc.clone(), self.state.clone(), self.warnings.clone())));
            }
        }
        *self.state.write().unwrap() = checks;
    }
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for t in self.tasks.values() {
            t.abort();
        }
    }
}

/// Serves `first` (the Service that claimed the port; later ones are read from `state`).
async fn serve(first: HealthCheck, state: Shared, warnings: Option<Warnings>) {
    let port = first.port;
    let l = crate::report::health::bind_retrying(SocketAddr::from(([0, 0, 0, 0], port)), "healthCheckNodePort", |e| {
        if let Some(w) = &warnings {
            w.on_service(&first.namespace, &first.name, FAILED_TO_START, "Listen", &failed_to_start_note(w.node(), &first, e));
        }
    })
    .await;
    // The port is open to anyone who reaches the node: the agent's hardened server (header
    // timeout, bounded connections and request heads, accept errors backed off).
    let respond = move |_req: &hyper::Request<hyper::body::Incoming>| {
        let hc = state.read().unwrap().get(&port).cloned();
        let (code, body) = match hc {
            Some(hc) if hc.local_endpoints > 0 => (StatusCode::OK, body(&hc)),
            Some(hc) => (StatusCode::SERVICE_UNAVAILABLE, body(&hc)),
            None => (StatusCode::NOT_FOUND, String::new()),
        };
        Response::builder()
            .status(code)
            .header("Content-Type", "application/json")
            .header("X-Content-Type-Options", "nosniff")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_default()
    };
    if let Err(e) = crate::report::health::serve_http_limited(l, "healthCheckNodePort", crate::report::health::HTTP_LIMITS, respond).await {
        tracing::warn!("healthCheckNodePort {port}: {e:#}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::health::test_http;

    /// `GET /healthz` on the loopback side of a server listening on all addresses.
    async fn get(port: u16) -> String {
        test_http::get_raw(SocketAddr::from(([127, 0, 0, 1], port)), "/healthz").await
    }

    async fn get_once_served(port: u16) -> String {
        test_http::get_once_served(SocketAddr::from(([127, 0, 0, 1], port)), "/healthz").await
    }

    #[tokio::test]
    async fn answers_like_kube_proxy_and_follows_updates() {
        // Find a free port on loopback (the server listens on all addresses).
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let hc = |n| HealthCheck { port, namespace: "d".into(), name: "web".into(), local_endpoints: n };
        let mut s = HealthCheckServers::default();
        s.update(BTreeMap::from([(port, hc(2))]));
        let r = get_once_served(port).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains(r#""localEndpoints":2"#), "{r}");
        s.update(BTreeMap::from([(port, hc(0))]));
        let r = get(port).await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        s.update(BTreeMap::new());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err(), "listener closed");
    }

    #[test]
    fn a_port_it_cannot_listen_on_is_told_as_kube_proxy_tells_it() {
        let hc = HealthCheck { port: 32000, namespace: "d".into(), name: "web".into(), local_endpoints: 1 };
        let e = std::io::Error::from_raw_os_error(98); // EADDRINUSE
        assert_eq!(failed_to_start_note("n1", &hc, &e), r#"node n1 failed to start healthcheck "d/web" on port 32000: Address already in use (os error 98)"#);
    }

    /// A port held by another process (kube-proxy during a migration) is served once it is
    /// free, without another update.
    #[tokio::test]
    async fn serves_a_port_once_its_holder_lets_go() {
        let holder = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = holder.local_addr().unwrap().port();
        let mut s = HealthCheckServers::default();
        s.update(BTreeMap::from([(port, HealthCheck { port, namespace: "d".into(), name: "web".into(), local_endpoints: 1 })]));
        // Long enough for the first bind to fail and a retry to be scheduled.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        drop(holder);
        // The retries come 0.5, 1 and 2 s apart: answered within ~2 s.
        let r = get_once_served(port).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
}
