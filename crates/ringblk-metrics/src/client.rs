//! The reading side of the daemon's endpoint, for `ringblk stats` and
//! `ringblk-bench`.

use std::io::{Read, Write};
use std::time::Duration;

use crate::transport::MetricsAddr;
use crate::{MetricsDoc, MetricsError};

/// Timeout for connecting, sending the request and reading the answer.
const TIMEOUT: Duration = Duration::from_secs(3);

/// GETs `path` from the endpoint at `addr` and returns the body.
pub fn get(addr: &str, path: &str) -> Result<String, MetricsError> {
    let fail = |what: &str, e: std::io::Error| MetricsError::Fetch {
        addr: addr.to_string(),
        what: what.into(),
        source: e,
    };
    let mut s = MetricsAddr::parse(addr)
        .connect(TIMEOUT)
        .map_err(|e| fail("connect", e))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: ringblk\r\n\r\n").as_bytes())
        .map_err(|e| fail("send", e))?;
    let mut raw = Vec::new();
    // The response is a few KiB; cap it so a wrong address cannot make us
    // read forever.
    s.take(16 << 20)
        .read_to_end(&mut raw)
        .map_err(|e| fail("read", e))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| MetricsError::Protocol(format!("{addr}: no HTTP response head")))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(MetricsError::Protocol(format!("{addr}{path}: {status}")));
    }
    Ok(body.to_string())
}

/// Fetches and parses `/metrics.json`.
pub fn fetch(addr: &str) -> Result<MetricsDoc, MetricsError> {
    let body = get(addr, "/metrics.json")?;
    serde_json::from_str(&body)
        .map_err(|e| MetricsError::Protocol(format!("{addr}/metrics.json: {e}")))
}
