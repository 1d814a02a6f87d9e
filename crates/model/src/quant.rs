//! Quantised checkpoints: the `quantization_config` of `config.json` ([`Quantization`]) and the
//! stored encodings of quantised linear weights ([`QuantizedSource`]), with their dequantisation.
//!
//! Two encodings are read:
//!
//! - **GPTQ** (`quant_method` `"gptq"`, as AutoGPTQ / GPTQModel export it, and `"auto-round"` with
//!   `packing_format` `"auto_round:auto_gptq"`, AutoRound's GPTQ-compatible export). A linear
//!   `X.weight` `[out, in]` is stored instead as
//!   - `X.qweight` I32 `[in·bits/32, out]`: `32/bits` values per word along `in`, lowest bits first
//!     (input row `i` lives in word row `i / 8`, bits `4·(i % 8)..` for 4 bits);
//!   - `X.scales` F16 (or BF16/F32) `[groups, out]`, `groups = ceil(in / group_size)`;
//!   - `X.qzeros` I32 `[groups, out·bits/32]`: zero points packed the same way along `out`;
//!   - optional `X.g_idx` I32 `[in]`: the group of each input row (permuted under `desc_act`;
//!     without it the group of row `i` is `i / group_size`);
//!   - optional `X.bias` (must be zero: the model has no biases).
//!
//!   Dequantisation: `w[o, i] = (q[i, o] − zero[g(i), o]) · scale[g(i), o]`, in f32.
//!
//!   Zero points: the classic ("v1") format, written by AutoGPTQ, by GPTQModel with
//!   `checkpoint_format: "gptq"` (its default) and by AutoRound's `auto_round:auto_gptq` packing,
//!   stores `zero − 1` (and so cannot represent a zero of 0); the real zero is `stored + 1` (the
//!   exllama/vLLM GPTQ kernels add 1 the same way, without masking). GPTQModel's
//!   `checkpoint_format: "gptq_v2"` stores the zero itself. For `sym: true` the zero is fixed at
//!   `2^(bits−1)` (8 for 4 bits, as Marlin assumes) and `qzeros` is not read (it holds 7 in v1, 8 in v2).
//!
//! - **Block FP8** (`quant_method` `"fp8"` with `weight_block_size`, the official `-FP8`
//!   checkpoints): `X.weight` F8_E4M3 `[out, in]` and `X.weight_scale_inv` F32 (or BF16/F16)
//!   `[ceil(out/bo), ceil(in/bi)]`; `w[o, i] = fp8(o, i) · scale_inv[o / bo, i / bi]`.
//!
//! Which linears are quantised is read from the checkpoint itself (a `qweight`, or an F8_E4M3
//! `weight`), so layers a quantiser left unquantised (`modules_to_not_convert`, AutoRound
//! `extra_config` entries with 16 bits, modules outside `block_name_to_quantize`, shapes it could
//! not pack) load densely as before; a module the config explicitly excludes but that is stored
//! quantised is an error.

use crate::checkpoint::{DType, TensorRef};
use crate::error::ModelError;

mod config;
mod fp8;
mod gptq;
mod resolve;
mod select;

pub use config::{Fp8BlockConfig, GPTQ_BITS, GptqConfig, GptqParams, GptqProducer, Quantization, ZeroFormat};
pub use fp8::{Fp8BlockSource, fp8_block_quantize, fp8_e4m3_from_f32, fp8_e4m3_to_f32};
pub use gptq::GptqSource;
pub use resolve::{companion_names, is_stored_quantized, linear_source};
pub use select::ModuleQuant;

/// How a quantised linear weight is stored; the raw checkpoint bytes, for a backend to upload as is
/// or to dequantise with [`QuantizedSource::dequantize`].
#[derive(Clone, Debug)]
pub enum QuantizedSource<'a> {
    Gptq(GptqSource<'a>),
    Fp8Block(Fp8BlockSource<'a>),
}

impl QuantizedSource<'_> {
    /// Every checkpoint byte the encoding reads (for progress accounting).
    pub fn byte_len(&self) -> usize {
        match self {
            Self::Gptq(g) => {
                g.qweight.len() + g.qzeros.map_or(0, <[u8]>::len) + g.scales.len() + g.g_idx.map_or(0, <[u8]>::len)
            }
            Self::Fp8Block(f) => f.weight.len() + f.scale_inv.len(),
        }
    }

    /// The dequantised `[out, in]` weight, row-major f32. `name` is used in errors.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        match self {
            Self::Gptq(g) => g.dequantize(name),
            Self::Fp8Block(f) => f.dequantize(name),
        }
    }
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn floats(name: &str, dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, ModelError> {
    let mut out = Vec::with_capacity(bytes.len() / dtype.size().unwrap_or(1));
    TensorRef::bytes_to_f32(name, dtype, bytes, &mut out)?;
    Ok(out)
}
