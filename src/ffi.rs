//! Raw bindings, re-exported for callers who need a symbol the safe API does not cover.

/// libcufile (cuFile) bindings and run-time loader: the `gpudirect-cufile-sys` crate.
pub use cufile_sys as cufile;
/// libibverbs and librdmacm bindings and run-time loaders: the `ibverbs-gdr-sys` crate.
pub use ibverbs_gdr_sys as ibverbs;
