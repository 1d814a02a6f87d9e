//! What every case runs on and checks with: the device arena (one region per case, outputs poisoned
//! with NaN before a launch, inputs rounded to bf16), the random inputs, and the comparisons of a
//! device result with the reference (within a tolerance, or bit for bit).

use deltaserve_cuda::Runtime;
use deltaserve_cuda::arena::{Arena, RegionId};
use half::bf16;
use rand::RngExt;
use rand::rngs::StdRng;

use crate::Tol;

/// One check of a case: passed or not, and the line printed for it.
pub struct Outcome {
    pub ok: bool,
    pub detail: String,
}

impl Outcome {
    pub fn error(msg: String) -> Self {
        Outcome { ok: false, detail: msg }
    }
}

/// Every element of `got` against `reference`: |ref − x| ≤ atol + rtol·|ref|, with the worst element.
pub fn compare(what: &str, reference: &[f32], got: &[f32], tol: Tol) -> Outcome {
    if reference.len() != got.len() {
        return Outcome::error(format!("{what}: length {} vs {}", got.len(), reference.len()));
    }
    let rms =
        (reference.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / reference.len().max(1) as f64).sqrt() as f32;
    let atol = tol.atol_rms * rms + tol.atol_abs;
    let (mut worst, mut worst_share, mut max_err, mut nan) = (0usize, 0f32, 0f32, 0usize);
    for (i, (&r, &x)) in reference.iter().zip(got).enumerate() {
        if !x.is_finite() {
            nan += 1;
            continue;
        }
        let err = (r - x).abs();
        let lim = atol + tol.rtol * r.abs();
        let share = if lim > 0.0 {
            err / lim
        } else if err > 0.0 {
            f32::INFINITY
        } else {
            0.0
        };
        max_err = max_err.max(err);
        if share > worst_share {
            worst_share = share;
            worst = i;
        }
    }
    let ok = nan == 0 && worst_share <= 1.0;
    Outcome {
        ok,
        detail: format!(
            "{what}: n={} max|err|={max_err:.3e} worst[{worst}] ref={:.4e} got={:.4e} ({:.0}% of tol; atol={atol:.2e} rtol={:.1e}){}",
            reference.len(),
            reference.get(worst).copied().unwrap_or(0.0),
            got.get(worst).copied().unwrap_or(0.0),
            worst_share * 100.0,
            tol.rtol,
            if nan > 0 { format!(" {nan} NON-FINITE (unwritten?)") } else { String::new() }
        ),
    }
}

/// Bit-exact comparison of 16-bit patterns.
pub fn same_bits(what: &str, want: &[u16], got: &[u16]) -> Outcome {
    let bad = want.iter().zip(got).filter(|(a, b)| a != b).count() + want.len().abs_diff(got.len());
    let first = want.iter().zip(got).position(|(a, b)| a != b);
    Outcome { ok: bad == 0, detail: format!("{what}: {} values, {bad} differ (first at {first:?})", want.len()) }
}

/// One arena region per case, poisoned outputs, bf16 uploads and downloads.
pub struct Dev<'a> {
    pub rt: &'a Runtime,
    arena: Arena,
    reg: RegionId,
}

pub type R<T> = Result<T, deltaserve_cuda::CudaError>;

impl<'a> Dev<'a> {
    pub fn new(rt: &'a Runtime, bytes: usize) -> R<Self> {
        let mut arena = Arena::new(rt.context().clone());
        let reg = arena.add_region("test", bytes)?;
        Ok(Dev { rt, arena, reg })
    }
    pub fn alloc(&mut self, bytes: usize) -> R<u64> {
        Ok(self.arena.alloc(self.reg, bytes)?.ptr)
    }
    pub fn bf16(&mut self, v: &[f32]) -> R<u64> {
        let h: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        self.u16s(&h)
    }
    /// Raw 16-bit codes (bf16 or f16 bits) as they are.
    pub fn u16s(&mut self, h: &[u16]) -> R<u64> {
        let p = self.alloc(2 * h.len())?;
        self.rt.upload(p, h)?;
        Ok(p)
    }
    /// `n` bytes at `p`.
    pub fn get_bytes(&self, p: u64, n: usize) -> R<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.rt.download(&mut v, p)?;
        Ok(v)
    }
    pub fn get_u16s(&self, p: u64, n: usize) -> R<Vec<u16>> {
        let mut h = vec![0u16; n];
        self.rt.download(&mut h, p)?;
        Ok(h)
    }
    pub fn f32s(&mut self, v: &[f32]) -> R<u64> {
        let p = self.alloc(4 * v.len())?;
        self.rt.upload(p, v)?;
        Ok(p)
    }
    pub fn i32s(&mut self, v: &[i32]) -> R<u64> {
        let p = self.alloc(4 * v.len().max(1))?;
        self.rt.upload(p, v)?;
        Ok(p)
    }
    /// Output buffer filled with 0xFF bytes: NaN as bf16 and as f32.
    pub fn poison(&mut self, bytes: usize) -> R<u64> {
        let p = self.alloc(bytes)?;
        self.rt.memset(p, 0xFF, bytes)?;
        Ok(p)
    }
    pub fn get_bf16(&self, p: u64, n: usize) -> R<Vec<f32>> {
        Ok(self.get_u16s(p, n)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect())
    }
    /// A DeltaNet recurrent state in the kernels' storage: bf16 (`bf16`, rounded) or f32.
    pub fn state(&mut self, v: &[f32], bf16: bool) -> R<u64> {
        if bf16 { self.bf16(v) } else { self.f32s(v) }
    }
    /// `n` values of a state stored as [`Dev::state`] stores it.
    pub fn get_state(&self, p: u64, n: usize, bf16: bool) -> R<Vec<f32>> {
        if bf16 { self.get_bf16(p, n) } else { self.get_f32(p, n) }
    }
    /// The 16-bit words of `n` state values stored as [`Dev::state`] stores them (bitwise comparisons).
    pub fn state_words(&self, p: u64, n: usize, bf16: bool) -> R<Vec<u16>> {
        let mut h = vec![0u16; if bf16 { n } else { 2 * n }];
        self.rt.download(&mut h, p)?;
        Ok(h)
    }
    pub fn get_f32(&self, p: u64, n: usize) -> R<Vec<f32>> {
        let mut h = vec![0f32; n];
        self.rt.download(&mut h, p)?;
        Ok(h)
    }
}

/// `x` rounded to bf16.
pub fn rb(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Uniform in [-a, a), rounded to bf16.
pub fn randv(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rb(rng.random_range(-a..a))).collect()
}

/// Offsets of sequences of `lens` rows in a packed batch: 0, lens[0], lens[0] + lens[1], ...
pub fn cu_of(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().copied().unwrap_or(0) + l as i32);
    }
    cu
}
