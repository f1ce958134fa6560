//! Which operation Gardener asks for, derived from a Network the way Gardener's extension
//! library does (`ComputeOperationType` and the network reconciler's dispatch): the
//! `gardener.cloud/operation` annotation, the deletion timestamp and the last operation.

use gardenet_agent::gardener::network::{LastOperationState, LastOperationType, Network};
use gardenet_agent::gardener::NETWORK_TYPE;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;

/// gardenlet's request to an extension: `reconcile`, `migrate`, `restore`, `wait-for-state`.
pub const ANNOTATION_OPERATION: &str = "gardener.cloud/operation";
/// When gardenlet set the operation annotation; `lastOperation.lastUpdateTime` must not be
/// older, or gardenlet keeps waiting.
pub const ANNOTATION_TIMESTAMP: &str = "gardener.cloud/timestamp";
/// The finalizer of network extension controllers.
pub const FINALIZER: &str = "extensions.gardener.cloud/network";

pub const OP_RECONCILE: &str = "reconcile";
pub const OP_MIGRATE: &str = "migrate";
pub const OP_RESTORE: &str = "restore";
pub const OP_WAIT_FOR_STATE: &str = "wait-for-state";

/// What to do with a Network now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Reconcile, recording the operation as `Create` or `Reconcile`.
    Reconcile(LastOperationType),
    Delete,
    Migrate,
    Restore,
    /// Up to date: only the readiness condition is kept current.
    Observe,
    Skip(SkipReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Another extension's Network (type or class).
    NotOurs,
    /// gardenlet is moving the shoot's state to this seed; nothing may act yet.
    WaitForState,
    /// The Shoot's last operation failed: leave it alone.
    ShootFailed,
    /// Migrated away from this seed and not restored: another seed owns the shoot.
    Migrated,
    /// Being deleted, and the finalizer is already gone (nothing left to clean up).
    Deleted,
}

/// Facts about a Network the decision depends on.
#[derive(Clone, Debug, Default)]
pub struct Facts<'a> {
    pub type_: &'a str,
    pub class: Option<&'a str>,
    pub operation: Option<&'a str>,
    pub deleting: bool,
    pub has_finalizer: bool,
    pub last_operation: Option<(LastOperationType, LastOperationState)>,
    pub generation: i64,
    pub observed_generation: i64,
    pub shoot_failed: bool,
}

impl<'a> Facts<'a> {
    pub fn of(network: &'a Network, shoot_failed: bool) -> Self {
        let meta = &network.metadata;
        let status = network.status.as_ref();
        Facts {
            type_: &network.spec.type_,
            class: network.spec.class.as_deref(),
            operation: meta.annotations.as_ref().and_then(|a| a.get(ANNOTATION_OPERATION)).map(String::as_str),
            deleting: meta.deletion_timestamp.is_some(),
            has_finalizer: meta.finalizers.iter().flatten().any(|f| f == FINALIZER),
            last_operation: status
                .and_then(|s| s.last_operation.as_ref())
                .map(|op| (op.type_.clone(), op.state.clone())),
            generation: meta.generation.unwrap_or_default(),
            observed_generation: status.map(|s| s.observed_generation).unwrap_or_default(),
            shoot_failed,
        }
    }
}

/// Whether gardenet handles Networks of this type and class (no class means `shoot`).
pub fn is_ours(type_: &str, class: Option<&str>) -> bool {
    type_ == NETWORK_TYPE && matches!(class, None | Some("") | Some("shoot"))
}

pub fn decide(f: &Facts<'_>) -> Decision {
    use LastOperationState::Succeeded;
    use LastOperationType as T;
    if !is_ours(f.type_, f.class) {
        return Decision::Skip(SkipReason::NotOurs);
    }
    if f.operation == Some(OP_WAIT_FOR_STATE) {
        return Decision::Skip(SkipReason::WaitForState);
    }
    let unfinished = |t: T| matches!(&f.last_operation, Some((ty, st)) if *ty == t && *st != Succeeded);
    if f.operation == Some(OP_MIGRATE) || unfinished(T::Migrate) {
        return Decision::Migrate;
    }
    let migrated = matches!(&f.last_operation, Some((T::Migrate, Succeeded)));
    if f.operation == Some(OP_RESTORE) || unfinished(T::Restore) {
        return Decision::Restore;
    }
    if f.deleting {
        return if !f.has_finalizer {
            Decision::Skip(SkipReason::Deleted)
        } else if migrated {
            // The finalizer of a migrated Network is gone already; this is a leftover.
            Decision::Skip(SkipReason::Migrated)
        } else {
            Decision::Delete
        };
    }
    if migrated {
        return Decision::Skip(SkipReason::Migrated);
    }
    if f.shoot_failed {
        return Decision::Skip(SkipReason::ShootFailed);
    }
    let op_type = if f.last_operation.is_none() || unfinished(T::Create) { T::Create } else { T::Reconcile };
    let asked = f.operation == Some(OP_RECONCILE);
    let settled = matches!(&f.last_operation, Some((_, Succeeded))) && f.generation == f.observed_generation && f.has_finalizer;
    if asked || !settled {
        Decision::Reconcile(op_type)
    } else {
        Decision::Observe
    }
}

/// How long to wait before acting again on a Network whose last attempt failed and that
/// nobody has changed since (same generation, no newer request from gardenlet): the error
/// write itself is a change to the object, and without this every failure would trigger the
/// next attempt at once. `None`: act now.
pub fn retry_wait(network: &Network, now: &Time, retry: Duration) -> Option<Duration> {
    let status = network.status.as_ref()?;
    let op = status.last_operation.as_ref()?;
    if op.state != LastOperationState::Error || status.observed_generation != network.metadata.generation.unwrap_or_default() {
        return None;
    }
    let failed_at = op.last_update_time.as_ref()?.0;
    let asked_at = network
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TIMESTAMP))
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    if asked_at.is_some_and(|asked| asked > failed_at) {
        return None;
    }
    let elapsed = Duration::try_from(now.0.duration_since(failed_at)).unwrap_or_default();
    retry.checked_sub(elapsed).filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;
    use LastOperationState as S;
    use LastOperationType as T;

    fn facts() -> Facts<'static> {
        Facts {
            type_: "gardenet",
            has_finalizer: true,
            last_operation: Some((T::Reconcile, S::Succeeded)),
            generation: 2,
            observed_generation: 2,
            ..Default::default()
        }
    }

    #[test]
    fn type_and_class() {
        assert_eq!(decide(&Facts { type_: "calico", ..facts() }), Decision::Skip(SkipReason::NotOurs));
        assert_eq!(decide(&Facts { class: Some("seed"), ..facts() }), Decision::Skip(SkipReason::NotOurs));
        assert_eq!(decide(&Facts { class: Some("shoot"), ..facts() }), Decision::Observe);
    }

    #[test]
    fn first_reconcile_is_a_create_until_it_succeeds() {
        let f = Facts { last_operation: None, has_finalizer: false, generation: 1, observed_generation: 0, ..facts() };
        assert_eq!(decide(&f), Decision::Reconcile(T::Create));
        let f = Facts { last_operation: Some((T::Create, S::Error)), ..facts() };
        assert_eq!(decide(&f), Decision::Reconcile(T::Create));
        let f = Facts { last_operation: Some((T::Create, S::Succeeded)), operation: Some(OP_RECONCILE), ..facts() };
        assert_eq!(decide(&f), Decision::Reconcile(T::Reconcile));
    }

    #[test]
    fn settled_networks_are_only_observed_unless_asked() {
        assert_eq!(decide(&facts()), Decision::Observe);
        assert_eq!(decide(&Facts { operation: Some(OP_RECONCILE), ..facts() }), Decision::Reconcile(T::Reconcile));
        assert_eq!(decide(&Facts { generation: 3, ..facts() }), Decision::Reconcile(T::Reconcile));
        let f = Facts { last_operation: Some((T::Reconcile, S::Error)), ..facts() };
        assert_eq!(decide(&f), Decision::Reconcile(T::Reconcile));
    }

    #[test]
    fn annotations_and_deletion() {
        assert_eq!(decide(&Facts { operation: Some(OP_WAIT_FOR_STATE), ..facts() }), Decision::Skip(SkipReason::WaitForState));
        assert_eq!(decide(&Facts { operation: Some(OP_MIGRATE), deleting: true, ..facts() }), Decision::Migrate);
        assert_eq!(decide(&Facts { operation: Some(OP_RESTORE), ..facts() }), Decision::Restore);
        assert_eq!(decide(&Facts { deleting: true, ..facts() }), Decision::Delete);
        assert_eq!(decide(&Facts { deleting: true, has_finalizer: false, ..facts() }), Decision::Skip(SkipReason::Deleted));
        // A failed shoot still gets deleted, migrated and restored, but not reconciled.
        assert_eq!(decide(&Facts { shoot_failed: true, operation: Some(OP_RECONCILE), ..facts() }), Decision::Skip(SkipReason::ShootFailed));
        assert_eq!(decide(&Facts { shoot_failed: true, deleting: true, ..facts() }), Decision::Delete);
    }

    #[test]
    fn failed_attempts_are_retried_after_a_while_unless_asked_again() {
        use gardenet_agent::gardener::network::{LastOperation, NetworkSpec, NetworkStatus};
        let t = |s: &str| Time(s.parse().unwrap());
        let mut n = Network::new("n", NetworkSpec::default());
        n.metadata.generation = Some(2);
        n.status = Some(NetworkStatus {
            observed_generation: 2,
            last_operation: Some(LastOperation {
                description: String::new(),
                last_update_time: Some(t("2025-01-01T10:00:00Z")),
                progress: 50,
                state: S::Error,
                type_: T::Reconcile,
            }),
            ..Default::default()
        });
        let retry = Duration::from_secs(30);
        assert_eq!(retry_wait(&n, &t("2025-01-01T10:00:10Z"), retry), Some(Duration::from_secs(20)));
        assert_eq!(retry_wait(&n, &t("2025-01-01T10:00:30Z"), retry), None);
        // A newer request from gardenlet, or a new generation: at once.
        n.metadata.annotations = Some([(ANNOTATION_TIMESTAMP.to_owned(), "2025-01-01T10:00:05Z".to_owned())].into());
        assert_eq!(retry_wait(&n, &t("2025-01-01T10:00:10Z"), retry), None);
        n.metadata.annotations = None;
        n.metadata.generation = Some(3);
        assert_eq!(retry_wait(&n, &t("2025-01-01T10:00:10Z"), retry), None);
    }

    #[test]
    fn migration_and_restore() {
        let migrated = Facts { last_operation: Some((T::Migrate, S::Succeeded)), has_finalizer: false, ..facts() };
        assert_eq!(decide(&migrated), Decision::Skip(SkipReason::Migrated));
        assert_eq!(decide(&Facts { operation: Some(OP_RESTORE), ..migrated.clone() }), Decision::Restore);
        assert_eq!(decide(&Facts { last_operation: Some((T::Migrate, S::Error)), ..facts() }), Decision::Migrate);
        assert_eq!(decide(&Facts { last_operation: Some((T::Restore, S::Processing)), ..facts() }), Decision::Restore);
    }
}
