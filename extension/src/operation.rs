//! Which operation Gardener asks for, derived from a Network the way Gardener's extension
//! library does: `OperationAnnotationWrapper` (wait-for-state), the network reconciler's
//! `Reconcile` (`IsFailed` first, then `ComputeOperationType`, `ShouldSkipOperation` and the
//! dispatch migrate, delete, restore, reconcile), from the `gardener.cloud/operation`
//! annotation, the deletion timestamp and the last operation.

use gardenet_agent::gardener::network::{LastOperationState, LastOperationType, Network};
use gardenet_agent::gardener::NETWORK_TYPE;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;

/// gardenlet's request to an extension: `reconcile`, `migrate`, `restore`, `wait-for-state`.
pub const ANNOTATION_OPERATION: &str = "gardener.cloud/operation";
/// Set by gardenlet with every request. gardenlet only uses it to know its cache holds the
/// version it wrote (`WaitUntilObjectReadyWithHealthFunction`); extensions do not read it.
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
    /// The Shoot's last operation failed: leave it alone, whatever is asked (`IsFailed`).
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
            last_operation: status.and_then(|s| s.last_operation.as_ref()).map(|op| (op.type_.clone(), op.state.clone())),
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

/// Gardener's `ComputeOperationType`: the annotation (migrate), the deletion timestamp, the
/// annotation (restore), then an unfinished Create, Migrate or Restore is carried on.
pub fn operation_type(f: &Facts<'_>) -> LastOperationType {
    use LastOperationState::Succeeded;
    use LastOperationType as T;
    let unfinished = |t: T| matches!(&f.last_operation, Some((ty, st)) if *ty == t && *st != Succeeded);
    if f.operation == Some(OP_MIGRATE) {
        T::Migrate
    } else if f.deleting {
        T::Delete
    } else if f.operation == Some(OP_RESTORE) {
        T::Restore
    } else if f.last_operation.is_none() || unfinished(T::Create) {
        T::Create
    } else if unfinished(T::Migrate) {
        T::Migrate
    } else if unfinished(T::Restore) {
        T::Restore
    } else {
        T::Reconcile
    }
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
    if f.shoot_failed {
        return Decision::Skip(SkipReason::ShootFailed);
    }
    let op_type = operation_type(f);
    // `ShouldSkipOperation`: once migrated away, only a migrate or a restore is honoured.
    let migrated = matches!(&f.last_operation, Some((T::Migrate, Succeeded)));
    if migrated && !matches!(op_type, T::Migrate | T::Restore) {
        return Decision::Skip(SkipReason::Migrated);
    }
    match op_type {
        T::Migrate => Decision::Migrate,
        _ if f.deleting => {
            if f.has_finalizer {
                Decision::Delete
            } else {
                Decision::Skip(SkipReason::Deleted)
            }
        }
        T::Restore => Decision::Restore,
        _ => {
            let asked = f.operation == Some(OP_RECONCILE);
            let settled = matches!(&f.last_operation, Some((_, Succeeded))) && f.generation == f.observed_generation && f.has_finalizer;
            if asked || !settled {
                Decision::Reconcile(op_type)
            } else {
                Decision::Observe
            }
        }
    }
}

/// How long to wait before acting again on a Network whose last attempt failed and that
/// nobody has changed since (same generation, no new request from gardenlet): the error
/// write itself is a change to the object, and without this every failure would trigger the
/// next attempt at once (Gardener's controllers back off the same way). `None`: act now.
pub fn retry_wait(network: &Network, now: &Time, retry: Duration) -> Option<Duration> {
    let status = network.status.as_ref()?;
    let op = status.last_operation.as_ref()?;
    if op.state != LastOperationState::Error || status.observed_generation != network.metadata.generation.unwrap_or_default() {
        return None;
    }
    // The request annotation is removed when picked up, so one present now is a new request.
    if network.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(ANNOTATION_OPERATION)) {
        return None;
    }
    let failed_at = op.last_update_time.as_ref()?.0;
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
        // ComputeOperationType: deletion wins over a restore request and an unfinished migration.
        assert_eq!(decide(&Facts { operation: Some(OP_RESTORE), deleting: true, ..facts() }), Decision::Delete);
        let unfinished_migration = Some((T::Migrate, S::Error));
        assert_eq!(decide(&Facts { last_operation: unfinished_migration, deleting: true, ..facts() }), Decision::Delete);
        // IsFailed: a failed shoot is left alone whatever is asked, deletion included.
        for f in [
            Facts { operation: Some(OP_RECONCILE), ..facts() },
            Facts { deleting: true, ..facts() },
            Facts { operation: Some(OP_MIGRATE), ..facts() },
            Facts { operation: Some(OP_RESTORE), ..facts() },
        ] {
            assert_eq!(decide(&Facts { shoot_failed: true, ..f }), Decision::Skip(SkipReason::ShootFailed));
        }
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
        // A new request from gardenlet, or a new generation: at once.
        n.metadata.annotations = Some([(ANNOTATION_OPERATION.to_owned(), OP_RECONCILE.to_owned())].into());
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
        // Migrated, then deleted (gardenlet cleans up the source seed): nothing to do here.
        assert_eq!(decide(&Facts { deleting: true, ..migrated.clone() }), Decision::Skip(SkipReason::Migrated));
        assert_eq!(decide(&Facts { deleting: true, has_finalizer: true, ..migrated }), Decision::Skip(SkipReason::Migrated));
    }
}
