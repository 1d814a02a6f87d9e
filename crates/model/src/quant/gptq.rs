//! GPTQ-packed linears: the stored tensors and their dequantisation (the layout is in the
//! [`crate::quant`] docs).

use super::{GptqParams, ZeroFormat, floats, words};
use crate::checkpoint::DType;
use crate::error::ModelError;

/// One GPTQ-packed linear (see the [`crate::quant`] docs for the layout).
#[derive(Clone, Debug)]
pub struct GptqSource<'a> {
    pub params: GptqParams,
    pub zero_format: ZeroFormat,
    /// `out` and `in` of the dequantised `[out, in]` weight.
    pub out_features: usize,
    pub in_features: usize,
    /// I32 `[in·bits/32, out]`.
    pub qweight: &'a [u8],
    /// I32 `[groups, out·bits/32]`; `None` only for symmetric weights stored without it.
    pub qzeros: Option<&'a [u8]>,
    /// `[groups, out]` in `scales_dtype`.
    pub scales: &'a [u8],
    pub scales_dtype: DType,
    /// I32 `[in]`, the group of each input row.
    pub g_idx: Option<&'a [u8]>,
}

impl GptqParams {
    /// The number of groups for `in_features` input rows.
    pub fn groups(&self, in_features: usize) -> usize {
        in_features.div_ceil(self.group_size.unwrap_or(in_features).max(1))
    }
    /// Values per packed int32.
    pub fn pack(&self) -> usize {
        32 / self.bits as usize
    }
}

impl GptqSource<'_> {
    /// The group of every input row, validated.
    fn groups_of_rows(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        let groups = self.params.groups(self.in_features);
        match self.g_idx {
            Some(bytes) => words(bytes)
                .enumerate()
                .map(|(i, g)| {
                    let g = g as i32;
                    if g < 0 || g as usize >= groups {
                        Err(ModelError::weights(format!(
                            "tensor `{name}` (GPTQ): g_idx[{i}] = {g} is outside the {groups} groups"
                        )))
                    } else {
                        Ok(g as usize)
                    }
                })
                .collect(),
            None => {
                let gs = self.params.group_size.unwrap_or(self.in_features);
                Ok((0..self.in_features).map(|i| i / gs).collect())
            }
        }
    }

    pub(super) fn dequantize(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (out_f, in_f) = (self.out_features, self.in_features);
        let bits = self.params.bits;
        let pack = self.params.pack();
        let mask = (1u32 << bits) - 1;
        let groups = self.params.groups(in_f);
        let gidx = self.groups_of_rows(name)?;
        let scales = floats(name, self.scales_dtype, self.scales)?;
        // Real zero of (group, out column), as i32.
        let zeros: Vec<i32> = if self.params.sym {
            vec![1i32 << (bits - 1); groups * out_f]
        } else {
            let qz = self
                .qzeros
                .ok_or_else(|| ModelError::weights(format!("tensor `{name}` (asymmetric GPTQ) has no qzeros")))?;
            let packed: Vec<u32> = words(qz).collect();
            let cols = out_f / pack;
            let off = self.zero_format.offset();
            (0..groups * out_f)
                .map(|k| {
                    let (g, o) = (k / out_f, k % out_f);
                    let w = packed[g * cols + o / pack];
                    ((w >> (bits as usize * (o % pack))) & mask) as i32 + off
                })
                .collect()
        };
        let mut out = vec![0f32; out_f * in_f];
        for (r, row) in self.qweight.chunks_exact(4 * out_f).enumerate() {
            for (o, w) in words(row).enumerate() {
                for k in 0..pack {
                    let i = r * pack + k;
                    let q = ((w >> (bits as usize * k)) & mask) as i32;
                    let gi = gidx[i] * out_f + o;
                    out[o * in_f + i] = (q - zeros[gi]) as f32 * scales[gi];
                }
            }
        }
        Ok(out)
    }
}
