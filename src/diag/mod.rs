//! Diagnostics: what the doctor example prints, as data.
