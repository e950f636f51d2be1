//! cuFile status codes (placeholder: replaced by the full decoder).

/// A cuFile status code (`CUfileOpError`), kept as a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cuFile status {0}")]
pub struct CuFileStatus(pub i32);
