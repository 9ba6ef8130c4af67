//! vhost layer.
