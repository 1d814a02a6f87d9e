//! Tensor maps for the tensor memory accelerator (Hopper's bulk tensor copies): a 2-D bf16 matrix in
//! global memory described once on the host (`cuTensorMapEncodeTiled`) and passed by value to the
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

/// The map of a row-major bf16 matrix at `ptr` with `rows` rows of `cols` elements, copied in boxes of
/// `box_rows` rows × 64 elements (128 bytes) in the 128-byte swizzle (row r's 16-byte chunk c lands at
/// chunk c ^ (r % 8) of its 128 bytes, the layout wgmma's swizzled operands take); rows outside the
/// matrix land as zeros.
pub fn bf16_rows_swizzled(ptr: u64, rows: usize, cols: usize, box_rows: usize) -> Result<TmaMap, CudaError> {
    const K: &str = "tensor map";
    let bad = |msg: String| CudaError::InvalidArgs { kernel: K, msg };
    if ptr == 0 || !ptr.is_multiple_of(16) || !(cols * 2).is_multiple_of(16) || cols < 64 {
        return Err(bad(format!("{ptr:#x}: a 16-byte aligned matrix of at least 64 columns (16-byte rows) is needed")));
    }
    if rows == 0 || rows > u32::MAX as usize || !(1..=256).contains(&box_rows) {
        return Err(bad(format!("{rows} rows in boxes of {box_rows}")));
    }
    let dims: [u64; 2] = [cols as u64, rows as u64];
    let strides: [u64; 1] = [(cols * 2) as u64];
    let boxes: [u32; 2] = [64, box_rows as u32];
    let elem: [u32; 2] = [1, 1];
    let mut map = TmaMap(sys::CUtensorMap { opaque: [0; 16] });
    // SAFETY: every pointer is to a local array of the rank's length (strides: rank - 1); the call
    // only writes the 128-byte map.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map.0,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|cause: DriverError| CudaError::Driver { call: "cuTensorMapEncodeTiled", cause })?;
    Ok(map)
}
