//! Argument structs for plugins newer than the PJRT C API 0.54 that pjrt-sys was generated from.
//!
//! PJRT grows argument structs by appending fields, and a plugin rejects a `struct_size` smaller
//! than the one it was built with ("The plugin is likely built with a later version than the
//! framework"). For the structs that grew, we allocate the 0.54 struct followed by zeroed
//! padding and announce the 0.81 size: the appended fields then read as zero/null, which is their
//! documented default, and plugins from 0.54 up to at least 0.115 accept that size.

use pjrt_sys::{
    PJRT_Client_CreateViewOfDeviceBuffer_Args, PJRT_Client_Create_Args, PJRT_Executable_DeserializeAndLoad_Args,
    PJRT_Executable_GetCompiledMemoryStats_Args, PJRT_ExecuteOptions, PJRT_Plugin_Attributes_Args,
};
use std::mem::size_of;

/// The 0.54 header's size macro stops before `num_attributes`, an output field; the real struct
/// (and what newer plugins demand) includes it.
pub(crate) const PLUGIN_ATTRIBUTES_ARGS_SIZE: usize = size_of::<PJRT_Plugin_Attributes_Args>();

/// Zeroed room after a grown struct; enough for every size announced below.
const TAIL: usize = 64;

/// A pjrt-sys argument struct followed by zeroed padding, announcing a larger `struct_size`.
#[repr(C)]
pub(crate) struct Grown<T> {
    pub args: T,
    tail: [u8; TAIL],
}

impl<T> Grown<T> {
    /// Pointer to the whole allocation (struct plus padding), as the plugin reads it.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut T {
        (self as *mut Self).cast()
    }
}

/// Defines `Grown::<$ty>::new()` announcing `$size` bytes (the struct's size in PJRT API 0.81).
macro_rules! grown {
    ($ty:ty, $size:expr) => {
        impl Grown<$ty> {
            pub(crate) fn new() -> Self {
                const { assert!($size >= size_of::<$ty>() && $size <= size_of::<Grown<$ty>>()) };
                let mut grown = Grown {
                    args: <$ty>::new(),
                    tail: [0; TAIL],
                };
                grown.args.struct_size = $size;
                grown
            }
        }
    };
}

grown!(PJRT_Client_Create_Args, 88);
grown!(PJRT_ExecuteOptions, 112);
grown!(PJRT_Executable_DeserializeAndLoad_Args, 64);
// Later headers append the memory space to view the buffer in (null: the device's default).
grown!(PJRT_Client_CreateViewOfDeviceBuffer_Args, 112);
// 0.115 appends an output field (104 -> 112 bytes), which the plugin writes into the padding.
grown!(PJRT_Executable_GetCompiledMemoryStats_Args, 112);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announced_sizes_fit_and_padding_is_zero() {
        let mut g = Grown::<PJRT_ExecuteOptions>::new();
        assert_eq!(g.args.struct_size, 112);
        assert!(g.tail.iter().all(|&b| b == 0));
        assert_eq!(
            g.as_mut_ptr().cast::<u8>(),
            (&mut g as *mut Grown<_>).cast::<u8>()
        );
        assert_eq!(PLUGIN_ATTRIBUTES_ARGS_SIZE, 32);
        assert_eq!(size_of::<PJRT_Client_CreateViewOfDeviceBuffer_Args>(), 104);
        assert_eq!(Grown::<PJRT_Client_Create_Args>::new().args.struct_size, 88);
        assert_eq!(
            Grown::<PJRT_Executable_DeserializeAndLoad_Args>::new()
                .args
                .struct_size,
            64
        );
        assert_eq!(
            Grown::<PJRT_Executable_GetCompiledMemoryStats_Args>::new()
                .args
                .struct_size,
            112
        );
    }
}
