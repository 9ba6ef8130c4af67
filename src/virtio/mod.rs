//! virtio layer.
