//! Sets an rpath to the libfusedce directory that `fusedce-sys` found (`DEP_FUSEDCE_LIB_DIR`) on this
//! crate's tests and examples, so they run without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FUSEDCE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_FUSEDCE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
