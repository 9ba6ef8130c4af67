use super::*;
use crate::metrics::{RequestType, fetch, get};

fn metrics() -> Vec<Arc<QueueMetrics>> {
    let q = Arc::new(QueueMetrics::default());
    q.count_request(RequestType::Read);
    QueueMetrics::add(&q.kicks, 3);
    vec![q, Arc::new(QueueMetrics::default())]
}

#[test]
fn metrics_over_tcp_and_unix() {
    let tcp = spawn_metrics("127.0.0.1:0", metrics()).expect("bind tcp");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.sock");
    let unix = spawn_metrics(path.to_str().expect("utf-8 path"), metrics()).expect("bind unix");
    for addr in [tcp.local_addr(), unix.local_addr()] {
        let doc = fetch(&addr).expect("json");
        assert_eq!(doc.queues.len(), 2);
        assert_eq!(doc.queues[0].kicks, 3);
        let text = get(&addr, "/metrics").expect("text");
        assert!(text.contains("ringblk_requests_total{queue=\"0\",type=\"read\"} 1"));
        assert!(get(&addr, "/nope").is_err());
        // No control verb on a metrics endpoint, whatever the method.
        for (method, path) in [("GET", "/api/v1/status"), ("PUT", "/api/v1/resize")] {
            let (status, _, body) =
                ringblk_metrics::request(&addr, method, path, b"{\"size\": 4096}").unwrap();
            assert_eq!(status, 404, "{method} {path}: {body}");
            assert!(body.contains("unknown verb"), "{body}");
        }
        let (status, _, _) = ringblk_metrics::request(&addr, "POST", "/metrics", b"").unwrap();
        assert_eq!(status, 405);
    }
    // A second daemon must not steal a live socket...
    assert!(spawn_metrics(path.to_str().expect("utf-8"), metrics()).is_err());
    unix.shutdown();
    tcp.shutdown();
    // ...and shutdown cleans up so the next one can bind.
    assert!(!path.exists());
    drop(UnixListener::bind(&path).expect("stale socket"));
    let again = spawn_metrics(path.to_str().expect("utf-8"), metrics());
    assert!(again.is_ok(), "a stale socket is replaced");
    drop(again);
    let file = dir.path().join("file");
    std::fs::write(&file, b"data").expect("write");
    assert!(spawn_metrics(file.to_str().expect("utf-8"), metrics()).is_err());
    assert!(file.exists(), "a regular file is never removed");
}

#[test]
fn every_verb_is_routed_and_control_verbs_need_control() {
    let q = metrics();
    for v in VERBS {
        let r = dispatch(&v.methods[0], v.path, b"", &q, None);
        if v.control {
            assert_eq!(r.status, 404, "{} without control", v.path);
        } else {
            assert_eq!(r.status, 200, "{}", v.path);
        }
    }
    let r = dispatch(&Method::Get, "/metrics?x=1", b"", &q, None);
    assert_eq!(r.status, 200, "a query string is ignored");
}
