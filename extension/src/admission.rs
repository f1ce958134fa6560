//! `gardenet-extension admission`: a validating webhook for Shoots of networking type
//! gardenet (`admission.k8s.io/v1` `AdmissionReview` over HTTPS).
//!
//! It refuses early what the controller would otherwise report as a configuration problem
//! after the Shoot was accepted: a providerConfig that does not parse (the message names the
//! field), IP families and CIDRs that do not fit together, and combinations the agent cannot
//! honour with kube-proxy disabled. Anything malformed is denied with a clear message; no
//! request can crash the server. The certificate files are reloaded when they change.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{server::conn::http1, service::service_fn, Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::cluster::Shoot;
use crate::contract::{self, Problem};
use gardenet_agent::gardener::NETWORK_TYPE;

/// Path of the Shoot validation endpoint (as in `deploy/extension/webhook.yaml`).
pub const VALIDATE_PATH: &str = "/webhooks/validate-shoot";
/// Largest request body read: a Shoot and its old version, with room to spare (the API
/// server caps objects at 1.5 MiB).
const MAX_BODY: usize = 4 << 20;
/// A client must finish its TLS handshake within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The answer to one AdmissionReview body: always an AdmissionReview, also for garbage.
pub fn review(body: &[u8]) -> Value {
    let parsed: Result<Value, _> = serde_json::from_slice(body);
    let request = match parsed {
        Ok(v) if v.get("kind").and_then(Value::as_str) == Some("AdmissionReview") => v.get("request").cloned(),
        Ok(_) => None,
        Err(e) => return response("", false, 400, &format!("the body is not JSON: {e}")),
    };
    let Some(request) = request.filter(Value::is_object) else {
        return response("", false, 400, "expected an admission.k8s.io/v1 AdmissionReview with a request");
    };
    let uid = request.get("uid").and_then(Value::as_str).unwrap_or_default();
    if uid.is_empty() {
        return response("", false, 400, "the AdmissionReview request has no uid");
    }
    let kind = request.pointer("/kind/kind").and_then(Value::as_str).unwrap_or_default();
    let operation = request.get("operation").and_then(Value::as_str).unwrap_or_default();
    if kind != "Shoot" || !matches!(operation, "CREATE" | "UPDATE") {
        return response(uid, true, 200, "not a Shoot create or update");
    }
    let Some(object) = request.get("object").filter(|o| o.is_object()) else {
        return response(uid, false, 400, "the request carries no object");
    };
    // An update that leaves the networking as it was is not this webhook's business: a Shoot
    // accepted by an older gardenet must stay editable (e.g. to be hibernated or deleted).
    if operation == "UPDATE" && request.get("oldObject").is_some_and(|old| same_networking(old, object)) {
        return response(uid, true, 200, "networking unchanged");
    }
    match validate_shoot(object) {
        Ok(()) => response(uid, true, 200, ""),
        Err(problems) => response(uid, false, 403, &problems.join("; ")),
    }
}

fn response(uid: &str, allowed: bool, code: u16, message: &str) -> Value {
    let mut resp = json!({"uid": uid, "allowed": allowed});
    if !allowed {
        let reason = if code == 400 { "BadRequest" } else { "Forbidden" };
        resp["status"] = json!({"code": code, "message": message, "reason": reason});
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp})
}

/// Whether two Shoots agree on everything [`validate_shoot`] looks at.
fn same_networking(old: &Value, new: &Value) -> bool {
    ["/spec/networking", "/spec/kubernetes/kubeProxy"].iter().all(|p| old.pointer(p) == new.pointer(p))
}

/// The checks for a Shoot; messages name the Shoot fields.
pub fn validate_shoot(object: &Value) -> Result<(), Vec<String>> {
    if object.pointer("/spec/networking/type").and_then(Value::as_str) != Some(NETWORK_TYPE) {
        return Ok(());
    }
    // Shoots being deleted must be able to lose their finalizers whatever their spec says.
    if object.pointer("/metadata/deletionTimestamp").is_some_and(|t| !t.is_null()) {
        return Ok(());
    }
    let shoot: Shoot = serde_json::from_value(object.clone()).map_err(|e| vec![format!("not a valid Shoot: {e}")])?;
    let networking = shoot.spec.networking.clone().unwrap_or_default();
    let config = contract::parse_config(networking.provider_config.as_ref(), "spec.networking.providerConfig").map_err(|p| vec![p.to_string()])?;
    let kube_proxy_enabled = shoot.kube_proxy_enabled();
    let mut problems: Vec<Problem> = contract::check_routing(&config, kube_proxy_enabled);
    let cidrs: Vec<(&'static str, &str)> = [
        ("spec.networking.pods", networking.pods.as_deref()),
        ("spec.networking.services", networking.services.as_deref()),
        ("spec.networking.nodes", networking.nodes.as_deref()),
    ]
    .into_iter()
    .filter_map(|(f, v)| v.map(|v| (f, v)))
    .collect();
    problems.extend(contract::check_network(
        &networking.ip_families,
        &cidrs,
        "spec.networking.ipFamilies",
        config.service_routing(kube_proxy_enabled).active(),
    ));
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.iter().map(ToString::to_string).collect())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// How often the certificate files are looked at again (they rotate, e.g. a Secret volume).
pub const CERT_RECHECK: Duration = Duration::from_secs(10);

/// A TLS acceptor from PEM files (certificate chain, private key). The files are read now
/// (so a bad pair fails at start) and again whenever they change, at most every `recheck`.
pub fn tls_acceptor(cert: &Path, key: &Path, recheck: Duration) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = FileCert::load(cert, key, provider.clone(), recheck)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The certificate from files, reloaded when their modification times change. A reload that
/// fails (e.g. the key written before the certificate) keeps the previous pair.
#[derive(Debug)]
struct FileCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<rustls::crypto::CryptoProvider>,
    recheck: Duration,
    state: std::sync::Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    certified: Arc<rustls::sign::CertifiedKey>,
    stamps: [Option<std::time::SystemTime>; 2],
    checked: std::time::Instant,
}

impl FileCert {
    fn load(cert: &Path, key: &Path, provider: Arc<rustls::crypto::CryptoProvider>, recheck: Duration) -> Result<Self, TlsError> {
        let stamps = Self::stamps(cert, key);
        let certified = Arc::new(Self::read(cert, key, &provider)?);
        Ok(FileCert {
            cert: cert.to_owned(),
            key: key.to_owned(),
            provider,
            recheck,
            state: std::sync::Mutex::new(Loaded { certified, stamps, checked: std::time::Instant::now() }),
        })
    }

    fn stamps(cert: &Path, key: &Path) -> [Option<std::time::SystemTime>; 2] {
        [cert, key].map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
    }

    fn read(cert: &Path, key: &Path, provider: &rustls::crypto::CryptoProvider) -> Result<rustls::sign::CertifiedKey, TlsError> {
        let read = |path: &Path, e: &dyn std::fmt::Display| TlsError::Read { path: path.to_owned(), message: e.to_string() };
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(cert).map_err(|e| read(cert, &e))?.collect::<Result<_, _>>().map_err(|e| read(cert, &e))?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate(cert.to_owned()));
        }
        let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| read(key, &e))?;
        Ok(rustls::sign::CertifiedKey::from_der(certs, key_der, provider)?)
    }

    fn current(&self) -> Arc<rustls::sign::CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.checked.elapsed() >= self.recheck {
            state.checked = std::time::Instant::now();
            let stamps = Self::stamps(&self.cert, &self.key);
            if stamps != state.stamps {
                match Self::read(&self.cert, &self.key, &self.provider) {
                    Ok(certified) => {
                        tracing::info!("reloaded the TLS certificate from {}", self.cert.display());
                        state.certified = Arc::new(certified);
                        state.stamps = stamps;
                    }
                    Err(e) => tracing::warn!("keeping the previous TLS certificate: {e}"),
                }
            }
        }
        state.certified.clone()
    }
}

impl rustls::server::ResolvesServerCert for FileCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }
}

fn reply(code: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    Response::builder().status(code).header(hyper::header::CONTENT_TYPE, "application/json").body(Full::new(body)).expect("static response parts are valid")
}

async fn handle(req: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    if req.method() == Method::GET && (path == "/healthz" || path == "/readyz") {
        return Ok(reply(StatusCode::OK, Bytes::from_static(b"{\"status\":\"ok\"}")));
    }
    if path != VALIDATE_PATH {
        return Ok(reply(StatusCode::NOT_FOUND, Bytes::from_static(b"{\"error\":\"not found\"}")));
    }
    if req.method() != Method::POST {
        return Ok(reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::from_static(b"{\"error\":\"POST an AdmissionReview\"}")));
    }
    let answer = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(body) => review(&body.to_bytes()),
        Err(e) => response("", false, 400, &format!("reading the request body: {e}")),
    };
    Ok(reply(StatusCode::OK, Bytes::from(answer.to_string())))
}

/// Serves the webhook on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, acceptor: TlsAcceptor) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(%peer, "TLS handshake: {e}"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(tls), service_fn(handle)).await {
                tracing::debug!(%peer, "webhook connection: {e}");
            }
        });
    }
}

/// Binds `addr` and serves.
pub async fn run(addr: SocketAddr, cert: &Path, key: &Path) -> anyhow::Result<()> {
    let acceptor = tls_acceptor(cert, key, CERT_RECHECK)?;
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    tracing::info!("admission webhook on https://{addr}{VALIDATE_PATH}");
    serve(listener, acceptor).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gardenet_agent::gardener::PROVIDER_API_VERSION;

    fn shoot(networking: Value, kube_proxy: bool) -> Value {
        json!({
            "apiVersion": "core.gardener.cloud/v1beta1", "kind": "Shoot",
            "metadata": {"name": "s", "namespace": "garden-dev"},
            "spec": {"kubernetes": {"version": "1.33.0", "kubeProxy": {"enabled": kube_proxy}}, "networking": networking},
        })
    }

    fn admission(object: Value) -> Value {
        let body = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "core.gardener.cloud", "version": "v1beta1", "kind": "Shoot"},
                        "operation": "CREATE", "object": object},
        });
        review(body.to_string().as_bytes())["response"].clone()
    }

    fn net(pc: Value) -> Value {
        json!({"type": "gardenet", "pods": "100.96.0.0/11", "services": "100.64.0.0/13", "nodes": "10.250.0.0/16", "providerConfig": pc})
    }

    fn pc(extra: Value) -> Value {
        let mut v = json!({"apiVersion": PROVIDER_API_VERSION, "kind": "NetworkConfig"});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    }

    #[test]
    fn valid_shoot_is_allowed() {
        let r = admission(shoot(net(pc(json!({}))), false));
        assert_eq!(r["allowed"], true, "{r}");
        assert_eq!(r["uid"], "u-1");
    }

    #[test]
    fn other_network_types_are_not_ours() {
        let r = admission(shoot(json!({"type": "calico", "providerConfig": {"garbage": 1}}), false));
        assert_eq!(r["allowed"], true, "{r}");
    }

    #[test]
    fn provider_config_errors_name_the_field() {
        let r = admission(shoot(net(pc(json!({"xdp": {"mode": "turbo"}}))), true));
        assert_eq!(r["allowed"], false);
        let msg = r["status"]["message"].as_str().unwrap();
        assert!(msg.starts_with("spec.networking.providerConfig.xdp.mode:"), "{msg}");
        assert_eq!(r["status"]["code"], 403);
    }

    #[test]
    fn the_pod_networks_settings_are_validated_by_field() {
        let gardener_example =
            pc(json!({"ipam": {"type": "host-local", "cidr": "usePodCIDR"}, "mtu": 1450, "masquerade": {"nonMasqueradeCIDRs": ["10.250.0.0/16"]}}));
        assert_eq!(admission(shoot(net(gardener_example), false))["allowed"], true);
        for (extra, field) in [
            (json!({"ipam": {"type": "calico-ipam", "cidr": "usePodCIDR"}}), "ipam.type"),
            (json!({"ipam": {"type": "host-local", "cidr": "10.0.0.0/8"}}), "ipam.cidr"),
            (json!({"mtu": 576}), "mtu"),
            (json!({"masquerade": {"nonMasqueradeCIDRs": ["nope"]}}), "masquerade.nonMasqueradeCIDRs[0]"),
        ] {
            let r = admission(shoot(net(pc(extra.clone())), false));
            assert_eq!(r["allowed"], false, "{extra}");
            let msg = r["status"]["message"].as_str().unwrap();
            assert!(msg.starts_with(&format!("spec.networking.providerConfig.{field}:")), "{extra}: {msg}");
        }
    }

    #[test]
    fn combinations_the_agent_cannot_honour() {
        let off = pc(json!({"socketLB": {"enabled": false}, "interfaces": {"include": []}}));
        let r = admission(shoot(net(off.clone()), false));
        assert_eq!(r["allowed"], false);
        assert!(r["status"]["message"].as_str().unwrap().contains("socketLB.enabled is false"), "{r}");
        assert_eq!(admission(shoot(net(off), true))["allowed"], true);
        let refused = pc(json!({"kubeProxyReplacement": {"enabled": false}}));
        assert_eq!(admission(shoot(net(refused), false))["allowed"], false);
    }

    #[test]
    fn cidrs_and_families() {
        let mut n = net(pc(json!({})));
        n["services"] = json!("100.96.0.0/13");
        let r = admission(shoot(n, true));
        assert!(r["status"]["message"].as_str().unwrap().contains("overlap"), "{r}");
        let mut n = net(pc(json!({})));
        n["pods"] = json!("fd00::/48");
        let r = admission(shoot(n, true));
        assert!(r["status"]["message"].as_str().unwrap().contains("spec.networking.pods"), "{r}");
        // IPv6 and dual stack are routed by gardenet, also without kube-proxy.
        let mut n = net(pc(json!({})));
        n["ipFamilies"] = json!(["IPv6"]);
        n["pods"] = json!("fd00:10::/56");
        n["services"] = json!("fd00:20::/112");
        n["nodes"] = json!("fd00:30::/64");
        assert_eq!(admission(shoot(n, false))["allowed"], true);
        let mut n = net(pc(json!({})));
        n["ipFamilies"] = json!(["IPv4", "IPv6"]);
        assert_eq!(admission(shoot(n, false))["allowed"], true);
    }

    #[test]
    fn updates_that_keep_the_networking_are_allowed() {
        let broken = shoot(net(pc(json!({"xdp": {"mode": "turbo"}}))), true);
        let mut hibernated = broken.clone();
        hibernated["spec"]["hibernation"] = json!({"enabled": true});
        let body = |old: &Value, new: &Value| {
            json!({"kind": "AdmissionReview", "request": {"uid": "u", "kind": {"kind": "Shoot"}, "operation": "UPDATE",
                                                          "object": new, "oldObject": old}})
            .to_string()
        };
        assert_eq!(review(body(&broken, &hibernated).as_bytes())["response"]["allowed"], true);
        let good = shoot(net(pc(json!({}))), true);
        assert_eq!(review(body(&good, &broken).as_bytes())["response"]["allowed"], false);
    }

    #[test]
    fn garbage_is_denied_not_fatal() {
        let bodies = [&b"not json"[..], b"{}", b"[]", b"{\"kind\":\"AdmissionReview\"}", b"{\"kind\":\"AdmissionReview\",\"request\":{}}"];
        for body in bodies.into_iter().chain([&[0xff, 0xfe][..]]) {
            let r = review(body);
            assert_eq!(r["kind"], "AdmissionReview");
            assert_eq!(r["response"]["allowed"], false, "{r}");
            assert_eq!(r["response"]["status"]["code"], 400);
        }
        let object = json!({"spec": {"networking": {"type": "gardenet"}, "kubernetes": {"kubeProxy": {"enabled": "no"}}}});
        let body = json!({"kind": "AdmissionReview", "request": {"uid": "x", "kind": {"kind": "Shoot"}, "operation": "CREATE", "object": object}});
        let r = review(body.to_string().as_bytes());
        assert_eq!(r["response"]["allowed"], false);
        assert!(r["response"]["status"]["message"].as_str().unwrap().contains("not a valid Shoot"), "{r}");
    }
}
