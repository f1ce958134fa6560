
pub mod apiserver;
