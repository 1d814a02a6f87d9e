//! Tensor maps for the tensor memory accelerator (Hopper's bulk tensor copies): a 2-D matrix (bf16 or
//! bytes) in global memory described on the host (`cuTensorMapEncodeTiled`) and passed by value to the
//! kernel that copies boxes of it into shared memory (`cp.async.bulk.tensor`).

use cudarc::driver::DriverError;
use cudarc::driver::sys;

use crate::error::CudaError;

/// A `CUtensorMap` (128 opaque bytes) as a kernel argument (`const __grid_constant__ TmaMap` in the
/// kernels).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub struct TmaMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte value; the kernel reads it as its `TmaMap` parameter of the same size.
unsafe impl cudarc::driver::DeviceRepr for TmaMap {}

/// The map of a row-major byte matrix at `ptr` with `rows` rows of `cols` bytes, copied in boxes of
/// `box_rows` rows × `box_cols` bytes (16-byte multiples up to 256) as they lie, unswizzled; rows outside
/// the matrix land as zeros.
pub fn bytes_rows(ptr: u64, rows: usize, cols: usize, box_cols: usize, box_rows: usize) -> Result<TmaMap, CudaError> {
    let ok = box_cols.is_multiple_of(16) && (16..=256).contains(&box_cols) && box_cols <= cols;
    if !ok || !cols.is_multiple_of(16) {
        let msg = format!("boxes of {box_cols} bytes over rows of {cols}: 16-byte multiples, at most 256 a box");
        return Err(CudaError::InvalidArgs { kernel: "tensor map", msg });
    }
    let m = Map { ptr, rows, cols, elem_bytes: 1, box_cols, box_rows };
    m.encode(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, false)
}

/// The map of a row-major bf16 matrix at `ptr` with `rows` rows of `cols` elements, copied in boxes of
/// `box_rows` rows × 64 elements (128 bytes) in the 128-byte swizzle (row r's 16-byte chunk c lands at
/// chunk c ^ (r % 8) of its 128 bytes, the layout wgmma's swizzled operands take); rows outside the
/// matrix land as zeros.
pub fn bf16_rows_swizzled(ptr: u64, rows: usize, cols: usize, box_rows: usize) -> Result<TmaMap, CudaError> {
    let m = Map { ptr, rows, cols, elem_bytes: 2, box_cols: 64, box_rows };
    m.encode(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, true)
}

/// The map of a row-major byte matrix at `ptr` with `rows` rows of `cols` bytes, copied in boxes of
/// `box_rows` rows × 128 bytes in the 128-byte swizzle (as [`bf16_rows_swizzled`]: the layout of wgmma's
/// swizzled 8-bit operands); rows outside the matrix land as zeros.
pub fn bytes_rows_swizzled(ptr: u64, rows: usize, cols: usize, box_rows: usize) -> Result<TmaMap, CudaError> {
    let m = Map { ptr, rows, cols, elem_bytes: 1, box_cols: 128, box_rows };
    m.encode(sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, true)
}

/// A 2-D row-major matrix and its box (columns in elements).
struct Map {
    ptr: u64,
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    box_cols: usize,
    box_rows: usize,
}

impl Map {
    fn encode(&self, dtype: sys::CUtensorMapDataType, swizzle_128b: bool) -> Result<TmaMap, CudaError> {
        let bad = |msg: String| CudaError::InvalidArgs { kernel: "tensor map", msg };
        let row_bytes = self.cols * self.elem_bytes;
        if self.ptr == 0 || !self.ptr.is_multiple_of(16) || !row_bytes.is_multiple_of(16) || self.cols < self.box_cols {
            return Err(bad(format!(
                "{:#x}: a 16-byte aligned matrix with 16-byte rows of at least {} columns is needed ({} columns)",
                self.ptr, self.box_cols, self.cols
            )));
        }
        if self.rows == 0 || self.rows > u32::MAX as usize || !(1..=256).contains(&self.box_rows) {
            return Err(bad(format!("{} rows in boxes of {}", self.rows, self.box_rows)));
        }
        let dims: [u64; 2] = [self.cols as u64, self.rows as u64];
        let strides: [u64; 1] = [row_bytes as u64];
        let boxes: [u32; 2] = [self.box_cols as u32, self.box_rows as u32];
        let elem: [u32; 2] = [1, 1];
        let swizzle = if swizzle_128b {
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
        } else {
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
        };
        let mut map = TmaMap(sys::CUtensorMap { opaque: [0; 16] });
        // SAFETY: every pointer is to a local array of the rank's length (strides: rank - 1); the call
        // only writes the 128-byte map.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                dtype,
                2,
                self.ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(|cause: DriverError| CudaError::Driver { call: "cuTensorMapEncodeTiled", cause })?;
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matrices and boxes the tensor memory accelerator cannot take are refused before the driver is asked.
    #[test]
    fn bad_shapes_are_errors() {
        let refused = |r: Result<TmaMap, CudaError>| matches!(r, Err(CudaError::InvalidArgs { .. }));
        assert!(refused(bf16_rows_swizzled(0, 64, 1024, 32)), "null pointer");
        assert!(refused(bf16_rows_swizzled(0x1008, 64, 1024, 32)), "8-byte aligned");
        assert!(refused(bf16_rows_swizzled(0x1000, 64, 32, 32)), "rows narrower than a box");
        assert!(refused(bf16_rows_swizzled(0x1000, 0, 1024, 32)), "no rows");
        assert!(refused(bf16_rows_swizzled(0x1000, 64, 1024, 512)), "box of 512 rows");
        assert!(refused(bytes_rows(0x1000, 64, 1024, 8, 32)), "box of 8 bytes");
        assert!(refused(bytes_rows(0x1000, 64, 1024, 512, 32)), "box of 512 bytes");
        assert!(refused(bytes_rows(0x1000, 64, 1000, 128, 32)), "rows not of 16-byte multiples");
        assert!(refused(bytes_rows(0x1000, 64, 64, 128, 32)), "rows narrower than a box");
    }
}
