"""What ``kvarena check`` compiles: the heaviest realistic launch of every kernel, the
targets' limits, and the contract's workloads for ``--perf``."""

from kvarena.kernels.arch import ARCHS
from kvarena.kernels.placement import OWN_AFTER_HISTORY, OWN_AT_QUERIES

#: The targets, by the names KVARENA_ARCH and `--target` take (kvarena.kernels.arch).
TARGETS = tuple(ARCHS)
# Shared memory (LDS) one block may use, per target: 163 KiB on A100, 99 KiB on the GeForce
# and L40S/L4 parts, 227 KiB on H100/H200/B200, 64 KiB on MI300X, 160 KiB on MI355X.
SHARED_LIMIT = {name: arch.smem_per_block for name, arch in ARCHS.items()}

# Realistic heaviest launches: (name, head_dim, group, dtype, q_len_max, block_size, split,
# deterministic, flags as launched). q_len_max is what the pool passes as max_seqlen_q: 1 for
# decode, the chunk for slabs; block_size selects the block layout specialization (16:
# power-of-two pages, 48: pages divided at run time, >= BLOCK_N: slabs and 64-token pages,
# the contiguous large-block path). Flags (causal, kv_start, lse, softcap): the slab pool's
# chunks run non-causal with kv_start and lse, decode and prefill causal. Each case also compiles with
# every flag on (the most code), since spills must not depend on the options.
_DECODE, _PREFILL, _SLAB = (True, False, False, False), (True, False, False, False), (False, True, True, False)
ATTENTION_CASES = [
    ("decode 32q/8kv", 128, 4, "bf16", 1, 16, False, False, _DECODE),
    ("decode 32q/8kv split", 128, 4, "bf16", 1, 16, True, False, _DECODE),
    ("decode D256 GQA8 split", 256, 8, "fp16", 1, 16, True, False, _DECODE),
    ("decode page64 split", 128, 4, "bf16", 1, 64, True, False, _DECODE),
    ("prefill 32q/8kv page48", 128, 4, "bf16", 2048, 48, False, False, _PREFILL),
    ("chunk MAGI 24q/8kv", 128, 3, "bf16", 12150, 12150, False, False, _SLAB),
    ("chunk Wan split", 128, 1, "fp16", 4680, 4680, True, False, _SLAB),
    # Wan-14B's 40 heads fill the waves unsplit: the unsplit form of the Wan step (its own keys
    # over an fp8 history spilt there while the split form fitted).
    ("chunk Wan-14B", 128, 1, "bf16", 4680, 4680, False, False, _SLAB),
    ("chunk GQA5 split", 128, 5, "bf16", 4096, 4096, True, False, _SLAB),
    ("chunk D256 GQA7 split", 256, 7, "bf16", 4096, 4096, True, False, _SLAB),
    ("spec-decode 4x8 split", 128, 8, "bf16", 4, 16, True, False, _PREFILL),
    ("deterministic 32q/8kv", 128, 4, "bf16", 1, 16, True, True, _DECODE),
    ("decode fp32", 128, 4, "fp32", 1, 16, False, False, _DECODE),
    ("chunk fp32 split", 128, 1, "fp32", 4680, 4680, True, False, _SLAB),
    ("chunk fp32 D256 GQA5", 256, 5, "fp32", 4680, 4680, False, False, _SLAB),
]
_FLAG_NAMES = ("causal", "kv_start", "lse", "softcap")
# Slab cases also compiled as a denoising step launches them: the cached history and the
# step's own keys as two key sources of one launch (commit=False). Head dim 256 takes its
# own tiles for own keys, fp8 and RoPE (attn_configs._d256_config): compiled too.
OWN_CASES = ("chunk MAGI 24q/8kv", "chunk Wan split", "chunk Wan-14B", "chunk D256 GQA7 split")
# Cases also compiled with a float8_e4m3fn cache (bytes decoded in registers, per-key fp32
# scales on the score and probability columns): decode (paged, and over 64-token pages on
# the block loop), prefill through the guarded page path, and a slab chunk on the
# large-block path with the step's own keys (never fp8).
FP8_CASES = ("decode 32q/8kv split", "decode D256 GQA8 split", "decode page64 split", "prefill 32q/8kv page48",
             "chunk Wan split", "chunk Wan-14B", "chunk D256 GQA7 split")
# Cases also compiled with RoPE on read (queries and keys rotated by table rows as loaded,
# per-block position shifts): decode with half-split pairs, the slab chunk (own keys,
# interleaved pairs as Wan's); with an fp8 cache too under --all-variants.
ROPE_CASES = ("decode 32q/8kv split", "decode D256 GQA8 split", "chunk Wan split", "chunk D256 GQA7 split")
# Cases also compiled with 64-bit key offsets on the page path: a cache whose layer view
# spans more than 2**31 elements (over 4 GiB of bf16 per K or V view; the other launches
# address keys with int32 offsets).
WIDE_CASES = ("decode 32q/8kv split",)
# Cases also compiled over the short-context decode tile (32-key tiles: B = 1 at 1K-2K keys,
# where 64-key tiles cannot fill a wave), with a bf16 and an fp8 cache: on 16-token pages
# (the page loop) and on 64-token pages (the block loop, at 3 stages).
SHORT_CASES = ("decode 32q/8kv split", "decode page64 split")
# The contract's workloads for --perf (sinks 1 + window 3 for slab chunks): the launch
# plan each gets, its grid and its wave efficiency. (name, head_dim, group, num_kv_heads,
# num_seqs, q_len, k_len (cached keys), block_size, causal, own_len (the step's own keys,
# attended in the same launch: a denoising step)).
WORKLOADS = [
    ("decode B=1 ctx=1K", 128, 4, 8, 1, 1, 1024, 16, True, 0),
    ("decode B=1 ctx=2K", 128, 4, 8, 1, 1, 2048, 16, True, 0),
    ("decode B=1 ctx=4K", 128, 4, 8, 1, 1, 4096, 16, True, 0),
    ("decode B=1 ctx=128K", 128, 4, 8, 1, 1, 131072, 16, True, 0),
    ("decode B=16 ctx=16K", 128, 4, 8, 16, 1, 16384, 16, True, 0),
    ("decode B=16 ctx=128K", 128, 4, 8, 16, 1, 131072, 16, True, 0),
    ("decode B=64 ctx=8K", 128, 4, 8, 64, 1, 8192, 16, True, 0),
    ("decode B=256 ctx=8K", 128, 4, 8, 256, 1, 8192, 16, True, 0),
    ("Wan-1.3B chunk, commit=True", 128, 1, 12, 1, 4680, 4 * 4680, 4680, False, 0),
    ("Wan-1.3B chunk, commit=False", 128, 1, 12, 1, 4680, 3 * 4680, 4680, False, 4680),
    ("Wan-14B chunk, commit=True", 128, 1, 40, 1, 4680, 4 * 4680, 4680, False, 0),
    ("Wan-14B chunk, commit=False", 128, 1, 40, 1, 4680, 3 * 4680, 4680, False, 4680),
    ("MAGI-1 chunk, commit=True", 128, 3, 8, 1, 12150, 4 * 12150, 12150, False, 0),
    ("MAGI-1 chunk, commit=False", 128, 3, 8, 1, 12150, 3 * 12150, 12150, False, 12150),
]
SM_COUNT = {name: arch.sm_count for name, arch in ARCHS.items()}
# The split reduce: (name, head_dim, dtype, rows (tokens x query heads), splits), each
# compiled at the tile :func:`kvarena.kernels.split_reduce._reduce_tile` gives it on
# 132 SMs: B=1 decode (32 rows; 33 splits = 64 at once, D split across programs), B=16, a
# split count past 64 (chunks), D = 256, and the deterministic pin (its tile is the same on every
# target: the reduce is bandwidth-bound and its tile holds 4096 fp32 partial elements).
REDUCE_CASES = [("reduce D128 B=1", 128, "bf16", 32, 33, False), ("reduce D128 B=16", 128, "bf16", 512, 2, False),
                ("reduce D128 B=1 100 splits", 128, "bf16", 32, 100, False),
                ("reduce D256", 256, "fp16", 64, 16, False), ("reduce D256 rows", 256, "fp16", 8192, 8, False),
                ("reduce D128 deterministic", 128, "bf16", 512, 32, True)]
# The backward kernels (dQ and dK/dV), every mask flag on: (name, head_dim, group, dtype,
# where the own keys sit: OWN_AT_QUERIES (paged / commit) or OWN_AFTER_HISTORY).
BWD_CASES = [
    ("bwd 32q/8kv", 128, 4, "bf16", OWN_AT_QUERIES),
    ("bwd Wan denoise", 128, 1, "bf16", OWN_AFTER_HISTORY),
    ("bwd D256 GQA2", 256, 2, "fp16", OWN_AT_QUERIES),
    ("bwd fp32", 128, 1, "fp32", OWN_AFTER_HISTORY),
]
# (name, head_dim, input dtype, quantize to fp8 with per-token scales).
STORE_CASES = [("store D256", 256, "bf16", False), ("store D256 fp32", 256, "fp32", False),
               ("store D128 fp8", 128, "bf16", True)]
MERGE_CASES = [("merge D256", 256, "bf16"), ("merge D256 fp32", 256, "fp32")]
