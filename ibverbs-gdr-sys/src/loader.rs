//! Run-time loaders for `libibverbs.so.1` and `librdmacm.so.1`.
//!
//! Each library is opened lazily, once per process, in a [`OnceLock`]; every symbol is resolved
//! on its own and is `None` when absent, so an older rdma-core still loads and a caller can gate
//! newer calls (e.g. `ibv_reg_dmabuf_mr`, rdma-core ≥ 34) on the symbol's presence. A library that
//! cannot be opened is a [`LoadError`] naming every path tried, never a panic.
//! [`Ibverbs::load_from`] and [`Rdmacm::load_from`] open an explicit path, so a test can hold a
//! loaded and an absent library in one process.

use std::ffi::OsStr;
use std::fmt;
use std::ops::Deref;
use std::sync::OnceLock;

use crate::bindings::{IbverbsFns, RdmacmFns};

/// Resolves one symbol, `None` when the library lacks it.
///
/// # Safety
///
/// `T` must be the C type of the symbol `name` (a function pointer type, `Copy`).
pub(crate) unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller guarantees that `T` is the symbol's type; the returned pointer is
    // copied out and stays valid while `lib` is loaded, which its owner (Ibverbs / Rdmacm)
    // guarantees by keeping the `Library` next to the table.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

/// A shared library that could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The library, e.g. `libibverbs.so.1`.
    pub library: &'static str,
    /// Every name or path tried, each with the dynamic loader's message.
    pub tried: Vec<String>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot load {} (tried {})",
            self.library,
            self.tried.join("; ")
        )
    }
}

impl std::error::Error for LoadError {}

fn open(
    library: &'static str,
    candidates: &[String],
) -> Result<(libloading::Library, String), LoadError> {
    let mut tried = Vec::new();
    for c in candidates {
        // SAFETY: loading runs the library's initialisers; the candidates are rdma-core's own
        // sonames or a path the user named for exactly this library (env var or load_from).
        match unsafe { libloading::Library::new(OsStr::new(c)) } {
            Ok(lib) => return Ok((lib, c.clone())),
            Err(e) => tried.push(format!("{c}: {e}")),
        }
    }
    Err(LoadError { library, tried })
}

fn candidates(env: &str, sonames: &[&str]) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os(env) {
        if !p.is_empty() {
            v.push(p.to_string_lossy().into_owned());
        }
    }
    v.extend(sonames.iter().map(|s| s.to_string()));
    v
}

macro_rules! loader {
    ($(#[$m:meta])* $name:ident, $fns:ident, $soname:literal, $env:literal, [$($alt:literal),*]) => {
        $(#[$m])*
        pub struct $name {
            fns: $fns,
            path: String,
            // Dropped last: the function pointers in `fns` point into this library.
            _lib: libloading::Library,
        }

        impl $name {
            /// The soname opened by default.
            pub const SONAME: &'static str = $soname;
            /// The environment variable that names a path to try first.
            pub const ENV: &'static str = $env;

            /// The process-wide instance, opened on first use: the path in the environment
            /// variable [`Self::ENV`] when set, then [`Self::SONAME`] and the unversioned name.
            /// The outcome (success or the error) is cached for the life of the process.
            pub fn get() -> Result<&'static $name, LoadError> {
                static LIB: OnceLock<Result<$name, LoadError>> = OnceLock::new();
                LIB.get_or_init(|| {
                    let c = candidates($env, &[$soname, $($alt),*]);
                    let (lib, path) = open($soname, &c)?;
                    // SAFETY: `lib` is rdma-core's library of this name (soname or the path the
                    // user set for it in the environment variable).
                    Ok(unsafe { $name::from_library(lib, path) })
                })
                .as_ref()
                .map_err(Clone::clone)
            }

            /// Opens the library at `path` (a file path or a soname), independently of the
            /// process-wide instance.
            ///
            /// # Safety
            ///
            /// `path` must name this rdma-core library (or nothing loadable): its initialisers
            /// run, and its symbols are used with the C types of the rdma-core headers the
            /// bindings were generated from.
            pub unsafe fn load_from(path: impl AsRef<OsStr>) -> Result<$name, LoadError> {
                let p = path.as_ref().to_string_lossy().into_owned();
                let (lib, p) = open($soname, std::slice::from_ref(&p))?;
                // SAFETY: the caller guarantees that `path` is this library.
                Ok(unsafe { $name::from_library(lib, p) })
            }

            /// # Safety
            ///
            /// `lib` must be this rdma-core library.
            unsafe fn from_library(lib: libloading::Library, path: String) -> $name {
                // SAFETY: forwarded from the caller.
                let fns = unsafe { $fns::resolve(&lib) };
                $name { fns, path, _lib: lib }
            }

            /// The name or path the library was opened from.
            pub fn path(&self) -> &str {
                &self.path
            }

            /// The resolved function table (also reachable through `Deref`).
            pub fn fns(&self) -> &$fns {
                &self.fns
            }
        }

        impl Deref for $name {
            type Target = $fns;
            fn deref(&self) -> &$fns {
                &self.fns
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name)).field("path", &self.path).finish_non_exhaustive()
            }
        }
    };
}

loader!(
    /// `libibverbs.so.1`, loaded at run time, with its function table.
    ///
    /// Field access through `Deref` (`lib.ibv_open_device`) gives the raw, optional symbol;
    /// the methods named after the header's `static inline` functions and macros
    /// (`lib.ibv_query_port(..)`, `lib.ibv_reg_mr(..)`) behave as those do, as in C where the
    /// macro shadows the exported symbol.
    Ibverbs,
    IbverbsFns,
    "libibverbs.so.1",
    "GPUDIRECT_IBVERBS_LIB",
    ["libibverbs.so"]
);

loader!(
    /// `librdmacm.so.1` (the RDMA connection manager), loaded at run time, with its function
    /// table (reached through `Deref`).
    Rdmacm,
    RdmacmFns,
    "librdmacm.so.1",
    "GPUDIRECT_RDMACM_LIB",
    ["librdmacm.so"]
);

// SAFETY: the tables hold plain function pointers and the `Library` handle, which libloading
// documents as Send + Sync; rdma-core's libibverbs and librdmacm are thread-safe ("all verbs are
// thread safe", libibverbs(7) / rdma-core Documentation/libibverbs.md), and calling a function
// pointer concurrently is no different from calling the exported function.
unsafe impl Send for Ibverbs {}
// SAFETY: see the `Send` impl above.
unsafe impl Sync for Ibverbs {}
// SAFETY: see the `Send` impl of `Ibverbs`; librdmacm is thread-safe in the same way.
unsafe impl Send for Rdmacm {}
// SAFETY: see above.
unsafe impl Sync for Rdmacm {}
