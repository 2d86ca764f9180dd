"""The compiled GPU split: the CPU executor's records, launched as kernels on a device stream and
replayed as one CUDA graph (ggml-cuda's `ggml_backend_cuda_graph_compute`: a graph's nodes
launched on the backend's stream, captured once into a cudaGraph and replayed while the graph
keeps its shape; ggml-alloc's addresses; the CPU counterpart is backend/executor.py).

One executor design, two launchers. `compile_split` runs the CPU executor's record compiler
(`executor._Compiler`: the steps, the RMS_NORM × weight and ADD → RMS_NORM fusions, the arena
offsets from sched/alloc.py, the records of the row-wise ops, ROPE, SET_ROWS and attention) with a
`GPUTarget`, which resolves values to device addresses and writes the products' records itself:

  * MUL_MAT_W: a fused dequantize + matrix-vector product over the weight's raw blocks on the
    device (slots 1 dst, 2 x, 3 the weight's blocks; 6 tokens, 7 n_in, 8 x's row stride, 9 the
    GGML type, 10 n_out, 11 row bytes; 18 a float32 bias of n_out or 0: the ADD after the
    product as its epilogue — the compiler's `_fuse_mul_mat_bias`, `fuse_bias`: qwen2's and
    gpt-oss's stacked Q/K/V bias, whose Q, K and V views then make a ROPE_QKV; gpt-oss's output
    and router biases);
  * GET_ROWS_W: rows of a weight matrix expanded (1 dst, 2 the blocks, 3 ids; 6 ids, 7 n_in,
    8 row bytes, 9 n_out, 10 the GGML type);
  * MUL_MAT_GLU: the product of the stacked gate/up matrix with its GLU as epilogue (the
    compiler's MUL_MAT + GLU step, `fuse_glu`): MUL_MAT_W's slots, 1 the GLU's result, 10 n_ff
    (half the rows), 12 the GLU (0 SwiGLU, 1 GEGLU);
  * ROPE_QKV: a layer's ROPE of Q, ROPE of K and its store into the cache, and the store of V, as
    one launch (cuda_ops.rope_qkv), when Q, K and V are column views of one product (one row
    stride) and the roped K is read by its store alone: 1 Q's result, 2 Q, 3 positions, 4 cells,
    5 K, 10 V; 6 tokens, 7 heads, 8 head size, 9 the row stride, 11 n_dims, 12 NeoX, 13 / 14
    base / scale bits, 15 KV heads, 16 V's head size, 17 rope_freqs, 18 cells of the cache,
    19-22 the K cache, its type code, row bytes, rotation; 23-26 the V cache's;
  * MUL_MAT_ID_W: the expert product (common.cuh's mmv_id: the expert ids read on the device, so
    the graph does not depend on the routing): 1 dst (T, U, M), 2 x, 3 the stacked experts'
    blocks, 4 ids (int32); 6 T, 7 U, 8 M, 9 the GGML type, 10 n_in, 11 row bytes, 12 n_expert,
    13 / 14 x's token / slot strides (14 0: one row a token), 15 the ids' row stride;
  * MUL_MAT_ID_GLU: the gate and up expert products of one input with the GLU after them as one
    launch (the compiler's step `_fuse_mul_mat_id_glu`, so the allocator places the GLU's result
    apart from the products' input): MUL_MAT_ID_W's slots for the gate experts, 1 the GLU's
    result, 16 the up experts' blocks, 17 the GLU (0 SwiGLU, 1 GEGLU, 2 swiglu_oai); with the
    experts' biases (gpt-oss: the compiler's `_fuse_mul_mat_id_bias` folds each ADD_ID into its
    product's step, `fuse_bias`), 18 / 20 the gate's / up's bias rows, 19 their row stride, 21 /
    22 swiglu_oai's alpha / limit (float64 bits) — a biased MUL_MAT_ID_W's slots 18 / 19 alike;
  * the router (SOFT_MAX, ARGSORT, the batched GET_ROWS, SUM_ROWS, CLAMP, DIV and MUL by one value
    a row): the CPU's records, launched as moe.cu's kernels; ROUTER: the chain SOFT_MAX .. DIV
    of build_moe_ffn's normalised weights as one launch (`_fuse_router`, moe.cu's router_f32):
    1 the weights (T, U), 2 the logits, 3 the ARGSORT's result (T, E); 6 T, 7 E, 8 the logits'
    row stride, 9 the softmax scale, 10 U, 11 / 12 the clamp's bounds (float64 bits);
    ROUTER_TOPK: gpt-oss's ARGSORT of the logits, GET_ROWS of the chosen ones and their SOFT_MAX
    (`_fuse_router_topk`, moe.cu's router_topk_f32): ROUTER's slots 1-3 and 6-10;
  * ROPE: the CPU's record, with slot 4 the rope_freqs divisors on the device (0: none) instead of
    the CPU's table of inverse frequencies, 13 / 14 the frequency base and scale (float64 bits),
    15 YaRN's constants on the device (kernels.yarn_table; 0: none; ROPE_QKV's slot 27);
  * ADD_ID (gpt-oss's expert biases): the CPU's record, slot 3 the bias rows on the device, 11
    n_expert, 12 their row stride; ATTN's slot 24, the sinks, and the GLU's swiglu_oai slots
    10-12 are the CPU's;
  * QUANTIZE_Q8_1 + MUL_MAT_Q8: in the q8 mode (the default; `GPUTarget.q8`), a decode product of
    a type mmvq.cu has a decoder for whose matrix has MMVQ_MIN_WEIGHTS weights or more
    (`product_path` "mmvq"): QUANTIZE_Q8_1 writes x's q8_1 copy into the plan's one q8_1 scratch
    (after the values; 1 the copy, 2 x; 6 tokens, 7 n_in, 8 x's row stride), MUL_MAT_Q8
    takes int8 dot products with the weight's blocks (1 dst, 2 the copy, 3 the blocks; 6 tokens,
    7 n_in, 9 the GGML type, 10 the values written a token, 11 row bytes, 12 the GLU: 0 none,
    1 SwiGLU, 2 GEGLU; 18 MUL_MAT_W's bias). A later product of an input whose copy the scratch holds (Q, K and V
    of a Q4_K_M file, attn_v in Q6_K) reads it without a QUANTIZE_Q8_1, whatever its size. The
    QUANTIZE_Q8_1 of an RMS_NORM's result just after it joins that norm (`_fuse_norm_q8`: the
    norm's slot 16, the copy written by the norm's kernel), brought there from after the
    records between (`_hoist_q8`: the router's, before a MoE layer's gate/up experts);
  * MUL_MAT_ID_Q8: an expert product on the q8_1 copy in the q8 mode, by the same rule with the
    weights a token reads (n_used x M x n_in, twice with the up experts; mmvq.cu's mmvq_id):
    MUL_MAT_ID_GLU's slots (16 0: no up experts, no GLU), 2 the copy, 13 / 14 the pairs' rows of
    it a token / a slot (1 / 0: the token's normed row, gate/up; n_used / 1: the pair's own, down),
    23 the copy's rows;
  * MUL_MAT_GEMM: a prompt's product (`product_path`: more tokens than the matrix-vector kernels
    take) on the tensor cores: the input rounded to f16 into a scratch, the weight's rows decoded to
    f16 into another, a tile of rows at a time, and one cuBLAS GEMM with float32 accumulation per
    tile (cuda_ops.mul_mat_gemm): 1 dst (the GLU's result when fused), 2 x, 3 the weight's blocks,
    4 the f16 weight scratch, 5 the f16 input scratch (the step's own: see Memory); 6 tokens, 7 n_in, 8 x's row stride, 9 the
    GGML type, 10 the values written a token (n_ff with a GLU), 11 row bytes, 12 the GLU (0 none,
    1 SwiGLU, 2 GEGLU), 13 rows per GEMM, 14 the float32 product's scratch (with a GLU), 15 the
    input's scale scratch (cuda_ops.F16_SCALE_BYTES: the input divided by a power of two that
    keeps it in f16's range, the GEMMs' alpha read from there), 18 MUL_MAT_W's bias (added in
    place after the GEMMs: elementwise.cu's add, the ADD record's bits; never with a GLU);
  * MUL_MAT_ID_GEMM: a prompt's expert product (more tokens than mmv_id takes; see Prompts below):
    MUL_MAT_ID_W's / MUL_MAT_ID_GLU's slots 1-22, 23 flags (1: the gate/up experts with their
    GLU, slot 16 the up ones; 2: the same routing as the expert record before, whose grouping it
    reuses), 24 the grouping's scratch (the pairs' order, then the experts' offsets), 25 the
    gathered f16 input rows, 26 the f16 weight tile, 27 the float32 products, 5 the gathered
    rows' scale scratch (MUL_MAT_GEMM's slot 15);
  * records are WIDTH slots: the CPU's REC (25), and in an ATTN record slot 25 points at the int32
    count of cells attended (0: slot 9 holds it), 26 at the scratch of its split partials, 27
    the number of splits of the cells (the runtime's choice for the shape).

Memory: one device arena per device (the `Runtime`'s), shared by its plans as the CPU's is. Its
first HEAD bytes hold the count slots (one int32 per mask); the allocator's offsets follow. A
step's scratches (`GPUTarget.step_scratch`: an attention's split partials, a prompt product's f16
weight tile, f16 input, GLU product and input scale, a prompt expert product's likewise) are
values of that step alone to the allocator (256-byte aligned), as ggml-alloc places a node's
temporaries: they reuse memory free at that step — the logits' region before the output product
— instead of lying after the values' peak. Two outlive their step and follow the values
(`GPUTarget.scratch`, both small): the q8_1 copy (a later product of the same input reads it) and
a prompt's expert grouping (the down experts reuse it). Every scratch address is in the arena, so
it moves with it (`Built.moves`: slots 4, 5, 14, 15, 24-27, SCRATCH). The
inputs come first (sched/alloc.py places values in the order they are listed, and the compiler lists
the inputs before any step), so everything that changes each step — token ids, positions, KV
cells, the mask, the counts — lies in [0, in_bytes) of the arena: written into a pinned host
mirror of that range and sent by ONE asynchronous host-to-device copy before the launches. A
mask's slot spans the whole cache, its rows keep that stride, and only the attended cells are
written: the records never change with the length of history, so one capture serves them all.

Launches: the runtime turns each record into a prepared kernel launch once (`Runtime.prepare`,
every kernel compiled and loaded then). The first run captures the launches on the device's
stream into a CUDA graph (`Runtime.capture`); every run replays it. A plan that cannot be
captured (the runtime refuses: graphs turned off, or the capture failed) runs its launches
directly, and `summary()` (LLAMAPY_SCHED_DEBUG) says which and why. If the arena had to grow,
the records move to the new block and the launches are prepared and captured again.

Exports (values other splits read, the graph's outputs) stay where the launches left them: each
is an `ArenaValue` (its arena address and slot), which a device->host boundary reads in place (one
batch of D2H copies and one wait: CUDADevice.download_batch). The arena is shared by the device's
plans, so the next plan to run first gives each export still alive a device copy of its own
(`settle`, a D2D copy queued on the stream before its launches), which later readers get; so does
a reader on the device itself (run_nodes, another device's peer copy: `ArenaValue.own`).

Prompts: a split whose products take more tokens than the matrix-vector kernels is a plan too,
its products MUL_MAT_GEMM records, its attention fattn.cu's prompt kernel (cuda_ops picks it by
the token count); CuPy refuses cuBLAS inside a stream capture, so such a plan runs its launches
directly (prepared once per batch shape, kept like the decode plans). Each GEMM step has its
scratches (its f16 weight tiles at most 1/32 of the split's weights: cuda_ops.gemm_scratch_budget)
and a scale scratch
(the f16 inputs' power-of-two scales: an activation past 65504 would round to inf in f16, which
llama.cpp's q8_1 blocks with their own scales never do).

A mixture of experts' prompt (MUL_MAT_ID_GEMM, cuda_ops.mul_mat_id_gemm) is designed for the
H200's tensor cores, reasoned, not measured: a prompt of T tokens routes T * U (token, slot)
pairs (Qwen3-30B-A3B at -ub 512: 4096 pairs over 128 experts, ~32 rows an expert; Mixtral: 512
over 8, ~128), so the work is a GEMM per used expert of its pairs' rows against its M x K rows
— the matrix-vector kernel would read each expert's rows once per 8 pairs — and what bounds it
is the number of launches from Python (128 experts: 2 x 128 decodes and GEMMs a product, ~10 us
each), not the tensor cores. Per product:
moe.cu's `moe_sort` groups the pairs by expert on the device (one block: deterministic, stable,
ids out of range last), the n_expert + 2 offsets are read to the host — the one host wait of the
layer: the GEMMs' sizes are the routing's, so this record is not captured (nor could a cuBLAS
call be) and the down experts reuse the gate/up's grouping and offsets (flag 2) —, `moe_gather_f16`
gathers the pairs' input rows rounded to f16 once, each expert's rows padded to the largest
count (a multiple of 8) when the padded rows are at most twice the pairs' (`cuda_ops.moe_pad`);
then the experts are decoded to f16 a group at a time (all of Qwen3's 128 in two groups of
MOE_W16_BYTES = 256 MiB; Mixtral's 117 MiB experts two at a time) and one cuBLAS strided batched
GEMM (f16 in, float32 accumulation) a group multiplies each expert with its block of rows — a
few launches a product whatever the number of experts, the padding's rows computed and never
read, unused experts decoded and multiplied with padding (cheaper than a launch each). A routing
too unequal for the padding (or experts larger than the scratch) falls back to one decode and GEMM
an expert (tiles of rows), experts no pair chose skipped. `moe_scatter` puts each row back at its
(token, slot) with mmv_id's epilogue (the experts' biases, the GLU: SwiGLU, GEGLU, gpt-oss's
swiglu_oai). What a GPU session should measure (tests/gpu/run_all.py 3b times pp512 of the
Qwen3-30B-A3B layer shape): the batched GEMMs' TFLOP/s at ~32-64 rows an expert against the
dense GEMM's, the padding bound (2x) against the per-expert fallback, the host wait a layer
(~10-20 us expected), whether cuBLAS's grouped GEMM (no padding) or an int8 / mmq path over the
file's blocks beats f16, and the single-block sort (it scans the pairs once per expert: 4096 x 129
reads).

Refused here (the split then runs node by node with run_nodes, CuPy's reference path): weights in
host memory, an op or layout the compiler does not know, an op the runtime has no kernel for.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..tensor import Tensor, TensorFlag
from ..types import GGMLType, LlamapyError, UnsupportedError
from .executor import (ADD, ADD_ID, ARGSORT, ATTN, CLAMP, CPY, DIV, GEGLU, GET_ROWS_F32, MUL, MUL_MAT, MUL_MAT_ID_Q, OP_NAMES, RMS_NORM,
                       ROPE, REC, SCALE, SOFT_MAX, SWIGLU, Built, Loc, Refusal, Refused, Target, _Compiler, _Slot, op_counts)
from .kernels import yarn_table

# The GPU's own record codes (from 33: apart from executor.c's and GEGLU's 32)
MUL_MAT_W, GET_ROWS_W, MUL_MAT_GLU, ROPE_QKV, MUL_MAT_ID_W, MUL_MAT_ID_GLU, ROUTER = 33, 34, 35, 36, 37, 38, 39
ROUTER_TOPK = 40
MUL_MAT_ID_GEMM = 41
QUANTIZE_Q8_1, MUL_MAT_Q8 = 42, 43
MUL_MAT_GEMM = 44
MUL_MAT_ID_Q8 = 45
WIDTH = REC + 3  # after the CPU's slots: an ATTN record's count slot, split scratch, splits
COUNT, SCRATCH, SPLITS = REC, REC + 1, REC + 2
HEAD = 64  # bytes of count slots at the arena's start: 16 masks
NAMES = {MUL_MAT_W: "MUL_MAT", GET_ROWS_W: "GET_ROWS", MUL_MAT_GLU: "MUL_MAT+GLU", ROPE_QKV: "ROPE+SET_ROWS",
         MUL_MAT_ID_W: "MUL_MAT_ID", MUL_MAT_ID_GLU: "MUL_MAT_ID+GLU",
         ROUTER: "SOFT_MAX+ARGSORT+GET_ROWS+SUM_ROWS+CLAMP+DIV", ROUTER_TOPK: "ARGSORT+GET_ROWS+SOFT_MAX",
         MUL_MAT_GEMM: "MUL_MAT(GEMM)", MUL_MAT_ID_GEMM: "MUL_MAT_ID(GEMM)", QUANTIZE_Q8_1: "QUANTIZE(q8_1)",
         MUL_MAT_Q8: "MUL_MAT(q8_1)", MUL_MAT_ID_Q8: "MUL_MAT_ID(q8_1)"}
GEMM_DIRECT = "cuBLAS GEMMs of a prompt (CuPy captures no cuBLAS call)"
MOE_SYNC = "; one host read of the expert counts a MoE layer"


# The smallest matrix (n_out x n_in weights) whose decode product takes the int8 path in the q8
# mode (a q8_1 copy of x, then mmvq.cu's dp4a product). It costs a second launch (the quantize,
# ~2 us inside a CUDA graph) and saves, by the sm_90 SASS at one token, ~110 of mmv_q4_k's ~210
# instructions a lane per unit of 32 weights (~0.1 ps a weight at ~1 T warp-instructions/s) and
# 2.75 of its 4 bytes of L1 reads of x a weight (~0.08 ps at ~33 TB/s): ~0.18 ps a weight, which
# pays for the launch from ~1.1e7 weights; 2^24 (Q4_K: 9.4 MB, ~2 us of HBM at 4.8 TB/s) leaves a
# margin. SmolLM2-135M: the output matrix alone (49152 x 576); a 1.2B Llama (2048 / 8192 / 128256):
# gate/up, down and output; an 8B (4096 / 14336 / 128256): every product (QKV 6144 x 4096, the
# output projection 4096 x 4096 = 2^24 exactly, gate/up, down, output). Reasoned, not measured.
MMVQ_MIN_WEIGHTS = 1 << 24


def product_path(n_out: int, n_tok: int, n_in: int, qtype: int, max_tokens: int, q8: bool = False,
                 min_weights: int | None = None) -> str:
    """The kernel a product of a (n_out, n_in) weight of `qtype` and n_tok tokens runs: "mmv"
    (the fused dequantize + matrix-vector kernels, up to `max_tokens`), "mmvq" (in the q8 mode, a
    type of mmvq.cu and a matrix of MMVQ_MIN_WEIGHTS or more: x quantized to q8_1, int8 dot
    products) or "gemm_f16" (the weight decoded to f16, cuBLAS on the tensor cores). The one
    decision, to be tuned on a GPU per shape and type (where they cross, whether bf16 or an int8
    kernel beats f16 for some types). `min_weights`: the threshold (MMVQ_MIN_WEIGHTS unless
    given: 0 for a product whose input's copy is already made)."""
    from .cuda_ops import MMVQ_SUFFIX

    if n_tok > max_tokens:
        return "gemm_f16"
    least = MMVQ_MIN_WEIGHTS if min_weights is None else min_weights
    if q8 and n_out * n_in >= least and qtype in MMVQ_SUFFIX:
        return "mmvq"
    return "mmv"


def graphs_enabled() -> bool:
    """LLAMAPY_CUDA_GRAPHS=0 launches every record directly each step (ggml's
    GGML_CUDA_DISABLE_GRAPHS)."""
    return os.environ.get("LLAMAPY_CUDA_GRAPHS", "1").lower() not in ("0", "off", "no")


class Runtime(Protocol):
    """What a GPU plan needs of its device (cuda_exec.CUDARuntime on CuPy; the tests' fake one
    records the launches): memory, one stream's copies and launches, graph capture."""

    buft: Any  # the device's buffer type: leaves in it are read in place
    max_tokens: int  # the largest batch the product kernels take
    arena: Any  # .ensure(nbytes) -> base address (grows; plans move when it does)

    def array_loc(self, v: Any) -> Loc: ...  # a device array (Refused for anything else)
    def weight(self, v: Any) -> tuple[int, int, int, int, int]: ...  # (blocks, type, n_out, n_in, row bytes)
    def host(self, v: Any) -> np.ndarray: ...  # a small device array's values (at compile time)
    def const(self, a: np.ndarray) -> tuple[int, Any]: ...  # (address, owner) of a table put on the device
    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]: ...
    # ^ (splits of the cells, scratch bytes) of an attention of that shape
    def prepare(self, rec: np.ndarray) -> Callable[[], None]: ...  # a record's launch (Refused: no kernel)
    def pinned(self, nbytes: int) -> np.ndarray: ...  # the host mirror of the inputs (uint8, >= nbytes)
    def h2d(self, dst: int, src: np.ndarray) -> None: ...  # asynchronous, on the stream
    def d2d(self, dst: int, value: Any) -> None: ...  # a device array into the arena, on the stream
    def capture(self, launches: Sequence[Callable[[], None]]) -> Any: ...
    # ^ a graph; raises Refused when the launches cannot be captured, UnsupportedError when a
    #   launch's kernel refuses its arguments
    def replay(self, graph: Any) -> None: ...
    def copy_out(self, addr: int, slot: _Slot, owner: Any) -> Any: ...  # an export: a device array (a copy)
    exported: list[Any]  # weak references to the ArenaValues of the last plan that ran (settle)
    def done(self) -> None: ...  # the step's work is queued (a timing runtime marks the stream here)


class GPUTarget(Target):
    """The record compiler's view of a device's memory."""

    name = "GPU"
    glu_ops = ("swiglu", "geglu", "swiglu_oai")
    attn_sinks = True
    fuse_glu = True
    fuse_bias = True
    head = HEAD
    width = WIDTH
    addr_slots = ((COUNT, ATTN), (SCRATCH, ATTN), (10, ROPE_QKV), (14, MUL_MAT_GEMM), (15, MUL_MAT_GEMM), (16, RMS_NORM),
                  *((k, MUL_MAT_ID_GEMM) for k in range(24, 28)))  # (slot 5 is every record's)

    def __init__(self, rt: Runtime, q8: bool = True) -> None:
        self.rt = rt
        self.q8 = q8  # the context's mode (cpu_matmul "q8"): the large decode products on int8 (mmvq.cu)
        # what the q8_1 scratch holds: (x, tokens, n_in, stride) of the last QUANTIZE_Q8_1 record. x is
        # a graph value, so while a later product reads it the allocator never writes over it, and
        # only a QUANTIZE_Q8_1 writes the scratch: a product of the same x anywhere after reuses it
        self.q8_prev: tuple[Tensor, int, int, int] | None = None
        self.max_tokens = None  # (a product refuses past rt.max_tokens: its record says why)
        self.yarn: dict[tuple, int] = {}  # one YaRN table a rope: Q's and K's records share it (ROPE_QKV)
        self.sorted: Tensor | None = None  # the ids the last prompt expert product grouped its pairs by
        self.splits: dict[Tensor, int] = {}  # an attention -> the splits of its cells (step_scratch's)
        self.gemm_budget: int | None = None  # bytes of a prompt product's f16 weight tile (step_scratch's)

    def leaf(self, t: Tensor) -> Any | None:
        r = t.root()
        if r.buffer is None:
            return None
        if r.buffer.buft is not self.rt.buft:
            if r.flags & TensorFlag.WEIGHT:
                raise Refused(f"weight {r.name} in {r.buffer.name} memory")
            return None  # copied in as a split input
        return self.storage(r)

    def storage(self, r: Tensor) -> Any:
        """The value of a leaf held in the device's memory (its buffer's storage)."""
        return r.buffer.storage(r)

    def array_loc(self, v: Any, keep: list[Any]) -> Loc:
        keep.append(v)
        return self.rt.array_loc(v)

    def host_array(self, v: Any) -> np.ndarray:
        return self.rt.host(v)

    def const(self, a: np.ndarray, keep: list[Any]) -> int:
        addr, owner = self.rt.const(a)
        keep.append(owner)
        return addr

    def export(self, l: Loc) -> Any:
        raise Refused("an export outside the arena")

    def id_type(self, n: Tensor) -> int | None:
        """A MUL_MAT_ID runs on the experts' own blocks (a weight in host memory: Refused)."""
        wv = self.leaf(n.src[0]) if n.src[0].is_leaf else None
        return None if wv is None else self.rt.weight(wv)[1]

    def step_scratch(self, c: _Compiler, st: Any) -> tuple[int, ...]:
        """The scratches alive during one step, placed by the allocator among the values alive
        then (the logits' region before the output product, ...): an attention's split partials
        (fattn, then their combine); a prompt product's f16 weight tile, f16 input, float32
        product (with a GLU: else 0) and input scale; a prompt expert product's likewise."""
        from .cuda_ops import F16_SCALE_BYTES, gemm_scratch_budget, gemm_tile_rows

        if st.code == ATTN:
            q, _k, v = st.node.src[:3]
            T, H, _D = q.shape
            N, Hkv, Dv = v.shape[0], v.shape[1], st.node.shape[-1]
            self.splits[st.node], nbytes = self.rt.attn_split(T, H, Hkv, N, Dv)
            return (nbytes,)
        if st.code == MUL_MAT:
            w, x = st.extra.get("mm", st.node).src
            n_out, n_in = w.shape[0], x.shape[-1]
            n_tok = x.n_elements // max(n_in, 1)
            if product_path(n_out, n_tok, n_in, w.type, self.rt.max_tokens, self.q8) != "gemm_f16":
                return ()
            if self.gemm_budget is None:  # (the split's weights: the same for each of its products)
                mats = {s.extra.get("mm", s.node).src[0] for s in c.steps if s.code == MUL_MAT}
                self.gemm_budget = gemm_scratch_budget(sum(m.nbytes for m in mats if m.is_leaf))
            return (2 * gemm_tile_rows(n_out, n_in, self.gemm_budget) * n_in, 2 * n_tok * n_in,
                    4 * n_tok * n_out if "glu" in st.extra else 0, F16_SCALE_BYTES)
        if st.code == MUL_MAT_ID_Q and st.node.shape[0] > self.rt.max_tokens:  # a prompt's experts
            _order, x16, w16, prod = self._moe_scratch(st)
            return (w16, x16, prod, F16_SCALE_BYTES)
        return ()

    @staticmethod
    def _moe_scratch(st: Any) -> tuple[int, int, int, int]:
        """cuda_ops.moe_scratch_bytes of a prompt's expert step."""
        from .cuda_ops import moe_scratch_bytes

        w, x, ids = GPUTarget._id_src(st)
        return moe_scratch_bytes(ids.shape[0], ids.shape[1] if len(ids.shape) > 1 else 1, w.shape[0], w.shape[1],
                                 x.shape[-1], "glu" in st.extra)

    def scratch(self, c: _Compiler, start: int) -> int:
        """The two scratches that outlive a step, after the allocator's values: the q8_1 copy of
        the int8 products' input (a later product of the same input reads it: Q, K and V) and a
        prompt's expert grouping (the pairs' order and the experts' offsets, which the down
        product reuses: flag 2). Both are small: a decode batch's rows, int32 a pair."""
        from .cuda_ops import q8_1_bytes

        q8 = sort = 0
        for st in c.steps:
            if st.code == MUL_MAT:
                w, x = st.extra.get("mm", st.node).src
                n_out, n_in = w.shape[0], x.shape[-1]
                n_tok = x.n_elements // max(n_in, 1)
                if product_path(n_out, n_tok, n_in, w.type, self.rt.max_tokens, self.q8) == "mmvq":
                    q8 = max(q8, q8_1_bytes(n_tok, n_in))
            elif st.code == MUL_MAT_ID_Q and st.node.shape[0] > self.rt.max_tokens:
                sort = max(sort, self._moe_scratch(st)[0])
            elif st.code == MUL_MAT_ID_Q and self._id_q8(st):
                x = self._id_src(st)[1]
                q8 = max(q8, q8_1_bytes(x.n_elements // x.shape[-1], x.shape[-1]))
        start += (-start) % 256
        self.sort_off = start
        start += sort
        start += (-start) % 256
        self.q8_off = start
        return start + q8

    def records(self, c: _Compiler, st: Any, loc: Callable[[Tensor], Loc]) -> list[list[int]] | None:
        n = st.node
        if st.code == MUL_MAT:
            mm = st.extra.get("mm", n)  # (a product with its GLU fused: the step's node is the GLU)
            w, x = mm.src
            wv = self.leaf(w) if w.is_leaf else None
            if wv is None:
                raise Refused(f"MUL_MAT {n.name} of two activations")
            blocks, qtype, n_out, n_in, row_bytes = self.rt.weight(wv)
            c.keep.append(wv)
            xl = loc(x)
            if xl.dtype != np.dtype(np.float32):
                raise Refused(f"MUL_MAT input of type {xl.dtype}")
            n_tok, k, xs = xl.rows()
            bias = self._bias_rows(c, st.extra["bias"])[0] if "bias" in st.extra else 0  # (the ADD after it)
            path = product_path(n_out, n_tok, n_in, qtype, self.rt.max_tokens, self.q8)
            if path == "gemm_f16":
                r = self._gemm(c, st, loc(n).addr, xl.addr, blocks, qtype, n_out, n_in, row_bytes, n_tok, k, xs)
                r[18] = bias
                return [r]
            copied = self.q8 and self._copied(x, n_tok, n_in, xs)
            if copied and product_path(n_out, n_tok, n_in, qtype, self.rt.max_tokens, True, min_weights=0) == "mmvq":
                path = "mmvq"  # (this input's q8_1 copy is made already: no launch to pay)
            if path == "mmvq" and k == n_in:
                recs = self._mmvq(c, st, loc(n).addr, x, xl.addr, blocks, qtype, n_out, n_in, row_bytes, n_tok, xs, copied)
                recs[-1][18] = bias
                return recs
            if n_tok > self.rt.max_tokens:
                raise Refused(f"a batch of {n_tok} tokens (prompts stay on the cuBLAS path)")
            if k != n_in or (xs != n_in and n_tok > 1) or xl.addr % 16:
                raise Refused(f"MUL_MAT {n.name}: input rows the matrix-vector kernel cannot read")
            dst = loc(n)
            r = [0] * WIDTH
            r[0], r[1], r[2], r[3] = MUL_MAT_W, dst.addr, xl.addr, blocks
            r[6], r[7], r[8], r[9], r[10], r[11], r[18] = n_tok, n_in, xs, qtype, n_out, row_bytes, bias
            if "glu" in st.extra:  # the GLU's result (contiguous rows of n_ff), the product never stored
                r[0], r[10], r[12] = MUL_MAT_GLU, n_out // 2, _epilogue(st.extra["glu"])
            return [r]
        if st.code == MUL_MAT_ID_Q:
            if "glu" not in st.extra:
                r = self._mul_mat_id(c, st.extra.get("mm", n), loc, dst=loc(n).addr, scratch=st.scratch)
                if "bias" in st.extra:  # the ADD_ID after it as its epilogue
                    r[18], r[19] = self._bias_rows(c, st.extra["bias"])
                return self._mmvq_id(c, st, r)
            r = self._mul_mat_id(c, st.extra["gate"], loc, dst=loc(n).addr, scratch=st.scratch)
            up = self._mul_mat_id(c, st.extra["up"], loc, dst=loc(n).addr, scratch=st.scratch)
            if up[6:16] != r[6:16]:
                raise Refused(f"{n.name}: gate and up experts of different layouts")
            if r[0] == MUL_MAT_ID_GEMM:
                r[23] |= 1  # (a prompt's: the GLU flag; MUL_MAT_ID_GLU's slots otherwise)
            glu = st.extra["glu"]
            r[0], r[16], r[17] = MUL_MAT_ID_GLU if r[0] == MUL_MAT_ID_W else r[0], up[3], _epilogue(glu, ids=True)
            if r[17] == 2:
                r[21], r[22] = _fbits(glu.params["alpha"]), _fbits(glu.params["limit"])
            strides = set()
            for k, slot in (("gate_bias", 18), ("up_bias", 20)):
                if k in st.extra:
                    r[slot], sb = self._bias_rows(c, st.extra[k])
                    strides.add(sb)
            if len(strides) > 1:
                raise Refused(f"{n.name}: gate and up biases of different layouts")
            r[19] = strides.pop() if strides else 0
            return self._mmvq_id(c, st, r)
        if st.code == ADD_ID:
            return [self._add_id(c, n, loc)]
        if st.code == GET_ROWS_F32:
            table, ids = n.src
            tv = self.leaf(table) if table.is_leaf else None
            if tv is None:
                return None  # rows of an activation: the shared record
            try:
                self.rt.array_loc(tv)
                return None  # a plain array (the shared record reads it as rows)
            except Refused:
                pass
            blocks, qtype, n_out, n_in, row_bytes = self.rt.weight(tv)
            c.keep.append(tv)
            il = loc(ids)
            if il.dtype != np.dtype(np.int32) or not il.contiguous():
                raise Refused("GET_ROWS ids that are not int32")
            r = [0] * WIDTH
            r[0], r[1], r[2], r[3] = GET_ROWS_W, loc(n).addr, blocks, il.addr
            r[6], r[7], r[8], r[9], r[10] = ids.n_elements, n_in, row_bytes, n_out, qtype
            return [r]
        if st.code == ROPE:
            return [self._rope(c, n, loc)]
        if st.code == ATTN:
            r = c._record(st, loc) + [0] * (WIDTH - REC)
            r[SCRATCH], r[SPLITS] = c.base + st.scratch[0], self.splits[n]
            return [r]
        return None

    def _gemm(self, c: _Compiler, st: Any, dst: int, x: int, blocks: int, qtype: int, n_out: int, n_in: int,
              row_bytes: int, n_tok: int, k: int, xs: int) -> list[int]:
        """MUL_MAT_GEMM: a prompt's product (with its GLU when the step has one) over the plan's
        GEMM scratches."""
        from .cuda_ops import gemm_tile_rows

        if k != n_in:
            raise Refused(f"MUL_MAT {st.node.name}: input rows of {k} for a matrix of {n_in}")
        r = [0] * WIDTH
        w16, x16, prod, scale = (c.base + off for off in st.scratch)
        r[0], r[1], r[2], r[3], r[4], r[5] = MUL_MAT_GEMM, dst, x, blocks, w16, x16
        r[6], r[7], r[8], r[9], r[10], r[11] = n_tok, n_in, xs, qtype, n_out, row_bytes
        r[13], r[15] = gemm_tile_rows(n_out, n_in, self.gemm_budget), scale
        if "glu" in st.extra:  # the product into its scratch, the GLU's result (n_ff a token) into dst
            op = st.extra["glu"].params.get("op")
            if op not in ("swiglu", "geglu"):
                raise Refused(f"a prompt's GLU {op} (cuda_ops.mul_mat_gemm: swiglu, geglu)")
            r[10], r[12], r[14] = n_out // 2, 1 + int(op == "geglu"), prod
        return r

    def _mmvq(self, c: _Compiler, st: Any, dst: int, xt: Tensor, x: int, blocks: int, qtype: int, n_out: int,
              n_in: int, row_bytes: int, n_tok: int, xs: int, copied: bool) -> list[list[int]]:
        """QUANTIZE_Q8_1 (x into the plan's q8_1 scratch; left out when it holds x's copy already:
        Q, K and V as three products) and MUL_MAT_Q8 (with the GLU when the step has one) over it."""
        xq = c.base + self.q8_off
        out = [] if copied else [self._quantize(c, xt, x, n_tok, n_in, xs)]
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3] = MUL_MAT_Q8, dst, xq, blocks
        r[6], r[7], r[9], r[10], r[11] = n_tok, n_in, qtype, n_out, row_bytes
        if "glu" in st.extra:
            r[10], r[12] = n_out // 2, 1 + _epilogue(st.extra["glu"])
        return out + [r]

    def _copied(self, xt: Tensor, rows: int, n_in: int, sx: int) -> bool:
        """Whether the q8_1 scratch holds the copy of these rows of xt already (a later product of
        the same input reads it)."""
        return self.q8_prev is not None and self.q8_prev[0] is xt and self.q8_prev[1:] == (rows, n_in, sx)

    def _quantize(self, c: _Compiler, xt: Tensor, x: int, rows: int, n_in: int, sx: int) -> list[int]:
        """QUANTIZE_Q8_1: rows of xt (at x, sx apart) into the plan's q8_1 scratch, which then holds
        their copy."""
        q = [0] * WIDTH
        q[0], q[1], q[2], q[6], q[7], q[8] = QUANTIZE_Q8_1, c.base + self.q8_off, x, rows, n_in, sx
        self.q8_prev = (xt, rows, n_in, sx)
        return q

    @staticmethod
    def _id_src(st: Any) -> tuple[Tensor, ...]:
        """(experts, input, ids) of an expert step (the gate's of a fused gate/up step)."""
        return st.extra.get("gate", st.extra.get("mm", st.node)).src[:3]

    def _id_q8(self, st: Any, min_weights: int | None = None) -> bool:
        """Whether an expert step's decode product takes the int8 path: `product_path`'s rule with
        the weights a token reads (n_used experts of M x n_in, twice with the up experts)."""
        w, x, ids = self._id_src(st)
        T, U = ids.shape
        n_out = U * w.shape[1] * (2 if "glu" in st.extra else 1)
        return product_path(n_out, T, w.shape[2], w.type, self.rt.max_tokens, self.q8, min_weights) == "mmvq"

    def _mmvq_id(self, c: _Compiler, st: Any, r: list[int]) -> list[list[int]]:
        """The expert record r (MUL_MAT_ID_W / _GLU) as MUL_MAT_ID_Q8 over x's q8_1 copy, after the
        QUANTIZE_Q8_1 that makes it (none when the scratch holds it), where `_id_q8` says so and
        x's rows are one run the copy can index: the token's one row (gate/up), or a row a pair
        with the tokens' rows n_used apart (down). Else r as it is."""
        if r[0] not in (MUL_MAT_ID_W, MUL_MAT_ID_GLU):
            return [r]
        x = self._id_src(st)[1]
        T, U, n_in, sxt, sxu = r[6], r[7], r[10], r[13], r[14]
        rows, sx, qt, qu = (T, sxt, 1, 0) if sxu == 0 else (T * U, sxu, U, 1)
        if sxu and T > 1 and sxt != U * sxu:
            return [r]
        copied = self._copied(x, rows, n_in, sx)
        if not self._id_q8(st, 0 if copied else None):
            return [r]
        q8 = list(r)
        q8[0], q8[2], q8[13], q8[14], q8[23] = MUL_MAT_ID_Q8, c.base + self.q8_off, qt, qu, rows
        if r[0] == MUL_MAT_ID_W:
            q8[16] = q8[17] = 0
        return [q8] if copied else [self._quantize(c, x, r[2], rows, n_in, sx), q8]

    def _mul_mat_id(self, c: _Compiler, n: Tensor, loc: Callable[[Tensor], Loc], dst: int = 0,
                    scratch: tuple[int, ...] = ()) -> list[int]:
        """MUL_MAT_ID_W: the chosen experts' rows of the stacked matrix (n_expert * M rows) times
        each (token, slot)'s input row (into `dst`: a fused GLU's result; else n's own)."""
        w, x, ids = n.src
        wv = self.leaf(w)
        blocks, qtype, _n_out, n_in, row_bytes = self.rt.weight(wv)
        c.keep.append(wv)
        xl, il = loc(x), loc(ids)
        T, U, M = n.shape
        if xl.dtype != np.dtype(np.float32) or len(xl.shape) != 3 or xl.strides[2] != 1 or xl.shape[2] != n_in:
            raise Refused(f"MUL_MAT_ID {n.name}: input rows the matrix-vector kernel cannot read")
        if il.dtype != np.dtype(np.int32) or len(il.shape) != 2 or il.strides[1] != 1:
            raise Refused(f"MUL_MAT_ID {n.name} ids layout")
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3], r[4] = MUL_MAT_ID_W, dst or loc(n).addr, xl.addr, blocks, il.addr
        r[6], r[7], r[8], r[9], r[10], r[11], r[12] = T, U, M, qtype, n_in, row_bytes, w.shape[0]
        r[13], r[14], r[15] = xl.strides[0], xl.strides[1] if xl.shape[1] > 1 else 0, il.strides[0]
        if T > self.rt.max_tokens:  # a prompt's: grouped by expert, GEMMs (cuda_ops.mul_mat_id_gemm)
            r[0] = MUL_MAT_ID_GEMM
            w16, x16, prod, scale = (c.base + off for off in scratch)
            r[24], r[25], r[26], r[27], r[5] = c.base + self.sort_off, x16, w16, prod, scale
            if self.sorted is ids:  # the same routing as the product before: its grouping and counts
                r[23] |= 2
            self.sorted = ids
        return r

    def _rope(self, c: _Compiler, n: Tensor, loc: Callable[[Tensor], Loc]) -> list[int]:
        x, pos = loc(n.src[0]), loc(n.src[1])
        if x.dtype != np.dtype(np.float32) or len(x.shape) != 3 or x.strides[2] != 1 \
                or pos.dtype != np.dtype(np.int32) or not pos.contiguous():
            raise Refused("a ROPE layout")
        p = n.params
        r = [0] * WIDTH
        if p.get("yarn"):
            key = (p["n_dims"], p["freq_base"], p["freq_scale"], tuple(p["yarn"]))
            if key not in self.yarn:
                self.yarn[key] = self.const(yarn_table(*key), c.keep)
            r[15] = self.yarn[key]
        r[0], r[1], r[2], r[3] = ROPE, loc(n).addr, x.addr, pos.addr
        if len(n.src) > 2:
            f = loc(n.src[2])
            if f.dtype != np.dtype(np.float32) or not f.contiguous():
                raise Refused("rope_freqs of another type")
            r[4] = f.addr
        T, H, D = x.shape
        r[6], r[7], r[8], r[9], r[10], r[11], r[12] = T, H, D, x.strides[0], x.strides[1], p["n_dims"], \
            int(p["mode"] == 2)  # fmt: skip
        r[13], r[14] = _fbits(p["freq_base"]), _fbits(p["freq_scale"])
        return r

    def _bias_rows(self, c: _Compiler, n: Tensor) -> tuple[int, int]:
        """The bias an ADD_ID (a float32 matrix of n_expert rows) or an ADD after a product (a
        float32 vector) adds, on the device: (address, row stride in floats)."""
        op = n.op.name
        bv = self.leaf(n.src[1]) if n.src[1].is_leaf else None
        if bv is None:
            raise Refused(f"{op} {n.name}: biases that are not a weight")
        try:
            bl = self.array_loc(bv, c.keep)
            if bl.dtype != np.dtype(np.float32) or bl.strides[-1] != 1:
                raise Refused(f"{op} {n.name}: biases of type {bl.dtype}")
            return bl.addr, bl.strides[0]
        except Refused:
            b, qtype, _n_out, _n_in, row_bytes = self.rt.weight(bv)
            c.keep.append(bv)
            if qtype != int(GGMLType.F32):
                raise Refused(f"{op} {n.name}: biases of type {GGMLType(qtype).name}") from None
            return b, row_bytes // 4

    def _add_id(self, c: _Compiler, n: Tensor, loc: Callable[[Tensor], Loc]) -> list[int]:
        """ADD_ID: the shared record's layout over the bias rows on the device."""
        a, ids = loc(n.src[0]), loc(n.src[2])
        n_expert = n.src[1].shape[0]
        b, sb = self._bias_rows(c, n)
        if a.dtype != np.dtype(np.float32) or ids.dtype != np.dtype(np.int32) or ids.strides[-1] != 1:
            raise Refused(f"ADD_ID {n.name}: a layout")
        rows, cols, sa = a.rows()
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3], r[4] = ADD_ID, loc(n).addr, a.addr, b, ids.addr
        r[6], r[7], r[8], r[9], r[10], r[11], r[12] = rows, cols, sa, n.shape[1], ids.strides[0], n_expert, sb
        return r

    def finish(self, c: _Compiler, recs: list[list[int]], masks: list[tuple[Tensor, _Slot, np.ndarray]],
               exports: list[tuple[Tensor, Any]]) -> None:
        for r in recs:
            r.extend([0] * (WIDTH - len(r)))
        if len(masks) * 4 > HEAD:
            raise Refused(f"{len(masks)} masks (count slots for {HEAD // 4})")
        for i, (_t, _slot, rows) in enumerate(masks):
            for j in rows:
                recs[j][COUNT] = c.base + 4 * i
        spans = [(c.base + s.off, c.base + s.off + _extent(s)) for _t, s in exports if isinstance(s, _Slot)]
        recs[:] = _fuse_rope_qkv(recs, spans)  # (after the count slots: it changes the records' indices)
        recs[:] = _fuse_router(recs, spans)
        recs[:] = _fuse_router_topk(recs, spans)
        recs[:] = _fuse_norm_q8(_hoist_q8(recs))


@dataclass(eq=False)
class ArenaValue:
    """A plan's export where its launches left it (ggml's split outputs, read in place): `addr` in
    the device arena, laid out as `slot`. Valid until another plan of the device runs, which first
    gives it a device copy (`own`, by `settle`); readers that keep it past that point use `own()`."""

    rt: Runtime
    addr: int
    slot: _Slot
    owner: Any  # the plans' arena (kept alive with the value)
    array: Any = None  # its own device copy, once made

    @property
    def nbytes(self) -> int:
        return _extent(self.slot)

    def contiguous(self) -> bool:
        """Whether its bytes are one run (a D2H copy reads them straight from the arena)."""
        want = self.slot.dtype.itemsize
        for d, st in zip(reversed(self.slot.shape), reversed(self.slot.strides)):
            if d != 1 and st != want:  # (strides in bytes)
                return False
            want *= d
        return True

    def own(self) -> Any:
        """Its own device array (a copy out of the arena, queued on the stream once)."""
        if self.array is None:
            self.array = self.rt.copy_out(self.addr, self.slot, self.owner)
        return self.array


def settle(rt: Runtime) -> None:
    """Before a plan writes the arena: every export of the last plan still read by someone gets
    its own copy (queued before the writes, so it copies the values as they were)."""
    for ref in rt.exported:
        v = ref()
        if v is not None:
            v.own()
    rt.exported = []


def own_values(env: dict[Tensor, Any], nodes: Sequence[Tensor]) -> None:
    """The ArenaValues `nodes` read replaced in `env` by their own device arrays: for readers that
    keep what they read (run_nodes' views may outlive the arena's contents)."""
    for n in nodes:
        for t in n.src:
            v = env.get(t)
            if isinstance(v, ArenaValue):
                env[t] = v.own()


@dataclass
class GPUPlan:
    """A compiled GPU split: records over the device arena, their launches, the graph."""

    built: Built
    rt: Runtime
    in_bytes: int  # the arena's [0, in_bytes): every value written before the launches
    launches: list[Callable[[], None]] = field(default_factory=list)
    graph: Any = None
    direct: str = ""  # why the launches run directly ("" while a graph may be captured)
    n_runs: int = 0
    n_captures: int = 0
    _views: Any = None  # (mirror, input views, mask views, count slots, the region): made once per mirror
    host_inputs = True  # the scheduler hands host values over as they are (they go to the mirror)

    def __post_init__(self) -> None:
        self.launches = [self.rt.prepare(r) for r in self.built.recs]
        if not graphs_enabled():
            self.direct = "LLAMAPY_CUDA_GRAPHS=0"
        elif np.isin(self.built.recs[:, 0], (MUL_MAT_GEMM, MUL_MAT_ID_GEMM)).any():
            self.direct = GEMM_DIRECT + (MOE_SYNC if (self.built.recs[:, 0] == MUL_MAT_ID_GEMM).any() else "")
        self._capture()

    def _capture(self) -> None:
        """Record the launches into a graph now, before any run: a capture executes nothing, so
        a launch the kernels refuse (UnsupportedError) refuses the plan when it is made."""
        if self.direct:
            return
        try:
            self.graph = self.rt.capture(self.launches)
            self.n_captures += 1
        except Refused as e:
            self.direct = f"capture failed: {e}"

    @property
    def recs(self) -> np.ndarray:
        return self.built.recs

    def _move(self, base: int) -> None:
        """The arena was made again (larger): the records' addresses move, their launches and
        graph are made again."""
        b = self.built
        b.recs[b.moves] += base - b.base
        b.base = base
        self.launches = [self.rt.prepare(r) for r in b.recs]
        self.graph = None
        self._capture()

    def summary(self) -> str:
        b = self.built
        counts = op_counts(b.recs, {}, {**OP_NAMES, **NAMES})
        how = f"direct launches ({self.direct})" if self.direct else "one CUDA graph"
        return (f"GPU plan: {len(b.recs)} launches for {b.n_nodes} nodes ({b.n_fused} fused), {how}, "
                f"arena {b.nbytes / 1024:.0f} KiB, inputs {self.in_bytes} B in one copy, "
                f"{len(b.exports)} exports [{counts}]")

    def compute(self, env: dict[Tensor, Any]) -> None:
        """One step: the last plan's exports settled, the inputs into the pinned mirror, one H2D
        copy, the graph (or the launches), the exports left in the arena as ArenaValues. Nothing
        here waits for the device."""
        b, rt = self.built, self.rt
        settle(rt)  # (before the arena can move or be written)
        base = b.arena.ensure(b.nbytes)
        if base != b.base:
            self._move(base)
        mirror = rt.pinned(self.in_bytes)
        if self._views is None or self._views[0] is not mirror:  # views of the mirror, made once
            self._views = (mirror, [_view(mirror, s) for _t, s in b.inputs], [_view(mirror, s) for _t, s, _r in b.masks],
                           mirror[:HEAD].view(np.int32), mirror[: self.in_bytes])  # fmt: skip
        _m, ins, masks, counts, region = self._views
        late: list[tuple[int, Any]] = []  # inputs already on the device: copied after the mirror
        for (t, slot), view in zip(b.inputs, ins):
            v = env[t]
            if isinstance(v, np.ndarray):
                view[...] = v
            else:
                late.append((base + slot.off, v.own() if isinstance(v, ArenaValue) else v))
        for i, (t, slot, _rows) in enumerate(b.masks):
            v = env[t]
            if not isinstance(v, np.ndarray):
                v = rt.host(v.own() if isinstance(v, ArenaValue) else v)  # (a mask made on a device: rare)
            n = v.shape[-1]  # the cells attended
            if not 0 < n <= slot.shape[-1]:
                raise LlamapyError(f"GPU plan: a {list(v.shape)} mask for {list(slot.shape)}")
            masks[i][..., :n] = v
            counts[i] = n
        rt.h2d(base, region)
        for addr, v in late:
            rt.d2d(addr, v)
        if self.graph is not None:
            rt.replay(self.graph)
        else:
            for launch in self.launches:
                launch()
        self.n_runs += 1
        made = [ArenaValue(rt, base + slot.off, slot, b.arena) for _t, slot in b.exports]
        for (t, _slot), v in zip(b.exports, made):
            env[t] = v
        rt.exported = [weakref.ref(v) for v in made]
        rt.done()


def _reads(r: list[int]) -> list[int]:
    """The arena addresses a record may read (its sources; a fused RMS_NORM's ADD operands)."""
    return [r[k] for k in (2, 3, 4, 5)] + ([r[10]] if r[0] in (RMS_NORM, ROPE_QKV) else [])


def _dead_after(recs: list[list[int]], k0: int, lo: int, hi: int, exports: list[tuple[int, int]]) -> bool:
    """Whether the value in [lo, hi) is read by no record from k0 on until one writes there (the
    allocator reused its memory: it was dead), and is no export."""
    for r in recs[k0:]:
        if any(lo <= a < hi for a in _reads(r)):
            return False
        if r[1] < hi and lo < r[1] + _written(r) or (r[0] == RMS_NORM and lo <= r[10] < hi):
            return True
    return not any(a < hi and lo < b for a, b in exports)


_ROWS_OUT = frozenset({ADD, MUL, DIV, SCALE, CPY, SWIGLU, GEGLU, SOFT_MAX, CLAMP, ARGSORT, ADD_ID})


def _written(r: list[int]) -> int:
    """Bytes a record writes from r[1] where the products' extents are known (T x rows floats;
    a write over any part of a value shows it dead), else 1."""
    if r[0] in (MUL_MAT_ID_W, MUL_MAT_ID_GLU, MUL_MAT_ID_GEMM, MUL_MAT_ID_Q8):
        return 4 * r[6] * r[7] * r[8]
    if r[0] in _ROWS_OUT:  # contiguous rows (r[6]) of r[7] values
        return 4 * r[6] * r[7]
    return 4 * r[6] * r[10] if r[0] in (MUL_MAT_W, MUL_MAT_GLU, MUL_MAT_GEMM, MUL_MAT_Q8) else 1


def _fuse_windows(recs: list[list[int]], n: int,
                  fuse: Callable[[list[list[int]], int], list[int] | None]) -> list[list[int]]:
    """The records with each window of n, from record i, that `fuse(window, i)` turns into one
    record replaced by it (a window past the end is padded with empty records)."""
    out: list[list[int]] = []
    i = 0
    while i < len(recs):
        r = fuse((recs[i:i + n] + [[0] * WIDTH] * n)[:n], i)
        out.append(recs[i] if r is None else r)
        i += 1 if r is None else n
    return out


def _hoist_q8(recs: list[list[int]]) -> list[list[int]]:
    """Each QUANTIZE_Q8_1 of an RMS_NORM's result moved to just after that norm (for
    `_fuse_norm_q8`) when no record between writes the value or touches the q8_1 scratch: a MoE
    layer's normed row is read by the router's records before the gate/up experts' copy is made.
    The copy is the same: the value does not change between (no record writes it), and nothing
    between reads or writes the scratch."""
    out: list[list[int]] = []
    for r in recs:
        j = len(out)
        if r[0] == QUANTIZE_Q8_1:
            while j > 0 and out[j - 1][1] != r[2] and out[j - 1][0] not in (QUANTIZE_Q8_1, MUL_MAT_Q8, MUL_MAT_ID_Q8) \
                    and not (out[j - 1][0] == RMS_NORM and out[j - 1][16]):
                j -= 1
            if j == 0 or out[j - 1][0] != RMS_NORM or out[j - 1][1] != r[2]:
                j = len(out)
        out.insert(j, r)
    return out


def _fuse_norm_q8(recs: list[list[int]]) -> list[list[int]]:
    """An RMS_NORM and the QUANTIZE_Q8_1 of its result just after it (the layer's norm before
    the int8 Q/K/V and gate/up products, the output norm before the output matrix) as one record:
    slot 16 the q8_1 copy, which norm.cu writes beside y from the same float32 values (the same
    bits: one launch less, 2 a layer and 1 a token on an 8B). The norm's rows must be the copy's:
    one group of rows (no per-head tokens), y's contiguous rows of n."""

    def fuse(w: list[list[int]], _i: int) -> list[int] | None:
        norm, q = w
        if norm[0] != RMS_NORM or q[0] != QUANTIZE_Q8_1 or norm[13] or q[2] != norm[1] or q[6] != norm[6] \
                or not q[7] == q[8] == norm[7]:
            return None
        r = list(norm)
        r[16] = q[1]
        return r

    return _fuse_windows(recs, 2, fuse)


def _fuse_rope_qkv(recs: list[list[int]], exports: list[tuple[int, int]]) -> list[list[int]]:
    """ROPE(Q), ROPE(K), SET_ROWS(K) of that roped K, SET_ROWS(V) (build_attn's order) as one
    ROPE_QKV record where the kernel can take them: Q, K and V rows with one stride and heads
    packed, the same positions, rope and cells, float32 rows, the roped K read by nothing else."""
    from .executor import SET_ROWS

    def fuse(w: list[list[int]], i: int) -> list[int] | None:
        q, k, sk, sv = w
        T, H, D, Hkv = q[6], q[7], q[8], k[7]
        ok = (q[0], k[0], sk[0], sv[0]) == (ROPE, ROPE, SET_ROWS, SET_ROWS) and sk[4] == k[1] \
            and (T == 1 or q[9] == k[9] == sv[8]) and q[10] == k[10] == D and k[8] == D and k[6] == T \
            and q[3] == k[3] and q[11:16] == k[11:16] and q[4] == k[4] and sk[3] == sv[3] and sk[9] == sv[9] \
            and sk[6] == sv[6] == T and sk[7] == Hkv * D and sv[7] % Hkv == 0 \
            and _dead_after(recs, i + 4, k[1], k[1] + 4 * T * Hkv * D, exports)
        if not ok:
            return None
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3], r[4], r[5], r[10] = ROPE_QKV, q[1], q[2], q[3], sk[3], k[2], sv[4]
        r[6], r[7], r[8], r[9], r[11], r[12], r[13], r[14] = T, H, D, q[9], q[11], q[12], q[13], q[14]
        r[15], r[16], r[17], r[18] = Hkv, sv[7] // Hkv, q[4], sk[9]
        r[19], r[20], r[21], r[22] = sk[1], sk[10], sk[11], sk[12]
        r[23], r[24], r[25], r[26], r[27] = sv[1], sv[10], sv[11], sv[12], q[15]
        return r

    return _fuse_windows(recs, 4, fuse)


def _fuse_router(recs: list[list[int]], exports: list[tuple[int, int]]) -> list[list[int]]:
    """SOFT_MAX, ARGSORT of its result, the batched GET_ROWS of the chosen probabilities, SUM_ROWS,
    CLAMP and the DIV by one value a row (build_moe_ffn's order) as one ROUTER record, where each
    reads the one before as the kernel does and the probabilities, the chosen ones, their sum and
    its clamp are read by nothing after (the ids and the weights are kept)."""
    from .executor import GET_ROWS_B, SUM_ROWS

    def fuse(w: list[list[int]], i: int) -> list[int] | None:
        sm, a, g, sr, cl, d = w
        T, E = sm[6], sm[7]
        U = g[7]
        ok = (sm[0], a[0], g[0], sr[0], cl[0], d[0]) == (SOFT_MAX, ARGSORT, GET_ROWS_B, SUM_ROWS, CLAMP, DIV) \
            and a[2] == g[2] == sm[1] and a[6:9] == [T, E, E] and g[3] == a[1] and g[6] == T and g[8] == 1 \
            and g[9:13] == [E, 1, E, E] and 0 < U <= E and sr[2] == g[1] and sr[6:9] == [T, U, U] \
            and cl[2] == sr[1] and cl[6:9] == [T, 1, 1] and d[2] == g[1] and d[3] == cl[1] and d[10] == 1 \
            and d[6:10] == [T, U, U, 1]
        if ok:
            # the kernel's results: the ids (the logits' rows in place, each read before it is
            # written) and the weights (apart from the logits); what the chain wrote over the
            # intermediates is those results, so only the rest of each must be dead after it
            x, kept = (sm[2], sm[2] + 4 * ((T - 1) * sm[8] + E)), [(a[1], a[1] + 4 * T * E), (d[1], d[1] + 4 * T * U)]
            ok = (not _overlap(x, kept[0]) or (a[1] == x[0] and sm[8] == E)) and not _overlap(x, kept[1]) \
                and all(_dead_after(recs, i + 6, lo, hi, exports)
                        for r0, n in ((sm[1], 4 * T * E), (g[1], 4 * T * U), (sr[1], 4 * T), (cl[1], 4 * T))
                        for lo, hi in _minus((r0, r0 + n), kept))
        if not ok:
            return None
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3] = ROUTER, d[1], sm[2], a[1]
        r[6], r[7], r[8], r[9], r[10], r[11], r[12] = T, E, sm[8], sm[9], U, cl[9], cl[10]
        return r

    return _fuse_windows(recs, 6, fuse)


def _fuse_router_topk(recs: list[list[int]], exports: list[tuple[int, int]]) -> list[list[int]]:
    """gpt-oss's routing ("softmax_weight": ARGSORT of the logits, the batched GET_ROWS of the
    chosen ones, their SOFT_MAX) as one ROUTER_TOPK record (moe.cu's router_topk_f32), where each
    reads the one before, the chosen logits are read by nothing after, and the ids and weights
    lie over no other token's logits (a block reads its own row before it writes)."""
    from .executor import GET_ROWS_B

    def fuse(w: list[list[int]], i: int) -> list[int] | None:
        a, g, sm = w
        T, E, U = a[6], a[7], g[7]
        ok = (a[0], g[0], sm[0]) == (ARGSORT, GET_ROWS_B, SOFT_MAX) and g[2] == a[2] and g[3] == a[1] \
            and g[6] == T and g[8] == 1 and g[9:13] == [a[8], 1, E, E] and 0 < U <= E and sm[2] == g[1] \
            and sm[6:9] == [T, U, U]
        if ok:
            x = (a[2], a[2] + 4 * ((T - 1) * a[8] + E))
            kept = [(a[1], a[1] + 4 * T * E), (sm[1], sm[1] + 4 * T * U)]
            ok = (T == 1 or not any(_overlap(x, k) for k in kept)) \
                and all(_dead_after(recs, i + 3, lo, hi, exports) for lo, hi in _minus((g[1], g[1] + 4 * T * U), kept))
        if not ok:
            return None
        r = [0] * WIDTH
        r[0], r[1], r[2], r[3] = ROUTER_TOPK, sm[1], a[2], a[1]
        r[6], r[7], r[8], r[9], r[10] = T, E, a[8], sm[9], U
        return r

    return _fuse_windows(recs, 3, fuse)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _minus(r: tuple[int, int], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the byte range r outside the ranges `cut`."""
    parts = [r]
    for c0, c1 in cut:
        parts = [q for lo, hi in parts for q in ((lo, min(hi, c0)), (max(lo, c1), hi)) if q[0] < q[1]]
    return parts


def _epilogue(glu: Tensor, ids: bool = False) -> int:
    """A product's GLU epilogue code: 0 SwiGLU, 1 GEGLU, 2 swiglu_oai (the expert products'
    only: mmv_id's epilogue has it, mmv_glu's not — no dense gpt-oss FFN)."""
    op = glu.params.get("op")
    if op not in ("swiglu", "geglu", "swiglu_oai") or (op == "swiglu_oai" and not ids):
        raise Refused(f"a product with a {op} epilogue")
    return ("swiglu", "geglu", "swiglu_oai").index(str(op))


def _fbits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def _view(mirror: np.ndarray, slot: _Slot) -> np.ndarray:
    return np.ndarray(slot.shape, slot.dtype, buffer=mirror, offset=slot.off, strides=slot.strides)


def compile_split(nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any],
                  rt: Runtime, cpu_matmul: str = "q8") -> GPUPlan | Refusal:
    """A split's GPU plan over `rt`'s arena, or a Refusal saying why it runs node by node.
    `cpu_matmul`: the context's MUL_MAT mode ("q8": the large decode products on int8; "f32")."""
    try:
        built = _Compiler(nodes, exports, GPUTarget(rt, cpu_matmul == "q8"), allocate).build(rt.arena)
        if built.pre:
            raise Refused("GET_ROWS expanded in Python")
        ends = [s.off + _extent(s) for _t, s in built.inputs] + [s.off + _extent(s) for _t, s, _r in built.masks]
        in_bytes = max([HEAD, *ends])
        _reserve_for_largest_batch(built, rt)
        return GPUPlan(built, rt, in_bytes)
    except (Refused, UnsupportedError) as e:
        return Refusal(str(e))


def arena_bytes(nodes: Sequence[Tensor], exports: Sequence[Tensor], allocate: Callable[..., Any], buft: Any,
                max_tokens: int, n_sm: int, cpu_matmul: str = "q8") -> int | None:
    """The device arena a split's GPU plan will take, from its tensors alone (the fit plans on
    dry buffers, before anything is loaded): the record compiler's steps and allocator offsets
    after HEAD (the steps' scratches among them: `GPUTarget.step_scratch`), then
    `GPUTarget.scratch` (the q8_1 copy, a prompt's expert grouping) — the passes `compile_split`
    runs —, a decode plan scaled as `_reserve_for_largest_batch`
    grows the arena. None when the compiler refuses the split (it runs node by node); a refusal
    only the records would make (a layout) is not seen here. `allocate`: compile_split's."""
    t = _DryTarget(_DryRuntime(buft, max_tokens, n_sm), cpu_matmul == "q8")
    try:
        c = _Compiler(nodes, exports, t, allocate)
        c.steps_pass()
        c.alloc()
        nbytes = t.scratch(c, c.arena_size)
    except (Refused, UnsupportedError):
        return None
    tokens = [_tokens(st) for st in c.steps if st.code == MUL_MAT]
    if any(n > max_tokens for n in tokens) or any(st.node.shape[0] > max_tokens for st in c.steps if st.code == MUL_MAT_ID_Q):
        return nbytes  # (a prompt's plan: not scaled)
    return _largest_batch_bytes(nbytes, min(tokens, default=0), max_tokens)


def _tokens(st: Any) -> int:
    x = st.extra.get("mm", st.node).src[1]
    return x.n_elements // max(x.shape[-1], 1)


def _largest_batch_bytes(nbytes: int, n_tok: int, max_tokens: int) -> int:
    """A decode plan's arena scaled to the largest batch (see _reserve_for_largest_batch)."""
    return -(-nbytes * max_tokens // n_tok) if 0 < n_tok < max_tokens else nbytes


@dataclass
class _DryRuntime:
    """What GPUTarget's sizing reads of a runtime: the buffer type, the batch limit, the split
    of the attention's cells (cuda_ops' choice for n_sm SMs; 0: never split)."""

    buft: Any
    max_tokens: int
    n_sm: int

    def attn_split(self, n_tokens: int, n_head: int, n_head_kv: int, n_cells: int, dv: int) -> tuple[int, int]:
        from .cuda_ops import fattn_scratch_floats, fattn_splits

        n = fattn_splits(n_tokens, n_head_kv, n_cells, self.n_sm)
        return n, 4 * fattn_scratch_floats(n_tokens, n_head, dv, n)


class _DryTarget(GPUTarget):
    """GPUTarget over tensors without memory: a leaf in the device's buffer type is its own value."""

    def storage(self, r: Tensor) -> Any:
        return r

    def id_type(self, n: Tensor) -> int | None:
        return int(n.src[0].root().type) if self.leaf(n.src[0]) is not None else None


def _reserve_for_largest_batch(built: Built, rt: Runtime) -> None:
    """Grow the arena now to what a plan of the largest batch (rt.max_tokens) would take, before
    this plan is captured: a server's steps of 1..8 sequences each get their plan and graph the
    first time their size occurs, and a later, larger one must not make the arena grow, which
    would move every earlier plan and capture it again. Estimated from this plan's size scaled by
    max_tokens / the fewest rows a product of it takes (its values grow with its tokens and
    outputs, its fixed part does not: an over-estimate); a plan that still outgrows it moves the
    others, as before."""
    n_tok = min((int(r[6]) for r in built.recs if r[0] in (MUL_MAT_W, MUL_MAT_GLU, MUL_MAT_Q8)), default=0)
    if not 0 < n_tok < rt.max_tokens or np.isin(built.recs[:, 0], (MUL_MAT_GEMM, MUL_MAT_ID_GEMM)).any():
        return  # (a prompt's plan: larger than any decode plan already; its 1-token tail is no guide)
    base = rt.arena.ensure(_largest_batch_bytes(built.nbytes, n_tok, rt.max_tokens))
    if base != built.base:  # (the block was made again: the records not yet launched move)
        built.recs[built.moves] += base - built.base
        built.base = base


def _extent(s: _Slot) -> int:
    """Bytes from a slot's first element past its last."""
    if not s.shape or 0 in s.shape:
        return s.dtype.itemsize
    return sum((d - 1) * st for d, st in zip(s.shape, s.strides)) + s.dtype.itemsize
