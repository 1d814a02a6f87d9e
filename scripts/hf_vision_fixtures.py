#!/usr/bin/env python3
"""Image fixtures: a tiny random Qwen3.5 with a vision tower, images, and HF's reference numbers.

Usage:
    python3 scripts/hf_vision_fixtures.py --out DIR [--device cpu|cuda] [--seed 4321]

Writes DIR/qwen35_vision/:
    config.json, generation_config.json, model.safetensors, preprocessor_config.json  (bf16, real HF names)
    image_a.png, image_b.png        the two images of the prompt (a needs no resize, b does)
    reference.safetensors           input_ids [T] i64, pixel_values [P, 3*2*16*16] f32, image_grid_thw [2,3] i64,
                                    position_ids [3,T] i64, patch_embeds [P, Dv], block0 [P, Dv],
                                    image_embeds [P/4, D] f32, logits [T,V] f32,
                                    decode_ids [T+8] i64, decode_logits [8,V] f32 (greedy, cached decode)
    reference.json                  the prompt layout, grids, rope deltas, versions, processor class
and DIR/image_preprocess/: images of several sizes and formats with the processor settings each used and HF's
pixel_values and grids (preprocess.safetensors: NAME.pixel_values, NAME.image_grid_thw; cases.json), to check decoding and smart-resize alone.

The model runs in fp32 (bf16-rounded weights reloaded) with eager attention, as scripts/hf_fixtures.py does.
"""

import argparse
import io
import json
import os
import struct
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_fixtures as base  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3_5ForConditionalGeneration  # noqa: E402

LIN, FULL = base.LIN, base.FULL
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
PATCH, TEMPORAL, MERGE = 16, 2, 2
DECODE_STEPS = 8


def vision_config(out_hidden):
    return dict(depth=2, hidden_size=144, num_heads=2, intermediate_size=288, out_hidden_size=out_hidden,
                patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3,
                num_position_embeddings=64, hidden_act="gelu_pytorch_tanh")


def model_config():
    cfg = base.qwen35_config(hidden=128, layer_types=[LIN, LIN, LIN, FULL], heads=4, kv_heads=2, head_dim=32,
                             prf=0.25, lk=2, lv=4, dk=32, dv=32, inter=256, vocab=512, tied=False)
    cfg.vision_config = type(cfg.vision_config)(**vision_config(128))
    cfg.image_token_id, cfg.video_token_id = IMAGE_TOKEN, VIDEO_TOKEN
    cfg.vision_start_token_id, cfg.vision_end_token_id = VISION_START, VISION_END
    return cfg


def png_bytes(rgb):
    """A plain 8-bit RGB PNG (no PIL needed)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def test_image(h, w, seed):
    """Smooth gradients plus noise: resampling differences show, and the image is not constant."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], -1).astype(np.int32)
    img = img + rng.integers(-40, 41, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def decode(data):
    """Decoded RGB array as HF users feed it (PIL when installed; our own PNGs are raw RGB)."""
    try:
        from PIL import Image

        return np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    except ImportError:
        return None


def processors(min_px, max_px):
    """Every Qwen2-VL image processor class this transformers has, configured as Qwen3.5's."""
    kw = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE, image_mean=[0.5, 0.5, 0.5],
              image_std=[0.5, 0.5, 0.5], size={"shortest_edge": min_px, "longest_edge": max_px})
    out = {}
    for name in ("Qwen2VLImageProcessorFast", "Qwen2VLImageProcessor"):
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            out[name] = cls(**kw)
        except Exception as e:  # missing torchvision / PIL
            print(f"   {name}: not usable ({e})")
    if not out:
        sys.exit("no Qwen2-VL image processor could be built")
    return out


def run_processor(proc, rgb):
    res = proc(images=[rgb], return_tensors="pt")
    return res["pixel_values"].float().contiguous(), res["image_grid_thw"].long().contiguous()


def preprocess_fixture(out_root):
    """Decoding and smart-resize alone, at sizes that need no resize, rounding, upscaling and downscaling."""
    d = os.path.join(out_root, "image_preprocess")
    os.makedirs(d, exist_ok=True)
    cases = [  # (name, h, w, min_px, max_px, format)
        ("exact", 64, 96, 32 * 32, 256 * 256, "png"),
        ("round", 75, 50, 32 * 32, 256 * 256, "png"),
        ("upscale", 30, 40, 96 * 96, 256 * 256, "png"),
        ("downscale", 150, 200, 32 * 32, 96 * 96, "png"),
        ("jpeg", 64, 64, 32 * 32, 256 * 256, "jpeg"),
    ]
    tensors, meta = {}, []
    for i, (name, h, w, min_px, max_px, fmt) in enumerate(cases):
        rgb = test_image(h, w, 100 + i)
        if fmt == "png":
            data = png_bytes(rgb)
        else:
            try:
                from PIL import Image
            except ImportError:
                print("   jpeg case skipped: no PIL")
                continue
            buf = io.BytesIO()
            Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
            data = buf.getvalue()
        fname = f"{name}.{fmt}"
        with open(os.path.join(d, fname), "wb") as f:
            f.write(data)
        dec = decode(data)
        if dec is None:
            dec = rgb
        entry = {"name": name, "file": fname, "height": h, "width": w, "min_pixels": min_px, "max_pixels": max_px,
                 "processors": {}}
        first = None
        for pname, proc in processors(min_px, max_px).items():
            pv, grid = run_processor(proc, dec)
            if first is None:  # the reference: the class AutoImageProcessor picks
                first = pv
                tensors[f"{name}.pixel_values"] = pv
                tensors[f"{name}.image_grid_thw"] = grid
                entry["reference"] = pname
            diff = (pv - first).abs().max().item() if pv.shape == first.shape else None
            entry["processors"][pname] = {"grid_thw": grid[0].tolist(), "patches": pv.shape[0],
                                          "max_abs_diff_to_reference": diff}
        meta.append(entry)
        print(f"   preprocess {name}: {h}x{w} -> {entry['processors']}")
    save_file(tensors, os.path.join(d, "preprocess.safetensors"))
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump({"cases": meta, "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                   "transformers": transformers.__version__}, f, indent=1)


class Capture:
    """Forward hooks that keep one module's output (first call) or its keyword inputs."""

    def __init__(self):
        self.out, self.handles = {}, []

    def output(self, name, module):
        def hook(mod, args, out):
            if name not in self.out:
                t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
                self.out[name] = t.detach().float().cpu().contiguous()

        self.handles.append(module.register_forward_hook(hook))

    def position_ids(self, module):
        def hook(mod, args, kwargs):
            pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            if pos is not None and "position_ids" not in self.out:
                self.out["position_ids"] = pos.detach().long().cpu().contiguous()

        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def model_fixture(out_root, device, seed):
    t0 = time.time()
    mdir = os.path.join(out_root, "qwen35_vision")
    os.makedirs(mdir, exist_ok=True)
    cfg = model_config()
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.float32)
    base.randomize_(model, seed)
    model.to(torch.bfloat16).save_pretrained(mdir)
    del model
    model = Qwen3_5ForConditionalGeneration.from_pretrained(mdir, dtype=torch.float32,
                                                            attn_implementation="eager").to(device).eval()

    min_px, max_px = 32 * 32, 256 * 256
    procs = processors(min_px, max_px)
    pname = next(iter(procs))
    proc = procs[pname]
    proc.save_pretrained(mdir)
    images = {"image_a.png": test_image(128, 192, 7), "image_b.png": test_image(75, 50, 8)}
    pvs, grids = [], []
    for fname, rgb in images.items():
        data = png_bytes(rgb)
        with open(os.path.join(mdir, fname), "wb") as f:
            f.write(data)
        pv, grid = run_processor(proc, rgb)
        pvs.append(pv)
        grids.append(grid)
    pixel_values = torch.cat(pvs)
    grid_thw = torch.cat(grids)
    n_tokens = [int(g.prod().item()) // (MERGE * MERGE) for g in grid_thw]

    gen = torch.Generator().manual_seed(seed)
    text = [torch.randint(0, 490, (n,), generator=gen).tolist() for n in (5, 7, 9)]
    ids = (text[0] + [VISION_START] + [IMAGE_TOKEN] * n_tokens[0] + [VISION_END] + text[1]
           + [VISION_START] + [IMAGE_TOKEN] * n_tokens[1] + [VISION_END] + text[2])
    x = torch.tensor([ids], device=device)
    mm = (x == IMAGE_TOKEN).int()  # the processor's mm_token_type_ids: 1 for image tokens
    pv_dev, grid_dev = pixel_values.to(device), grid_thw.to(device)

    cap = Capture()
    visual = model.model.visual
    cap.output("patch_embeds", visual.patch_embed)
    cap.output("block0", visual.blocks[0])
    cap.output("image_embeds", visual.merger)
    cap.position_ids(model.model.language_model.rotary_emb)
    out = model(input_ids=x, pixel_values=pv_dev, image_grid_thw=grid_dev, mm_token_type_ids=mm, use_cache=False)
    cap.remove()
    logits = out.logits[0].float().cpu().contiguous()

    rope = {}
    try:
        pos, deltas = model.model.get_rope_index(x, mm, grid_dev, None, attention_mask=torch.ones_like(x))
        rope = {"get_rope_index": pos[:, 0].cpu().tolist() == cap.out["position_ids"][:, 0].tolist()
                if "position_ids" in cap.out and cap.out["position_ids"].dim() == 3 else None,
                "rope_deltas": deltas.cpu().flatten().tolist()}
        cap.out.setdefault("position_ids", pos.detach().long().cpu())
    except Exception as e:
        rope = {"get_rope_index_error": repr(e)}
    position_ids = cap.out["position_ids"]
    if position_ids.dim() == 3:  # [3 or 4, B, T]: keep the (t, h, w) rows
        position_ids = position_ids[-3:, 0]

    g = model.generate(input_ids=x, pixel_values=pv_dev, image_grid_thw=grid_dev, mm_token_type_ids=mm,
                       max_new_tokens=DECODE_STEPS,
                       do_sample=False, output_logits=True, return_dict_in_generate=True)
    decode_ids = g.sequences[0].cpu()
    decode_logits = torch.stack([lg[0].float().cpu() for lg in g.logits])
    checks = {
        "decode0_vs_full_forward_last": (decode_logits[0] - logits[-1]).abs().max().item(),
        "generated_equals_argmax": decode_ids[len(ids):].tolist() == decode_logits.argmax(-1).tolist(),
    }

    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "pixel_values": pixel_values,
        "image_grid_thw": grid_thw,
        "position_ids": position_ids.contiguous(),
        "logits": logits,
        "decode_ids": decode_ids.long().contiguous(),
        "decode_logits": decode_logits.contiguous(),
    }
    for k in ("patch_embeds", "block0", "image_embeds"):
        if k in cap.out:
            tensors[k] = cap.out[k]
    save_file(tensors, os.path.join(mdir, "reference.safetensors"))
    meta = {
        "layout": {"text": [len(t) for t in text], "image_tokens": n_tokens, "images": list(images),
                   "image_sizes_hw": [list(v.shape[:2]) for v in images.values()]},
        "image_grid_thw": grid_thw.tolist(),
        "processor": {"class": pname, "min_pixels": min_px, "max_pixels": max_px},
        "token_ids": {"image": IMAGE_TOKEN, "video": VIDEO_TOKEN, "vision_start": VISION_START,
                      "vision_end": VISION_END},
        "rope": rope,
        "self_checks": checks,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "device": str(device),
        "seed": seed,
    }
    with open(os.path.join(mdir, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"== qwen35_vision: T={len(ids)} images {grid_thw.tolist()} -> {n_tokens} tokens, processor {pname}, "
          f"{time.time() - t0:.1f}s\n   checks {checks}\n   rope {rope}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    base.set_fp32_strict()
    os.makedirs(args.out, exist_ok=True)
    preprocess_fixture(args.out)
    model_fixture(args.out, torch.device(args.device), args.seed)


if __name__ == "__main__":
    main()
