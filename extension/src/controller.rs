//! The reconciler: watches Networks (and the Clusters they belong to), decides what Gardener
//! asks for ([`crate::operation`]) and carries it out against the seed.
//!
//! Every step is idempotent and reads the object fresh, so a controller restarted halfway,
//! or an API server that went away for a while, converges on the next attempt. Writes to
//! other owners' objects are merge patches of our own fields; list-valued fields (finalizers,
//! conditions) carry the resourceVersion they were computed from.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gardenet_agent::gardener::network::{LastOperationType, Network};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};
use tracing::{debug, info, warn, Instrument};

use crate::cluster::{Cluster, Shoot};
use crate::contract::{self, Plan, PlanError, Problems};
use crate::managed::{self, ManagedResource};
use crate::metrics::Metrics;
use crate::operation::{self, Decision, Facts, SkipReason, ANNOTATION_OPERATION, FINALIZER, OP_RECONCILE};
use crate::render::{self, RenderError};
use crate::serve::Health;
use crate::shoot::{self, ShootAccessError};
use crate::status;

/// Wait before retrying after a write lost a race (409).
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

/// Field manager of the extension's server-side applies.
pub const FIELD_MANAGER: &str = "gardenet-extension";

#[derive(Clone, Debug)]
pub struct Settings {
    /// The agent image rendered into the shoot.
    pub image: String,
    /// How long Delete and Migrate wait for the ManagedResource to go.
    pub delete_timeout: Duration,
    /// Poll interval while waiting for the ManagedResource to go.
    pub poll: Duration,
    /// How often a settled Network's readiness condition is refreshed.
    pub observe_every: Duration,
    /// Wait before retrying a failed operation.
    pub retry: Duration,
    /// Deadline of one API request.
    pub request_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            image: "gardenet-agent:latest".into(),
            delete_timeout: Duration::from_secs(120),
            poll: Duration::from_secs(2),
            observe_every: Duration::from_secs(60),
            retry: Duration::from_secs(15),
            request_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Configuration(#[from] Problems),
    #[error("{}", PlanError::NoApiServerAddress)]
    NoApiServerAddress,
    #[error("Cluster {0} not found")]
    ClusterMissing(String),
    #[error("Cluster {cluster}: spec.shoot is not a Shoot: {source}")]
    BadShoot { cluster: String, source: serde_json::Error },
    #[error("rendering the shoot manifests: {0}")]
    Render(#[from] RenderError),
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("{what}: no answer within {limit:?}")]
    Timeout { what: String, limit: Duration },
    #[error("ManagedResource {name} still exists after {waited:?} (is gardener-resource-manager running?)")]
    ManagedResourceStuck { name: String, waited: Duration },
    #[error("Network without a namespace")]
    NoNamespace,
}

impl Error {
    /// Only a changed configuration fixes these (`ERR_CONFIGURATION_PROBLEM`).
    pub fn is_configuration_problem(&self) -> bool {
        matches!(self, Error::Configuration(_) | Error::BadShoot { .. })
    }

    fn kind(&self) -> &'static str {
        match self {
            Error::Configuration(_) | Error::BadShoot { .. } => "configuration",
            Error::ClusterMissing(_) | Error::NoApiServerAddress => "cluster",
            Error::Render(_) => "render",
            Error::Api { .. } | Error::Timeout { .. } => "api",
            Error::ManagedResourceStuck { .. } => "timeout",
            Error::NoNamespace => "invalid",
        }
    }
}

impl From<PlanError> for Error {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Configuration(p) => Error::Configuration(p),
            PlanError::NoApiServerAddress => Error::NoApiServerAddress,
        }
    }
}

struct Ctx {
    seed: Client,
    settings: Settings,
    metrics: Arc<Metrics>,
}

impl Ctx {
    /// One API call with the request deadline.
    async fn call<T>(&self, what: impl Into<String>, f: impl Future<Output = kube::Result<T>>) -> Result<T, Error> {
        let limit = self.settings.request_timeout;
        match tokio::time::timeout(limit, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(Error::Api { what: what.into(), source }),
            Err(_) => Err(Error::Timeout { what: what.into(), limit }),
        }
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn is_code(e: &Error, code: u16) -> bool {
    matches!(e, Error::Api { source: kube::Error::Api(s), .. } if s.code == code)
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(seed: Client, settings: Settings, metrics: Arc<Metrics>, health: Arc<Health>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let networks: Api<Network> = Api::all(seed.clone());
    let clusters: Api<Cluster> = Api::all(seed.clone());
    let ctx = Arc::new(Ctx { seed, settings, metrics });
    health.set_ready(true);
    Controller::new(networks, watcher::Config::default())
        // A Cluster change (e.g. kube-proxy toggled, addresses advertised) concerns the
        // shoot's Network, which Gardener names after the shoot.
        .watches(clusters, watcher::Config::default(), |cluster: Cluster| {
            let shoot_name = cluster.spec.shoot.pointer("/metadata/name").and_then(Value::as_str).map(str::to_owned);
            shoot_name.map(|name| ObjectRef::new(&name).within(&cluster.name_any()))
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                debug!("controller: {e}");
            }
        })
        .await;
    health.set_ready(false);
}

fn error_policy(network: Arc<Network>, error: &Error, ctx: Arc<Ctx>) -> Action {
    warn!(network = %key(&network), "{error}");
    let wait = if error.is_configuration_problem() { ctx.settings.retry * 4 } else { ctx.settings.retry };
    Action::requeue(wait)
}

fn key(network: &Network) -> String {
    format!("{}/{}", network.namespace().unwrap_or_default(), network.name_any())
}

/// One reconcile, logged within a span that carries the Network's key.
async fn reconcile(cached: Arc<Network>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let span = tracing::info_span!("reconcile", network = %key(&cached));
    reconcile_network(cached, ctx).instrument(span).await
}

async fn reconcile_network(cached: Arc<Network>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let namespace = cached.namespace().ok_or(Error::NoNamespace)?;
    let name = cached.name_any();
    let api: Api<Network> = Api::namespaced(ctx.seed.clone(), &namespace);
    // Fresh: the cache may lag behind our own writes.
    let Some(network) = ctx.call("reading the Network", api.get_opt(&name)).await? else {
        return Ok(Action::await_change());
    };
    if !operation::is_ours(&network.spec.type_, network.spec.class.as_deref()) {
        return Ok(Action::await_change());
    }
    let clusters: Api<Cluster> = Api::all(ctx.seed.clone());
    let cluster = ctx.call("reading the Cluster", clusters.get_opt(&namespace)).await?;
    let shoot = cluster.as_ref().map(|c| c.shoot().map_err(|source| Error::BadShoot { cluster: namespace.clone(), source }));
    let shoot_failed = matches!(&shoot, Some(Ok(s)) if s.is_failed());
    let decision = operation::decide(&Facts::of(&network, shoot_failed));
    debug!(?decision);
    // Before the request is removed below: a request present now counts as new.
    let throttle = operation::retry_wait(&network, &now(), ctx.settings.retry);
    // Gardener's `OperationAnnotationWrapper`: a `reconcile` request is removed as soon as it
    // is picked up, before the work (and whatever its outcome); gardenlet then waits on
    // lastOperation and lastError. Restore and migrate requests are removed on success.
    let picked_up = !matches!(decision, Decision::Skip(SkipReason::NotOurs | SkipReason::WaitForState));
    let network = if picked_up && network.annotations().get(ANNOTATION_OPERATION).map(String::as_str) == Some(OP_RECONCILE) {
        match remove_operation_annotation(&ctx, &api, &network).await {
            Ok(n) => n,
            Err(e) if is_code(&e, 409) => return Ok(Action::requeue(CONFLICT_RETRY)),
            Err(e) => return Err(e),
        }
    } else {
        network
    };
    let op_type = match decision {
        Decision::Skip(reason) => {
            debug!(?reason, "skipping");
            return Ok(Action::await_change());
        }
        Decision::Observe => {
            if let Some(Ok(shoot)) = &shoot {
                observe(&ctx, &api, &network, shoot).await;
            }
            return Ok(Action::requeue(ctx.settings.observe_every));
        }
        Decision::Reconcile(t) => t,
        Decision::Delete => LastOperationType::Delete,
        Decision::Migrate => LastOperationType::Migrate,
        Decision::Restore => LastOperationType::Restore,
    };
    if let Some(wait) = throttle {
        debug!(?wait, "last attempt failed recently; waiting");
        return Ok(Action::requeue(wait));
    }
    let op_name = op_type.as_str().to_lowercase();
    ctx.metrics.reconciled(&op_name);
    info!("{} the Network", status::verb(&op_type).0);
    let result = match op_type {
        LastOperationType::Delete => delete(&ctx, &api, &network).await,
        LastOperationType::Migrate => migrate(&ctx, &api, &network).await,
        _ => {
            let cluster = cluster.ok_or_else(|| Error::ClusterMissing(namespace.clone()));
            match (cluster, shoot) {
                (Ok(_), Some(Ok(shoot))) => deploy(&ctx, &api, &network, &shoot, &op_type).await,
                (Err(e), _) | (_, Some(Err(e))) => Err(e),
                (Ok(_), None) => Err(Error::ClusterMissing(namespace.clone())),
            }
        }
    };
    match result {
        Ok(action) => Ok(action),
        // Someone else changed the Network meanwhile (e.g. gardenlet's next request): routine,
        // not an error to report; the next run starts from the new version.
        Err(e) if is_code(&e, 409) => {
            debug!("{e}; retrying");
            Ok(Action::requeue(CONFLICT_RETRY))
        }
        Err(e) => {
            ctx.metrics.failed(&op_name, e.kind());
            let generation = network.metadata.generation.unwrap_or_default();
            let patch = status::error(&op_type, generation, &e.to_string(), e.is_configuration_problem(), &now());
            if let Err(write) = patch_status(&ctx, &api, &network, &patch).await {
                warn!("writing the error status: {write}");
            }
            Err(e)
        }
    }
}

async fn patch_status(ctx: &Ctx, api: &Api<Network>, network: &Network, patch: &Value) -> Result<Network, Error> {
    ctx.call("writing the Network status", api.patch_status(&network.name_any(), &PatchParams::default(), &Patch::Merge(patch))).await
}

/// Merge patch of `metadata` with the object's resourceVersion as precondition.
async fn patch_meta(ctx: &Ctx, api: &Api<Network>, network: &Network, meta: Value, what: &str) -> Result<Network, Error> {
    let mut meta = meta;
    meta["resourceVersion"] = json!(network.metadata.resource_version);
    ctx.call(what, api.patch(&network.name_any(), &PatchParams::default(), &Patch::Merge(&json!({"metadata": meta})))).await
}

async fn add_finalizer(ctx: &Ctx, api: &Api<Network>, network: Network) -> Result<Network, Error> {
    if network.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(network);
    }
    let mut finalizers = network.finalizers().to_vec();
    finalizers.push(FINALIZER.to_owned());
    patch_meta(ctx, api, &network, json!({"finalizers": finalizers}), "adding the finalizer").await
}

async fn remove_finalizer(ctx: &Ctx, api: &Api<Network>, network: &Network) -> Result<(), Error> {
    let finalizers: Vec<&String> = network.finalizers().iter().filter(|f| *f != FINALIZER).collect();
    match patch_meta(ctx, api, network, json!({"finalizers": finalizers}), "removing the finalizer").await {
        Ok(_) => Ok(()),
        // Gone already: the finalizer was the last thing holding it.
        Err(e) if is_code(&e, 404) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes gardenlet's request (`extensionscontroller.RemoveAnnotation`), with the
/// resourceVersion it was read at: a conflict means a newer request may have arrived.
async fn remove_operation_annotation(ctx: &Ctx, api: &Api<Network>, network: &Network) -> Result<Network, Error> {
    if network.annotations().get(ANNOTATION_OPERATION).is_none() {
        return Ok(network.clone());
    }
    let patch = json!({"annotations": {ANNOTATION_OPERATION: null}});
    patch_meta(ctx, api, network, patch, "removing the operation annotation").await
}

/// Create, Reconcile and Restore: render, write Secret and ManagedResource, report.
async fn deploy(ctx: &Ctx, api: &Api<Network>, network: &Network, shoot: &Shoot, op_type: &LastOperationType) -> Result<Action, Error> {
    let namespace = network.namespace().ok_or(Error::NoNamespace)?;
    let network = add_finalizer(ctx, api, network.clone()).await?;
    let network = patch_status(ctx, api, &network, &status::processing(op_type, &now())).await?;
    let plan = contract::plan(&network.spec, shoot)?;
    let data = render::render(&plan, &render::Settings { image: ctx.settings.image.clone() })?;
    let secret = managed::secret(&namespace, managed::NAME, &data);
    let secret_name = secret.metadata.name.clone().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.seed.clone(), &namespace);
    // Immutable and named by content: an existing one already holds exactly this.
    match ctx.call("creating the ManagedResource secret", secrets.create(&PostParams::default(), &secret)).await {
        Err(e) if is_code(&e, 409) => {}
        other => drop(other?),
    }
    let mr = managed::managed_resource(&namespace, managed::NAME, &secret_name, false);
    let mrs: Api<ManagedResource> = Api::namespaced(ctx.seed.clone(), &namespace);
    ctx.call("applying the ManagedResource", mrs.patch(managed::NAME, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&mr))).await?;
    let generation = network.metadata.generation.unwrap_or_default();
    let patch = status::succeeded(op_type, generation, Some((&plan, status::provider_status(&plan, &secret_name))), &now());
    let network = patch_status(ctx, api, &network, &patch).await?;
    info!(secret = %secret_name, "Successfully {} Network", status::verb(op_type).2);
    // A restore request is answered now (a reconcile request was removed when picked up; one
    // present now is newer). A conflict leaves it for the next run.
    if *op_type == LastOperationType::Restore {
        if let Err(e) = remove_operation_annotation(ctx, api, &network).await {
            debug!("{e}");
        }
    }
    observe_plan(ctx, api, &network, shoot, &plan).await;
    Ok(Action::requeue(ctx.settings.observe_every))
}

/// Refreshes `ServiceRoutingReady` of a settled Network. Best effort: readiness is reported,
/// it does not fail the operation (Gardener waits for the agents through the
/// ManagedResource's health and the node taint).
async fn observe(ctx: &Ctx, api: &Api<Network>, network: &Network, shoot: &Shoot) {
    if let Ok(plan) = contract::plan(&network.spec, shoot) {
        observe_plan(ctx, api, network, shoot, &plan).await;
    }
}

async fn observe_plan(ctx: &Ctx, api: &Api<Network>, network: &Network, shoot: &Shoot, plan: &Plan) {
    if shoot.nodes_away() {
        return;
    }
    let Some(namespace) = network.namespace() else { return };
    let client = match tokio::time::timeout(ctx.settings.request_timeout, shoot::client(&ctx.seed, &namespace)).await {
        Ok(Ok(c)) => c,
        Ok(Err(ShootAccessError::NotYet(what))) => {
            debug!("no shoot access yet: {what}");
            return;
        }
        Ok(Err(e)) => {
            warn!("shoot access: {e}");
            return;
        }
        Err(_) => return,
    };
    let now = now();
    let nodes = match ctx.call("listing the shoot's Nodes", shoot::node_readiness_all(&client, &now)).await {
        Ok(n) => n,
        Err(e) => {
            debug!("{e}");
            return;
        }
    };
    let Ok(Some(fresh)) = ctx.call("reading the Network", api.get_opt(&network.name_any())).await else { return };
    if let Some(patch) = status::condition_patch(&fresh, plan, &nodes, now) {
        if let Err(e) = patch_status(ctx, api, &fresh, &patch).await {
            debug!("{e}");
        }
    }
}

/// Deletes the ManagedResource (waiting up to the delete timeout for the resource manager to
/// remove the shoot objects and release it), then every Secret gardenet created for it.
async fn delete_managed_resource(ctx: &Ctx, namespace: &str) -> Result<(), Error> {
    let mrs: Api<ManagedResource> = Api::namespaced(ctx.seed.clone(), namespace);
    match ctx.call("deleting the ManagedResource", mrs.delete(managed::NAME, &DeleteParams::default())).await {
        Err(e) if is_code(&e, 404) => {}
        other => drop(other?),
    }
    let deadline = tokio::time::Instant::now() + ctx.settings.delete_timeout;
    while ctx.call("reading the ManagedResource", mrs.get_opt(managed::NAME)).await?.is_some() {
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::ManagedResourceStuck { name: managed::NAME.into(), waited: ctx.settings.delete_timeout });
        }
        tokio::time::sleep(ctx.settings.poll).await;
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.seed.clone(), namespace);
    let selector = format!("{}={}", managed::LABEL_MANAGED_RESOURCE, managed::NAME);
    let list = ctx.call("listing the ManagedResource secrets", secrets.list(&ListParams::default().labels(&selector))).await?;
    for name in list.items.iter().map(|s| s.name_any()) {
        match ctx.call(format!("deleting secret {name}"), secrets.delete(&name, &DeleteParams::default())).await {
            Err(e) if is_code(&e, 404) => {}
            other => drop(other?),
        }
    }
    Ok(())
}

async fn delete(ctx: &Ctx, api: &Api<Network>, network: &Network) -> Result<Action, Error> {
    let namespace = network.namespace().ok_or(Error::NoNamespace)?;
    let t = LastOperationType::Delete;
    let network = patch_status(ctx, api, network, &status::processing(&t, &now())).await?;
    delete_managed_resource(ctx, &namespace).await?;
    let generation = network.metadata.generation.unwrap_or_default();
    let network = patch_status(ctx, api, &network, &status::succeeded(&t, generation, None, &now())).await?;
    remove_finalizer(ctx, api, &network).await?;
    info!("Successfully deleted Network");
    Ok(Action::await_change())
}

/// Migrate: the shoot keeps its objects (and keeps routing) while its control plane moves;
/// only the seed side goes.
async fn migrate(ctx: &Ctx, api: &Api<Network>, network: &Network) -> Result<Action, Error> {
    let namespace = network.namespace().ok_or(Error::NoNamespace)?;
    let t = LastOperationType::Migrate;
    let network = patch_status(ctx, api, network, &status::processing(&t, &now())).await?;
    let mrs: Api<ManagedResource> = Api::namespaced(ctx.seed.clone(), &namespace);
    let keep = json!({"spec": {"keepObjects": true}});
    match ctx.call("setting keepObjects", mrs.patch(managed::NAME, &PatchParams::default(), &Patch::Merge(&keep))).await {
        Err(e) if is_code(&e, 404) => {}
        other => drop(other?),
    }
    delete_managed_resource(ctx, &namespace).await?;
    let generation = network.metadata.generation.unwrap_or_default();
    let network = patch_status(ctx, api, &network, &status::succeeded(&t, generation, None, &now())).await?;
    // `RemoveAllFinalizers`, as the network reconciler's migrate does: the source seed lets
    // the object go entirely.
    let mut meta = json!({"finalizers": null});
    if network.annotations().contains_key(ANNOTATION_OPERATION) {
        meta["annotations"] = json!({ANNOTATION_OPERATION: null});
    }
    match patch_meta(ctx, api, &network, meta, "finishing the migration").await {
        Err(e) if is_code(&e, 404) => {}
        other => drop(other?),
    }
    info!("Successfully migrated Network");
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Problem;

    #[test]
    fn only_configuration_problems_carry_the_code() {
        assert!(Error::Configuration(Problems(vec![Problem::ReplacementRefused])).is_configuration_problem());
        let bad_shoot = serde_json::from_value::<Shoot>(json!({"spec": 1})).unwrap_err();
        assert!(Error::BadShoot { cluster: "c".into(), source: bad_shoot }.is_configuration_problem());
        assert!(!Error::ClusterMissing("c".into()).is_configuration_problem());
        assert!(!Error::ManagedResourceStuck { name: "m".into(), waited: Duration::from_secs(1) }.is_configuration_problem());
        let timeout = Error::Timeout { what: "x".into(), limit: Duration::from_secs(1) };
        assert!(!timeout.is_configuration_problem());
        assert_eq!(timeout.kind(), "api");
    }
}
