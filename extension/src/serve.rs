//! `/healthz`, `/readyz` and `/metrics` of the controller over plain HTTP/1.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{server::conn::http1, service::service_fn, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// What the endpoints report.
#[derive(Default)]
pub struct Health {
    /// The controller runs (this replica leads and its watches started).
    pub ready: AtomicBool,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }
}

fn respond(path: &str, health: &Health, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (code, body, content_type) = match path {
        "/healthz" | "/livez" => (StatusCode::OK, "ok\n".to_owned(), "text/plain"),
        // Standby replicas are alive but not ready: only the leader reconciles.
        "/readyz" if health.ready.load(Ordering::SeqCst) => (StatusCode::OK, "ok\n".to_owned(), "text/plain"),
        "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, "not leading or not started\n".to_owned(), "text/plain"),
        "/metrics" => (StatusCode::OK, metrics.encode(), "application/openmetrics-text; version=1.0.0; charset=utf-8"),
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned(), "text/plain"),
    };
    Response::builder()
        .status(code)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, health: Arc<Health>, metrics: Arc<Metrics>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            // E.g. out of file descriptors: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let (health, metrics) = (health.clone(), metrics.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let response = respond(req.uri().path(), &health, &metrics);
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(tcp), service).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_flag() {
        let (h, m) = (Health::default(), Metrics::default());
        assert_eq!(respond("/healthz", &h, &m).status(), StatusCode::OK);
        assert_eq!(respond("/readyz", &h, &m).status(), StatusCode::SERVICE_UNAVAILABLE);
        h.set_ready(true);
        assert_eq!(respond("/readyz", &h, &m).status(), StatusCode::OK);
        assert_eq!(respond("/metrics", &h, &m).status(), StatusCode::OK);
        assert_eq!(respond("/nope", &h, &m).status(), StatusCode::NOT_FOUND);
    }
}
