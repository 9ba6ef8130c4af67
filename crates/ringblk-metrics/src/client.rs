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
    let (status, line, body) = request(addr, "GET", path, b"")?;
    if status != 200 {
        return Err(MetricsError::Protocol(format!("{addr}{path}: {line}")));
    }
    Ok(body)
}

/// Sends `method path` with `body` (JSON) to the endpoint at `addr` over
/// HTTP/1.0, and returns the status code, the status line and the body,
/// whatever the status.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, String, String), MetricsError> {
    let fail = |what: &str, e: std::io::Error| MetricsError::Fetch {
        addr: addr.to_string(),
        what: what.into(),
        source: e,
    };
    let mut s = MetricsAddr::parse(addr)
        .connect(TIMEOUT)
        .map_err(|e| fail("connect", e))?;
    let mut msg = format!("{method} {path} HTTP/1.0\r\nHost: ringblk\r\n").into_bytes();
    if !body.is_empty() {
        msg.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    msg.extend_from_slice(b"\r\n");
    msg.extend_from_slice(body);
    let sent = s.write_all(&msg);
    let mut raw = Vec::new();
    // The response is a few KiB; cap it so a wrong address cannot make us
    // read forever.
    let read = s.take(16 << 20).read_to_end(&mut raw);
    match (sent, read) {
        (Ok(()), Ok(_)) => {}
        // The daemon answers a request it refuses unread (a body over its
        // limit: 413) and closes, which can fail the rest of the send: its
        // answer is what counts.
        (Err(_), _) if raw.windows(4).any(|w| w == b"\r\n\r\n") => {}
        (Err(e), _) => return Err(fail("send", e)),
        (Ok(()), Err(e)) => return Err(fail("read", e)),
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| MetricsError::Protocol(format!("{addr}: no HTTP response head")))?;
    let line = head.lines().next().unwrap_or_default().to_string();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| MetricsError::Protocol(format!("{addr}: bad status line '{line}'")))?;
    Ok((status, line, body.to_string()))
}

/// Fetches and parses `/metrics.json`.
pub fn fetch(addr: &str) -> Result<MetricsDoc, MetricsError> {
    let body = get(addr, "/metrics.json")?;
    serde_json::from_str(&body)
        .map_err(|e| MetricsError::Protocol(format!("{addr}/metrics.json: {e}")))
}
