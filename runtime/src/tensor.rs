//! Element types and shapes: what a buffer or an executable's argument is declared to be.

use crate::error::{Error, Result};
use pjrt_sys::PJRT_Buffer_Type;

/// Element types this backend moves between host and device. It is also the graph IR's element
/// type (re-exported by the compiler), so its serde spelling and variant order are part of the
/// IR's canonical bytes: add variants only at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    /// Complex of two `f32`.
    C64,
}

impl DType {
    /// Every variant, for exhaustive tests and lookups.
    pub const ALL: [DType; 11] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::Bf16,
        DType::F32,
        DType::F64,
        DType::C64,
    ];

    /// The IR's spelling (`"f32"`, `"bf16"`, `"bool"`, …), as serde writes it.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::C64 => "c64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::Bf16 | DType::F32 | DType::F64)
    }

    pub fn is_complex(self) -> bool {
        self == DType::C64
    }

    pub fn is_integer(self) -> bool {
        matches!(self, DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    pub fn is_signed_integer(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    /// Bytes per element in a dense host buffer (a `Bool` takes one byte).
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::Bf16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 | DType::C64 => 8,
        }
    }

    pub(crate) fn to_pjrt(self) -> PJRT_Buffer_Type {
        use pjrt_sys::*;
        match self {
            DType::Bool => PJRT_Buffer_Type_PJRT_Buffer_Type_PRED,
            DType::U8 => PJRT_Buffer_Type_PJRT_Buffer_Type_U8,
            DType::I8 => PJRT_Buffer_Type_PJRT_Buffer_Type_S8,
            DType::I16 => PJRT_Buffer_Type_PJRT_Buffer_Type_S16,
            DType::I32 => PJRT_Buffer_Type_PJRT_Buffer_Type_S32,
            DType::I64 => PJRT_Buffer_Type_PJRT_Buffer_Type_S64,
            DType::F16 => PJRT_Buffer_Type_PJRT_Buffer_Type_F16,
            DType::Bf16 => PJRT_Buffer_Type_PJRT_Buffer_Type_BF16,
            DType::F32 => PJRT_Buffer_Type_PJRT_Buffer_Type_F32,
            DType::F64 => PJRT_Buffer_Type_PJRT_Buffer_Type_F64,
            DType::C64 => PJRT_Buffer_Type_PJRT_Buffer_Type_C64,
        }
    }

    /// The `DType` of a PJRT element type; other types (u32, fp8, ...) are unsupported here.
    pub(crate) fn from_pjrt(raw: PJRT_Buffer_Type) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.to_pjrt() == raw)
            .ok_or_else(|| Error::invalid(format!("unsupported PJRT element type {raw}")))
    }
}

/// A dense tensor's element type and dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    pub dtype: DType,
    pub dims: Vec<i64>,
}

impl TensorSpec {
    pub fn new(dtype: DType, dims: impl Into<Vec<i64>>) -> Self {
        TensorSpec {
            dtype,
            dims: dims.into(),
        }
    }

    /// Number of elements, or an error for a negative dimension or an overflowing size.
    pub fn element_count(&self) -> Result<usize> {
        self.dims.iter().try_fold(1usize, |count, &d| {
            usize::try_from(d)
                .ok()
                .and_then(|d| count.checked_mul(d))
                .ok_or_else(|| Error::invalid(format!("bad dimensions {:?}", self.dims)))
        })
    }

    /// Bytes of a dense row-major host copy.
    pub fn byte_size(&self) -> Result<usize> {
        self.element_count()?
            .checked_mul(self.dtype.size())
            .ok_or_else(|| Error::invalid(format!("tensor too large: {self}")))
    }

    /// Calls `run(offset, outer_offset, bytes)` for each contiguous run of a dense row-major
    /// array of this type seen as the leading corner of one of type `outer` (same dtype and
    /// rank, no dimension larger): the copies that pad an array to `outer` or cut it back.
    pub fn corner_runs(&self, outer: &TensorSpec, mut run: impl FnMut(usize, usize, usize)) -> Result<()> {
        let fits = self.dtype == outer.dtype
            && self.dims.len() == outer.dims.len()
            && self.dims.iter().zip(&outer.dims).all(|(&d, &o)| (0..=o).contains(&d));
        if !fits {
            return Err(Error::invalid(format!("{self} is not a corner of {outer}")));
        }
        let dims = |d: &[i64]| d.iter().map(|&n| n as usize).collect::<Vec<usize>>();
        let (inner, outer) = (dims(&self.dims), dims(&outer.dims));
        let item = self.dtype.size();
        let Some(last) = (0..inner.len()).rev().find(|&d| inner[d] != outer[d]) else {
            run(0, 0, inner.iter().product::<usize>() * item);
            return Ok(());
        };
        // From `last` on, each run is contiguous in both; the dimensions before it step `outer`.
        let len = inner[last..].iter().product::<usize>() * item;
        if len == 0 {
            return Ok(());
        }
        let strides: Vec<usize> = (0..last).map(|d| outer[d + 1..].iter().product::<usize>() * item).collect();
        let mut index = vec![0; last];
        for n in 0..inner[..last].iter().product() {
            run(n * len, index.iter().zip(&strides).map(|(i, s)| i * s).sum(), len);
            for d in (0..last).rev() {
                index[d] += 1;
                if index[d] < inner[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for TensorSpec {
    /// MLIR-like, e.g. `f32[2,3]`, for error messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<String> = self.dims.iter().map(i64::to_string).collect();
        write!(f, "{:?}[{}]", self.dtype, dims.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_pjrt(d.to_pjrt()).unwrap(), d);
        }
        assert_eq!(TensorSpec::new(DType::F32, [2, 3]).byte_size().unwrap(), 24);
        assert_eq!(TensorSpec::new(DType::C64, []).byte_size().unwrap(), 8);
        assert_eq!(TensorSpec::new(DType::Bf16, [4, 0]).byte_size().unwrap(), 0);
        assert!(TensorSpec::new(DType::F32, [-1]).byte_size().is_err());
        assert!(TensorSpec::new(DType::F64, [i64::MAX, 4])
            .byte_size()
            .is_err());
        assert!(DType::from_pjrt(pjrt_sys::PJRT_Buffer_Type_PJRT_Buffer_Type_U32).is_err());
    }

    /// `data` (u8, dims `small`) zero-padded to dims `big`.
    fn pad(small: &[i64], big: &[i64], data: &[u8]) -> Vec<u8> {
        let (small, big) = (TensorSpec::new(DType::U8, small), TensorSpec::new(DType::U8, big));
        let mut out = vec![0; big.byte_size().unwrap()];
        small
            .corner_runs(&big, |s, b, len| out[b..b + len].copy_from_slice(&data[s..s + len]))
            .unwrap();
        out
    }

    #[test]
    fn corner_runs_pad_the_dimensions_that_differ() {
        // Rows keep the outer array's stride.
        assert_eq!(pad(&[2, 3], &[3, 4], &[1, 2, 3, 4, 5, 6]), [1, 2, 3, 0, 4, 5, 6, 0, 0, 0, 0, 0]);
        // A K/V cache `[batch, heads, length, dim]` padded along its length only.
        assert_eq!(pad(&[1, 2, 2, 1], &[1, 2, 3, 1], &[1, 2, 3, 4]), [1, 2, 0, 3, 4, 0]);
        assert_eq!(pad(&[1, 2], &[2, 2], &[7, 8]), [7, 8, 0, 0]);
        assert_eq!(pad(&[2, 2], &[2, 2], &[1, 2, 3, 4]), [1, 2, 3, 4]);
        assert_eq!(pad(&[0, 2], &[2, 2], &[]), [0, 0, 0, 0]);
        assert_eq!(pad(&[], &[], &[9]), [9]);
        // Wider elements: offsets in bytes.
        let (small, big) = (TensorSpec::new(DType::F32, [1, 1]), TensorSpec::new(DType::F32, [2, 2]));
        let mut runs = vec![];
        small.corner_runs(&big, |s, b, len| runs.push((s, b, len))).unwrap();
        assert_eq!(runs, [(0, 0, 4)]);
        let bigger = TensorSpec::new(DType::F32, [3, 1]);
        assert!(bigger.corner_runs(&big, |_, _, _| {}).is_err());
        assert!(small.corner_runs(&TensorSpec::new(DType::F16, [2, 2]), |_, _, _| {}).is_err());
    }
}
