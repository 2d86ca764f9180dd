"""Block dequantization in numpy (ggml-quants.c's `dequantize_row_*` / gguf-py's `gguf.quants`),
and the references of ggml's activation quantization: q8_K (`quantize_row_q8_K_ref`) and q8_0 /
q8_1 as llama.cpp's x86 build computes them (ggml-cpu arch/x86/quants.c `quantize_row_q8_0` /
`quantize_row_q8_1`, not their `_ref` versions: `quantize_q8_act`).

Every type a llama GGUF uses is expanded to float32 with the same float operations, in the same
order, as gguf-py's reference `gguf.quants.dequantize`, so the results agree bit for bit. The
products involved are mostly exact in float32 (an f16 scale times a few-bit integer), so only the
order of the few rounding steps (`d*q + m`, `(d*sc)*q - dmin*m`) matters; it is kept.

The work is done on whole (n_blocks, block_bytes) views at once, in chunks of rows so that the
temporaries stay cache-sized; no Python loop per block.
"""

from __future__ import annotations

import numpy as np

from llamapy.types import GGMLType, UnsupportedError, block_size

QK_K = 256

# Elements per chunk when expanding many rows; keeps the int/float temporaries in L2-ish sizes.
_CHUNK_ELEMS = 1 << 18

_SHIFT_4 = np.array([0, 4], dtype=np.uint8)
_SHIFT_2 = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT_1 = np.arange(8, dtype=np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 columns holding a little-endian f16 -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """(n, k*half) bytes -> (n, k, 2, half) uint8: low nibbles of each `half`-byte run, then
    the high nibbles (ggml's order within a block or sub-block)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, half) >> _SHIFT_4.reshape(1, 1, 2, 1)
    return q & np.uint8(0x0F)


def _bits(qh: np.ndarray, n_elems: int) -> np.ndarray:
    """(n, 4) bytes holding a little-endian uint32 bit mask -> (n, 32) uint8 of 0/1."""
    h = np.ascontiguousarray(qh).view(np.uint32)
    return ((h >> np.arange(n_elems, dtype=np.uint32).reshape(1, -1)) & np.uint32(1)).astype(
        np.uint8
    )


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18], 16).reshape(-1, 32).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20], 16).reshape(-1, 32).astype(np.float32)
    return d * q + m


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    qh = _bits(b[:, 2:6], 32)
    ql = _nibbles(b[:, 6:22], 16).reshape(-1, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    qh = _bits(b[:, 4:8], 32)
    ql = _nibbles(b[:, 8:24], 16).reshape(-1, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.float32)
    return d * q + m


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32) * d


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = b[:, 0:16]
    qs = b[:, 16:80]
    d = _f16(b[:, 80:82])
    dmin = _f16(b[:, 82:84])
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32)).reshape(n, 16, 1)
    # Each 32-byte run of qs holds four 32-element groups, 2 bits apiece (low bits first).
    q = (qs.reshape(n, 2, 1, 32) >> _SHIFT_2.reshape(1, 1, 4, 1)) & np.uint8(3)
    q = q.reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _k_scales_6bit_q3(sc: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> (n, 16) signed 6-bit scales as float32."""
    n = sc.shape[0]
    lo = (sc[:, 0:8].reshape(n, 1, 8) >> _SHIFT_4.reshape(1, 2, 1)).reshape(n, 16)
    hi = (sc[:, 8:12].reshape(n, 1, 4) >> _SHIFT_2.reshape(1, 4, 1)).reshape(n, 16)
    s = (lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))
    return (s.astype(np.int8) - np.int8(32)).astype(np.float32)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask = b[:, 0:32]
    qs = b[:, 32:96]
    d = _f16(b[:, 108:110])
    dl = (d * _k_scales_6bit_q3(b[:, 96:108])).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _SHIFT_2.reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(n, 1, 1, 32) >> _SHIFT_1.reshape(1, 1, 8, 1)) & np.uint8(1)
    ql = ql.reshape(n, 16, 16)
    # A set high bit means "no offset"; a clear one subtracts 4.
    qh = (qh.reshape(n, 16, 16) ^ np.uint8(1)) << np.uint8(2)
    q = (ql.astype(np.int8) - qh.astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> (scales, mins), each (n, 8) uint8 of 6 bits."""
    n = sc.shape[0]
    s = sc.reshape(n, 3, 4)
    a, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = np.concatenate([a & np.uint8(0x3F), (md & np.uint8(0x0F)) | ((a >> 2) & np.uint8(0x30))], axis=1)
    mins = np.concatenate([m & np.uint8(0x3F), (md >> 4) | ((m >> 2) & np.uint8(0x30))], axis=1)
    return scale, mins


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks: each sub-block's scale d * sc and min dmin * m, (n, 8, 1)."""
    sc, mn = k_scale_min(b[:, 4:16])
    d, dmin = (_f16(b[:, k : k + 2]).reshape(-1, 1, 1) for k in (0, 2))
    return d * sc.astype(np.float32).reshape(-1, 8, 1), dmin * mn.astype(np.float32).reshape(-1, 8, 1)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_scales(b)  # (n, 8, 1) each
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_scales(b)  # (n, 8, 1) each
    qh = b[:, 16:48]
    ql = _nibbles(b[:, 48:176], 32).reshape(n, 8, 32)
    h = ((qh.reshape(n, 1, 32) >> _SHIFT_1.reshape(1, 8, 1)) & np.uint8(1)).reshape(n, 8, 32)
    q = (ql | (h << np.uint8(4))).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128]
    qh = b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    dl = (d * sc).reshape(n, 16, 1)
    lo = _nibbles(ql, 64).reshape(n, 8, 32)
    hi = ((qh.reshape(n, 2, 1, 32) >> _SHIFT_2.reshape(1, 1, 4, 1)) & np.uint8(3)).reshape(n, 8, 32)
    q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    q = q.reshape(n, 16, 16).astype(np.float32)
    return (dl * q).reshape(n, QK_K)


# -- the types mixture-of-experts models ship in: IQ4_NL, IQ4_XS (ggml-quants.c's kvalues_iq4nl
# non-linear grid) and MXFP4 (OCP microscaling FP4: e2m1 values under a shared E8M0 exponent) ----

# ggml-common.h's kvalues_iq4nl and kvalues_mxfp4 (the e2m1 values doubled, so they are integers:
# the scale is halved instead, ggml_e8m0_to_fp32_half)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> float32 2**(e - 128) (ggml_e8m0_to_fp32_half; e < 2: subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18], 16).reshape(-1, 32)
    return d * KVALUES_IQ4NL[q].astype(np.float32)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (n, 136) -> (n, 8) int8 sub-block scales (6 bits: 4 in scales_l, 2 in
    scales_h, minus 32)."""
    n = b.shape[0]
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # (n, 1)
    lo = (b[:, 4:8].reshape(n, 4, 1) >> _SHIFT_4.reshape(1, 1, 2)).reshape(n, 8) & np.uint8(0x0F)
    hi = ((sh >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)) & np.uint16(3)).astype(np.uint8)
    return (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)


def _deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = (_f16(b[:, 0:2]) * iq4_xs_scales(b).astype(np.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:136], 16).reshape(n, 8, 32)
    return (dl * KVALUES_IQ4NL[q].astype(np.float32)).reshape(n, QK_K)


def _deq_mxfp4(b: np.ndarray) -> np.ndarray:
    d = e8m0_to_f32_half(b[:, 0:1])
    q = _nibbles(b[:, 1:17], 16).reshape(-1, 32)
    with np.errstate(over="ignore"):  # e = 255 with a value of 8 or 12: inf, as in ggml
        return d * KVALUES_MXFP4[q].astype(np.float32)


_BLOCK_FNS = {
    GGMLType.Q4_0: _deq_q4_0,
    GGMLType.Q4_1: _deq_q4_1,
    GGMLType.Q5_0: _deq_q5_0,
    GGMLType.Q5_1: _deq_q5_1,
    GGMLType.Q8_0: _deq_q8_0,
    GGMLType.Q2_K: _deq_q2_k,
    GGMLType.Q3_K: _deq_q3_k,
    GGMLType.Q4_K: _deq_q4_k,
    GGMLType.Q5_K: _deq_q5_k,
    GGMLType.Q6_K: _deq_q6_k,
    GGMLType.IQ4_NL: _deq_iq4_nl,
    GGMLType.IQ4_XS: _deq_iq4_xs,
    GGMLType.MXFP4: _deq_mxfp4,
}

DEQUANT_TYPES: frozenset[GGMLType] = frozenset(
    [GGMLType.F32, GGMLType.F16, GGMLType.BF16, *_BLOCK_FNS]
)


def dequantize(raw: np.ndarray, qtype: GGMLType, n_cols: int) -> np.ndarray:
    """Expand whole rows of `qtype` data to float32.

    `raw` is uint8, (n_rows, row_bytes) or 1-D holding whole rows; the result is a new
    (n_rows, n_cols) float32 array (never a view of `raw`, which is usually a read-only mmap).
    """
    qtype = GGMLType(qtype)
    if qtype not in DEQUANT_TYPES:
        raise UnsupportedError(f"dequantization of type {qtype.name}")
    blck, bsize = block_size(qtype)
    if n_cols % blck:
        raise ValueError(f"{n_cols} columns is not a multiple of {qtype.name}'s block of {blck}")
    row_bytes = n_cols // blck * bsize
    flat = np.asarray(raw).view(np.uint8).reshape(-1)
    if flat.size % row_bytes:
        raise ValueError(f"{flat.size} bytes is not a whole number of {qtype.name} rows of {n_cols}")
    n_rows = flat.size // row_bytes

    if qtype == GGMLType.F32:
        return flat.view(np.float32).reshape(n_rows, n_cols).copy()
    if qtype == GGMLType.F16:
        return flat.view(np.float16).astype(np.float32).reshape(n_rows, n_cols)
    if qtype == GGMLType.BF16:
        w = flat.view(np.uint16).astype(np.uint32) << np.uint32(16)
        return w.view(np.float32).reshape(n_rows, n_cols)

    fn = _BLOCK_FNS[qtype]
    blocks = flat.reshape(-1, bsize)
    out = np.empty((blocks.shape[0], blck), dtype=np.float32)
    step = max(1, _CHUNK_ELEMS // blck)
    for i in range(0, blocks.shape[0], step):
        out[i : i + step] = fn(blocks[i : i + step])
    return out.reshape(n_rows, n_cols)


# ggml-common.h's block_q8_K: the K-quants' vec_dot_type (activations), 292 bytes, unpadded
Q8_K_DTYPE = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (QK_K // 16,))])


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """float32 rows (..., k), k a multiple of 256 -> (..., k // 256) `Q8_K_DTYPE` blocks, as
    ggml's quantize_row_q8_K_ref (which ggml-cpu's x86 quantize_row_q8_K calls) for finite x.

    Per block: max = the first element of largest magnitude, with its sign; iscale = -127/max
    in float32 (ggml's choice of sign, so d = 1/iscale has the sign of -max); qs =
    nearest_int(iscale * x) (the float32 product rounded to nearest, ties to even), at most 127;
    bsums = sums of 16 qs. An all-zero block is all zeros (ggml leaves its bsums unwritten)."""
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % QK_K:
        raise ValueError(f"{k} values is not a multiple of q8_K's block of {QK_K}")
    xb = x.reshape(-1, QK_K)  # (n_blocks, 256)
    n = xb.shape[0]
    mx = xb[np.arange(n), np.abs(xb).argmax(axis=1)]
    nz = mx != 0
    iscale = np.zeros(n, np.float32)
    iscale[nz] = np.float32(-127.0) / mx[nz]
    q = np.minimum(np.rint(xb * iscale[:, None]), 127).astype(np.int8)
    out = np.zeros(n, Q8_K_DTYPE)
    out["d"][nz] = np.float32(1.0) / iscale[nz]
    out["qs"] = q
    out["bsums"] = q.reshape(n, QK_K // 16, 16).sum(axis=-1, dtype=np.int16)
    return out.reshape(*x.shape[:-1], k // QK_K)


def quantize_q8_1_cuda(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (n_rows, n_cols) -> (int8 quants (n_rows, n_cols), float32 (n_rows, n_cols / 32, 2)
    pairs (d, d * sum q)): the q8_1 copy CUDA's int8 decode products read (kernels_cuda/mmvq.cu).
    ggml-cuda's rule (quantize.cu), not the CPU's x86 one above: d = amax / 127, q = roundf(x / d)
    (halves away from zero), amax 0 gives q = 0; d and d * sum(q) kept in float32."""
    x = np.asarray(x, dtype=np.float32)
    n_rows, n_cols = x.shape
    if n_cols % 32:
        raise ValueError(f"{n_cols} columns is not a multiple of q8_1's block of 32")
    b = x.reshape(n_rows, -1, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (b / d[..., None]).astype(np.float32).astype(np.float64)
    q = np.where(amax[..., None] == 0, 0, np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
    return q.reshape(n_rows, n_cols), np.stack([d, s], axis=-1)


def quantize_q8_act(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes) of Q8_0 or Q8_1 blocks, as llama.cpp's
    x86 build quantizes MUL_MAT activations (arch/x86/quants.c quantize_row_q8_0 / q8_1: the CPU
    backend's q8 mode, kernels_c/quants.c lp_quantize_row_q8_0 / q8_1, computes the same bytes).

    Per block of 32: amax = max|x|, d = amax / 127 (stored as f16), id = 127 / amax in float32
    (0 when amax == 0), q = x * id rounded to nearest, ties to EVEN (vroundps), int32 -> int8 with
    saturation (a nan product: -128); Q8_1 adds s = f16(d * sum(q)). ggml's reference quantizer
    (gguf.quants, `quantize`) takes id = 1 / d and rounds ties away from zero: it differs on
    a few values in a thousand (tests/unit/test_native_quants.py counts them)."""
    qtype = GGMLType(qtype)
    if qtype not in (GGMLType.Q8_0, GGMLType.Q8_1):
        raise UnsupportedError(f"activation quantization to type {qtype.name}")
    x = np.asarray(x, dtype=np.float32)
    n_rows, n_cols = x.shape
    if n_cols % 32:
        raise ValueError(f"{n_cols} columns is not a multiple of {qtype.name}'s block of 32")
    b = x.reshape(-1, 32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # max_ps's tree (8 lanes over the 4 vectors, then 8 -> 4 -> 2 -> 1) only matters for nan:
        # a > b ? a : b, as max_ps, keeps the second operand where either is nan
        def mx(p: np.ndarray, q: np.ndarray) -> np.ndarray:
            return np.where(p > q, p, q)

        a = np.abs(b).reshape(-1, 4, 8)
        m = a[:, 0]
        for j in range(1, 4):
            m = mx(m, a[:, j])
        m = mx(m[:, 4:], m[:, :4])
        m = mx(m[:, :2], m[:, 2:])
        amax = mx(m[:, 0], m[:, 1])
        d = (amax / np.float32(127)).astype(np.float32)
        idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        v = np.rint((b * idv[:, None]).astype(np.float32))
        q32 = np.where(np.abs(v) < 2.0**31, v, -(2.0**31)).astype(np.int64)  # cvtps: 0x80000000 if out of range
    q = np.clip(q32, -128, 127).astype(np.int8)
    off = 2 if qtype == GGMLType.Q8_0 else 4
    out = np.empty((b.shape[0], off + 32), np.uint8)
    out[:, :2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if qtype == GGMLType.Q8_1:
        sumq = ((q32.sum(axis=1) + 2**31) % 2**32 - 2**31).astype(np.float32)  # int32 lanes wrap
        with np.errstate(invalid="ignore", over="ignore"):
            out[:, 2:4] = (d * sumq).astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, off:] = q.view(np.uint8)
    return out.reshape(n_rows, -1)


# -- quantization of the KV cache's rows (ggml-quants.c's quantize_row_q8_0_ref / q4_0_ref) --------

KV_QUANT_TYPES: frozenset[GGMLType] = frozenset([GGMLType.Q8_0, GGMLType.Q4_0])


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly: numpy's round goes to even."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.copysign(fl + np.floor(np.float32(2) * (a - fl)), v)


def quantize(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes) of Q8_0 or Q4_0 blocks, with the
    float32 operations of ggml's reference quantizers (bit-identical to gguf.quants.quantize)."""
    qtype = GGMLType(qtype)
    if qtype not in KV_QUANT_TYPES:
        raise UnsupportedError(f"quantization to type {qtype.name}")
    x = np.asarray(x, dtype=np.float32)
    n_rows, n_cols = x.shape
    blck, bsize = block_size(qtype)
    if n_cols % blck:
        raise ValueError(f"{n_cols} columns is not a multiple of {qtype.name}'s block of {blck}")
    b = x.reshape(-1, blck)  # (n_blocks, 32)
    out = np.empty((b.shape[0], bsize), np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        if qtype == GGMLType.Q8_0:
            d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            out[:, 2:] = _roundf(b * inv).astype(np.int8).view(np.uint8)
        else:  # Q4_0: the scale is the signed value of largest magnitude (its first one) / -8
            imax = np.abs(b).argmax(axis=1)[:, None]
            d = np.take_along_axis(b, imax, axis=1) / np.float32(-8)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            # (int8_t)(x*id + 8.5f): truncation toward zero, then at most 15
            q = np.minimum(np.trunc(b * inv + np.float32(8.5)), np.float32(15)).astype(np.uint8)
            out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    return out.reshape(n_rows, -1)


def hadamard_scale(n: int) -> np.float32:
    """The entries' magnitude of `hadamard(n)`, 1/sqrt(n) rounded as ggml_gen_hadamard does."""
    return np.float32(1.0 / np.sqrt(np.float32(n)))


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order `n` (a power of two), built as llama.cpp's
    ggml_gen_hadamard does in float32: symmetric, its own inverse."""
    h = np.zeros((n, n), np.float32)
    h[0, 0] = hadamard_scale(n)
    s = 1
    while s < n:
        blk = h[:s, :s].copy()
        h[s : 2 * s, :s], h[:s, s : 2 * s], h[s : 2 * s, s : 2 * s] = blk, blk, -blk
        s *= 2
    return h


def rotate(x: np.ndarray, n: int) -> np.ndarray:
    """`x` (…, m) with each run of `n` contiguous values multiplied by hadamard(n) (llama.cpp's
    llama_mul_mat_hadamard: rows of n, `m` a multiple of n)."""
    shape = x.shape
    y = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n)  # (…*m/n, n)
    # the fast Walsh-Hadamard transform: log2(n) stages of butterflies (a + b, a - b) over pairs
    # h apart, which is rows @ hadamard(n) unscaled, then the scale 1/sqrt(n) once. Written out
    # so that its float32 operations have one order (a BLAS product's depends on the library):
    # the compiled executor repeats them bit for bit (ops.c lp_hadamard_runs)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)  # (rows, blocks, pair, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return (y.reshape(-1, n) * hadamard(n)[0, 0]).reshape(shape)


def round_trip_q8_0(x: np.ndarray) -> np.ndarray:
    """`x` (…, n) as the Q8_0 blocks ggml converts it to, expanded back to float32 (exact: an
    int8 times an f16 scale). llama.cpp's flash attention does this to Q over a quantized K cache
    (q_to_vec_dot: Q4_0 and Q8_0 both dot with Q8_0), so the float product equals the integer one
    up to the order of the float sums."""
    shape = x.shape
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
    return dequantize(quantize(rows, GGMLType.Q8_0), GGMLType.Q8_0, shape[-1]).reshape(shape)
