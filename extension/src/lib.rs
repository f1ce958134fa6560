//! `gardenet-extension`: the Gardener network extension of `type: gardenet`.
//!
//! It runs in the seed, picks up `Network` objects of type `gardenet`, parses their
//! providerConfig, renders what the shoot needs (the agent DaemonSet, its RBAC and config)
//! into a ManagedResource for gardener-resource-manager, and owns the Network's status.
//! `gardenet-extension admission` validates Shoots of networking type gardenet.
//!
//! The decisions are pure and unit-tested without a server:
//! - [`cluster`]: the `Cluster` resource and the few Shoot fields gardenet reads.
//! - [`contract`]: the kube-proxy contract and everything else a Network must satisfy.
//! - [`operation`]: which operation Gardener asks for (annotation, deletion, last operation).
//! - [`render`]: the shoot manifests.
//! - [`managed`]: ManagedResource and its immutable, content-hashed Secret.
//! - [`status`]: the status patches (lastOperation, lastError, condition).
//!
//! The I/O lives in [`controller`] (the reconciler), [`shoot`] (shoot access), [`serve`]
//! (health and metrics endpoints) and [`admission`] (the webhook).

pub mod admission;
pub mod cluster;
pub mod contract;
pub mod controller;
pub mod managed;
pub mod metrics;
pub mod operation;
pub mod render;
pub mod serve;
pub mod shoot;
pub mod status;
