//! What a real API server does to an object besides storing it, for the resources that need
//! it: status subresources (writes to the main resource leave `.status` alone, and objects are
//! created without one), `metadata.generation` (1 on create, bumped when anything but metadata
//! and status changes), and finalizers (a DELETE of an object with finalizers only sets
//! `deletionTimestamp`; it goes once the last finalizer is removed, and no new finalizer may
//! be added meanwhile).
use serde_json::{json, Value};

use super::store::{Coll, Failure};

/// Custom resources the double serves with a status subresource (their CRDs declare one).
const WITH_STATUS_SUBRESOURCE: &[(&str, &str)] =
    &[("extensions.gardener.cloud/v1alpha1", "networks"), ("resources.gardener.cloud/v1alpha1", "managedresources")];

/// Time the double stamps as `deletionTimestamp`.
const DELETION_TIME: &str = "2025-01-01T00:00:01Z";

fn has_status_subresource(coll: &Coll) -> bool {
    WITH_STATUS_SUBRESOURCE.iter().any(|(av, p)| *av == coll.api_version && *p == coll.plural)
}

/// The real server maintains `generation` for custom resources (and some built-ins, which
/// the double's users do not rely on).
fn tracks_generation(coll: &Coll) -> bool {
    !coll.builtin()
}

fn finalizers(obj: &Value) -> Vec<Value> {
    obj.pointer("/metadata/finalizers").and_then(Value::as_array).cloned().unwrap_or_default()
}

fn deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some_and(|t| !t.is_null())
}

/// Everything but metadata and status: what `generation` counts changes of.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(map) = v.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            map.remove(k);
        }
    }
    v
}

/// A new object from a POST.
pub fn on_create(coll: &Coll, obj: &mut Value) {
    if has_status_subresource(coll) {
        if let Some(map) = obj.as_object_mut() {
            map.remove("status");
        }
    }
    if tracks_generation(coll) {
        obj["metadata"]["generation"] = json!(1);
    }
    if let Some(meta) = obj["metadata"].as_object_mut() {
        meta.remove("deletionTimestamp");
    }
}

/// A PUT or PATCH of the main resource turning `current` into `new`.
pub fn on_update(coll: &Coll, current: &Value, new: &mut Value) -> Result<(), Failure> {
    if has_status_subresource(coll) {
        match current.get("status") {
            Some(s) => new["status"] = s.clone(),
            None => {
                if let Some(map) = new.as_object_mut() {
                    map.remove("status");
                }
            }
        }
    }
    // deletionTimestamp is the server's to set, once.
    match current.pointer("/metadata/deletionTimestamp") {
        Some(t) => new["metadata"]["deletionTimestamp"] = t.clone(),
        None => {
            if let Some(meta) = new["metadata"].as_object_mut() {
                meta.remove("deletionTimestamp");
            }
        }
    }
    if deleting(current) {
        let had = finalizers(current);
        if finalizers(new).iter().any(|f| !had.contains(f)) {
            return Err(Failure::new(422, "Invalid", "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted"));
        }
    }
    if tracks_generation(coll) {
        let generation = current.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(1);
        let bumped = spec_part(current) != spec_part(new);
        new["metadata"]["generation"] = json!(if bumped { generation + 1 } else { generation });
    }
    Ok(())
}

/// Whether an updated object is now gone: being deleted, and its last finalizer removed.
pub fn finalized(obj: &Value) -> bool {
    deleting(obj) && finalizers(obj).is_empty()
}

/// What a DELETE does to `current`: `Some(updated)` when finalizers hold it (it stays, with
/// `deletionTimestamp` set), `None` when it goes now.
pub fn on_delete(current: &Value) -> Option<Value> {
    if finalizers(current).is_empty() {
        return None;
    }
    let mut obj = current.clone();
    if !deleting(&obj) {
        obj["metadata"]["deletionTimestamp"] = json!(DELETION_TIME);
        obj["metadata"]["deletionGracePeriodSeconds"] = json!(0);
    }
    Some(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network() -> Coll {
        Coll { api_version: "extensions.gardener.cloud/v1alpha1".into(), plural: "networks".into() }
    }

    #[test]
    fn create_drops_status_and_starts_generation() {
        let mut obj = json!({"metadata": {"name": "n", "deletionTimestamp": "x"}, "spec": {}, "status": {"a": 1}});
        on_create(&network(), &mut obj);
        assert_eq!(obj.get("status"), None);
        assert_eq!(obj["metadata"]["generation"], 1);
        assert_eq!(obj["metadata"].get("deletionTimestamp"), None);
    }

    #[test]
    fn updates_keep_status_and_bump_generation_on_spec_changes() {
        let current = json!({"metadata": {"name": "n", "generation": 2}, "spec": {"a": 1}, "status": {"s": 1}});
        let mut same = json!({"metadata": {"name": "n", "annotations": {"x": "y"}}, "spec": {"a": 1}, "status": {"s": 2}});
        on_update(&network(), &current, &mut same).unwrap();
        assert_eq!(same["status"]["s"], 1);
        assert_eq!(same["metadata"]["generation"], 2);
        let mut changed = json!({"metadata": {"name": "n"}, "spec": {"a": 2}});
        on_update(&network(), &current, &mut changed).unwrap();
        assert_eq!(changed["metadata"]["generation"], 3);
        assert_eq!(changed["status"]["s"], 1);
    }

    #[test]
    fn finalizers_hold_deletion() {
        let plain = json!({"metadata": {"name": "n"}});
        assert_eq!(on_delete(&plain), None);
        let held = json!({"metadata": {"name": "n", "finalizers": ["f"]}});
        let marked = on_delete(&held).unwrap();
        assert!(deleting(&marked) && !finalized(&marked));
        let mut added = json!({"metadata": {"name": "n", "finalizers": ["f", "g"]}});
        assert_eq!(on_update(&network(), &marked, &mut added).unwrap_err().code, 422);
        let mut released = json!({"metadata": {"name": "n", "finalizers": []}});
        on_update(&network(), &marked, &mut released).unwrap();
        assert!(finalized(&released));
    }
}
