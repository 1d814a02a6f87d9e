//! The kernels check: every module compiled for every supported arch without a GPU, with ptxas's resource
//! lines and each kernel's instruction count.

use deltaserve_plan::{KvDtype, StateDtype};

use super::{AttnTiling, KernelDims, KernelSource, KvFormats, SOURCES, compile, nvrtc_version};
use crate::error::CudaError;

/// Archs the kernels must compile for (no `a` variants: no Hopper-only instructions).
pub const CHECK_ARCHS: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90"];

/// The arch-specific target of Hopper's additional paths (wgmma): where the checked archs include
/// sm_90, [`kernels_check`] also builds the attention module for it ([`CHECK_WGMMA`]).
pub const HOPPER_ARCH: &str = "sm_90a";

/// The [`HOPPER_ARCH`] builds of the attention module that [`kernels_check`] compiles (the wgmma
/// prefill kernel's body exists only there): bf16, one 8-bit and one mixed pair of quantised formats.
pub const CHECK_WGMMA: &[(KvFormats, &str)] = &[
    (KvFormats::BF16, "attention[wgmma]"),
    (KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 }, "attention[wgmma fp8/fp8]"),
    (KvFormats { k: KvDtype::Int8, v: KvDtype::Int4 }, "attention[wgmma int8/int4]"),
];

/// Quantised-KV builds of the attention module that [`kernels_check`] compiles besides the bf16
/// one: every format's K path and V path at least once, and mixed pairs.
pub const CHECK_KV: &[(KvFormats, &str)] = &[
    (KvFormats { k: KvDtype::Fp8, v: KvDtype::Fp8 }, "attention[fp8/fp8]"),
    (KvFormats { k: KvDtype::Int8, v: KvDtype::Int4 }, "attention[int8/int4]"),
    (KvFormats { k: KvDtype::Int4, v: KvDtype::Int8 }, "attention[int4/int8]"),
    (KvFormats { k: KvDtype::Bf16, v: KvDtype::Fp8 }, "attention[bf16/fp8]"),
];

/// The DeltaNet state modules that [`kernels_check`] also compiles with the state stored bf16.
pub const CHECK_BF16_STATE: [(&str, &str); 2] =
    [("gdn_decode", "gdn_decode[bf16 state]"), ("gdn_chunk", "gdn_chunk[bf16 state]")];

/// What ptxas says (C7510 … C7515) where it makes a kernel's warpgroup products wait for each other
/// instead of running asynchronously: a kernel built that way loses the overlap it was written for.
pub const WGMMA_SERIALISED: &str = "wgmma.mma_async instructions are serialized";

/// One line of the kernels-check report.
#[derive(Clone, Debug)]
pub struct CheckLine {
    pub module: &'static str,
    pub arch: String,
    pub ok: bool,
    pub cubin_bytes: usize,
    pub compile_ms: f64,
    /// ptxas resource lines (registers, smem, spills) or the compiler error.
    pub detail: String,
    /// Instructions of each kernel ([`kernel_instructions`]).
    pub code: Vec<(String, usize)>,
}

/// Result of [`kernels_check`].
#[derive(Clone, Debug)]
pub struct KernelsReport {
    pub nvrtc_version: (i32, i32),
    pub lines: Vec<CheckLine>,
}

impl KernelsReport {
    pub fn all_ok(&self) -> bool {
        self.lines.iter().all(|l| l.ok)
    }
}

impl std::fmt::Display for KernelsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ma, mi) = self.nvrtc_version;
        writeln!(f, "NVRTC {ma}.{mi}")?;
        for l in &self.lines {
            writeln!(
                f,
                "{:<20} {:<6} {:<4} {:>8} B {:>7.0} ms",
                l.module,
                l.arch,
                if l.ok { "ok" } else { "FAIL" },
                l.cubin_bytes,
                l.compile_ms
            )?;
            for d in l.detail.lines().filter(|d| !d.trim().is_empty()) {
                writeln!(f, "    {}", d.trim())?;
            }
            if !l.code.is_empty() {
                let sizes: Vec<String> = l.code.iter().map(|(k, n)| format!("{k} {n}")).collect();
                writeln!(f, "    instructions: {}", sizes.join(", "))?;
            }
        }
        let bad = self.lines.iter().filter(|l| !l.ok).count();
        write!(f, "{} module builds, {} failed", self.lines.len(), bad)
    }
}

/// Compiles every kernel module for every arch in `archs` (default [`CHECK_ARCHS`]) with `dims`;
/// needs NVRTC only, no GPU. Compile failures are reported per line, not returned as `Err`.
pub fn kernels_check(archs: &[&str], dims: &KernelDims) -> Result<KernelsReport, CudaError> {
    kernels_check_where(archs, dims, |_| true)
}

/// The compile-time defines of `module` in [`kernels_check`]'s builds at `dims` (the model's dims and
/// the attention tiling that runs where the wide prefill kernels do not fit: 32-key tiles); two dims
/// whose defines are equal build the same module.
pub fn check_defines(dims: &KernelDims, module: &str) -> Vec<(&'static str, String)> {
    let mut defines = dims.defines(module);
    let tiling = AttnTiling { keys: 32, wide: false, ..AttnTiling::DEFAULT };
    defines.extend(tiling.defines(dims, module));
    defines
}

/// [`kernels_check`] over the modules for which `keep(module)` holds.
pub fn kernels_check_where(
    archs: &[&str],
    dims: &KernelDims,
    keep: impl Fn(&str) -> bool,
) -> Result<KernelsReport, CudaError> {
    let nvrtc_version = nvrtc_version()?;
    dims.validate()?;
    let sources: Vec<&KernelSource> = SOURCES.iter().filter(|s| keep(s.module)).collect();
    // (source, arch, KV formats, dims, report label)
    let bf16_state = dims.with_state_dtype(StateDtype::Bf16);
    let mut jobs: Vec<(&KernelSource, &str, KvFormats, &KernelDims, &'static str)> =
        archs.iter().flat_map(|a| sources.iter().map(move |s| (*s, *a, KvFormats::BF16, dims, s.module))).collect();
    if let Some(&attn) = sources.iter().find(|s| s.module == "attention") {
        jobs.extend(archs.iter().flat_map(|a| CHECK_KV.iter().map(move |&(kv, label)| (attn, *a, kv, dims, label))));
        if archs.contains(&"sm_90") {
            jobs.extend(CHECK_WGMMA.iter().map(|&(kv, label)| (attn, HOPPER_ARCH, kv, dims, label)));
        }
    }
    // The DeltaNet state kernels with the state stored bf16.
    for (module, label) in CHECK_BF16_STATE {
        if let Some(&src) = sources.iter().find(|s| s.module == module) {
            jobs.extend(archs.iter().map(|a| (src, *a, KvFormats::BF16, &bf16_state, label)));
        }
    }
    let lines = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|&(src, arch, kv, dims, label)| {
                scope.spawn(move || {
                    // attn_prefill as it runs where the wide kernels do not fit (sm_86/89: 32-key
                    // tiles); the wide kernels do not depend on the tiling's defines.
                    let mut defines = check_defines(dims, src.module);
                    defines.extend(kv.defines(src.module));
                    let r = compile(src, arch, &defines, true);
                    match r {
                        Ok(c) => CheckLine {
                            module: label,
                            arch: arch.to_string(),
                            ok: true,
                            cubin_bytes: c.image.len(),
                            compile_ms: c.compile_ms,
                            detail: resource_lines(&c.log),
                            code: kernel_instructions(&c.image),
                        },
                        Err(e) => CheckLine {
                            module: label,
                            arch: arch.to_string(),
                            ok: false,
                            cubin_bytes: 0,
                            compile_ms: 0.0,
                            detail: e.to_string(),
                            code: Vec::new(),
                        },
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .zip(&jobs)
            .map(|(h, (_, arch, _, _, label))| {
                h.join().unwrap_or_else(|_| CheckLine {
                    module: label,
                    arch: arch.to_string(),
                    ok: false,
                    cubin_bytes: 0,
                    compile_ms: 0.0,
                    detail: "compiler thread panicked".into(),
                    code: Vec::new(),
                })
            })
            .collect()
    });
    Ok(KernelsReport { nvrtc_version, lines })
}

/// Machine-code size of each kernel in a cubin: its `.text.<name>` section's bytes / 16 (every SASS
/// instruction of sm_70 and later is 16 bytes), sorted by name. Read from the ELF section headers
/// (64-bit little-endian, as NVRTC emits); anything malformed gives an empty list. The size matters
/// for kernels that run once per layer on the decode path: their code is fetched cold each time
/// (bench/results/decode-small-kernels-h200-2026-12-01.md: an unrolled `qk_norm_rope` of 9K instructions was
/// 2.7x slower than the 3.2K one).
pub fn kernel_instructions(cubin: &[u8]) -> Vec<(String, usize)> {
    let u16_at = |o: usize| cubin.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o: usize| cubin.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as usize);
    let u64_at = |o: usize| cubin.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize);
    let parse = || -> Option<Vec<(String, usize)>> {
        if cubin.get(..5)? != b"\x7fELF\x02" {
            return None;
        }
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
        let sh = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
        let strtab = u64_at(sh(shstrndx)? + 24)?;
        let mut out = Vec::new();
        for i in 0..shnum {
            let h = sh(i)?;
            let name_at = strtab.checked_add(u32_at(h)?)?;
            let name = cubin.get(name_at..)?.split(|&b| b == 0).next()?;
            if let Some(kernel) = name.strip_prefix(b".text.") {
                out.push((String::from_utf8_lossy(kernel).into_owned(), u64_at(h + 32)? / 16));
            }
        }
        out.sort();
        Some(out)
    };
    parse().unwrap_or_default()
}

/// Keeps ptxas's per-function summary lines ("Compiling entry", "Used N registers", spills), its
/// warnings and its performance notes (e.g. [`WGMMA_SERIALISED`]).
fn resource_lines(log: &str) -> String {
    log.lines()
        .filter(|l| {
            l.contains("Compiling entry")
                || l.contains("registers")
                || l.contains(WGMMA_SERIALISED)
                || (l.contains("ptxas") && l.contains("arning"))
                || (l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads"))
        })
        .map(|l| l.trim_start_matches("ptxas info    : ").to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::{WGMMA_SERIALISED, kernel_instructions, resource_lines};

    /// The report keeps what ptxas says about registers, spills and serialised warpgroup products, and
    /// drops the rest of its log.
    #[test]
    fn the_report_keeps_resources_and_serialised_products() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
                   ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized \
                   due to the presence of Extern calls in the function 'k'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 16 barriers\n\
                   ptxas info    : Compile time = 1.0 ms";
        let kept = resource_lines(log);
        assert_eq!(kept.lines().count(), 3, "{kept}");
        assert!(kept.contains(WGMMA_SERIALISED) && kept.contains("Used 168 registers"), "{kept}");
    }

    /// A 64-bit ELF with a null section, `.shstrtab` and the given `.text.*` sections (name, bytes).
    fn elf(texts: &[(&str, usize)]) -> Vec<u8> {
        let mut names = b"\0.shstrtab\0".to_vec();
        let text_names: Vec<usize> = texts
            .iter()
            .map(|(n, _)| {
                let at = names.len();
                names.extend_from_slice(format!(".text.{n}\0").as_bytes());
                at
            })
            .collect();
        let shoff = 64 + names.len();
        let mut f = vec![0u8; 64];
        f[..5].copy_from_slice(b"\x7fELF\x02");
        f[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&(2 + texts.len() as u16).to_le_bytes());
        f[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&names);
        let header = |name: usize, offset: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&(name as u32).to_le_bytes());
            h[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            h
        };
        f.extend(header(0, 0, 0));
        f.extend(header(1, 64, names.len()));
        for (&at, &(_, bytes)) in text_names.iter().zip(texts) {
            f.extend(header(at, 0, bytes));
        }
        f
    }

    #[test]
    fn kernel_sizes_come_from_the_text_sections() {
        let got = kernel_instructions(&elf(&[("w4p_hsb", 16 * 4976), ("attn", 32)]));
        assert_eq!(got, vec![("attn".to_string(), 2), ("w4p_hsb".to_string(), 4976)]);
    }

    #[test]
    fn malformed_cubins_give_no_sizes() {
        assert!(kernel_instructions(b"").is_empty());
        assert!(kernel_instructions(b"\x7fELF\x01 32-bit").is_empty());
        let mut cut = elf(&[("k", 64)]);
        cut.truncate(cut.len() - 30); // the last section header cut inside its size field
        assert!(kernel_instructions(&cut).is_empty());
        let mut wild = elf(&[("k", 64)]);
        wild[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes()); // section headers past the end
        assert!(kernel_instructions(&wild).is_empty());
    }
}
