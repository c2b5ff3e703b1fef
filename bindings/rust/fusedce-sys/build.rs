//! Finds libfusedce for linking, in this order:
//! 1. `FUSEDCE_LIB_DIR`: a directory holding `libfusedce.so` (e.g. the Meson build directory);
//! 2. `pkg-config --libs fusedce`, run as a command (honours `PKG_CONFIG_PATH`), when pkg-config knows it;
//! 3. the in-tree Meson build directory, `../../../build` from this crate (`<repo>/build`).
//!
//! If none applies, the library is still linked by name (`-lfusedce`) and left to the system linker.
//! The directory used is exported to dependents as `DEP_FUSEDCE_LIB_DIR` and set as an rpath of this
//! crate's own tests.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn has_lib(dir: &Path) -> bool {
    dir.join("libfusedce.so").exists()
}

/// `-L` directories and `-l` names from `pkg-config --libs fusedce`, or None if pkg-config fails.
fn pkg_config() -> Option<(Vec<PathBuf>, Vec<String>)> {
    let pc = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    let out = Command::new(pc).args(["--libs", "fusedce"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let mut dirs = Vec::new();
    let mut libs = Vec::new();
    for tok in text.split_whitespace() {
        if let Some(d) = tok.strip_prefix("-L") {
            dirs.push(PathBuf::from(d));
        } else if let Some(l) = tok.strip_prefix("-l") {
            libs.push(l.to_string());
        }
    }
    Some((dirs, libs))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=FUSEDCE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let mut lib_dir: Option<PathBuf> = None;
    let mut extra_libs: Vec<String> = Vec::new();

    if let Ok(dir) = env::var("FUSEDCE_LIB_DIR") {
        let dir = PathBuf::from(dir);
        if !has_lib(&dir) {
            println!("cargo:warning=FUSEDCE_LIB_DIR={} holds no libfusedce.so; linking may fail", dir.display());
        }
        lib_dir = Some(dir);
    } else if let Some((dirs, libs)) = pkg_config() {
        lib_dir = dirs.into_iter().find(|d| has_lib(d));
        extra_libs = libs.into_iter().filter(|l| l != "fusedce").collect();
    } else {
        let in_tree = manifest.join("../../../build");
        if has_lib(&in_tree) {
            lib_dir = Some(in_tree.canonicalize().unwrap_or(in_tree));
        } else {
            println!(
                "cargo:warning=libfusedce not found (set FUSEDCE_LIB_DIR, or PKG_CONFIG_PATH, or build \
                 <repo>/build with Meson); relying on the system linker's search path"
            );
        }
    }

    if let Some(dir) = &lib_dir {
        println!("cargo:rustc-link-search=native={}", dir.display());
        // Metadata for dependents' build scripts: DEP_FUSEDCE_LIB_DIR.
        println!("cargo:lib_dir={}", dir.display());
        // This crate's own test binaries (bindgen's layout tests).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=fusedce");
    for l in extra_libs {
        println!("cargo:rustc-link-lib={}", l);
    }
}
