//! Where a checkpoint's routed experts go as they load: every expert of a layer laid out alike, in the
//! weights region or (`experts_on_host`) in the pinned host block: bf16 experts copied in, GPTQ ones
//! converted on the host and copied in, bf16 ones quantised at load on the GPU (for the host block in the
//! device stage, then copied down whole).

use deltaserve_model::weights::TensorSource;

use crate::error::CudaError;
use crate::ops::w4a16::W4Weights;
use crate::w4::{ScaleDtype, W4Linear};

use super::loader::Loader;
use super::moe::W4ExpertLayout;
use super::weights::Part;

impl Loader<'_> {
    /// Room for `bytes` of routed experts: in the pinned host block with the experts on the host, else in
    /// the weights region.
    pub(super) fn alloc_experts(&mut self, bytes: usize) -> Result<u64, CudaError> {
        match self.host.as_deref_mut() {
            Some(h) => h.alloc(bytes),
            None => Ok(self.arena.alloc(self.wreg, bytes)?.ptr),
        }
    }

    /// Routed-expert bytes to their place at `at` (in the host block: copied there on the host).
    pub(super) fn put_experts(&mut self, at: u64, bytes: &[u8]) -> Result<(), CudaError> {
        match self.host.as_deref_mut() {
            Some(h) => h.write(at, bytes),
            None => self.rt.upload(at, bytes),
        }
    }

    /// A host int4 linear into the placed routed expert `w` (same shape and format).
    pub(super) fn put_w4_expert(&mut self, l: &W4Linear, w: &W4Weights) -> Result<(), CudaError> {
        match self.host.as_deref_mut() {
            Some(h) => h.write_w4(l, w),
            None => self.upload_w4(l, w),
        }
    }

    /// `rows` bf16 rows of expert `e`'s projection `proj` (0 gate, 1 up, 2 down), quantised into rows
    /// `row0 ..` of the device stage's linear, which is copied down whole to `target` in the host block
    /// once it is complete (the gate/up linear after its up rows, which must follow its gate rows).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantize_host_expert(
        &mut self,
        bf16: &[u8],
        rows: usize,
        (e, proj): (usize, usize),
        target: &W4Weights,
        row0: usize,
        name: &str,
    ) -> Result<(), CudaError> {
        let werr = |msg: &str| CudaError::Weights(format!("`{name}` (int4 expert on the host): {msg}"));
        let mut st = self.stage.ok_or_else(|| werr("no device stage to quantise it in"))?;
        let (staged, len) = if proj == 2 { (st.down, st.down_bytes) } else { (st.gate_up, st.gate_up_bytes) };
        if (staged.out, staged.inp, staged.zeros.is_some()) != (target.out, target.inp, target.zeros.is_some()) {
            return Err(werr("its linear is not the shape or format of the model's experts"));
        }
        if proj == 1 && st.gate_of != Some(e) {
            return Err(werr("its gate rows were not loaded right before its up rows"));
        }
        self.quantize_rows(bf16, rows, &staged, row0, name)?;
        st.gate_of = (proj == 0).then_some(e);
        self.stage = Some(st);
        if proj != 0 {
            let host = self.host.as_deref_mut().ok_or_else(|| werr("no host block"))?;
            host.download(self.rt, target.qweight, staged.qweight, len)?;
        }
        Ok(())
    }
}

/// Where a layer's int4 experts go as a checkpoint loads ([`W4ExpertLayout`]): the block is allocated
/// when expert 0's gate arrives (experts load in order, gate / up / down); bf16 experts are quantised
/// into place, GPTQ ones converted on the host, a GPTQ gate kept until its up rows arrive (the two are
/// one linear on the device). Every expert of a layer must come in one format.
#[derive(Default)]
pub(super) struct W4ExpertBlock {
    base: u64,
    layout: Option<W4ExpertLayout>,
    gate: Option<W4Linear>,
}

impl W4ExpertBlock {
    /// Places expert tensor `(e, proj)` (projection 0 gate, 1 up, 2 down); the part the model's weights
    /// record for it (gate and up: the expert's gate/up linear).
    pub(super) fn place(
        &mut self,
        ld: &mut Loader<'_>,
        src: &TensorSource<'_>,
        (e, proj): (usize, usize),
        num_experts: usize,
        asym: bool,
    ) -> Result<Part, CudaError> {
        let name = src.name.as_str();
        let werr = |msg: String| CudaError::Weights(format!("`{name}` (int4 expert): {msg}"));
        if e >= num_experts {
            return Err(werr(format!("expert {e} of a layer of {num_experts}")));
        }
        let gptq = match &src.quantized {
            Some(deltaserve_model::QuantizedSource::Gptq(g)) => Some(ld.convert_gptq(g, name)?),
            _ => None,
        };
        let (lin, bytes, (out, inp)) = match gptq {
            Some(l) => {
                let shape = (l.out_features, l.in_features);
                (Some(l), Vec::new(), shape)
            }
            None => {
                let (b, shape) = ld.bytes(src, false).map_err(|e| CudaError::Weights(e.to_string()))?;
                match shape.as_slice() {
                    [o, i] => (None, b, (*o, *i)),
                    s => return Err(werr(format!("shape {s:?} is not a linear"))),
                }
            }
        };
        let (width, hidden) = if proj == 2 { (inp, out) } else { (out, inp) };
        if (e, proj) == (0, 0) {
            W4Linear::check_shape(name, 2 * width, hidden)?;
            W4Linear::check_shape(name, hidden, width)?;
            let (a, sd) = lin.as_ref().map_or((asym, ScaleDtype::F16), |l| (l.zeros.is_some(), l.scale_dtype));
            let layout = W4ExpertLayout::new(width, hidden, a, sd);
            self.base = ld.alloc_experts(num_experts * layout.stride)?;
            self.layout = Some(layout);
            self.gate = None;
        }
        let layout = self.layout.ok_or_else(|| werr("expert 0's gate was not loaded first".into()))?;
        let (gu, down) = layout.expert(self.base, e);
        if (width, hidden) != (down.inp, down.out) {
            return Err(werr(format!("[{out}, {inp}]: the layer's experts are {} wide over {}", down.inp, down.out)));
        }
        let target = if proj == 2 { down } else { gu };
        let Some(l) = lin else {
            let row0 = if proj == 1 { width } else { 0 };
            match ld.stage {
                None => ld.quantize_rows(&bytes, out, &target, row0, name)?,
                Some(_) => ld.quantize_host_expert(&bytes, out, (e, proj), &target, row0, name)?,
            }
            return Ok(Part::W4(target));
        };
        if l.perm.is_some() || l.zeros.is_some() != gu.zeros.is_some() || l.scale_dtype != gu.scale_dtype {
            return Err(werr(
                "the layer's int4 experts must share one format (zero points, scale dtype) without act-order".into(),
            ));
        }
        match proj {
            0 => self.gate = Some(l),
            1 => {
                let g = self.gate.take().ok_or_else(|| werr("its gate was not loaded before it".into()))?;
                ld.put_w4_expert(&g.stack_rows(&l, name)?, &gu)?;
            }
            _ => ld.put_w4_expert(&l, &down)?,
        }
        Ok(Part::W4(target))
    }
}
