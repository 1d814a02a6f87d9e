//! Module selection: which linears a `quantization_config` quantises, by module name.

use super::{GptqParams, Quantization};

/// A module name without the text-model prefix (`model.language_model.`, `model.`), so that config
/// entries and checkpoint names written with either prefix compare equal.
fn normalize(name: &str) -> &str {
    for p in ["model.language_model.", "language_model.model.", "language_model.", "model."] {
        if let Some(rest) = name.strip_prefix(p) {
            return rest;
        }
    }
    name
}

/// True when `pattern` names `module` or a block (dotted prefix / component run) containing it.
fn module_matches(module: &str, pattern: &str) -> bool {
    let (m, p) = (normalize(module), normalize(pattern.trim_end_matches('.')));
    if p.is_empty() {
        return false;
    }
    m == p
        || module == pattern
        || m.starts_with(&format!("{p}."))
        || m.ends_with(&format!(".{p}"))
        || m.contains(&format!(".{p}."))
}

/// True when `module` lies under block `block` (e.g. `model.language_model.layers`).
fn within_block(module: &str, block: &str) -> bool {
    let (m, b) = (normalize(module), normalize(block.trim_end_matches('.')));
    !b.is_empty() && (m == b || m.starts_with(&format!("{b}.")))
}

/// What the config says about one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleQuant {
    /// Explicitly left unquantised by the config.
    Excluded,
    /// GPTQ-quantised with these parameters (if the checkpoint stores it quantised).
    Gptq(GptqParams),
    /// Block-FP8 (if the checkpoint stores it so).
    Fp8([usize; 2]),
}

impl Quantization {
    /// The config's rule for `module` (a linear's name without `.weight`).
    pub fn module(&self, module: &str) -> ModuleQuant {
        match self {
            Self::Gptq(g) => {
                if let Some((_, entry)) = g.extra_config.iter().find(|(k, _)| normalize(k) == normalize(module)) {
                    return entry.map_or(ModuleQuant::Excluded, ModuleQuant::Gptq);
                }
                if g.modules_to_not_convert.iter().any(|p| module_matches(module, p)) {
                    return ModuleQuant::Excluded;
                }
                if let Some(blocks) = &g.block_name_to_quantize
                    && !blocks.iter().any(|b| within_block(module, b))
                {
                    return ModuleQuant::Excluded;
                }
                ModuleQuant::Gptq(g.params)
            }
            Self::Fp8Block(c) => {
                if c.modules_to_not_convert.iter().any(|p| module_matches(module, p)) {
                    ModuleQuant::Excluded
                } else {
                    ModuleQuant::Fp8(c.block)
                }
            }
        }
    }
}
