//! Links librbd and librados (Debian: librbd-dev, librados-dev, installed
//! by scripts/ceph-deps.sh). The bindings are pre-generated
//! (regenerate.sh), so no libclang is needed here.
fn main() {
    println!("cargo:rustc-link-lib=dylib=rbd");
    println!("cargo:rustc-link-lib=dylib=rados");
    println!("cargo:rerun-if-changed=build.rs");
}
