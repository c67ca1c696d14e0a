"""Goldens of the KIVI authors' quantizer and cache (jy-yuan/KIVI) for tests/unit/test_quantizer_kivi.py.

    python scripts/make_kivi_goldens.py --kivi-repo <a checkout of jy-yuan/KIVI> [--commit <sha>]
        [--out tests/fixtures/kivi/goldens.safetensors]

What runs from the reference (quant/new_pack.py, loaded by path; its Triton kernels are never called, so `triton`
is replaced by a stand-in module whose `jit` returns the function unchanged, only so that the file imports):
- `quant_and_pack_vcache` / `unpack_and_dequant_vcache`: values `[B, H, T, D]`, per token in groups of channels;
  the same two on keys transposed to `[B, H, D, T]` are the pure-torch steps of `triton_quantize_and_pack_along_
  last_dim` (the model's key path: min/max per group of tokens, scale, subtract, divide, clamp, round, pack 32 / b
  codes per int32 along the last dim), which needs CUDA;
- `quant_and_pack_kcache` / `unpack_and_dequant_kcache`: keys `[B, H, T, D]` packed along T (the other key layout
  in the file; the same codes, packed along dim 2).
The cache bookkeeping of `models/llama_kivi.py` (LlamaAttention_KIVI.forward) needs the CUDA GEMV kernels, so its
rules are restated here in prose and applied with the reference quantizer above:
- prefill of n tokens: keys: the first n - n % R quantized (groups of `group` tokens per channel), the last n % R kept
  in full precision (all of them when n < R, none when n % R == 0); values: all but the last R quantized (per token,
  groups of `group` channels), the last R kept (all when n <= R);
- each decode step: the new key joins the full-precision keys and the step attends [dequantized keys, full keys];
  then, when the full keys number exactly R, they are quantized as one block and appended. The new value joins the
  full-precision values, the step attends [dequantized values, full values]; then, when they number R + 1, the
  oldest is quantized (one token) and appended.
The goldens record, at chosen steps, what that step attends (dequantized + full precision, in token order), plus the
quantizer's codes, scales, zeros and packed bytes (the int32 codes viewed as little-endian bytes). Made from commit
876b4d2 of the reference; fp16 (KIVI's dtype) and fp32 inputs. Nothing of the reference is copied into kvbench.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

QUANT_CASES = [  # (name, seed, dtype, bits, group): one [1, 2, 64, 32] key/value pair each
    ("fp16_b2_g32", 0, torch.float16, 2, 32),
    ("fp16_b4_g32", 1, torch.float16, 4, 32),
    ("fp16_b8_g32", 2, torch.float16, 8, 32),
    ("fp32_b2_g32", 3, torch.float32, 2, 32),
    ("fp32_b4_g16", 4, torch.float32, 4, 16),
]
CACHE_CASES = [  # (name, seed, dtype, bits, group, residual, prompt tokens, decode steps, steps recorded)
    ("cache_b2_n100", 10, torch.float16, 2, 32, 32, 100, 40, (1, 28, 29, 40)),  # 100 % 32 = 4 full keys
    ("cache_b4_n64", 11, torch.float16, 4, 32, 64, 64, 3, (1, 3)),  # n % R == 0: every key quantized
    ("cache_b2_n20", 12, torch.float16, 2, 32, 32, 20, 14, (1, 12, 13, 14)),  # n < R: nothing quantized at first
]


def load_reference(repo: Path):
    """quant/new_pack.py as a module, with a stand-in `triton` (the kernels it defines are never run here)."""
    stub = types.ModuleType("triton")
    stub.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    stub.cdiv = lambda a, b: -(-a // b)
    stub.language = types.ModuleType("triton.language")
    stub.language.constexpr = object
    sys.modules.setdefault("triton", stub)
    sys.modules.setdefault("triton.language", stub.language)
    module = types.ModuleType("kivi_new_pack")
    path = repo / "quant" / "new_pack.py"
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Seeded keys or values with channel outliers (KIVI's reason for per-channel keys); the test reads them back
    from the file rather than regenerating them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 8  # an outlier channel
    return x.to(dtype)


def quantizer_goldens(ref, out: dict) -> None:
    for name, seed, dtype, bits, group in QUANT_CASES:
        keys, values = inputs(seed, (1, 2, 64, 32), dtype), inputs(seed + 100, (1, 2, 64, 32), dtype)
        out[f"{name}.keys"], out[f"{name}.values"] = keys, values
        code, scale, mn = ref.quant_and_pack_vcache(values.clone(), group, bits)  # per token, groups of channels
        out[f"{name}.v_bytes"] = code.contiguous().view(torch.uint8)
        out[f"{name}.v_scale"], out[f"{name}.v_zero"] = scale[..., 0], mn[..., 0]
        out[f"{name}.v_dequant"] = ref.unpack_and_dequant_vcache(code, scale, mn, group, bits)
        keys_t = keys.transpose(2, 3).contiguous()  # the model's path: [B, H, D, T], groups of tokens per channel
        code, scale, mn = ref.quant_and_pack_vcache(keys_t.clone(), group, bits)
        out[f"{name}.k_bytes"] = code.contiguous().view(torch.uint8)
        out[f"{name}.k_scale"], out[f"{name}.k_zero"] = scale[..., 0], mn[..., 0]
        out[f"{name}.k_dequant"] = ref.unpack_and_dequant_vcache(code, scale, mn, group, bits).transpose(2, 3)
        code_t, scale_t, mn_t = ref.quant_and_pack_kcache(keys.clone(), group, bits)  # packed along T instead
        out[f"{name}.k_dequant_kcache"] = ref.unpack_and_dequant_kcache(code_t, scale_t, mn_t, group, bits)


def dequant_keys(ref, block, group: int, bits: int) -> torch.Tensor:
    code, scale, mn = block
    return ref.unpack_and_dequant_vcache(code, scale, mn, group, bits).transpose(2, 3)


def cache_goldens(ref, out: dict) -> None:
    """The reference's prefill split and decode flushes (module docstring), its quantizer doing the quantization."""
    for name, seed, dtype, bits, group, residual, n, steps, recorded in CACHE_CASES:
        shape = (1, 2, n + steps, 32)
        keys, values = inputs(seed, shape, dtype), inputs(seed + 100, shape, dtype)
        out[f"{name}.keys"], out[f"{name}.values"] = keys, values
        k, v = keys[:, :, :n], values[:, :, :n]
        n_kq = n - n % residual
        k_blocks = [ref.quant_and_pack_vcache(k[:, :, :n_kq].transpose(2, 3).contiguous(), group, bits)] \
            if n_kq else []
        k_full = k[:, :, n_kq:]
        v_blocks = [ref.quant_and_pack_vcache(v[:, :, :n - residual].contiguous(), group, bits)] \
            if n > residual else []
        v_full = v[:, :, max(n - residual, 0):]
        for t in range(1, steps + 1):
            k_full = torch.cat([k_full, keys[:, :, n + t - 1:n + t]], dim=2)
            v_full = torch.cat([v_full, values[:, :, n + t - 1:n + t]], dim=2)
            if t in recorded:  # what this step attends
                out[f"{name}.step{t}.keys"] = torch.cat([dequant_keys(ref, b, group, bits) for b in k_blocks]
                                                        + [k_full], dim=2)
                out[f"{name}.step{t}.values"] = torch.cat(
                    [ref.unpack_and_dequant_vcache(*b, group, bits) for b in v_blocks] + [v_full], dim=2)
            if k_full.shape[2] == residual:
                k_blocks.append(ref.quant_and_pack_vcache(k_full.transpose(2, 3).contiguous(), group, bits))
                k_full = k_full[:, :, :0]
            if v_full.shape[2] > residual:
                v_blocks.append(ref.quant_and_pack_vcache(v_full[:, :, :1].contiguous(), group, bits))
                v_full = v_full[:, :, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kivi-repo", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the checkout's commit, where it is not a git work tree")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/kivi/goldens.safetensors"))
    args = parser.parse_args()
    ref = load_reference(args.kivi_repo)
    out: dict[str, torch.Tensor] = {}
    quantizer_goldens(ref, out)
    cache_goldens(ref, out)
    commit = args.commit or subprocess.run(["git", "-C", str(args.kivi_repo), "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or "unknown"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in out.items()}, str(args.out),
              metadata={"reference": "jy-yuan/KIVI", "commit": commit, "torch": torch.__version__})
    print(f"wrote {len(out)} tensors to {args.out} (KIVI {commit[:7]})")


if __name__ == "__main__":
    main()
