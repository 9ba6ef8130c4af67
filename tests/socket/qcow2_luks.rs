//! Encrypted qcow2 images (`encrypt.format=luks`, and the legacy AES
//! method), as qemu-img makes them: refused with one line, in any layer
//! of a chain, and left as they were. Served as they are, their
//! ciphertext would reach the guest as its data and the guest's
//! plaintext would land among it.

use std::path::{Path, PathBuf};

use ringblk_testkit::luks::{PASS, qemu_img_create};
use ringblk_testkit::{MIB, serve_refused, test_dir};

/// `qemu-img create -f qcow2` with `opts` (an encryption), the secret
/// [`PASS`], `size` bytes.
fn encrypted(dir: &Path, name: &str, opts: &str, size: u64) -> PathBuf {
    let img = dir.join(name);
    let secret = format!("secret,id=s0,data={}", String::from_utf8_lossy(PASS));
    qemu_img_create(&[
        "create",
        "-f",
        "qcow2",
        "--object",
        &secret,
        "-o",
        opts,
        img.to_str().unwrap(),
        &size.to_string(),
    ]);
    img
}

/// Serves `image` (qcow2), expects a refusal; checks the image was not
/// written and returns the line.
fn refused(dir: &Path, image: &Path, extra: &[&str]) -> String {
    let before = std::fs::read(image).unwrap();
    let mut args = vec!["--image", image.to_str().unwrap(), "--format", "qcow2"];
    args.extend_from_slice(extra);
    let line = serve_refused(dir, &[], &args);
    assert!(
        std::fs::read(image).unwrap() == before,
        "{}: written by a refused open",
        image.display()
    );
    line
}

#[test]
fn encrypted_qcow2_is_refused_in_any_layer() {
    let dir = test_dir();
    let d = dir.path();
    let luks = encrypted(
        d,
        "luks.qcow2",
        "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
        8 * MIB,
    );
    let line = refused(d, &luks, &[]);
    assert!(
        line.contains("luks.qcow2") && line.contains("encrypt.format=luks"),
        "{line}"
    );
    let aes = encrypted(
        d,
        "aes.qcow2",
        "encryption=on,encrypt.key-secret=s0",
        8 * MIB,
    );
    let line = refused(d, &aes, &[]);
    assert!(
        line.contains("aes.qcow2") && line.contains("legacy AES"),
        "{line}"
    );
    for (name, backing) in [("over-luks.qcow2", &luks), ("over-aes.qcow2", &aes)] {
        let top = d.join(name);
        ringblk_testkit::luks::qemu_img_create(&[
            "create",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            backing.to_str().unwrap(),
            top.to_str().unwrap(),
        ]);
        let line = refused(d, &top, &[]);
        let bname = backing.file_name().unwrap().to_str().unwrap();
        assert!(line.contains(bname) && line.contains("encrypt"), "{line}");
        let line = refused(d, &top, &["--readonly"]);
        assert!(line.contains(bname), "read-only too: {line}");
    }
}
