//! qemu-img as the oracle for image files: running it, `check` (corruptions
//! and leaked clusters), `compare` against a raw reference, and checksums.
//! The tools come from `scripts/format-deps.sh` when missing; a test
//! never skips for want of them.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use crate::workspace_root;

/// Installs qemu-utils through the project's script once; panics if the
/// tools are still missing (CI installs them; a test never skips).
pub fn need_qemu_img() {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| need_format_tools("qemu-img", || runs("qemu-img", &["--version"])));
}

/// Whether `tool ARGS` runs and succeeds.
pub fn runs(tool: &str, args: &[&str]) -> bool {
    Command::new(tool)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `scripts/format-deps.sh` (which installs the image tools: qemu-img,
/// qemu-io, cryptsetup, Python's cryptography) when `have` says `what` is
/// missing, and panics if it still is. Callers keep a `OnceLock` so that
/// this runs once per test process.
pub fn need_format_tools(what: &str, have: impl Fn() -> bool) {
    if have() {
        return;
    }
    let script = workspace_root().join("scripts/format-deps.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("running format-deps.sh");
    assert!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(have(), "{what} is still missing after {}", script.display());
}

/// Runs a tool, panicking with its output if it fails; returns stdout.
pub fn run(tool: &str, args: &[&str]) -> String {
    need_qemu_img();
    let out = Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn qemu_img(args: &[&str]) -> String {
    run("qemu-img", args)
}

/// `qemu-img check --output=json`: (corruptions, leaks). Panics on a
/// check that cannot run at all.
pub fn check(path: &Path) -> (u64, u64) {
    check_with(&["-f", "qcow2", path.to_str().expect("UTF-8 path")])
}

/// `qemu-img check --output=json ARGS`: the image and how to open it
/// (`--object secret,... --image-opts OPTS` for an encrypted one); its
/// corruptions and leaks.
pub fn check_with(args: &[&str]) -> (u64, u64) {
    need_qemu_img();
    let out = Command::new("qemu-img")
        .args(["check", "--output=json"])
        .args(args)
        .output()
        .expect("qemu-img check");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "qemu-img check {args:?}: {e}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    (n("corruptions"), n("leaks"))
}

/// Asserts `qemu-img check` finds no corruption; returns the leaks.
pub fn check_clean(path: &Path) -> u64 {
    let (corruptions, leaks) = check(path);
    if corruptions != 0 {
        let out = Command::new("qemu-img")
            .arg("check")
            .arg(path)
            .output()
            .unwrap();
        // What is corrupt (its ERROR lines) goes to stderr.
        panic!(
            "qemu-img check: {corruptions} corruptions in {}:\n{}{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    leaks
}

/// Asserts the qcow2 image reads exactly as the raw reference.
pub fn compare_identical(image: &Path, reference: &Path) {
    need_qemu_img();
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(image)
        .arg(reference)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img compare {} {}: {}{}",
        image.display(),
        reference.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn sha256(path: &Path) -> String {
    run("sha256sum", &[path.to_str().unwrap()])
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `qemu-img create -q -f qcow2 [-o OPTS] [-b BACKING -F FORMAT] PATH
/// [SIZE]`: a qcow2 image with the creation options `opts` (empty for
/// QEMU's defaults), over `backing` (its name as the header is to store
/// it, and its format), of `size` (`"16M"`; `None`: the backing file's).
pub fn create_qcow2(path: &Path, opts: &str, backing: Option<(&str, &str)>, size: Option<&str>) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    if let Some((name, format)) = backing {
        args.extend(["-b", name, "-F", format]);
    }
    args.push(path.to_str().expect("UTF-8 path"));
    args.extend(size);
    qemu_img(&args);
}

/// `qemu-img create -f qcow2 -b BASE -F FMT TOP`, with the base named
/// relative to the overlay's directory when it is in the same one.
pub fn overlay(base: &Path, base_format: &str, top: &Path) {
    let name = match (base.parent(), top.parent()) {
        (Some(a), Some(b)) if a == b => base.file_name().unwrap().to_str().unwrap().to_string(),
        _ => base.to_str().unwrap().to_string(),
    };
    create_qcow2(top, "", Some((&name, base_format)), None);
}

/// `qemu-img info`'s `backing-filename` of `img` ("" without one).
pub fn backing_filename(img: &Path) -> String {
    let info = qemu_img(&["info", "--output=json", img.to_str().expect("UTF-8 path")]);
    let v: serde_json::Value = serde_json::from_str(&info).expect("qemu-img's JSON");
    v["backing-filename"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The persistent bitmaps `qemu-img info` lists for a qcow2 image:
/// `(name, flags)` in its order (flags such as `in-use`, `auto`).
pub fn bitmaps(img: &Path) -> Vec<(String, Vec<String>)> {
    let info = qemu_img(&["info", "--output=json", img.to_str().expect("UTF-8 path")]);
    let v: serde_json::Value = serde_json::from_str(&info).expect("qemu-img's JSON");
    let Some(list) = v["format-specific"]["data"]["bitmaps"].as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|b| {
            let flags = b["flags"].as_array().expect("flags").iter();
            (
                b["name"].as_str().expect("name").to_string(),
                flags
                    .map(|f| f.as_str().expect("flag").to_string())
                    .collect(),
            )
        })
        .collect()
}
