//! Storage formats of the decoder weights ([`WeightsDtype`]) and of the KV cache ([`KvDtype`]), and what
//! each costs in bytes. Names parse case-insensitively; an unknown name is an error that lists the choices.

use std::fmt;
use std::str::FromStr;

/// Group size of int4 weights (along `in`) and block edge of fp8 weights.
pub const QUANT_GROUP: usize = 128;

/// f32 scales per row of 128×128 blocks of an fp8 linear with `inp` inputs: its `ceil(inp/128)` blocks,
/// padded to a multiple of 4 (16 bytes, the row alignment cuBLASLt's block-scaled FP8 GEMM reads).
pub fn fp8_scale_cols(inp: usize) -> usize {
    inp.div_ceil(QUANT_GROUP).next_multiple_of(4)
}

/// How the decoder linears are stored. Norms, conv, `A_log` and `dt_bias` stay at 16 bit (32 bit for `F32`);
/// the embedding and lm_head stay at 16 bit (32 bit for `F32`) unless `lm_head_int4` is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightsDtype {
    Bf16,
    F16,
    F32,
    /// 4-bit, groups of 128 along `in`, one fp16 scale per group (+ packed int4 zero points when asymmetric).
    Int4,
    /// fp8 e4m3 in 128×128 blocks, one f32 scale per block.
    Fp8Block,
}

impl WeightsDtype {
    pub const CHOICES: &'static str = "bf16, fp16, fp32, int4, fp8";

    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
            Self::F32 => "fp32",
            Self::Int4 => "int4",
            Self::Fp8Block => "fp8",
        }
    }

    /// Bytes per element of the tensors that are never quantised (embedding, norms, conv, `A_log`, `dt_bias`).
    pub fn dense_elem_bytes(self) -> u64 {
        if self == Self::F32 { 4 } else { 2 }
    }

    /// Bytes of one `[out, in]` linear weight in this format, scales (and int4 zero points when `asym`) included.
    pub fn linear_bytes(self, out: usize, inp: usize, asym: bool) -> u128 {
        let (o, i) = (out as u128, inp as u128);
        let g = QUANT_GROUP as u128;
        match self {
            Self::Bf16 | Self::F16 => 2 * o * i,
            Self::F32 => 4 * o * i,
            Self::Int4 => {
                let groups = i.div_ceil(g);
                let data = o * i.div_ceil(2);
                let scales = o * groups * 2;
                let zeros = if asym { groups * o.div_ceil(2) } else { 0 }; // [groups, ceil(out/2)] nibbles
                data + scales + zeros
            }
            Self::Fp8Block => o * i + o.div_ceil(g) * fp8_scale_cols(inp) as u128 * 4,
        }
    }
}

impl fmt::Display for WeightsDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WeightsDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Self::F16),
            "fp32" | "f32" | "float32" | "float" => Ok(Self::F32),
            "int4" | "q4" | "w4" => Ok(Self::Int4),
            "fp8" | "fp8-block" | "fp8_block" | "fp8_e4m3" | "e4m3" => Ok(Self::Fp8Block),
            _ => Err(format!("unknown weights dtype `{s}` (choices: {})", Self::CHOICES)),
        }
    }
}

/// How K or V of the attention layers is stored in the paged cache. The 8- and 4-bit formats carry one
/// fp16 scale per (token, kv head).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    Bf16,
    F16,
    F32,
    /// fp8 e4m3 + a per-(token, head) fp16 scale.
    Fp8,
    /// int8 + a per-(token, head) fp16 scale.
    Int8,
    /// int4 packed two per byte + a per-(token, head) fp16 scale.
    Int4,
}

impl KvDtype {
    pub const ALL: [KvDtype; 6] = [Self::F32, Self::Bf16, Self::F16, Self::Fp8, Self::Int8, Self::Int4];
    pub const CHOICES: &'static str = "bf16, fp16, fp32, fp8, int8, int4";

    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
            Self::F32 => "fp32",
            Self::Fp8 => "fp8",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
        }
    }

    /// Bits per stored element.
    pub fn bits(self) -> u64 {
        match self {
            Self::F32 => 32,
            Self::Bf16 | Self::F16 => 16,
            Self::Fp8 | Self::Int8 => 8,
            Self::Int4 => 4,
        }
    }

    /// Bytes of the per-(token, head) scale (0 for the float formats).
    pub fn scale_bytes(self) -> u64 {
        match self {
            Self::Fp8 | Self::Int8 | Self::Int4 => 2,
            _ => 0,
        }
    }

    /// Bytes of one token of one kv head (`head_dim` elements + scale).
    pub fn bytes_per_head(self, head_dim: usize) -> u64 {
        (head_dim as u64 * self.bits()).div_ceil(8) + self.scale_bytes()
    }

    /// The next smaller format to suggest when KV does not fit (None for the smallest).
    pub fn smaller(self) -> Option<Self> {
        match self {
            Self::F32 | Self::Bf16 | Self::F16 => Some(Self::Fp8),
            Self::Fp8 | Self::Int8 => Some(Self::Int4),
            Self::Int4 => None,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" | "auto" => Ok(Self::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Self::F16),
            "fp32" | "f32" | "float32" | "float" => Ok(Self::F32),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(Self::Fp8),
            "int8" | "i8" | "q8" => Ok(Self::Int8),
            "int4" | "i4" | "q4" => Ok(Self::Int4),
            _ => Err(format!("unknown KV cache dtype `{s}` (choices: {})", Self::CHOICES)),
        }
    }
}

/// How the DeltaNet layers' recurrent state (`[Hv, dk, dv]` per layer and sequence) is stored in its slots and
/// snapshots. The recurrence computes in f32 either way; `Bf16` rounds the state to bf16 each time a step
/// stores it (half the memory and half the bytes a decode step reads and writes for it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StateDtype {
    /// f32: exact (the checkpoints' `mamba_ssm_dtype`).
    #[default]
    F32,
    Bf16,
}

impl StateDtype {
    pub const CHOICES: &'static str = "fp32, bf16";

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "fp32",
            Self::Bf16 => "bf16",
        }
    }

    /// Bytes per stored element.
    pub fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl fmt::Display for StateDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StateDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            // `auto`: the checkpoints' `mamba_ssm_dtype` (float32 for Qwen3.5/3.6), as vLLM reads it.
            "fp32" | "f32" | "float32" | "float" | "auto" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            _ => Err(format!("unknown DeltaNet state dtype `{s}` (choices: {})", Self::CHOICES)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_errors() {
        assert_eq!("BF16".parse::<WeightsDtype>(), Ok(WeightsDtype::Bf16));
        assert_eq!("f16".parse::<WeightsDtype>(), Ok(WeightsDtype::F16));
        assert_eq!("fp8".parse::<WeightsDtype>(), Ok(WeightsDtype::Fp8Block));
        assert_eq!("int8".parse::<KvDtype>(), Ok(KvDtype::Int8));
        let e = "int3".parse::<KvDtype>().unwrap_err();
        assert!(e.contains("int3") && e.contains("fp8, int8, int4"), "{e}");
        let e = "int8".parse::<WeightsDtype>().unwrap_err();
        assert!(e.contains("bf16, fp16, fp32, int4, fp8"), "{e}");
    }

    #[test]
    fn linear_bytes() {
        // int4 sym: 4.125 bit; asym adds 0.5 B per group.
        assert_eq!(WeightsDtype::Int4.linear_bytes(2, 256, false), 2 * 128 + 2 * 2 * 2);
        assert_eq!(WeightsDtype::Int4.linear_bytes(2, 256, true), 2 * 128 + 2 * 2 * 2 + 2);
        // Two rows of scale blocks, each padded from 1 to 4 scales.
        assert_eq!(WeightsDtype::Fp8Block.linear_bytes(129, 128, false), 129 * 128 + 2 * 4 * 4);
        assert_eq!(KvDtype::Int4.bytes_per_head(256), 130);
    }

    #[test]
    fn state_dtype() {
        assert_eq!("bfloat16".parse::<StateDtype>(), Ok(StateDtype::Bf16));
        assert_eq!("F32".parse::<StateDtype>(), Ok(StateDtype::F32));
        assert_eq!(StateDtype::default(), StateDtype::F32);
        let e = "fp8".parse::<StateDtype>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("fp32, bf16"), "{e}");
    }
}
