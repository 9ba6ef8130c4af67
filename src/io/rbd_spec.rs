//! `--image rbd:POOL/IMAGE`: which images are RBD images, and their pool
//! and name. Parsed whether or not the daemon was built with the RBD
//! engine, so that one built without it says so instead of looking for a
//! file called `rbd:...`.

use std::path::Path;

/// The prefix that makes `--image` an RBD image. (A file whose name starts
/// with it is served as `./rbd:...`.)
pub const RBD_PREFIX: &str = "rbd:";

/// A pool and an image in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
}

impl RbdSpec {
    /// `None` when `image` is not an `rbd:` spec; else the spec, or why it
    /// is malformed (one line).
    pub fn from_image_arg(image: &Path) -> Option<Result<RbdSpec, String>> {
        let s = image.to_str()?;
        let rest = s.strip_prefix(RBD_PREFIX)?;
        Some(Self::parse(rest).map_err(|why| {
            format!("--image {s}: {why}; expected rbd:POOL/IMAGE, e.g. rbd:rbd/vm0-disk")
        }))
    }

    fn parse(rest: &str) -> Result<RbdSpec, String> {
        let (pool, image) = rest
            .split_once('/')
            .ok_or("no '/' between pool and image")?;
        if pool.is_empty() {
            return Err("the pool name is empty".into());
        }
        if image.is_empty() {
            return Err("the image name is empty".into());
        }
        // rbd's own spec would take POOL/NAMESPACE/IMAGE and IMAGE@SNAP;
        // neither is supported here.
        if image.contains(['/', '@']) {
            return Err("namespaces and snapshots are not supported".into());
        }
        if rest.contains('\0') {
            return Err("a NUL byte in the name".into());
        }
        Ok(RbdSpec {
            pool: pool.into(),
            image: image.into(),
        })
    }
}

impl std::fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{RBD_PREFIX}{}/{}", self.pool, self.image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Option<Result<RbdSpec, String>> {
        RbdSpec::from_image_arg(Path::new(s))
    }

    #[test]
    fn specs() {
        assert_eq!(parse("disk.img"), None);
        assert_eq!(parse("./rbd:x/y"), None);
        assert_eq!(
            parse("rbd:rbd/vm0"),
            Some(Ok(RbdSpec {
                pool: "rbd".into(),
                image: "vm0".into()
            }))
        );
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/img",
            "rbd:pool/",
            "rbd:p/ns/img",
            "rbd:p/i@snap",
        ] {
            let err = parse(bad).expect("an rbd spec").expect_err(bad);
            assert!(
                err.contains("rbd:POOL/IMAGE") && !err.contains('\n'),
                "{err}"
            );
        }
    }
}
