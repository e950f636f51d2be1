//! Raw bindings to libibverbs and librdmacm (placeholder).
