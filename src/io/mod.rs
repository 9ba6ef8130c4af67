//! io layer.
