pub mod apiserver;
pub mod lab;
pub mod netns;
