"""Self-Forcing-style video generation with a diffusers ``WanTransformer3DModel`` on kvarena.

Chunk by chunk, as Self-Forcing's ``CausalInferencePipeline`` does: a few denoising steps
on the chunk's noise (``clean=False``: nothing is written), then one clean pass at
timestep ``context_noise`` that commits the chunk's K/V (``clean=True``); the next chunk
attends to the committed ones through the slab cache (sinks + window, RoPE by absolute
frame). The scheduler is Self-Forcing's (flow matching, shift 5, its warped 4-step list).

    python examples/diffusers_self_forcing.py                   # a tiny random model, CPU, seconds
    python examples/diffusers_self_forcing.py --model self_forcing_dmd.pt \\
        --prompt-embeds prompt.pt --vae Wan2.1-T2V-1.3B-Diffusers --out frames/ \\
        --frames 21 --height 60 --width 104 --device cuda --dtype bfloat16

``--model`` takes a Self-Forcing / CausVid / Wan checkpoint (``.pt`` / ``.safetensors``,
converted with ``kvarena.integrations.diffusers.convert_self_forcing_state_dict``) or a
diffusers model folder. ``--prompt-embeds`` is a saved ``[L, text_dim]`` (or ``[B, L,
text_dim]``) UMT5 embedding; padded with zeros to ``--text-len`` (512), as both Self-Forcing
and diffusers' ``WanPipeline`` do. Without one the prompt is random (the tiny model has no
text encoder). With ``--vae`` (a diffusers ``AutoencoderKLWan`` folder) frames are written
to ``--out`` as PNG files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvarena.integrations.diffusers import (
    CausalWanRollout,
    convert_self_forcing_state_dict,
    wan_config_from_state_dict,
)

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=1024)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Self-Forcing/CausVid/Wan checkpoint file or diffusers folder (default: tiny random)")
    p.add_argument("--prompt-embeds", help="a saved [L, text_dim] prompt embedding (default: random)")
    p.add_argument("--vae", help="a diffusers AutoencoderKLWan folder: decode and write frames to --out")
    p.add_argument("--out", default="self_forcing_frames", help="where frames go (with --vae)")
    p.add_argument("--frames", type=int, default=21, help="latent frames to generate")
    p.add_argument("--num-frame-per-block", type=int, default=3)
    p.add_argument("--local-attn-size", type=int, default=-1, help="window in frames, sink included (-1: global)")
    p.add_argument("--sink-size", type=int, default=0)
    p.add_argument("--height", type=int, default=6, help="latent height (60 for 480p)")
    p.add_argument("--width", type=int, default=10, help="latent width (104 for 832 px)")
    p.add_argument("--text-len", type=int, default=512, help="prompt padding length (with --prompt-embeds)")
    p.add_argument("--steps", default="1000,750,500,250", help="Self-Forcing's denoising_step_list (warped)")
    p.add_argument("--context-noise", type=float, default=0.0, help="timestep of the clean pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="one line per chunk instead of a progress bar")
    return p.parse_args(argv)


class FlowMatch:
    """Self-Forcing's ``FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True)`` at 1000 steps."""

    def __init__(self, shift: float = 5.0, steps: int = 1000) -> None:
        s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
        self.sigmas = shift * s / (1 + (shift - 1) * s)
        self.timesteps = self.sigmas * 1000

    def warped(self, step_list: list[int]) -> list[float]:
        """``warp_denoising_step``: Self-Forcing's 1000/750/500/250 mapped onto the shifted schedule."""
        ext = torch.cat([self.timesteps, torch.zeros(1, dtype=torch.float64)])
        return [float(ext[1000 - s]) for s in step_list]

    def sigma(self, t: float) -> float:
        return float(self.sigmas[(self.timesteps - t).abs().argmin()]) if t > 0 else 0.0

    def x0(self, flow: torch.Tensor, xt: torch.Tensor, t: float) -> torch.Tensor:
        return (xt.double() - self.sigma(t) * flow.double()).to(xt.dtype)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: float) -> torch.Tensor:
        s = self.sigma(t)
        return ((1 - s) * x0.double() + s * noise.double()).to(x0.dtype)


def load_transformer(args: argparse.Namespace, dtype: torch.dtype):
    from diffusers import WanTransformer3DModel

    if args.model is None:
        torch.manual_seed(args.seed)
        model = WanTransformer3DModel(**TINY).eval()
        return model if dtype == torch.float32 else model.to(dtype)
    if os.path.isdir(args.model):
        sub = "transformer" if os.path.isdir(os.path.join(args.model, "transformer")) else None
        return WanTransformer3DModel.from_pretrained(args.model, subfolder=sub, torch_dtype=dtype).eval()
    if args.model.endswith(".safetensors"):
        from safetensors.torch import load_file

        raw = load_file(args.model)
    else:
        raw = torch.load(args.model, map_location="cpu", weights_only=True)
    sd = convert_self_forcing_state_dict(raw)
    with torch.device("meta"):
        model = WanTransformer3DModel(**wan_config_from_state_dict(sd))
    model.load_state_dict(sd, strict=True, assign=True)
    return model.to(dtype).eval()


def prompt_embedding(args: argparse.Namespace, text_dim: int, device, dtype) -> torch.Tensor:
    if args.prompt_embeds is None:
        return torch.randn(1, 7, text_dim, generator=torch.Generator().manual_seed(args.seed + 1)).to(device, dtype)
    emb = torch.load(args.prompt_embeds, map_location="cpu", weights_only=True)
    emb = emb[None] if emb.dim() == 2 else emb
    pad = max(0, args.text_len - emb.shape[1])  # padding attended, not stripped (as in both codebases)
    return torch.nn.functional.pad(emb, (0, 0, 0, pad)).to(device, dtype)


def generate(model, rollout: CausalWanRollout, args, emb: torch.Tensor, report) -> torch.Tensor:
    """Self-Forcing's temporal loop; returns the latents ``[1, C, F, H, W]``."""
    sched = FlowMatch()
    steps = sched.warped([int(s) for s in args.steps.split(",")])
    fpc, dev, dt = args.num_frame_per_block, emb.device, emb.dtype
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    c = model.config.in_channels
    chunks, out = [], []
    start = 0
    while start < args.frames:
        chunks.append(min(fpc, args.frames - start) if start else min(fpc, args.frames))
        start += chunks[-1]
    if any(f != fpc for f in chunks[1:]):
        raise SystemExit(f"--frames: {args.frames} is not a whole number of {fpc}-frame chunks")
    start = 0
    for i, f in enumerate(chunks):
        x = torch.randn(1, c, f, args.height, args.width, generator=gen).to(dev, dt)
        for k, t in enumerate(steps):
            with rollout.step(start_frame=start, clean=False):
                flow = model(hidden_states=x, timestep=torch.full((1,), t, device=dev), encoder_hidden_states=emb,
                             return_dict=False)[0]
            x0 = sched.x0(flow, x, t)
            if k + 1 < len(steps):
                x = sched.add_noise(x0, torch.randn(x0.shape, generator=gen).to(dev, dt), steps[k + 1])
        with rollout.step(start_frame=start, clean=True):  # commit the chunk's clean K/V
            model(hidden_states=x0, timestep=torch.full((1,), args.context_noise, device=dev),
                  encoder_hidden_states=emb, return_dict=False)
        out.append(x0)
        start += f
        report(i, len(chunks), rollout.used_bytes)
    return torch.cat(out, dim=2)


def write_frames(latents: torch.Tensor, vae_path: str, out_dir: str) -> int:
    from diffusers import AutoencoderKLWan
    from PIL import Image

    sub = "vae" if os.path.isdir(os.path.join(vae_path, "vae")) else None
    vae = AutoencoderKLWan.from_pretrained(vae_path, subfolder=sub, torch_dtype=torch.float32).to(latents.device)
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device)
    with torch.no_grad():
        video = vae.decode(latents.float() * std + mean, return_dict=False)[0]  # [1, 3, T, H, W] in [-1, 1]
    frames = ((video[0].permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
    os.makedirs(out_dir, exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray(frame).save(os.path.join(out_dir, f"frame_{i:04d}.png"))
    return len(frames)


def make_reporter(args, used: list[int]):
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=-(-args.frames // args.num_frame_per_block), unit="chunk", file=sys.stdout)
        except ImportError:
            bar = None

    def report(i: int, n: int, used_bytes: int) -> None:
        used.append(used_bytes)
        if bar is not None:
            bar.set_postfix(kv_mib=f"{used_bytes / 2**20:.2f}")
            bar.update(1)
            if i + 1 == n:
                bar.close()
        print(f"chunk {i + 1}/{n}: self-attention K/V held {used_bytes} bytes", flush=True)

    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    t0 = time.monotonic()
    model = load_transformer(args, dtype).to(args.device)
    emb = prompt_embedding(args, model.config.text_dim, args.device, dtype)
    used: list[int] = []
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=args.num_frame_per_block,
                                           local_attn_size=args.local_attn_size, sink_size=args.sink_size,
                                           max_frames=args.frames) as rollout:
        latents = generate(model, rollout, args, emb, make_reporter(args, used))
    tail = used[-2:]
    if args.local_attn_size == -1:
        print(f"global attention: K/V grow with the frames ({used[0]} -> {used[-1]} bytes)")
    else:
        flat = len(set(tail)) == 1
        print(f"memory flat after the window: {'yes' if flat else 'no'} (last chunks: {tail} bytes)")
    print(f"latents {tuple(latents.shape)} in {time.monotonic() - t0:.1f} s; "
          f"prompt K/V: {rollout.prompt_cache.stats()['misses']} projections")
    if args.vae:
        print(f"wrote {write_frames(latents, args.vae, args.out)} frames to {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
