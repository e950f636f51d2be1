//! The Rust types a tensor can be viewed as ([`Element`]), and how a [`Dtype`] (which lives in
//! the core, beside the [`Problem`](super::Problem) that names it) maps to the `safetensors`
//! crate's.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

pub use crate::error::checkpoint::Dtype;
#[cfg(test)]
use crate::error::checkpoint::ALL;

impl Dtype {
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
