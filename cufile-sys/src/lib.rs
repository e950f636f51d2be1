//! Raw bindings to libcufile (placeholder).
