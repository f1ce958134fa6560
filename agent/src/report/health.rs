//! The agent's own view of its health, and the HTTP endpoints that expose it.
//!
//! - `/healthz` (liveness): 200 while the run loop keeps beating ([`AgentState::beat`]);
//!   503 once the last beat is older than the liveness timeout (30 s by default), or when
//!   the loop has not started within the startup grace (5 min: loading programs is slow).
//!   A wedged loop is what a restart can fix; a not-ready dataplane is not, so it does not
//!   fail this.
//! - `/readyz` (readiness): 200 `ok` when the programs are loaded, attached to every selected
//!   interface and the first full sync is programmed; else 503 with the reasons, one a line.
//! - `/metrics`: [`Metrics::encode`].
//!
//! [`serve_proxy_healthz`] is a separate server with kube-proxy's health check contract
//! (port 10256): cloud load balancers probe it to learn whether a node can route Services
//! (`externalTrafficPolicy: Cluster`), so a kube-proxy replacement must answer it.
//!
//! [`AgentState`] is shared (`Arc`) between the run loop (writer), the HTTP server and the
//! Node status reporter (readers); readers that want to react to readiness changes
//! [`subscribe`](AgentState::subscribe).

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, RwLock,
    },
    time::{Duration, Instant},
};

use http_body_util::Full;
use hyper::{
    body::{Bytes, Incoming},
    header,
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::watch};

use crate::report::metrics::{self, Metrics};

/// How long the run loop may go without a beat before `/healthz` fails.
pub const DEFAULT_LIVENESS_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the agent may take to reach its run loop (the first beat). Loading and
/// verifying the programs alone can take over a minute on a busy node; restarting the
/// agent for that would only start the wait again. A load that hangs for longer is a fault.
pub const DEFAULT_STARTUP_GRACE: Duration = Duration::from_secs(300);

/// `last_beat_ms` before the first beat.
const NEVER: u64 = u64::MAX;

/// A scraper or probe that sends nothing must not hold a connection forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Attachment of the TC load balancer to one selected interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfaceState {
    pub attached: bool,
    /// Why the last attach failed, if it did.
    pub error: Option<String>,
}

/// The parts of readiness. An interface listed here is one the agent must be attached to:
/// the run loop registers every selected interface (attached or not).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    pub programs_loaded: bool,
    pub interfaces: BTreeMap<String, InterfaceState>,
    /// The first full sync of Services and EndpointSlices is programmed.
    pub synced: bool,
    /// When the last flush finished (informational, not a readiness condition).
    pub last_sync: Option<Instant>,
    /// The same, as wall-clock time (reported by the kube-proxy-style health check).
    pub last_sync_at: Option<std::time::SystemTime>,
    /// Dataplane prerequisites this node lacks (`gardener::capability::check`).
    pub missing: Vec<String>,
    /// Maps at least 90% full, one line each (`crate::dataplane::mapfill`): not a readiness condition,
    /// reported as the Node's `GardenetMapPressure` condition.
    pub map_pressure: Vec<String>,
    /// Why the pod network is not installed yet (`None`: installed, or not gardenet's job).
    pub pod_network: Option<String>,
}

impl Readiness {
    /// `Ok` when ready, else every reason it is not, in a stable order.
    pub fn ready(&self) -> Result<(), Vec<String>> {
        let mut reasons: Vec<String> = self.missing.iter().map(|m| format!("missing prerequisite: {m}")).collect();
        reasons.extend(self.pending());
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons)
        }
    }

    /// The reasons other than missing prerequisites: what the agent is still working on.
    /// (The Node condition reports missing prerequisites separately, as they are a
    /// configuration problem and not progress.)
    pub fn pending(&self) -> Vec<String> {
        let mut reasons = Vec::new();
        if !self.programs_loaded {
            reasons.push("eBPF programs are not loaded".to_owned());
        }
        for (name, iface) in &self.interfaces {
            match (&iface.attached, &iface.error) {
                (true, _) => {}
                (false, Some(e)) => reasons.push(format!("interface {name}: not attached: {e}")),
                (false, None) => reasons.push(format!("interface {name}: not attached yet")),
            }
        }
        if !self.synced {
            reasons.push("first full sync of Services and EndpointSlices is not programmed yet".to_owned());
        }
        if let Some(why) = &self.pod_network {
            reasons.push(format!("pod network not installed: {why}"));
        }
        reasons
    }
}

/// Shared agent state: readiness parts and the run loop's heartbeat.
pub struct AgentState {
    readiness: RwLock<Readiness>,
    started: Instant,
    /// Milliseconds since `started` of the last beat; [`NEVER`] before the first.
    last_beat_ms: AtomicU64,
    liveness_timeout: Duration,
    startup_grace: Duration,
    /// Bumped whenever the readiness verdict (or its reasons) or the map pressure changes.
    changes: watch::Sender<u64>,
    /// The node may receive load-balancer traffic (not being deleted, not marked for removal
    /// by the cluster autoscaler), as kube-proxy's health check reports it.
    node_eligible: std::sync::atomic::AtomicBool,
}

impl Default for AgentState {
    fn default() -> Self {
        Self::new(DEFAULT_LIVENESS_TIMEOUT, DEFAULT_STARTUP_GRACE)
    }
}

impl AgentState {
    /// `/healthz` fails when the run loop has not beaten for `liveness_timeout`, or has not
    /// started within `startup_grace`.
    pub fn new(liveness_timeout: Duration, startup_grace: Duration) -> Self {
        AgentState {
            readiness: RwLock::default(),
            started: Instant::now(),
            last_beat_ms: AtomicU64::new(NEVER),
            liveness_timeout,
            startup_grace,
            changes: watch::channel(0).0,
            node_eligible: std::sync::atomic::AtomicBool::new(true),
        }
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.node_eligible.store(eligible, Ordering::Relaxed);
    }

    pub fn node_eligible(&self) -> bool {
        self.node_eligible.load(Ordering::Relaxed)
    }

    /// A copy of the current readiness parts.
    pub fn snapshot(&self) -> Readiness {
        self.readiness.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn ready(&self) -> Result<(), Vec<String>> {
        self.readiness.read().unwrap_or_else(|e| e.into_inner()).ready()
    }

    /// Changes readiness parts; subscribers are woken only if the verdict, its reasons or the map
    /// pressure changed (not for every `last_sync`), so they can afford to react to each wake-up.
    pub fn update(&self, f: impl FnOnce(&mut Readiness)) {
        // A panic while holding the lock cannot leave a half-updated struct of plain
        // fields behind in a way that matters here: keep going with what is there.
        let mut r = self.readiness.write().unwrap_or_else(|e| e.into_inner());
        let before = (r.ready(), r.map_pressure.clone());
        f(&mut r);
        let after = (r.ready(), r.map_pressure.clone());
        drop(r);
        if before != after {
            self.changes.send_modify(|generation| *generation += 1);
        }
    }

    pub fn set_map_pressure(&self, pressure: Vec<String>) {
        self.update(|r| r.map_pressure = pressure);
    }

    pub fn set_programs_loaded(&self, loaded: bool) {
        self.update(|r| r.programs_loaded = loaded);
    }

    /// Registers a selected interface and its attachment (`error` when attaching failed).
    pub fn set_interface(&self, name: &str, attached: bool, error: Option<String>) {
        self.update(|r| {
            r.interfaces.insert(name.to_owned(), InterfaceState { attached, error });
        });
    }

    /// Replaces the whole set of selected interfaces (e.g. from the link manager's snapshot):
    /// interfaces not in `interfaces` are no longer required.
    pub fn set_interfaces(&self, interfaces: BTreeMap<String, InterfaceState>) {
        self.update(|r| r.interfaces = interfaces);
    }

    /// An interface that is gone or no longer selected is no longer required.
    pub fn remove_interface(&self, name: &str) {
        self.update(|r| {
            r.interfaces.remove(name);
        });
    }

    /// Records a finished flush; `synced` is the pipeline's first-full-sync flag.
    pub fn set_synced(&self, synced: bool) {
        self.update(|r| {
            r.synced = synced;
            r.last_sync = Some(Instant::now());
            r.last_sync_at = Some(std::time::SystemTime::now());
        });
    }

    pub fn set_missing(&self, missing: Vec<String>) {
        self.update(|r| r.missing = missing);
    }

    /// Wakes on readiness changes (see [`update`](Self::update)).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Called by the run loop on every iteration and on a timer while idle.
    pub fn beat(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(NEVER - 1);
        self.last_beat_ms.store(ms, Ordering::Relaxed);
    }

    /// `Err(age of the last beat, or time since start)` when the run loop looks stuck.
    pub fn alive(&self) -> Result<(), Duration> {
        let (age, limit) = match self.last_beat_ms.load(Ordering::Relaxed) {
            NEVER => (self.started.elapsed(), self.startup_grace),
            ms => (self.started.elapsed().saturating_sub(Duration::from_millis(ms)), self.liveness_timeout),
        };
        if age > limit {
            Err(age)
        } else {
            Ok(())
        }
    }
}

/// How long to wait before trying a port that could not be bound again: first, and at most.
const BIND_RETRY_FIRST: Duration = Duration::from_millis(500);
const BIND_RETRY_MAX: Duration = Duration::from_secs(30);

/// Binds `addr` for the server `what`, trying again with growing pauses for as long as the
/// task lives: the port may be held for a while by another process, kube-proxy above all
/// while a node moves from it to gardenet. Giving up would leave load balancers seeing this
/// node unhealthy until the agent restarts. The first failure is logged as a warning and
/// handed to `on_first_failure` (which publishes kube-proxy's Warning Event).
pub async fn bind_retrying(addr: SocketAddr, what: &str, on_first_failure: impl FnOnce(&std::io::Error)) -> TcpListener {
    let mut on_first_failure = Some(on_first_failure);
    let (mut pause, mut failures) = (BIND_RETRY_FIRST, 0u32);
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => {
                if failures > 0 {
                    tracing::info!("{what} on {addr}: listening after {failures} failed attempts");
                }
                return l;
            }
            Err(e) => {
                if failures == 0 {
                    tracing::warn!(
                        "{what} on {addr}: cannot listen: {e} (held by another process, kube-proxy still running?); trying again, every {}s at most",
                        BIND_RETRY_MAX.as_secs()
                    );
                    if let Some(f) = on_first_failure.take() {
                        f(&e);
                    }
                }
                failures += 1;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(BIND_RETRY_MAX);
            }
        }
    }
}

/// Binds `addr` and serves `/healthz`, `/readyz` and `/metrics` until the task is dropped.
pub async fn serve(addr: SocketAddr, state: Arc<AgentState>, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding the health/metrics endpoint {addr}: {e}"))?;
    tracing::info!("serving /healthz, /readyz and /metrics on {addr}");
    serve_on(listener, state, metrics).await
}

/// [`serve`] on a bound listener (tests bind port 0 and read the address).
pub async fn serve_on(listener: TcpListener, state: Arc<AgentState>, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    serve_http(listener, "health endpoint", move |req| respond(req, &state, &metrics)).await
}

/// Serves kube-proxy's health check on a bound listener until the task is dropped:
/// `/healthz` is 200 when the agent is alive and ready (programs loaded and attached, the
/// first full sync programmed) *and* the node is eligible for load-balancer traffic, else
/// 503; `/livez` ignores eligibility. The body is kube-proxy's JSON
/// (`lastUpdated`, `currentTime`, `nodeEligible`).
pub async fn serve_proxy_healthz(listener: TcpListener, state: Arc<AgentState>) -> anyhow::Result<()> {
    serve_http(listener, "proxy health endpoint", move |req| proxy_health(req.method(), req.uri().path(), &state)).await
}

/// What one HTTP server of the agent tolerates from its clients (scrapers, probes, and on
/// healthCheckNodePorts anyone who can reach the node).
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// A client must send a whole request head within this (also on a kept-alive
    /// connection): a slow or silent client does not hold a connection.
    pub header_read_timeout: Duration,
    /// Connections served at once; more are closed right after accept, so a flood cannot take
    /// the agent's file descriptors (which its map writes need).
    pub max_connections: usize,
    /// Largest request head; a larger one gets `431`.
    pub max_head_bytes: usize,
}

pub const HTTP_LIMITS: HttpLimits = HttpLimits { header_read_timeout: HEADER_READ_TIMEOUT, max_connections: 256, max_head_bytes: 16 * 1024 };

/// Accepts HTTP/1 connections on `listener` and answers every request with `respond`.
async fn serve_http<F>(listener: TcpListener, what: &'static str, respond: F) -> anyhow::Result<()>
where
    F: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    serve_http_limited(listener, what, HTTP_LIMITS, respond).await
}

/// [`serve_http`] with explicit limits. Request bodies are never read (every endpoint is a
/// GET), so a large body costs nothing but the connection.
pub async fn serve_http_limited<F>(listener: TcpListener, what: &'static str, limits: HttpLimits, respond: F) -> anyhow::Result<()>
where
    F: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning, keep serving.
                tracing::warn!("{what}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!("{what}: {} connections open; closing a new one", limits.max_connections);
            drop(tcp);
            continue;
        };
        let respond = respond.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |req| {
                let response = respond(&req);
                async move { Ok::<_, Infallible>(response) }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(limits.max_head_bytes.max(8192))
                .serve_connection(TokioIo::new(tcp), service);
            if let Err(e) = conn.await {
                tracing::debug!("{what} connection: {e}");
            }
        });
    }
}

fn rfc3339(t: std::time::SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map(|t| t.to_string()).unwrap_or_default()
}

/// The kube-proxy health check's answer (separate from the HTTP plumbing for tests).
fn proxy_health(method: &Method, path: &str, state: &AgentState) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n".into());
    }
    let healthy = state.alive().is_ok() && state.ready().is_ok();
    let eligible = state.node_eligible();
    let ok = match path {
        "/healthz" => healthy && eligible,
        "/livez" => healthy,
        _ => return text(StatusCode::NOT_FOUND, "not found: try /healthz or /livez\n".into()),
    };
    let last = state.snapshot().last_sync_at;
    let body = serde_json::json!({
        "lastUpdated": last.map(rfc3339).unwrap_or_default(),
        "currentTime": rfc3339(std::time::SystemTime::now()),
        "nodeEligible": eligible,
    });
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    with_type(status, "application/json", body.to_string())
}

fn respond(req: &Request<Incoming>, state: &AgentState, metrics: &Metrics) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n".into());
    }
    match req.uri().path() {
        "/healthz" | "/livez" => match state.alive() {
            Ok(()) => text(StatusCode::OK, "ok\n".into()),
            Err(age) => text(StatusCode::SERVICE_UNAVAILABLE, format!("run loop stalled: no heartbeat for {}s\n", age.as_secs())),
        },
        "/readyz" => match state.ready() {
            Ok(()) => text(StatusCode::OK, "ok\n".into()),
            Err(reasons) => {
                let mut body = reasons.join("\n");
                body.push('\n');
                text(StatusCode::SERVICE_UNAVAILABLE, body)
            }
        },
        "/metrics" => with_type(StatusCode::OK, metrics::CONTENT_TYPE, metrics.encode()),
        _ => text(StatusCode::NOT_FOUND, "not found: try /healthz, /readyz or /metrics\n".into()),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    with_type(status, "text/plain; charset=utf-8", body)
}

fn with_type(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(content_type));
    response
}

/// Plain HTTP GETs for the tests of the agent's servers (this one, kube-proxy's health check,
/// the healthCheckNodePorts).
#[cfg(test)]
pub(crate) mod test_http {
    use std::{net::SocketAddr, time::Duration};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// `GET path` over a fresh connection: the raw response, head and body.
    pub async fn try_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes()).await?;
        let mut raw = String::new();
        tcp.read_to_string(&mut raw).await?;
        Ok(raw)
    }

    pub async fn get_raw(addr: SocketAddr, path: &str) -> String {
        try_get(addr, path).await.unwrap()
    }

    /// [`get_raw`] once the server listens, for at most ~10 s; empty if it never does.
    pub async fn get_once_served(addr: SocketAddr, path: &str) -> String {
        for _ in 0..100 {
            if let Ok(Ok(raw)) = tokio::time::timeout(Duration::from_secs(1), try_get(addr, path)).await {
                return raw;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::timeout;

    const PATIENCE: Duration = Duration::from_secs(5);

    /// A taken port is reported once (the Warning Event), however often it is tried, and
    /// bound once free.
    #[tokio::test]
    async fn bind_retrying_reports_the_first_failure_once() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = holder.local_addr().unwrap();
        let reports = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = reports.clone();
        let task = tokio::spawn(async move { bind_retrying(addr, "test", move |e| seen.lock().unwrap().push(e.kind())).await });
        // Tried at 0, 0.5 and 1.5 s.
        tokio::time::sleep(Duration::from_millis(1700)).await;
        assert_eq!(*reports.lock().unwrap(), [std::io::ErrorKind::AddrInUse]);
        drop(holder);
        let l = timeout(PATIENCE, task).await.expect("bound once free").unwrap();
        assert_eq!(l.local_addr().unwrap(), addr);
        assert_eq!(reports.lock().unwrap().len(), 1);
    }

    /// One request over a fresh connection; (status, body).
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let raw = timeout(PATIENCE, test_http::get_raw(addr, path)).await.expect("response in time");
        let (head, body) = raw.split_once("\r\n\r\n").expect("a full HTTP response");
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status code");
        (status, body.to_owned())
    }

    async fn server(state: Arc<AgentState>) -> (SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        metrics.set_programmed(1, 2, 1);
        (addr, tokio::spawn(serve_on(listener, state, metrics)))
    }

    #[test]
    fn readiness_reasons() {
        let mut r = Readiness::default();
        assert_eq!(r.ready().unwrap_err(), ["eBPF programs are not loaded", "first full sync of Services and EndpointSlices is not programmed yet"]);
        r.programs_loaded = true;
        r.synced = true;
        r.interfaces.insert("eth0".into(), InterfaceState { attached: true, error: None });
        assert_eq!(r.ready(), Ok(()));
        r.interfaces.insert("eth1".into(), InterfaceState { attached: false, error: Some("no such device".into()) });
        r.missing = vec!["cgroup2 is not mounted".into()];
        assert_eq!(r.ready().unwrap_err(), ["missing prerequisite: cgroup2 is not mounted", "interface eth1: not attached: no such device"]);
        assert_eq!(r.pending(), ["interface eth1: not attached: no such device"]);
    }

    #[test]
    fn subscribers_wake_only_on_verdict_changes() {
        let state = AgentState::default();
        let mut rx = state.subscribe();
        state.set_programs_loaded(true);
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        state.set_programs_loaded(true);
        assert!(!rx.has_changed().unwrap());
        state.set_synced(true);
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        state.set_synced(true); // a later flush: last_sync moves, the verdict does not
        assert!(!rx.has_changed().unwrap());
        assert!(state.snapshot().last_sync.is_some());
    }

    /// Raw bytes in, the first response line out (empty if the server closed without one).
    async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(raw).await;
        let mut out = Vec::new();
        let _ = timeout(PATIENCE, s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn hostile_requests_get_errors_and_never_stall_the_server() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = HttpLimits { header_read_timeout: Duration::from_millis(300), max_connections: 8, max_head_bytes: 8192 };
        let task = tokio::spawn(serve_http_limited(listener, "test", limits, |_| text(StatusCode::OK, "ok\n".into())));
        // Malformed request line, oversized head, binary junk: an error status, no hang.
        assert!(exchange(addr, b"NONSENSE\r\n\r\n").await.starts_with("HTTP/1.1 400"));
        let big = format!("GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "a".repeat(64 * 1024));
        assert!(exchange(addr, big.as_bytes()).await.starts_with("HTTP/1.1 431"));
        assert!(exchange(addr, &[0u8, 0xff, 0x13, 0x37, b'\n', b'\n']).await.starts_with("HTTP/1.1 400"));
        // Silent clients fill every slot: further connections are closed at once, and the
        // silent ones are cut after the header timeout, after which requests are served again.
        let mut silent = Vec::new();
        for _ in 0..8 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await, "", "over the limit: closed");
        for mut s in silent {
            let mut buf = Vec::new();
            let n = timeout(PATIENCE, s.read_to_end(&mut buf)).await.expect("a silent client is cut off");
            assert!(n.is_ok());
        }
        assert!(exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.starts_with("HTTP/1.1 200"));
        // A slow client that dribbles its head is cut off too.
        let t0 = std::time::Instant::now();
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        {
            use tokio::io::AsyncWriteExt;
            for b in b"GET / HT" {
                if slow.write_all(&[*b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let mut buf = Vec::new();
        let _ = timeout(PATIENCE, slow.read_to_end(&mut buf)).await.expect("closed");
        assert!(t0.elapsed() < PATIENCE);
        task.abort();
    }

    #[tokio::test]
    async fn kube_proxy_style_health_check() {
        let state = Arc::new(AgentState::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(serve_proxy_healthz(listener, state.clone()));
        let json = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap();

        // Not synced yet: unhealthy (a cloud load balancer must not send traffic here).
        state.beat();
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 503, "{body}");
        assert_eq!(json(&body)["lastUpdated"], "");
        state.set_programs_loaded(true);
        state.set_synced(true);
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 200, "{body}");
        let v = json(&body);
        assert_eq!(v["nodeEligible"], true);
        assert!(v["lastUpdated"].as_str().unwrap().ends_with('Z'), "{v}");
        assert!(v["currentTime"].as_str().unwrap() >= v["lastUpdated"].as_str().unwrap(), "{v}");
        // A node on its way out: /healthz fails (drains LB traffic), /livez does not.
        state.set_node_eligible(false);
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!((code, json(&body)["nodeEligible"].clone()), (503, false.into()));
        assert_eq!(get(addr, "/livez").await.0, 200);
        assert_eq!(get(addr, "/metrics").await.0, 404);
        task.abort();
    }

    #[tokio::test]
    async fn endpoints() {
        let state = Arc::new(AgentState::default());
        let (addr, task) = server(state.clone()).await;

        let (code, body) = get(addr, "/readyz").await;
        assert_eq!(code, 503);
        assert_eq!(body, "eBPF programs are not loaded\nfirst full sync of Services and EndpointSlices is not programmed yet\n");
        state.set_programs_loaded(true);
        state.set_interface("eth0", true, None);
        state.set_synced(true);
        assert_eq!(get(addr, "/readyz").await, (200, "ok\n".into()));

        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".into()));
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("gardenet_frontends 1"), "{body}");
        assert_eq!(get(addr, "/nope").await.0, 404);
        task.abort();
    }

    #[tokio::test]
    async fn healthz_fails_when_the_loop_stops_beating() {
        let state = Arc::new(AgentState::new(Duration::from_millis(200), Duration::from_millis(300)));
        let (addr, task) = server(state.clone()).await;
        // Starting: the grace applies until the first beat.
        assert_eq!(get(addr, "/healthz").await.0, 200);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(get(addr, "/healthz").await.0, 503);
        state.beat();
        assert_eq!(get(addr, "/healthz").await.0, 200);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 503);
        assert!(body.starts_with("run loop stalled"), "{body}");
        state.beat();
        assert_eq!(get(addr, "/healthz").await.0, 200);
        task.abort();
    }
}
