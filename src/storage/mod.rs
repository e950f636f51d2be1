//! Files↔GPU: cuFile where it works, gpudirect's parallel POSIX engine where it can't.

mod status;
pub use status::{CuFileStatus, IoReturn};
pub mod cufile;
