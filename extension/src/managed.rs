//! gardener-resource-manager's `ManagedResource` (`resources.gardener.cloud/v1alpha1`) and
//! its Secret, built the way Gardener's `managedresources.CreateForShoot` builds them
//! (`pkg/utils/managedresources`, `kubernetes.MakeUnique`, the builder's `Reconcile`): the
//! manifests go into an immutable Secret `managedresource-<name>-<checksum[:8]>`, labelled
//! garbage-collectable, and the ManagedResource (no class: applied to the shoot) references
//! it in `secretRefs` and in a `reference.resources.gardener.cloud/secret-...` annotation.
//! A changed content produces a new Secret; the resource manager's garbage collector deletes
//! a collectable Secret once no object's reference annotation names it any more, so the
//! annotation is what keeps the current Secret alive.

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
/// Prefix of the reference annotations the garbage collector reads
/// (`references.AnnotationKeyPrefix`).
pub const ANNOTATION_REFERENCE_PREFIX: &str = "reference.resources.gardener.cloud/";
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

fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Gardener's `utils.ComputeSecretChecksum`: the SHA-256 (hex) of the concatenated hex
/// SHA-256s of the values, in key order. Following it exactly gives the Secret the name
/// `CreateForShoot` would give it.
pub fn checksum(data: &BTreeMap<String, String>) -> String {
    let digests: String = data.values().map(|v| sha256_hex(v.as_bytes())).collect();
    sha256_hex(digests.as_bytes())
}

/// The first 8 hex digits of [`checksum`] (`MakeUnique`'s suffix).
pub fn content_hash(data: &BTreeMap<String, String>) -> String {
    checksum(data)[..8].to_owned()
}

/// `managedresource-<name>-<hash>`.
pub fn secret_name(mr_name: &str, data: &BTreeMap<String, String>) -> String {
    format!("managedresource-{mr_name}-{}", content_hash(data))
}

/// `references.AnnotationKey("secret", name)`: the prefix, the kind and the first 8 hex
/// digits of the SHA-256 of the name.
pub fn reference_annotation_key(secret_name: &str) -> String {
    format!("{ANNOTATION_REFERENCE_PREFIX}secret-{}", &sha256_hex(secret_name.as_bytes())[..8])
}

/// The immutable Secret holding the manifests (`data` maps file names to YAML).
pub fn secret(namespace: &str, mr_name: &str, data: &BTreeMap<String, String>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(mr_name, data)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(LABEL_GARBAGE_COLLECTABLE.to_owned(), "true".to_owned()), (LABEL_MANAGED_RESOURCE.to_owned(), mr_name.to_owned())])),
            ..Default::default()
        },
        immutable: Some(true),
        type_: Some("Opaque".to_owned()),
        data: Some(data.iter().map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes()))).collect()),
        ..Default::default()
    }
}

/// The ManagedResource referencing `secret_name`, as `NewForShoot` builds it: no class (the
/// shoot's resource manager applies it into the shoot), `origin` label, `keepObjects` set,
/// `shoot.gardener.cloud/no-cleanup` injected, and the reference annotation
/// (`references.InjectAnnotations`) that keeps the Secret from being garbage-collected.
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
    mr.metadata.annotations = Some(BTreeMap::from([(reference_annotation_key(secret_name), secret_name.to_owned())]));
    mr
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(v: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("a.yaml".to_owned(), v.to_owned())])
    }

    #[test]
    fn hash_is_gardeners_secret_checksum() {
        // Expected values: `printf x | sha256sum`, its hex digest hashed again (and for two
        // keys the two hex digests concatenated in key order), as ComputeSecretChecksum does.
        assert_eq!(content_hash(&data("x")), "a57b5956");
        let two = BTreeMap::from([("b.yaml".to_owned(), "y".to_owned()), ("a.yaml".to_owned(), "x".to_owned())]);
        assert_eq!(content_hash(&two), "80d88848");
        assert_ne!(content_hash(&data("x")), content_hash(&data("y")));
        assert_eq!(checksum(&data("x")).len(), 64);
        assert_eq!(secret_name(NAME, &data("x")), "managedresource-extension-networking-gardenet-a57b5956");
    }

    #[test]
    fn reference_annotation_is_the_garbage_collectors() {
        // `printf managedresource-extension-networking-gardenet-abcd1234 | sha256sum | cut -c1-8`
        let key = reference_annotation_key("managedresource-extension-networking-gardenet-abcd1234");
        assert_eq!(key, "reference.resources.gardener.cloud/secret-37b08cea");
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
        assert_eq!(v["metadata"]["annotations"][reference_annotation_key("s1")], "s1");
        assert_eq!(v["metadata"]["annotations"].as_object().unwrap().len(), 1);
    }
}
