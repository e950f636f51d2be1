//! The format's element types ([`Dtype`]) and the Rust types a tensor can be viewed as
//! ([`Element`]).

use std::fmt;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use serde::Serialize;

/// An element type of the safetensors format (the header's `"dtype"` string).
///
/// Every dtype the format defines (safetensors 0.8) is here, including the sub-byte and
/// micro-scaling ones; those without a Rust [`Element`] type are still loaded and saved as
/// bytes ([`TensorRef::bytes`](super::TensorRef::bytes)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // the format's own names
pub enum Dtype {
    /// `BOOL`: one byte per element, 0 or 1 (read as [`u8`]: a file byte that is neither would
    /// make a Rust `bool` unsound).
    BOOL,
    /// `F4`: 4-bit MX float (two per byte).
    F4,
    /// `F6_E2M3`: 6-bit MX float.
    F6_E2M3,
    /// `F6_E3M2`: 6-bit MX float.
    F6_E3M2,
    /// `U8`.
    U8,
    /// `I8`.
    I8,
    /// `F8_E5M2` ([`F8E5M2`]).
    F8_E5M2,
    /// `F8_E4M3` ([`F8E4M3`]).
    F8_E4M3,
    /// `F8_E8M0`: MX scale (bytes only).
    F8_E8M0,
    /// `F8_E4M3FNUZ` (bytes only).
    F8_E4M3FNUZ,
    /// `F8_E5M2FNUZ` (bytes only).
    F8_E5M2FNUZ,
    /// `I16`.
    I16,
    /// `U16`.
    U16,
    /// `F16` ([`half::f16`]).
    F16,
    /// `BF16` ([`half::bf16`]).
    BF16,
    /// `I32`.
    I32,
    /// `U32`.
    U32,
    /// `F32`.
    F32,
    /// `C64`: complex of two f32 (bytes only).
    C64,
    /// `F64`.
    F64,
    /// `I64`.
    I64,
    /// `U64`.
    U64,
}

/// Every dtype, in the format's order of increasing alignment.
pub(crate) const ALL: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

impl Dtype {
    /// The header's name for it, e.g. `"BF16"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parses the header's name (exact, case-sensitive, as the format requires).
    pub fn parse(s: &str) -> Option<Dtype> {
        ALL.into_iter().find(|d| d.as_str() == s)
    }

    /// Bits per element (4 and 6 for the sub-byte MX types).
    pub fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The alignment a typed view of this dtype needs in device memory, in bytes (1 for
    /// sub-byte types; C64's is its f32 parts').
    pub fn align(self) -> usize {
        match self {
            Dtype::C64 => 4,
            d => (d.bits() / 8).max(1),
        }
    }

    /// The `safetensors` crate's name for it (its validation is the reference).
    pub(crate) fn to_crate(self) -> ::safetensors::Dtype {
        use ::safetensors::Dtype as D;
        match self {
            Dtype::BOOL => D::BOOL,
            Dtype::F4 => D::F4,
            Dtype::F6_E2M3 => D::F6_E2M3,
            Dtype::F6_E3M2 => D::F6_E3M2,
            Dtype::U8 => D::U8,
            Dtype::I8 => D::I8,
            Dtype::F8_E5M2 => D::F8_E5M2,
            Dtype::F8_E4M3 => D::F8_E4M3,
            Dtype::F8_E8M0 => D::F8_E8M0,
            Dtype::F8_E4M3FNUZ => D::F8_E4M3FNUZ,
            Dtype::F8_E5M2FNUZ => D::F8_E5M2FNUZ,
            Dtype::I16 => D::I16,
            Dtype::U16 => D::U16,
            Dtype::F16 => D::F16,
            Dtype::BF16 => D::BF16,
            Dtype::I32 => D::I32,
            Dtype::U32 => D::U32,
            Dtype::F32 => D::F32,
            Dtype::C64 => D::C64,
            Dtype::F64 => D::F64,
            Dtype::I64 => D::I64,
            Dtype::U64 => D::U64,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An 8-bit float, E4M3 (OCP FP8), as stored: the raw byte. Any bit pattern is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// An 8-bit float, E5M2 (OCP FP8), as stored: the raw byte. Any bit pattern is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

// SAFETY: both are #[repr(transparent)] over u8, which cudarc implements DeviceRepr for: same
// size, alignment and validity (every bit pattern) on host and device.
unsafe impl DeviceRepr for F8E4M3 {}
// SAFETY: as above.
unsafe impl DeviceRepr for F8E5M2 {}
// SAFETY: all-zero bytes are a valid u8, hence a valid F8E4M3 / F8E5M2.
unsafe impl ValidAsZeroBits for F8E4M3 {}
// SAFETY: as above.
unsafe impl ValidAsZeroBits for F8E5M2 {}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type a tensor's elements can be viewed as on the device.
///
/// Implemented for `half::bf16`, `half::f16`, `f32`, `f64`, `i8`..`i64`, `u8`..`u64`,
/// [`F8E4M3`] and [`F8E5M2`]. Every bit pattern of the file is a valid value of each (that is
/// why `BOOL` tensors are read as `u8`), so a view of untrusted file bytes is sound. Sealed.
pub trait Element:
    DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static + sealed::Sealed
{
    /// The dtypes whose bytes this type views (e.g. `u8`: `U8` and `BOOL`).
    const DTYPES: &'static [Dtype];
}

macro_rules! element {
    ($($t:ty => [$($d:ident),+]),+ $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPES: &'static [Dtype] = &[$(Dtype::$d),+];
        }
    )+};
}

element! {
    half::bf16 => [BF16],
    half::f16 => [F16],
    f32 => [F32],
    f64 => [F64],
    i8 => [I8],
    i16 => [I16],
    i32 => [I32],
    i64 => [I64],
    u8 => [U8, BOOL],
    u16 => [U16],
    u32 => [U32],
    u64 => [U64],
    F8E4M3 => [F8_E4M3],
    F8E5M2 => [F8_E5M2],
}

/// The dtype a Rust element type saves as (its first [`Element::DTYPES`]).
pub(crate) fn dtype_of<T: Element>() -> Dtype {
    T::DTYPES[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_the_crate() {
        for d in ALL {
            assert_eq!(Dtype::parse(d.as_str()), Some(d));
            assert_eq!(d.to_crate().to_string(), d.as_str());
            assert_eq!(d.to_crate().bitsize(), d.bits(), "{d}");
        }
        // The format's order of increasing alignment is the crate's Ord.
        for w in ALL.windows(2) {
            assert!(w[0].to_crate() < w[1].to_crate());
        }
        assert_eq!(Dtype::parse("bf16"), None);
        assert_eq!(Dtype::parse("BF16 "), None);
        assert_eq!(Dtype::parse(""), None);
    }

    #[test]
    fn elements_match_their_dtype_sizes() {
        fn check<T: Element>() {
            for d in T::DTYPES {
                assert_eq!(d.bits(), 8 * std::mem::size_of::<T>(), "{d}");
                assert!(std::mem::align_of::<T>() <= d.align(), "{d}");
            }
        }
        check::<half::bf16>();
        check::<half::f16>();
        check::<f32>();
        check::<f64>();
        check::<i8>();
        check::<i16>();
        check::<i32>();
        check::<i64>();
        check::<u8>();
        check::<u16>();
        check::<u32>();
        check::<u64>();
        check::<F8E4M3>();
        check::<F8E5M2>();
        assert_eq!(dtype_of::<u8>(), Dtype::U8);
    }
}
