//! Request handling: routes Kubernetes REST paths to the store, and serves watches as the
//! real server does (a chunked stream of newline-delimited `{"type":..,"object":..}`).
use std::{collections::HashMap, collections::VecDeque, convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt as _, Full, StreamBody};
use hyper::{
    body::{Frame, Incoming},
    header::CONTENT_TYPE,
    Method, Request, Response, StatusCode,
};
use serde_json::{json, Value};
use tokio::{sync::broadcast, time::Instant};

use super::{
    select::Selector,
    semantics,
    store::{name_of, namespace_of, not_found, Change, ChangeType, Coll, Failure, Target},
    RecordedRequest, Shared, Signal,
};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

type Query = HashMap<String, String>;

pub async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    // Apply patches are YAML by content type, but every client we care about sends JSON.
    let body = (!bytes.is_empty()).then(|| serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())));
    let content_type = parts.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let query_str = parts.uri.query().unwrap_or_default();
    let request = RecordedRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        query: query_str.to_owned(),
        content_type: content_type.clone(),
        body: body.clone(),
    };
    if shared.unavailable() {
        // A request that slipped in on a connection about to be dropped: never answer it.
        return std::future::pending().await;
    }
    let query: Query = form_urlencoded::parse(query_str.as_bytes()).into_owned().collect();
    let response = route(&shared, &parts.method, parts.uri.path(), &query, content_type.as_deref(), body)
        .unwrap_or_else(|failure| json_response(failure.code, &failure.status()));
    // Recorded once handled, so a watch in the log is a watch that already sees changes.
    shared.record(request);
    Ok(response)
}

fn route(shared: &Arc<Shared>, method: &Method, path: &str, query: &Query, content_type: Option<&str>, body: Option<Value>) -> Result<Response<Body>, Failure> {
    if path == "/version" {
        let version = json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-gardenet-double"});
        return Ok(json_response(200, &version));
    }
    let target = Target::parse(path).ok_or_else(|| Failure::new(404, "NotFound", "the server could not find the requested resource"))?;
    let ns = target.namespace.clone().unwrap_or_default();
    let coll = &target.coll;
    let status = target.subresource.as_deref() == Some("status");
    match (method, target.name.as_deref()) {
        (&Method::GET, None) if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) => watch(shared, &target, query),
        (&Method::GET, None) => {
            let sel = selector(query)?;
            let limit = match query.get("limit") {
                Some(l) => Some(l.parse::<usize>().map_err(|_| Failure::new(400, "BadRequest", format!("invalid limit {l:?}")))?),
                None => None,
            };
            let page = shared.store().list_page(coll, target.namespace.as_deref(), |o| sel.matches(o), limit, query.get("continue").map(String::as_str))?;
            let mut metadata = json!({"resourceVersion": page.rv.to_string()});
            if let Some((token, remaining)) = page.next {
                metadata["continue"] = token.into();
                metadata["remainingItemCount"] = remaining.into();
            }
            Ok(json_response(
                200,
                &json!({
                    "kind": format!("{}List", coll.kind()),
                    "apiVersion": coll.api_version,
                    "metadata": metadata,
                    "items": page.items,
                }),
            ))
        }
        (&Method::GET, Some(name)) => {
            let store = shared.store();
            let obj = store.get(coll, &ns, name).ok_or_else(|| not_found(coll, name))?;
            Ok(json_response(200, obj))
        }
        (&Method::POST, None) => {
            let mut obj = object_body(body)?;
            let ns = if ns.is_empty() { namespace_of(&obj).to_owned() } else { ns };
            if name_of(&obj).is_empty() {
                let prefix = obj.pointer("/metadata/generateName").and_then(Value::as_str).unwrap_or_default();
                let suffix = shared.store().resource_version() + 1;
                obj["metadata"]["name"] = format!("{prefix}{suffix:05x}").into();
            }
            semantics::on_create(coll, &mut obj);
            let created = shared.commit(|store| store.create(coll, &ns, obj))?;
            Ok(json_response(201, &created))
        }
        (&Method::PUT, Some(name)) => {
            let mut obj = object_body(body)?;
            obj["metadata"]["name"] = name.into();
            if status {
                // The status subresource only ever changes `.status`.
                let current = shared.store().get(coll, &ns, name).cloned().ok_or_else(|| not_found(coll, name))?;
                let mut merged = current;
                merged["status"] = obj["status"].take();
                if let Some(rv) = obj.pointer("/metadata/resourceVersion") {
                    merged["metadata"]["resourceVersion"] = rv.clone();
                }
                obj = merged;
            } else if let Some(current) = shared.store().get(coll, &ns, name) {
                semantics::on_update(coll, current, &mut obj)?;
            }
            let replaced = shared.commit(|store| {
                if semantics::finalized(&obj) {
                    store.replace(coll, &ns, obj)?;
                    return store.remove(coll, &ns, name);
                }
                store.replace(coll, &ns, obj)
            })?;
            Ok(json_response(200, &replaced))
        }
        (&Method::PATCH, Some(name)) => patch(shared, coll, &ns, name, status, content_type, body),
        (&Method::DELETE, Some(name)) => {
            // Finalizers hold the object: it is only marked (deletionTimestamp).
            let deleted = shared.commit(|store| {
                let current = store.get(coll, &ns, name).ok_or_else(|| not_found(coll, name))?;
                match semantics::on_delete(current) {
                    Some(marked) => Ok(store.put(coll, &ns, marked)),
                    None => store.remove(coll, &ns, name),
                }
            })?;
            Ok(json_response(200, &deleted))
        }
        _ => Err(Failure::new(405, "MethodNotAllowed", format!("{method} is not supported on {path}"))),
    }
}

/// Merge patch (RFC 7386) and JSON patch (RFC 6902) exactly; strategic-merge and server-side
/// apply are approximated as merge patches (enough for the flat objects the agent writes; apply
/// creates the object if missing, like the real server).
fn patch(
    shared: &Arc<Shared>,
    coll: &Coll,
    ns: &str,
    name: &str,
    status: bool,
    content_type: Option<&str>,
    body: Option<Value>,
) -> Result<Response<Body>, Failure> {
    let patch = body.ok_or_else(|| Failure::new(400, "BadRequest", "empty patch"))?;
    let content_type = content_type.unwrap_or_default();
    let apply = content_type.starts_with("application/apply-patch");
    let json_patch = content_type.starts_with("application/json-patch");
    if !apply && !json_patch && !content_type.contains("merge-patch") {
        return Err(Failure::new(415, "UnsupportedMediaType", format!("unsupported patch type {content_type:?}")));
    }
    let mut result = None;
    shared.commit(|store| {
        let (mut doc, created) = match store.get(coll, ns, name) {
            Some(current) => (current.clone(), false),
            None if apply && !status => (json!({"metadata": {"name": name}}), true),
            None => return Err(not_found(coll, name)),
        };
        // A merge patch naming a resourceVersion is a precondition, as on the real server.
        if let Some(want) = (!json_patch).then(|| patch.pointer("/metadata/resourceVersion")).flatten().and_then(Value::as_str) {
            if !created && doc.pointer("/metadata/resourceVersion").and_then(Value::as_str) != Some(want) {
                return Err(Failure::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been \
                         modified; please apply your changes to the latest version and try again",
                        coll.plural
                    ),
                ));
            }
        }
        let mut patched = doc.clone();
        if json_patch {
            let ops: json_patch::Patch = serde_json::from_value(patch).map_err(|e| Failure::new(400, "BadRequest", format!("invalid JSON patch: {e}")))?;
            json_patch::patch(&mut patched, &ops).map_err(|e| Failure::new(422, "Invalid", format!("JSON patch failed: {e}")))?;
        } else {
            json_patch::merge(&mut patched, &patch);
        }
        if status {
            doc["status"] = patched["status"].take();
        } else {
            if !created {
                semantics::on_update(coll, &doc, &mut patched)?;
            } else {
                semantics::on_create(coll, &mut patched);
            }
            doc = patched;
        }
        doc["metadata"]["name"] = name.into();
        if semantics::finalized(&doc) {
            store.put(coll, ns, doc);
            let change = store.remove(coll, ns, name)?;
            result = Some((change.new.clone(), false));
            return Ok(change);
        }
        let change = store.put(coll, ns, doc);
        result = Some((change.new.clone(), created));
        Ok(change)
    })?;
    let (obj, created) = result.expect("set on success");
    Ok(json_response(if created { 201 } else { 200 }, &obj))
}

fn object_body(body: Option<Value>) -> Result<Value, Failure> {
    match body {
        Some(obj @ Value::Object(_)) => Ok(obj),
        _ => Err(Failure::new(400, "BadRequest", "the request body must be a JSON object")),
    }
}

fn selector(query: &Query) -> Result<Selector, Failure> {
    let get = |k: &str| query.get(k).map(String::as_str);
    Selector::parse(get("fieldSelector"), get("labelSelector")).map_err(|e| Failure::new(400, "BadRequest", e))
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .expect("static response parts are valid")
}

/// Which changes one watch sees.
struct WatchFilter {
    coll: Coll,
    namespace: Option<String>,
    selector: Selector,
}

impl WatchFilter {
    fn selects(&self, obj: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| namespace_of(obj) == ns) && self.selector.matches(obj)
    }

    /// The event line for `change`, if this watch sees it. A modification that moves an object
    /// into or out of the selection is an ADDED or DELETED for this watch.
    fn line_for(&self, change: &Change) -> Option<Bytes> {
        if change.coll != self.coll {
            return None;
        }
        let now = self.selects(&change.new);
        let before = change.old.as_ref().is_some_and(|o| self.selects(o));
        let kind = match (change.kind, before, now) {
            (ChangeType::Added, _, true) => "ADDED",
            (ChangeType::Deleted, _, true) => "DELETED",
            (ChangeType::Modified, true, true) => "MODIFIED",
            (ChangeType::Modified, false, true) => "ADDED",
            (ChangeType::Modified, true, false) => "DELETED",
            _ => return None,
        };
        Some(event_line(kind, &change.new))
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).expect("JSON values serialize");
    line.push(b'\n');
    line.into()
}

fn bookmark_line(coll: &Coll, rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string(), "creationTimestamp": null});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line("BOOKMARK", &json!({"kind": coll.kind(), "apiVersion": coll.api_version, "metadata": metadata}))
}

/// A watch: replays what the client missed since its resourceVersion (or the current state for
/// `0`/none), then follows live changes until `timeoutSeconds`, `close_watches`, or the client
/// goes away. Watching from a compacted version yields one ERROR event (410 Expired).
fn watch(shared: &Arc<Shared>, target: &Target, query: &Query) -> Result<Response<Body>, Failure> {
    let filter = WatchFilter { coll: target.coll.clone(), namespace: target.namespace.clone(), selector: selector(query)? };
    let flag = |k: &str| query.get(k).is_some_and(|v| v == "true");
    let bookmarks = flag("allowWatchBookmarks");
    let timeout = query.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(1800);
    let from: u64 = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") => 0,
        Some(rv) => rv.parse().map_err(|_| Failure::new(400, "BadRequest", format!("invalid resourceVersion {rv:?}")))?,
    };

    let mut lines = VecDeque::new();
    let mut ended = false;
    // Replay and subscribe under the store lock (changes are broadcast under it too), so the
    // watch neither misses nor repeats a change.
    let store = shared.store();
    let signals = shared.signals.subscribe();
    if from == 0 {
        let current = store.iter(&filter.coll, filter.namespace.as_deref()).filter(|o| filter.selector.matches(o));
        lines.extend(current.map(|o| event_line("ADDED", o)));
        if flag("sendInitialEvents") {
            lines.push_back(bookmark_line(&filter.coll, store.resource_version(), true));
        }
    } else {
        match store.changes_since(from) {
            Ok(changes) => lines.extend(changes.filter_map(|c| filter.line_for(c))),
            Err(expired) => {
                lines.push_back(event_line("ERROR", &expired.status()));
                ended = true;
            }
        }
    }
    drop(store);

    let state = WatchState { shared: shared.clone(), lines, ended, signals, filter, bookmarks, deadline: Instant::now() + Duration::from_secs(timeout) };
    let body = StreamBody::new(futures::stream::unfold(state, WatchState::next).map(|line| Ok(Frame::data(line))));
    Ok(Response::builder().status(StatusCode::OK).header(CONTENT_TYPE, "application/json").body(body.boxed_unsync()).expect("static response parts are valid"))
}

struct WatchState {
    shared: Arc<Shared>,
    lines: VecDeque<Bytes>,
    ended: bool,
    signals: broadcast::Receiver<Signal>,
    filter: WatchFilter,
    bookmarks: bool,
    deadline: Instant,
}

impl WatchState {
    async fn next(mut self) -> Option<(Bytes, Self)> {
        loop {
            if self.shared.unavailable() {
                // The connection is being dropped: send nothing more, not even the end.
                return std::future::pending().await;
            }
            if let Some(line) = self.lines.pop_front() {
                return Some((line, self));
            }
            if self.ended {
                return None;
            }
            let signal = tokio::select! {
                signal = self.signals.recv() => signal,
                () = tokio::time::sleep_until(self.deadline) => return None,
            };
            match signal {
                Ok(Signal::Change(change)) => self.lines.extend(self.filter.line_for(&change)),
                Ok(Signal::Bookmark(rv)) if self.bookmarks => {
                    self.lines.push_back(bookmark_line(&self.filter.coll, rv, false));
                }
                Ok(Signal::Bookmark(_)) => {}
                // Lagging behind ends the watch; the client resumes from its last version.
                Ok(Signal::CloseWatches) | Err(_) => return None,
            }
        }
    }
}
