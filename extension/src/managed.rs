//! gardener-resource-manager's `ManagedResource` (`resources.gardener.cloud/v1alpha1`) and
//! its Secret, built the way Gardener's `managedresources.CreateForShoot` builds them: the
//! manifests go into an immutable Secret whose name ends in a hash of its content, and the
//! ManagedResource (no class: applied to the shoot) references that Secret. A changed
//! content therefore produces a new Secret; the old one is garbage-collected by the resource
//! manager once nothing references it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Name of gardenet's ManagedResource in the shoot namespace of the seed.
pub const NAME: &str = "extension-networking-gardenet";
/// Label `CreateForShoot` puts on the ManagedResource (`origin: <who>`).
pub const LABEL_ORIGIN: &str = "origin";
pub const ORIGIN: &str = "gardenet";
/// Lets the resource manager delete Secrets no ManagedResource refers to any more.
pub const LABEL_GARBAGE_COLLECTABLE: &str = "resources.gardener.cloud/garbage-collectable-reference";
/// Injected into every shoot object, so Gardener's shoot cleanup leaves them to the MR.
pub const LABEL_NO_CLEANUP: &str = "shoot.gardener.cloud/no-cleanup";
/// Label gardenet puts on its Secrets, to find them again on delete.
pub const LABEL_MANAGED_RESOURCE: &str = "gardenet.networking.extensions.gardener.cloud/managed-resource";

#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "resources.gardener.cloud",
    version = "v1alpha1",
    kind = "ManagedResource",
    plural = "managedresources",
    namespaced,
    status = "ManagedResourceStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct ManagedResourceSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    #[serde(default)]
    pub secret_refs: Vec<SecretRef>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub inject_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_objects: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretRef {
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagedResourceStatus {
    #[serde(default)]
    pub conditions: Vec<Value>,
    #[serde(default)]
    pub observed_generation: i64,
}

/// The first 8 hex digits of the SHA-256 of the data (keys and values, in key order).
pub fn content_hash(data: &BTreeMap<String, String>) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for (k, v) in data {
        // Length-prefixed, so ("ab","c") and ("a","bc") differ.
        for part in [k, v] {
            ctx.update(&(part.len() as u64).to_be_bytes());
            ctx.update(part.as_bytes());
        }
    }
    ctx.finish().as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// `managedresource-<name>-<hash>`.
pub fn secret_name(mr_name: &str, data: &BTreeMap<String, String>) -> String {
    format!("managedresource-{mr_name}-{}", content_hash(data))
}

/// The immutable Secret holding the manifests (`data` maps file names to YAML).
pub fn secret(namespace: &str, mr_name: &str, data: &BTreeMap<String, String>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(mr_name, data)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (LABEL_GARBAGE_COLLECTABLE.to_owned(), "true".to_owned()),
                (LABEL_MANAGED_RESOURCE.to_owned(), mr_name.to_owned()),
            ])),
            ..Default::default()
        },
        immutable: Some(true),
        type_: Some("Opaque".to_owned()),
        data: Some(data.iter().map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes()))).collect()),
        ..Default::default()
    }
}

/// The ManagedResource referencing `secret_name`; no class, so the shoot's resource manager
/// applies it into the shoot.
pub fn managed_resource(namespace: &str, mr_name: &str, secret_name: &str, keep_objects: bool) -> ManagedResource {
    let mut mr = ManagedResource::new(
        mr_name,
        ManagedResourceSpec {
            class: None,
            secret_refs: vec![SecretRef { name: secret_name.to_owned() }],
            inject_labels: BTreeMap::from([(LABEL_NO_CLEANUP.to_owned(), "true".to_owned())]),
            keep_objects: Some(keep_objects),
        },
    );
    mr.metadata.namespace = Some(namespace.to_owned());
    mr.metadata.labels = Some(BTreeMap::from([(LABEL_ORIGIN.to_owned(), ORIGIN.to_owned())]));
    mr
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(v: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("a.yaml".to_owned(), v.to_owned())])
    }

    #[test]
    fn hash_follows_content() {
        assert_eq!(content_hash(&data("x")), content_hash(&data("x")));
        assert_ne!(content_hash(&data("x")), content_hash(&data("y")));
        assert_eq!(content_hash(&data("x")).len(), 8);
        let split = BTreeMap::from([("ab".to_owned(), "c".to_owned())]);
        let other = BTreeMap::from([("a".to_owned(), "bc".to_owned())]);
        assert_ne!(content_hash(&split), content_hash(&other));
    }

    #[test]
    fn secret_is_immutable_and_collectable() {
        let s = secret("shoot--a--b", NAME, &data("x"));
        assert_eq!(s.immutable, Some(true));
        let name = s.metadata.name.unwrap();
        assert!(name.starts_with("managedresource-extension-networking-gardenet-"), "{name}");
        assert_eq!(s.metadata.labels.unwrap()[LABEL_GARBAGE_COLLECTABLE], "true");
        assert_eq!(s.data.unwrap()["a.yaml"].0, b"x");
    }

    #[test]
    fn managed_resource_has_no_class_and_references_the_secret() {
        let mr = managed_resource("ns", NAME, "s1", false);
        let v = serde_json::to_value(&mr).unwrap();
        assert_eq!(v["apiVersion"], "resources.gardener.cloud/v1alpha1");
        assert!(v["spec"].get("class").is_none());
        assert_eq!(v["spec"]["secretRefs"][0]["name"], "s1");
        assert_eq!(v["spec"]["keepObjects"], false);
        assert_eq!(v["spec"]["injectLabels"][LABEL_NO_CLEANUP], "true");
        assert_eq!(v["metadata"]["labels"]["origin"], "gardenet");
    }
}
