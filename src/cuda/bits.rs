//! Element types that accept any bit pattern.

use cudarc::driver::DeviceRepr;

/// A [`DeviceRepr`] type for which every bit pattern of its size is a valid value: the element
/// types gpudirect lets memory filled by someone else (another process's export, a peer) be
/// seen as. Integers and floats are; `bool` is not (a byte 2 read as `bool` is undefined
/// behaviour), nor are `char`, enums, references or types with padding.
///
/// # Safety
/// Any `size_of::<Self>()` bytes, whatever their values, must form a valid `Self` (the contract
/// of bytemuck's `AnyBitPattern`), and `Self` must have no padding.
pub unsafe trait AnyBitPattern: DeviceRepr {}

macro_rules! any_bit_pattern {
    ($($t:ty),*) => {
        $(
            // SAFETY: a primitive integer or IEEE float: every bit pattern is a value, no padding.
            unsafe impl AnyBitPattern for $t {}
        )*
    };
}

any_bit_pattern!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);
