#!/usr/bin/env python3
"""Generate tiny random Qwen3.5 / Qwen3-Next checkpoints + HF reference logits.

Usage:
    python3 scripts/hf_fixtures.py --out DIR [--device cpu|cuda] [--seed 1234] [--only NAME ...]

For each model NAME in (qwen35_gva3, qwen35_gva3_d32, qwen35_gva1_tied, qwen3next_dense, qwen35_moe,
qwen3next_moe, qwen35_fp8) writes DIR/NAME/:
    config.json, generation_config.json, model.safetensors   (bf16, real HF tensor names; qwen35_fp8: the
                            block-FP8 checkpoint transformers' FineGrainedFP8Config writes, made on a CUDA GPU)
    reference.safetensors   logits_<T> [T,V] f32 (T in 1,37,300,1100), decode_logits [24,V] f32,
                            input_ids_<T> [T] i64, decode_ids [37+24] i64
    reference.json          prompts, greedy decode trace, metadata, self-checks

The reference is computed in fp32 (weights = the bf16-rounded saved weights, upcast) with
attn_implementation="eager" and HF's pure-PyTorch GDN / conv paths (fla and causal_conv1d must
NOT be importable; the script records and by default refuses otherwise).
See scripts/README-fixtures.md.
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys
import time

# Never pull kernels from the hub; we want the readable torch reference paths.
os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

PROMPT_LENS = [1, 37, 300, 1100]
# Fixtures saved as block-FP8 checkpoints: the bf16 model quantised by transformers' FineGrainedFP8Config
# (e4m3 codes + `weight_scale_inv` per 128 x 128 block, on a GPU of compute capability >= 8.9) and saved with
# save_pretrained; the reference reloads that checkpoint dequantised to float32 by transformers itself.
# Left in bf16, as the official Qwen -FP8 releases leave them: lm_head, the embedding (not a linear), the
# DeltaNet conv1d and in_proj_a / in_proj_b, and the vision tower.
FP8_FIXTURES = {"qwen35_fp8"}
# (transformers matches these against a module's whole name or its last parts: the vision tower's linears are
# named in full, for the one block of tiny_vision_config.)
FP8_NOT_CONVERTED = ["lm_head", "in_proj_a", "in_proj_b", "conv1d"] + [
    f"model.visual.{m}"
    for m in ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.linear_fc1", "blocks.0.mlp.linear_fc2",
              "merger.linear_fc1", "merger.linear_fc2"]
]
# Mixture-of-experts fixtures skip the 1100-token prompt (chunk carry-over is covered by the dense ones):
# fewer routed tokens keep the smallest top-k margin large (see MIN_ROUTER_GAP).
MOE_PROMPT_LENS = [1, 37, 300]
# Every routed token's k-th and (k+1)-th router logits must be at least this far apart (f32 rounding
# differences between implementations are ~1e-5); the router weights are redrawn until they are.
MIN_ROUTER_GAP = 2e-3
ROUTER_ATTEMPTS = 40
DECODE_PROMPT_LEN = 37
DECODE_STEPS = 24

FULL = "full_attention"
LIN = "linear_attention"

# Router weights get this many times the usual 1/sqrt(fan_in) std, so the router logits spread widely and
# the k-th and (k+1)-th expert of a token are far apart (no near-ties that rounding could flip).
ROUTER_STD_SCALE = 6.0


# ----------------------------------------------------------------------------------------------
# Model specs
# ----------------------------------------------------------------------------------------------


def tiny_vision_config(out_hidden_size):
    return dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=out_hidden_size,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        num_position_embeddings=64,  # must be a square (8x8 grid)
        hidden_act="gelu_pytorch_tanh",
    )


def qwen35_config(*, hidden, layer_types, heads, kv_heads, head_dim, prf, lk, lv, dk, dv, inter, vocab, tied, moe=None):
    """A `Qwen3_5Config`; with `moe` (experts, top_k, expert width, shared width) a `Qwen3_5MoeConfig`."""
    rotary_dim = int(head_dim * prf)
    half = rotary_dim // 2
    # mrope_section sums to rotary_dim/2 (T gets the remainder, like [11,11,10] for 32)
    s_hw = half // 4 if half >= 4 else 0
    mrope_section = [half - 2 * s_hw, s_hw, s_hw]
    assert sum(mrope_section) == half
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": prf,
        "mrope_section": mrope_section,
        "mrope_interleaved": True,
    }
    text = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters=rope_parameters,
        partial_rotary_factor=prf,
        attention_bias=False,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_num_key_heads=lk,
        linear_num_value_heads=lv,
        layer_types=list(layer_types),
    )
    if moe is not None:
        experts, top_k, width, shared = moe
        del text["intermediate_size"]  # every layer of a qwen3_5_moe model is sparse
        text.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    shared_expert_intermediate_size=shared)
        return Qwen3_5MoeConfig(text_config=text, vision_config=tiny_vision_config(hidden), tie_word_embeddings=tied)
    return Qwen3_5Config(
        text_config=text,
        vision_config=tiny_vision_config(hidden),
        tie_word_embeddings=tied,
    )


def qwen3next_config(**overrides):
    """The tiny Qwen3-Next shape (D64, L L L F, attn 4/2 x 16, GDN k2/v4) with `overrides`."""
    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        partial_rotary_factor=0.25,
        attention_bias=False,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=[LIN, LIN, LIN, FULL],
        decoder_sparse_step=1,
    )
    fields.update(overrides)
    return Qwen3NextConfig(**fields)


def sparse_layers(tcfg):
    """Indices of the decoder layers with a mixture-of-experts MLP, as the HF decoder layers decide."""
    experts = getattr(tcfg, "num_experts", 0) or 0
    if tcfg.model_type == "qwen3_5_moe_text":
        return list(range(tcfg.num_hidden_layers))
    step = getattr(tcfg, "decoder_sparse_step", 1)
    dense = getattr(tcfg, "mlp_only_layers", None) or []
    return [i for i in range(tcfg.num_hidden_layers) if i not in dense and experts > 0 and (i + 1) % step == 0]


def build_configs():
    return {
        "qwen35_gva3": (
            Qwen3_5ForConditionalGeneration,
            qwen35_config(
                hidden=96,
                layer_types=[LIN, LIN, FULL, LIN, LIN, FULL],
                heads=4,
                kv_heads=2,
                head_dim=32,
                prf=0.25,
                lk=2,
                lv=6,
                dk=16,
                dv=24,
                inter=160,
                vocab=512,
                tied=False,
            ),
        ),
        # Head dims that the CUDA kernels take (multiples of 32): the fixture CUDA is checked on.
        "qwen35_gva3_d32": (
            Qwen3_5ForConditionalGeneration,
            qwen35_config(
                hidden=128,
                layer_types=[LIN, LIN, LIN, FULL, LIN, LIN, LIN, FULL],
                heads=4,
                kv_heads=2,
                head_dim=32,
                prf=0.25,
                lk=2,
                lv=6,
                dk=32,
                dv=32,
                inter=256,
                vocab=512,
                tied=False,
            ),
        ),
        "qwen35_gva1_tied": (
            Qwen3_5ForConditionalGeneration,
            qwen35_config(
                hidden=64,
                layer_types=[LIN, FULL, LIN, FULL],
                heads=4,
                kv_heads=1,
                head_dim=16,
                prf=0.5,
                lk=4,
                lv=4,
                dk=16,
                dv=16,
                inter=128,
                vocab=384,
                tied=True,
            ),
        ),
        "qwen3next_dense": (
            Qwen3NextForCausalLM,
            # Dense: a layer gets Qwen3NextMLP iff it is in mlp_only_layers OR num_experts == 0
            # (Qwen3NextDecoderLayer.__init__). We set both.
            qwen3next_config(num_experts=0, mlp_only_layers=[0, 1, 2, 3]),
        ),
        # Every layer sparse; 8 experts, top 2, a gated shared expert; top-k weights renormalised.
        "qwen35_moe": (
            Qwen3_5MoeForConditionalGeneration,
            qwen35_config(
                hidden=64,
                layer_types=[LIN, LIN, LIN, FULL],
                heads=4,
                kv_heads=2,
                head_dim=16,
                prf=0.25,
                lk=2,
                lv=4,
                dk=16,
                dv=16,
                inter=None,
                vocab=256,
                tied=False,
                moe=(8, 2, 32, 48),
            ),
        ),
        # Layers 0, 1, 3 sparse (6 experts, top 3, top-k weights NOT renormalised), layer 2 dense.
        "qwen3next_moe": (
            Qwen3NextForCausalLM,
            qwen3next_config(
                num_experts=6,
                mlp_only_layers=[2],
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
                vocab_size=256,
            ),
        ),
        # Block-FP8 (see FP8_FIXTURES): every quantised linear's dims are multiples of the 128 x 128 scale blocks.
        "qwen35_fp8": (
            Qwen3_5ForConditionalGeneration,
            qwen35_config(
                hidden=128,
                layer_types=[LIN, LIN, FULL, LIN],
                heads=4,
                kv_heads=2,
                head_dim=128,
                prf=0.25,
                lk=2,
                lv=4,
                dk=64,
                dv=64,
                inter=256,
                vocab=512,
                tied=False,
            ),
        ),
    }


# ----------------------------------------------------------------------------------------------
# Weight randomisation
# ----------------------------------------------------------------------------------------------


def _normal(gen, shape, std, mean=0.0):
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


@torch.no_grad()
def randomize_(model, seed, decay="mixed", router_attempt=0):
    """Overwrite every parameter (deterministically, CPU generator, sorted by name). Router weights come
    from their own generator, seeded by (`seed`, `router_attempt`), so redrawing them leaves the rest alone."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    router_gen = torch.Generator(device="cpu")
    router_gen.manual_seed(seed * 1000 + 7 + router_attempt)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # tied params appear once
    out_w = model.get_output_embeddings().weight
    tied_weight = out_w if out_w is model.get_input_embeddings().weight else None
    counts = {}
    for name in sorted(params):
        p = params[name]
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        cls = type(mod).__name__
        shape = tuple(p.shape)
        if leaf == "A_log":
            kind = "A_log"
            val = torch.log(torch.rand(shape, generator=gen) * 15.0 + 1.0)  # log(U(1,16))
            if decay == "mixed":
                # odd value heads: A in U(0.005, 0.1) -> per-token decay exp(g) ~0.9..0.99, so the
                # recurrent state carries information across many tokens / 64-token chunk boundaries
                # (with A in [1,16] alone, exp(g) has median ~0.005: the state forgets within 1-2 tokens).
                slow = torch.log(torch.rand(shape, generator=gen) * 0.095 + 0.005)
                val[1::2] = slow[1::2]
        elif leaf == "dt_bias":
            kind = "dt_bias"
            val = _normal(gen, shape, 0.5)
        elif "RMSNormGated" in cls:  # linear_attn.norm: plain weight
            kind = "gated_norm"
            val = _normal(gen, shape, 0.3, mean=1.0)
        elif "RMSNorm" in cls:  # zero-centred (1 + w) norms
            kind = "rmsnorm_1p"
            val = _normal(gen, shape, 0.3)
        elif isinstance(mod, torch.nn.Conv1d) and leaf == "weight":
            kind = "conv1d"
            val = _normal(gen, shape, 0.5)
        elif cls.endswith("Experts") and leaf in ("gate_up_proj", "down_proj"):
            kind = "experts"  # [E, out, in] stacked linears
            val = _normal(gen, shape, 1.0 / math.sqrt(shape[-1]))
        elif cls.endswith("TopKRouter") and leaf == "weight":
            kind = "router"
            val = _normal(router_gen, shape, ROUTER_STD_SCALE / math.sqrt(shape[-1]))
        elif isinstance(mod, torch.nn.Embedding):
            kind = "embedding"
            # normal(0,1); but when tied to lm_head that gives logits with std ~sqrt(hidden) and a
            # degenerate greedy trace (one token repeated), so use std 2/sqrt(hidden) there.
            std = 2.0 / math.sqrt(shape[1]) if p is tied_weight else 1.0
            val = _normal(gen, shape, std)
        elif isinstance(mod, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Conv2d)) and leaf == "weight":
            kind = "linear"
            fan_in = p[0].numel()
            val = _normal(gen, shape, 1.0 / math.sqrt(fan_in))
        elif isinstance(mod, torch.nn.LayerNorm) and leaf == "weight":
            kind = "layernorm_w"
            val = _normal(gen, shape, 0.1, mean=1.0)
        elif leaf == "bias":
            kind = "bias"
            val = _normal(gen, shape, 0.1)
        else:
            raise RuntimeError(f"don't know how to randomise {name} ({cls}, {shape})")
        p.copy_(val.to(p.dtype))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ----------------------------------------------------------------------------------------------
# Reference computation
# ----------------------------------------------------------------------------------------------


def fast_path_modules():
    """Optional packages HF would use instead of its torch reference code."""
    return {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "kernels")}


def set_fp32_strict():
    # no TF32 anywhere (cuBLAS matmul + cuDNN conv)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except Exception:
        pass
    try:
        torch.set_float32_matmul_precision("highest")
    except Exception:
        pass


@torch.no_grad()
def gdn_decay_stats(model, ids, device):
    """median / mean / fraction>0.9 of exp(g) per GDN layer and per value head (median)."""
    stats, handles = [], []

    def hook(mod, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        if hasattr(mod, "in_proj_a"):  # qwen3_5
            a = mod.in_proj_a(h)
        else:  # qwen3_next packed projections
            _, _, _, _, _, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(h), mod.in_proj_ba(h))
        d = (-mod.A_log.float().exp() * torch.nn.functional.softplus(a.float() + mod.dt_bias)).exp()[0]  # [T,Hv]
        stats.append({
            "layer": mod.layer_idx,
            "median": round(d.median().item(), 4),
            "mean": round(d.mean().item(), 4),
            "frac_gt_0.9": round((d > 0.9).float().mean().item(), 4),
            "per_head_median": [round(x, 4) for x in d.median(0).values.tolist()],
        })

    for mod in model.modules():
        if type(mod).__name__.endswith("GatedDeltaNet"):
            handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        full_forward_logits(model, ids, device)
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def router_margin(model, prompts, device):
    """Smallest gap, over every token of `prompts` and every sparse layer, between the router logits of
    the k-th and (k+1)-th expert: how far the top-k choice is from a tie that rounding could flip."""
    gaps, handles = [], []

    def hook(mod, args, out):
        logits = out[0].float()
        top = logits.topk(mod.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min().item())

    for mod in model.modules():
        if type(mod).__name__.endswith("TopKRouter"):
            handles.append(mod.register_forward_hook(hook))
    try:
        for ids in prompts:
            full_forward_logits(model, ids, device)
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


@torch.no_grad()
def full_forward_logits(model, ids, device):
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=False)
    return out.logits[0].float().cpu().contiguous()


@torch.no_grad()
def quantize_fp8(cls, mdir):
    """Rewrites the bf16 checkpoint in `mdir` as transformers' block-FP8 checkpoint: loaded with
    FineGrainedFP8Config (weights quantised on a CUDA GPU) and saved with save_pretrained."""
    from transformers import FineGrainedFP8Config

    if not torch.cuda.is_available():
        raise RuntimeError("FP8 fixtures are quantised by transformers on a CUDA GPU (compute capability >= 8.9)")
    qcfg = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=FP8_NOT_CONVERTED)
    q = cls.from_pretrained(mdir, dtype=torch.bfloat16, quantization_config=qcfg, device_map="cuda")
    tmp = mdir + ".fp8"
    q.save_pretrained(tmp)
    del q
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(mdir, f))
    os.rmdir(tmp)


def check_fp8_weights(mdir, sd, orig):
    """Each saved FP8 linear's reloaded float32 weight against code * its block's scale_inv, computed here,
    and its distance from the bf16 original; raises where transformers' dequantisation differs."""
    saved = load_file(os.path.join(mdir, "model.safetensors"))
    quantized, worst_rel, worst = [], 0.0, ""
    for k, v in saved.items():
        if v.dtype != torch.float8_e4m3fn:
            continue
        scale = saved[k + "_scale_inv"].float()
        rows, cols = v.shape
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        want = v.float() * full
        if k not in sd:
            raise RuntimeError(f"{k}: FP8 linear missing from the reloaded model")
        if not torch.equal(sd[k].cpu(), want):
            raise RuntimeError(f"{k}: dequantised by transformers != code * scale_inv (max diff "
                               f"{(sd[k].cpu() - want).abs().max().item():.3g})")
        ref = orig[k].to(torch.bfloat16).float()
        rel = ((want - ref).norm() / ref.norm()).item()
        if rel > worst_rel:
            worst_rel, worst = rel, k
        quantized.append(k)
    if not quantized:
        raise RuntimeError(f"{mdir}: no FP8 linear saved")
    return {"quantized": quantized, "max_l2_rel_err_vs_bf16_weights": worst_rel, "worst_weight": worst,
            "dequantised_equals_code_times_scale": True}


def make_one(name, cls, config, out_root, device, seed, decay, log):
    """Writes fixture `name`; a mixture-of-experts model is redrawn (router weights only) until every
    routed token's top-k choice clears MIN_ROUTER_GAP."""
    for attempt in range(ROUTER_ATTEMPTS):
        size = make_attempt(name, cls, config, out_root, device, seed, decay, log, attempt)
        if size is not None:
            return size
    raise RuntimeError(f"{name}: no router draw in {ROUTER_ATTEMPTS} attempts clears a top-k gap of {MIN_ROUTER_GAP}")


@torch.no_grad()
def make_attempt(name, cls, config, out_root, device, seed, decay, log, router_attempt):
    t0 = time.time()
    mdir = os.path.join(out_root, name)
    os.makedirs(mdir, exist_ok=True)

    # 1. build fp32 on CPU, randomise, save bf16
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    counts = randomize_(model, seed, decay, router_attempt)
    orig = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(mdir)
    del model
    fp8 = name in FP8_FIXTURES
    if fp8:
        quantize_fp8(cls, mdir)

    # 2. reload fp32 / eager on device (FP8: dequantised to float32 by transformers)
    load_kw = {}
    if fp8:
        from transformers import FineGrainedFP8Config

        load_kw["quantization_config"] = FineGrainedFP8Config(
            dequantize=True, weight_block_size=[128, 128], modules_to_not_convert=FP8_NOT_CONVERTED
        )
    model = cls.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager", **load_kw).to(device).eval()
    # checks: reloaded weights == bf16(rounded) originals; FP8 linears == code * block scale
    sd = model.state_dict()
    fp8_checks = check_fp8_weights(mdir, sd, orig) if fp8 else {}
    for k, v in orig.items():
        if k not in sd:
            raise RuntimeError(f"{name}: {k} missing after reload")
        if k in fp8_checks.get("quantized", []):
            continue
        exp = v.to(torch.bfloat16).to(torch.float32)
        if sd[k].dtype != torch.float32 or not torch.equal(sd[k].cpu(), exp):
            raise RuntimeError(f"{name}: {k} not equal to bf16-rounded original after reload")
    tcfg = model.config.get_text_config()
    vocab = tcfg.vocab_size
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if tied != bool(tcfg.tie_word_embeddings):
        raise RuntimeError(f"{name}: tie mismatch (tied={tied}, config={tcfg.tie_word_embeddings})")
    sparse = sparse_layers(tcfg)
    text_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    for i, layer in enumerate(text_model.layers):
        got_sparse = type(layer.mlp).__name__.endswith("SparseMoeBlock")
        if got_sparse != (i in sparse):
            raise RuntimeError(f"{name}: layer {i} mlp is {type(layer.mlp).__name__}, want sparse={i in sparse}")
    rot = text_model.rotary_emb
    prf = tcfg.rope_parameters["partial_rotary_factor"]
    rotary_dim = 2 * rot.inv_freq.numel()
    if rotary_dim != int(tcfg.head_dim * prf):
        raise RuntimeError(f"{name}: rotary dim {rotary_dim} != head_dim*prf {tcfg.head_dim}*{prf}")
    saved = load_file(os.path.join(mdir, "model.safetensors"))
    saved_dtypes = sorted({str(v.dtype) for v in saved.values()})

    # 3. prompts: full forward, no cache
    pgen = torch.Generator(device="cpu")
    pgen.manual_seed(seed + 1000)
    tensors, prompts, summary = {}, [], []
    prompt_lens = MOE_PROMPT_LENS if sparse else PROMPT_LENS
    for T in prompt_lens:
        ids = torch.randint(0, vocab, (T,), generator=pgen, dtype=torch.long)
        lg = full_forward_logits(model, ids.tolist(), device)
        assert lg.shape == (T, vocab), lg.shape
        if not torch.isfinite(lg).all():
            raise RuntimeError(f"{name}: non-finite logits for T={T}")
        tensors[f"logits_{T}"] = lg
        tensors[f"input_ids_{T}"] = ids.contiguous()
        prompts.append({"len": T, "ids": ids.tolist()})
        summary.append(f"logits_{T} {list(lg.shape)} max|.|={lg.abs().max().item():.3f} std={lg.std().item():.3f}")

    # per GDN layer, per-token decay exp(g) statistics on the 300-token prompt (informational)
    checks_decay = gdn_decay_stats(model, prompts[prompt_lens.index(300)]["ids"], device)

    # 4. greedy decode via generate (chunked prefill + recurrent one-token decode with caches)
    prompt_ids = prompts[prompt_lens.index(DECODE_PROMPT_LEN)]["ids"]
    inp = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    gcfg = model.generation_config
    gcfg.eos_token_id = None  # no eos in these configs anyway; make sure all 24 steps run
    gcfg.pad_token_id = None
    gcfg.bos_token_id = None
    gout = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=DECODE_STEPS,
        min_new_tokens=DECODE_STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    seq = gout.sequences[0].cpu()
    generated = seq[DECODE_PROMPT_LEN:].tolist()
    if len(generated) != DECODE_STEPS or len(gout.logits) != DECODE_STEPS:
        raise RuntimeError(f"{name}: generate produced {len(generated)} tokens / {len(gout.logits)} logits")
    dec = torch.stack([lg[0].float().cpu() for lg in gout.logits]).contiguous()  # [24, V]
    argmax_ok = dec.argmax(-1).tolist() == generated
    tensors["decode_logits"] = dec
    tensors["decode_ids"] = seq.contiguous()
    summary.append(f"decode_logits {list(dec.shape)} max|.|={dec.abs().max().item():.3f}")

    # self-checks (recorded, not fatal): cached decode vs full no-cache forward over the same tokens
    full = full_forward_logits(model, seq[: DECODE_PROMPT_LEN + DECODE_STEPS - 1].tolist(), device)
    full_tail = full[DECODE_PROMPT_LEN - 1 :]
    checks = {
        "generated_equals_argmax_of_decode_logits": argmax_ok,
        "max_abs_diff_decode_vs_full_forward": (dec - full_tail).abs().max().item(),
        "max_abs_diff_decode0_vs_logits_37_last": (dec[0] - tensors["logits_37"][-1]).abs().max().item(),
        "gdn_decay_exp_g_on_prompt_300": checks_decay,
    }
    if fp8:
        checks["fp8"] = {k: v for k, v in fp8_checks.items() if k != "quantized"}
        checks["fp8"]["quantized_linears"] = len(fp8_checks["quantized"])
    if sparse:
        margin = router_margin(model, [p["ids"] for p in prompts] + [seq.tolist()], device)
        log(f"   router draw {router_attempt}: smallest top-k logit gap {margin:.2e}")
        if margin < MIN_ROUTER_GAP:
            return None
        checks["min_router_logit_gap_topk"] = margin
        checks["router_draw"] = router_attempt

    # 5. write
    save_file(tensors, os.path.join(mdir, "reference.safetensors"))
    meta = {
        "name": name,
        "model_class": type(model).__name__,
        "model_type": model.config.model_type,
        "text_model_type": tcfg.model_type,
        "vocab_size": vocab,
        "layer_types": list(tcfg.layer_types),
        "sparse_layers": sparse,
        "tie_word_embeddings": bool(tied),
        "rotary_dim": rotary_dim,
        "prompts": prompts,
        "decode": {
            "prompt_len": DECODE_PROMPT_LEN,
            "generated": generated,
            "steps": DECODE_STEPS,
            "how": "model.generate(do_sample=False, use_cache=True, output_logits=True); "
            "decode_logits[i] = raw logits that produced generated[i] (row 0 = prefill last position)",
        },
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()},
        "self_checks": checks,
        "weights": {
            "file": "model.safetensors",
            "dtypes": saved_dtypes,
            "num_tensors": len(saved),
            "randomised_param_kinds": counts,
            "init": {
                "linear/conv3d weight": "normal(0, 1/sqrt(fan_in))",
                "embedding": "normal(0, 1); tied models: normal(0, 2/sqrt(hidden))",
                "RMSNorm (1+w) weights": "normal(0, 0.3)",
                "linear_attn.norm.weight": "1 + normal(0, 0.3)",
                "linear_attn.conv1d.weight": "normal(0, 0.5)",
                "A_log": "log(uniform(1, 16))" if decay == "spec"
                else "log(uniform(1, 16)) for even value heads, log(uniform(0.005, 0.1)) for odd value heads",
                "dt_bias": "normal(0, 0.5)",
                "experts gate_up_proj / down_proj [E, out, in]": "normal(0, 1/sqrt(in))",
                "router (mlp.gate.weight)": f"normal(0, {ROUTER_STD_SCALE}/sqrt(hidden))",
                "vision LayerNorm weight / biases": "1 + normal(0, 0.1) / normal(0, 0.1)",
            },
        },
        "metadata": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "device": str(device),
            "device_name": torch.cuda.get_device_name(0) if str(device).startswith("cuda") else "cpu",
            "compute_dtype": "float32",
            "weights_dtype": "float8_e4m3fn with 128x128 block scales (FineGrainedFP8Config) for the decoder linears, "
            "bfloat16 for the rest (saved); dequantised / upcast to float32 by transformers for the reference"
            if fp8 else "bfloat16 (saved), upcast to float32 for the reference",
            "attn_implementation": model.config._attn_implementation,
            "optional_fast_path_modules_importable": fast_path_modules(),
            "tf32": {
                "matmul": torch.backends.cuda.matmul.allow_tf32,
                "cudnn": torch.backends.cudnn.allow_tf32,
            },
            "seed": seed,
            "decay_mode": decay,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "script": "scripts/hf_fixtures.py",
        },
    }
    with open(os.path.join(mdir, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")

    size = sum(os.path.getsize(os.path.join(mdir, f)) for f in os.listdir(mdir))
    log(f"== {name} ({type(model).__name__}, {len(saved)} weight tensors {saved_dtypes}, {size/1e6:.2f} MB, "
        f"{time.time()-t0:.1f}s)")
    for s in summary:
        log("   " + s)
    log(f"   generated: {generated}")
    log("   checks: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in checks.items() if not k.startswith("gdn_")))
    log("   GDN exp(g) per-head medians: " + "; ".join(
        f"L{s['layer']}: " + " ".join(f"{x:.2f}" for x in s["per_head_median"]) for s in checks["gdn_decay_exp_g_on_prompt_300"]))
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*", help="subset of model names")
    ap.add_argument("--decay", default="mixed", choices=["mixed", "spec"],
                    help="A_log init: 'spec' = log(U(1,16)) for all heads (fast forgetting); "
                         "'mixed' (default) = odd value heads get slow decay so long-range state matters")
    ap.add_argument("--allow-fast-paths", action="store_true",
                    help="don't abort if fla / causal_conv1d are importable (reference would not be the torch fp32 path)")
    args = ap.parse_args()

    fp = fast_path_modules()
    if (fp["fla"] or fp["causal_conv1d"]) and not args.allow_fast_paths:
        sys.exit(f"refusing: optional fast-path packages importable: {fp} (HF would use them); "
                 "run in an env without them or pass --allow-fast-paths")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch.cuda.is_available() is False")
    set_fp32_strict()
    device = torch.device(args.device)

    configs = build_configs()
    names = args.only or list(configs)
    os.makedirs(args.out, exist_ok=True)
    total = 0
    # (Each fixture's seed is seed + 100 * its index here: new fixtures go last, so the others keep theirs.)
    for i, name in enumerate(configs):
        if name not in names:
            continue
        cls, cfg = configs[name]
        total += make_one(name, cls, cfg, args.out, device, args.seed + 100 * i, args.decay, print)
    print(f"total output: {total/1e6:.2f} MB in {os.path.abspath(args.out)}  "
          f"(transformers {transformers.__version__}, torch {torch.__version__}, device {device})")


if __name__ == "__main__":
    main()
