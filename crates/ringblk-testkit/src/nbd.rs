//! The backup's clients: libnbd's `nbdinfo` and `nbdcopy`, and `qemu-img`,
//! as a backup tool would run them against a daemon's point-in-time
//! export (docs/backup.md's procedure): the map of a metadata context, a
//! full copy, an incremental copy into a qcow2 overlay, and `ringblk ctl`
//! for the verbs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Once;

use crate::{ctl_ok, skip, workspace_root};

/// Whether nbdinfo, nbdcopy and qemu-img are here, installing them once
/// (scripts/nbd-tools.sh) if they are not. Without them a test skips,
/// except where `CI` is set: there it fails.
pub fn have_tools() -> bool {
    static INSTALL: Once = Once::new();
    let present = || {
        ["nbdinfo", "nbdcopy", "qemu-img"].iter().all(|t| {
            Command::new(t)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    };
    INSTALL.call_once(|| {
        if !present() {
            let _ = Command::new(workspace_root().join("scripts/nbd-tools.sh")).status();
        }
    });
    if present() {
        return true;
    }
    skip("nbdinfo, nbdcopy or qemu-img is missing (scripts/nbd-tools.sh installs them)");
    false
}

/// The export's NBD URI.
pub fn uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

/// Runs a tool, failing the test with its output when it fails; its
/// standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `nbdinfo --map[=CONTEXT] --json`: `(offset, length, type)` in order.
pub fn map(sock: &Path, context: Option<&str>) -> Vec<(u64, u64, u64)> {
    let flag = match context {
        Some(c) => format!("--map={c}"),
        None => "--map".into(),
    };
    let json = run(Command::new("nbdinfo").args([&flag, "--json", &uri(sock)]));
    let v: serde_json::Value = serde_json::from_str(&json).expect("nbdinfo's JSON");
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {json}"))
        .iter()
        .map(|e| {
            let f = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k} in {e}"));
            (f("offset"), f("length"), f("type"))
        })
        .collect()
}

/// The dirty ranges of `qemu:dirty-bitmap:NAME`, neighbours merged.
pub fn dirty(sock: &Path, bitmap: &str) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (off, len, ty) in map(sock, Some(&format!("qemu:dirty-bitmap:{bitmap}"))) {
        if ty & 1 == 0 {
            continue;
        }
        match out.last_mut() {
            Some((o, l)) if *o + *l == off => *l += len,
            _ => out.push((off, len)),
        }
    }
    out
}

/// `ranges` (offset, length) widened to whole `granularity` granules and
/// merged: what a bitmap of that granularity shows of those writes.
pub fn granules(ranges: &[(u64, u64)], granularity: u64, size: u64) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = ranges
        .iter()
        .filter(|r| r.1 > 0)
        .map(|&(o, l)| {
            let start = o / granularity * granularity;
            let end = (o + l).div_ceil(granularity) * granularity;
            (start, end.min(size))
        })
        .collect();
    spans.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in spans {
        match out.last_mut() {
            Some((o, l)) if *o + *l >= s => *l = (*l).max(e - *o),
            _ => out.push((s, e - s)),
        }
    }
    out
}

/// A full backup: `nbdcopy` of the export into a raw file `dest`.
pub fn copy_full(sock: &Path, dest: &Path) {
    run(Command::new("nbdcopy").arg(uri(sock)).arg(dest));
}

/// A full backup as `qemu-img convert -O qcow2` makes it.
pub fn convert_qcow2(sock: &Path, dest: &Path) {
    run(Command::new("qemu-img")
        .args(["convert", "-O", "qcow2"])
        .arg(uri(sock))
        .arg(dest));
}

/// An incremental backup, as docs/backup.md does it: a qcow2 overlay of
/// `base` (qcow2), with every range `qemu:dirty-bitmap:NAME` marks copied
/// into it from the export by `qemu-img convert -n` through raw
/// offset/size windows (zeroes written as zeroes, not left to the base).
/// Returns the ranges copied.
pub fn incremental(sock: &Path, bitmap: &str, base: &Path, overlay: &Path) -> Vec<(u64, u64)> {
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(overlay));
    let ranges = dirty(sock, bitmap);
    for &(off, len) in &ranges {
        let src = format!(
            "driver=raw,offset={off},size={len},file.driver=nbd,file.server.type=unix,file.server.path={}",
            sock.display()
        );
        let dst = format!(
            "driver=raw,offset={off},size={len},file.driver=qcow2,file.file.driver=file,file.file.filename={}",
            overlay.display()
        );
        run(Command::new("qemu-img").args([
            "convert",
            "-n",
            "--image-opts",
            "--target-image-opts",
            &src,
            &dst,
        ]));
    }
    ranges
}

/// `qemu-img convert -O raw` of a (qcow2) chain into `dest`: a restore.
pub fn restore(chain_top: &Path, dest: &Path) {
    run(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(chain_top)
        .arg(dest));
}

/// A bitmap of `ctl bitmap list --json`: (dirty bytes, consistent).
pub fn bitmap_state(api: &Path, name: &str) -> Option<(u64, bool)> {
    let list: serde_json::Value =
        serde_json::from_str(&ctl_ok(api, &["bitmap", "list", "--json"])).expect("JSON");
    list.as_array()?
        .iter()
        .find(|b| b["name"] == name)
        .map(|b| {
            (
                b["dirty_bytes"].as_u64().expect("dirty_bytes"),
                b["consistent"].as_bool().expect("consistent"),
            )
        })
}

/// `ctl backup start --nbd NAME [--bitmap B]`; the socket's path (in
/// `backup_dir`).
#[track_caller]
pub fn backup_start(api: &Path, backup_dir: &Path, name: &str, bitmap: Option<&str>) -> PathBuf {
    let mut args = vec!["backup", "start", "--nbd", name];
    if let Some(b) = bitmap {
        args.extend(["--bitmap", b]);
    }
    ctl_ok(api, &args);
    backup_dir.join(name)
}

/// A hand-written NBD client for what no well-behaved one sends: bad
/// magic, unknown options, huge lengths, reads past the end, silence.
pub mod raw {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::path::Path;
    use std::time::Duration;

    /// Connected, the server's greeting read, `client_flags` sent.
    pub fn greet(sock: &Path, client_flags: u32) -> UnixStream {
        let mut s = UnixStream::connect(sock).expect("connecting to the export");
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).expect("the greeting");
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        s.write_all(&client_flags.to_be_bytes()).unwrap();
        s
    }

    /// One option request.
    pub fn option(s: &mut UnixStream, opt: u32, data: &[u8]) {
        let mut m = b"IHAVEOPT".to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m).unwrap();
    }

    /// One option reply: `(option, type, data)`.
    pub fn option_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("an option reply");
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            0x3e889045565a9
        );
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d).unwrap();
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            d,
        )
    }

    /// Whether the server closed the connection (EOF) within the read
    /// timeout.
    pub fn closed(s: &mut UnixStream) -> bool {
        let mut b = [0u8; 64];
        loop {
            match s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    /// In transmission after NBD_OPT_GO of the default export (simple
    /// replies).
    pub fn go(sock: &Path) -> UnixStream {
        let mut s = greet(sock, 3);
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&0u16.to_be_bytes());
        option(&mut s, 7, &d);
        loop {
            match option_reply(&mut s).1 {
                3 => continue, // NBD_REP_INFO
                1 => return s, // NBD_REP_ACK
                t => panic!("GO answered {t:#x}"),
            }
        }
    }

    /// One request.
    pub fn request(s: &mut UnixStream, cmd: u16, handle: u64, offset: u64, len: u32) {
        try_request(s, cmd, handle, offset, len).unwrap();
    }

    /// One request, or why it could not be sent (the server closed the
    /// connection: a client that loops until then sees EPIPE here).
    pub fn try_request(
        s: &mut UnixStream,
        cmd: u16,
        handle: u64,
        offset: u64,
        len: u32,
    ) -> std::io::Result<()> {
        let mut r = 0x25609513u32.to_be_bytes().to_vec();
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&cmd.to_be_bytes());
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        s.write_all(&r)
    }

    /// A simple reply's `(error, handle)`.
    pub fn simple_reply(s: &mut UnixStream) -> (u32, u64) {
        let mut h = [0u8; 16];
        s.read_exact(&mut h).expect("a simple reply");
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), 0x67446698);
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }
}

/// What QEMU says is dirty in bitmap `name` of the qcow2 image `img`:
/// qemu-nbd exports it read-only with `-B NAME`, and nbdinfo maps
/// `qemu:dirty-bitmap:NAME` (neighbours merged).
pub fn qemu_nbd_dirty(img: &Path, name: &str) -> Vec<(u64, u64)> {
    assert!(have_tools(), "nbdinfo is missing");
    crate::qemu_img::need_qemu_img();
    let sock = img.with_extension(format!("{name}.nbd.sock"));
    let _ = std::fs::remove_file(&sock);
    let mut nbd = Command::new("qemu-nbd")
        .args(["-r", "-f", "qcow2", "-B", name, "-k"])
        .arg(&sock)
        .arg(img)
        .spawn()
        .expect("running qemu-nbd");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !sock.exists() {
        if let Ok(Some(st)) = nbd.try_wait() {
            panic!("qemu-nbd exited with {st}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "qemu-nbd did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = dirty(&sock, name);
    let _ = nbd.kill();
    let _ = nbd.wait();
    out
}
