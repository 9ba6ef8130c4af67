use super::*;
use crate::metrics::{RequestType, fetch, get};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;

fn metrics() -> Vec<Arc<QueueMetrics>> {
    let q = Arc::new(QueueMetrics::default());
    q.count_request(RequestType::Read);
    QueueMetrics::add(&q.kicks, 3);
    vec![q, Arc::new(QueueMetrics::default())]
}

#[test]
fn metrics_over_tcp_and_unix() {
    let tcp = spawn_metrics("127.0.0.1:0", metrics(), None).expect("bind tcp");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.sock");
    let unix =
        spawn_metrics(path.to_str().expect("utf-8 path"), metrics(), None).expect("bind unix");
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
    assert!(spawn_metrics(path.to_str().expect("utf-8"), metrics(), None).is_err());
    unix.shutdown();
    tcp.shutdown();
    // ...and shutdown cleans up so the next one can bind.
    assert!(!path.exists());
    drop(UnixListener::bind(&path).expect("stale socket"));
    let again = spawn_metrics(path.to_str().expect("utf-8"), metrics(), None);
    assert!(again.is_ok(), "a stale socket is replaced");
    drop(again);
    let file = dir.path().join("file");
    std::fs::write(&file, b"data").expect("write");
    assert!(spawn_metrics(file.to_str().expect("utf-8"), metrics(), None).is_err());
    assert!(file.exists(), "a regular file is never removed");
}

#[test]
fn every_verb_is_routed_and_control_verbs_need_control() {
    let api = Api::new(metrics(), None, None);
    for v in VERBS {
        let r = api.dispatch(&v.methods[0], v.path, b"");
        if v.control {
            assert_eq!(r.status, 404, "{} without control", v.path);
        } else {
            assert_eq!(r.status, 200, "{}", v.path);
        }
    }
    let r = api.dispatch(&Method::GET, "/metrics?x=1", b"");
    assert_eq!(r.status, 200, "a query string is ignored");
}

/// A control side over a small test device.
fn control() -> Arc<Control> {
    let mut spec = crate::device::DeviceSpec::default();
    spec.serial[..6].copy_from_slice(b"disk-7");
    let device = Arc::new(crate::device::Device::new(spec).expect("a device"));
    let identity = Identity {
        socket: "/run/test.sock".into(),
        started: std::time::Instant::now() - std::time::Duration::from_secs(3),
    };
    Arc::new(Control::new(device, identity))
}

/// `GET /api/v1/verbs` lists the table: every verb the endpoint serves,
/// with its methods and doc, and no other.
#[test]
fn the_verbs_verb_lists_the_table() {
    for control in [None, Some(control())] {
        let on_api = control.is_some();
        let api = Api::new(metrics(), control, None);
        let r = api.dispatch(&Method::GET, "/api/v1/verbs", b"");
        assert_eq!(r.status, 200, "{}", r.body);
        let listed: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        let want: Vec<serde_json::Value> = VERBS
            .iter()
            .filter(|v| on_api || !v.control)
            .map(|v| {
                serde_json::json!({
                    "methods": v.methods(),
                    "path": v.path,
                    "control": v.control,
                    "doc": v.doc,
                })
            })
            .collect();
        assert_eq!(listed, serde_json::Value::Array(want), "on --api: {on_api}");
    }
    assert!(
        VERBS.iter().all(|v| !v.doc.is_empty()),
        "a verb without a doc"
    );
    assert_eq!(
        verb_list(false),
        "GET /metrics, GET /metrics.json, GET /api/v1/verbs"
    );
}

/// The daemon's own fields of the status: version, uptime, socket,
/// serial, lock, front-end.
#[test]
fn status_has_the_daemons_identity() {
    let api = Api::new(metrics(), Some(control()), None);
    let r = api.dispatch(&Method::GET, "/api/v1/status", b"");
    assert_eq!(r.status, 200, "{}", r.body);
    let s: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    let up = s["uptime_s"].as_f64().expect("uptime");
    assert!((3.0..60.0).contains(&up), "{s}");
    assert_eq!(s["socket"], "/run/test.sock");
    assert_eq!(s["serial"], "disk-7");
    assert_eq!(s["lock"], "off", "the test device has no lock");
    assert_eq!(s["connected"], false);
    assert_eq!(s["front_end"], serde_json::Value::Null);
}

/// A table for the server's own tests: a verb that sleeps (on the verb
/// threads), one that answers the body's length, and the counters.
const TEST_VERBS: &[Verb] = &[
    Verb {
        methods: &[Method::GET],
        path: "/slow",
        control: false,
        slow: true,
        doc: "a test verb",
        run: |_| {
            std::thread::sleep(std::time::Duration::from_secs(1));
            Reply::error(200, "slept")
        },
    },
    Verb {
        methods: &[Method::PUT],
        path: "/len",
        control: false,
        slow: false,
        doc: "a test verb",
        run: |ctx| Reply::error(200, ctx.body.len().to_string()),
    },
    Verb {
        methods: &[Method::GET],
        path: "/metrics",
        control: false,
        slow: false,
        doc: "a test verb",
        run: metrics_text,
    },
];

/// A server of [`TEST_VERBS`] on a free TCP port.
fn test_server() -> (server::Server, String) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let api = Api {
        verbs: TEST_VERBS,
        queues: metrics(),
        control: None,
        device: None,
    };
    let s = server::Server::spawn("test", Bound::Tcp(l), api).expect("spawn");
    (s, addr)
}

/// Sends `raw` and returns the status code and everything read.
fn raw(addr: &str, raw: &[u8]) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(raw).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).into_owned();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out)
}

#[test]
fn a_slow_verb_does_not_hold_up_the_others() {
    let (_s, addr) = test_server();
    let started = std::time::Instant::now();
    // More slow requests than verb threads.
    let slow: Vec<_> = (0..VERB_THREADS + 1)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || get(&addr, "/slow"))
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(100));
    for _ in 0..5 {
        let t = std::time::Instant::now();
        assert!(get(&addr, "/metrics").is_ok());
        assert!(
            t.elapsed() < std::time::Duration::from_millis(500),
            "a scrape took {:?} beside slow verbs",
            t.elapsed()
        );
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    // The one past the verb threads waited its turn, within the client's
    // timeout.
    for s in slow {
        assert!(s.join().unwrap().is_ok());
    }
}

#[test]
fn bodies_are_bounded_and_a_get_takes_none() {
    let (_s, addr) = test_server();
    let put = |len: usize| {
        let mut rq =
            format!("PUT /len HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\n").into_bytes();
        rq.resize(rq.len() + len, b'x');
        raw(&addr, &rq)
    };
    let (code, out) = put(MAX_BODY);
    assert_eq!(code, 200, "{out}");
    assert!(out.contains(&format!("\"{MAX_BODY}\"")), "{out}");
    // Declared over the limit: refused unread (the body is not even sent).
    let (code, out) = raw(
        &addr,
        format!(
            "PUT /len HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        )
        .as_bytes(),
    );
    assert_eq!(code, 413, "{out}");
    // Chunked past the limit: refused once it passes it.
    let mut rq = b"PUT /len HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..(MAX_BODY / 4096 + 1) {
        rq.extend_from_slice(b"1000\r\n");
        rq.resize(rq.len() + 4096, b'x');
        rq.extend_from_slice(b"\r\n");
    }
    let (code, out) = raw(&addr, &rq);
    assert_eq!(code, 413, "{out}");
    // A body on a GET, even an empty chunked one.
    for rq in [
        &b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"[..],
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ] {
        let (code, out) = raw(&addr, rq);
        assert_eq!(code, 413, "{out}");
        assert!(out.contains("takes no body"), "{out}");
    }
    // A head over the limit.
    let mut rq = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Filler: ".to_vec();
    rq.resize(rq.len() + MAX_HEAD, b'a');
    rq.extend_from_slice(b"\r\n\r\n");
    let (code, out) = raw(&addr, &rq);
    assert_eq!(code, 431, "{out}");
    // And one request per connection: the second of two is not answered.
    let (code, out) = raw(
        &addr,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert_eq!(code, 200);
    assert_eq!(out.matches("HTTP/1.1 200").count(), 1, "{out}");
}
