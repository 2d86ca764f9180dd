"""GGUF -> weights placed on devices (llama.cpp's src/llama-model.cpp: `load_tensors`).

Which tensors exist and their shapes come from the architecture's spec (llamapy/models); this
module only finds them in the file, checks them, and places and loads them.

`-ngl` decides where weights live — and only that; the scheduler then follows the weights. The
rule is llama.cpp's: `i_gpu_start = max(n_layer + 1 - ngl, 0)`; repeating layers `il >=
i_gpu_start` and the output layer (index `n_layer`) go to the GPU; the input embedding always
stays on the CPU (a GET_ROWS of a few rows gains nothing from a GPU). A tied output (no
`output.weight`) is a second copy of `token_embd` in the output layer's buffer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import MODEL_TENSOR

from ..backend.interface import Buffer, BufferUsage, Device
from ..models import architecture
from ..models.base import HParams
from ..tensor import Tensor, TensorFlag
from ..types import SUPPORTED_TYPES, DeviceType, GGUFError, LlamapyError, OutOfMemoryError, UnsupportedError
from .gguf import GGUFFile


@dataclass
class Placement:
    """Where each layer's weights live: index n_layer is the output layer."""

    layer_device: list[Device]  # n_layer + 1 entries
    n_gpu_layers: int
    i_gpu_start: int
    cpu: Device


def select_devices(available: Sequence[Device], names: Sequence[str] | None) -> list[Device]:
    """`-dev A,B` (llama.cpp's `--device`): the GPUs to offload to, in that order; `none` offloads
    nothing. Host and accelerator devices (CPU, BLAS) are always used. A name that matches no
    device is an error, not silently dropped."""
    if not names:
        return list(available)
    by_name = {d.name.upper(): d for d in available}
    wanted = [n.strip() for n in names if n.strip()]
    gpus: list[Device] = []
    for n in wanted:
        if n.lower() == "none":
            continue
        dev = by_name.get(n.upper())
        if dev is None:
            known = ", ".join(d.name for d in available)
            raise LlamapyError(f"-dev {','.join(wanted)}: no device named {n!r} (available: {known}, none)")
        if dev.type is DeviceType.GPU and dev not in gpus:
            gpus.append(dev)
    if any(n.lower() == "none" for n in wanted) and gpus:
        raise LlamapyError(f"-dev {','.join(wanted)}: 'none' cannot be combined with device names")
    return gpus + [d for d in available if d.type is not DeviceType.GPU]


def override_devices(
    overrides: Sequence[tuple[str, str]], discovery: Any, in_use: Sequence[Device]
) -> list[tuple[str, Device]]:
    """`-ot REGEX=DEVICE` with each device resolved: unknown names fail as in discovery, and a
    device that `-dev` left out fails too (no backend of this context could read its buffer)."""
    out = []
    for pattern, name in overrides:
        dev = discovery.device(name)
        if dev not in in_use:
            used = ", ".join(d.name for d in in_use)
            raise LlamapyError(f"-ot {pattern}={name}: {dev.name} is not among the devices in use ({used}; see -dev)")
        out.append((pattern, dev))
    return out


# llama.cpp's LLM_FFN_EXPS_REGEX (common.h): every expert tensor of a layer (`ffn_up_exps`, …)
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def expert_overrides(n_layers: int | None) -> list[tuple[str, str]]:
    """`--cpu-moe` (n_layers None: every layer's experts) and `--n-cpu-moe N` (the experts of the
    first N layers) as the `-ot` entries llama.cpp makes of them (llm_ffn_exps_cpu_override,
    llm_add_n_cpu_ffn_overrides): the experts stay in host memory, attention and the router
    follow -ngl."""
    if n_layers is None:
        return [(FFN_EXPS_REGEX, "CPU")]
    if n_layers < 0:
        raise LlamapyError(f"--n-cpu-moe {n_layers}: must be >= 0")
    return [(rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n_layers)]


def check_split_options(tensor_split: Sequence[float], main_gpu: int, gpus: Sequence[Device]) -> None:
    """`-ts` proportions are finite and >= 0, and name no more GPUs than there are; `-mg` is the
    index of one of the GPUs (llama.cpp: "invalid value for main_gpu")."""
    text = ",".join(f"{x:g}" for x in tensor_split)
    for x in tensor_split:
        if not math.isfinite(x) or x < 0:
            raise LlamapyError(f"-ts {text}: each proportion must be a number >= 0")
    names = ", ".join(f"{i} = {d.name}" for i, d in enumerate(gpus))
    if gpus and len(tensor_split) > len(gpus) and any(tensor_split[len(gpus) :]):
        raise LlamapyError(f"-ts {text}: {len(tensor_split)} proportions for {len(gpus)} GPU(s) ({names})")
    if main_gpu != 0 and not 0 <= main_gpu < len(gpus):
        where = f"GPUs: {names}" if gpus else "no GPU is in use"
        raise LlamapyError(f"-mg {main_gpu}: no such GPU ({where})")


def split_proportions(gpus: Sequence[Device], tensor_split: Sequence[float], cpu: Device) -> list[float]:
    """How the offloaded layers divide between the GPUs: `-ts` when it has a non-zero entry, else
    each GPU's free memory (llama.cpp's default, split mode "layer"); a device that reports no
    memory at all counts with the host's, as llama.cpp does."""
    ts = [float(x) for x in tensor_split[: len(gpus)]] + [0.0] * max(len(gpus) - len(tensor_split), 0)
    if any(x > 0 for x in ts):
        return ts
    out = []
    for d in gpus:
        free, total = d.memory()
        if free == 0 and total == 0:
            free = cpu.memory()[0]
        out.append(float(max(free, 0)))
    return out


def place_layers(n_layer: int, ngl: int, cpu: Device, gpus: Sequence[Device], split: Sequence[float] = ()) -> Placement:
    """llama.cpp's rule: the last `ngl` of the n_layer+1 layers (the output counts as one) go to
    the GPUs, in contiguous runs in the ratio `split` (one proportion per GPU, see
    `split_proportions`; empty or all zero: equal shares)."""
    n_total = n_layer + 1
    if ngl < 0 or ngl > n_total:
        ngl = n_total  # clamp, as llama.cpp does
    if not gpus:
        ngl = 0
    i_gpu_start = max(n_total - ngl, 0)
    devices: list[Device] = [cpu] * n_total
    if ngl:
        weights = [float(x) for x in split[: len(gpus)]] + [0.0] * max(len(gpus) - len(split), 0)
        if not any(x > 0 for x in weights):
            weights = [1.0] * len(gpus)
        total = sum(weights)
        bounds = []  # cumulative fractions, as llama.cpp's `splits`
        acc = 0.0
        for w in weights:
            acc += w / total
            bounds.append(acc)
        for il in range(i_gpu_start, n_total):
            # the first GPU whose split point lies above the layer's fraction (std::upper_bound)
            frac = (il - i_gpu_start) / ngl
            g = next((i for i, b in enumerate(bounds) if frac < b), len(gpus) - 1)
            devices[il] = gpus[g]
    return Placement(devices, ngl, i_gpu_start, cpu)


@dataclass
class ModelWeights:
    tok_embd: Tensor
    output_norm: Tensor
    output: Tensor
    layers: list[dict[str, Tensor]]
    rope_freqs: Tensor | None
    cls_out: Tensor | None = None  # a reranker's classifier head (n_cls_out, E)
    buffers: list[Buffer] = field(default_factory=list)
    placement: Placement | None = None
    tied_output: bool = False

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers.clear()


def _weight(gf: GGUFFile, name: str, expect: tuple[int, ...] | None) -> Tensor:
    info = gf.tensors.get(name)
    if info is None:
        raise GGUFError(f"missing tensor {name!r}")
    if info.type not in SUPPORTED_TYPES:
        raise UnsupportedError(f"tensor {name!r} has quant type {info.type.name}, which llamapy does not support")
    if expect is not None and tuple(info.shape) != expect:
        raise GGUFError(f"tensor {name!r} has shape {list(info.ne)}, expected {list(reversed(expect))}")
    return Tensor(name, tuple(info.shape), info.type, flags=TensorFlag.WEIGHT)


FUSED_FROM = "fused_from"  # Tensor.params key: the GGUF tensors a fused weight concatenates


def _fuse(layer: dict[str, Tensor], il: int, parts: tuple[str, ...], name: str) -> None:
    """Replace matrices that multiply the same input by one whose rows are theirs, stacked:
    one MUL_MAT instead of several (llama.cpp's wqkv / ffn_gate_up when a model ships them).
    Only matrices of one type can share a buffer of quantized blocks. Their biases (qwen2's and
    gpt-oss's Q/K/V) are stacked alike into `{name}.bias` (llama.cpp's bqkv: one ADD after the
    product), when every part has one and all are of one type; when only some have one, the
    parts stay apart."""
    ts = [layer[k] for k in parts]
    bs = [layer.get(f"{k}.bias") for k in parts]
    biased = [b for b in bs if b is not None]
    if len({t.type for t in ts}) != 1 or len(biased) not in (0, len(parts)) or len({b.type for b in biased}) > 1:
        return
    rows = sum(t.shape[0] for t in ts)
    fused = Tensor(f"blk.{il}.{name}.weight", (rows, ts[0].shape[1]), ts[0].type, flags=TensorFlag.WEIGHT)
    fused.params[FUSED_FROM] = tuple(t.name for t in ts)
    for k in parts:
        del layer[k]
        layer.pop(f"{k}.bias", None)
    layer[name] = fused
    if biased:  # (n,) each: one vector of their sum of lengths, read as the parts' bytes in order
        bias = Tensor(f"blk.{il}.{name}.bias", (sum(b.shape[0] for b in biased),), biased[0].type,
                      flags=TensorFlag.WEIGHT)
        bias.params[FUSED_FROM] = tuple(b.name for b in biased)
        layer[f"{name}.bias"] = bias


_GLOBAL = {MODEL_TENSOR.TOKEN_EMBD: "tok_embd", MODEL_TENSOR.OUTPUT_NORM: "output_norm",
           MODEL_TENSOR.OUTPUT: "output", MODEL_TENSOR.ROPE_FREQS: "rope_freqs", MODEL_TENSOR.CLS_OUT: "cls_out"}  # fmt: skip


def collect_weights(gf: GGUFFile, p: HParams, fuse: bool = True, apart: frozenset[str] = frozenset()) -> ModelWeights:
    """Tensor descriptors for every weight of the architecture's spec (llama_model::load_tensors
    with create_tensor): required ones must exist, optional ones are taken when present, and
    every shape is checked against the hyper-parameters. Weights named in `apart` (those a LoRA
    adapter adapts) are not fused with others."""
    glob: dict[str, Tensor | None] = {}
    layers: list[dict[str, Tensor]] = [{} for _ in range(p.n_layer)]
    for spec in architecture(p.arch).tensors(p):
        if not spec.required and spec.name not in gf.tensors:
            if spec.bid is None:
                glob[_GLOBAL[spec.kind]] = None
            continue
        t = _weight(gf, spec.name, spec.shape)
        if spec.bid is None:
            glob[_GLOBAL[spec.kind]] = t
        else:
            layers[spec.bid][spec.key] = t
    if fuse:
        for il, layer in enumerate(layers):
            for parts, name in ((("attn_q", "attn_k", "attn_v"), "attn_qkv"), (("ffn_gate", "ffn_up"), "ffn_gate_up")):
                if all(k in layer and layer[k].name not in apart for k in parts):
                    _fuse(layer, il, parts, name)
    extra = [n for n in gf.tensors if n.startswith(f"blk.{p.n_layer}.")]
    if extra:
        raise GGUFError(f"tensor {extra[0]!r} beyond block_count {p.n_layer}")
    tok = glob["tok_embd"]
    assert tok is not None
    output = glob.get("output")
    tied = output is None
    if output is None:  # llama.cpp's TENSOR_DUPLICATED: the embedding read again
        output = Tensor("output.weight", tok.shape, tok.type, flags=TensorFlag.WEIGHT)
    norm = glob["output_norm"]
    assert norm is not None
    return ModelWeights(tok, norm, output, layers, glob.get("rope_freqs"), glob.get("cls_out"), tied_output=tied)


class ConcatRows:
    """The bytes of a fused weight: its parts' rows stacked, materialized only when a backend
    asks for the array (a backend whose cache already holds the prepared weight never does).
    `axis` 1: the parts are one row each (vectors: a fused bias), joined into one row."""

    def __init__(self, parts: list[np.ndarray], axis: int = 0) -> None:
        self.parts = parts
        self.axis = axis

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate(self.parts, axis=self.axis)
        return out if dtype is None else out.astype(dtype)


def weight_devices(
    w: ModelWeights, placement: Placement, overrides: Sequence[tuple[str, Device]] = ()
) -> dict[Tensor, Device]:
    """Which device holds each weight: the layer rule, then `-ot REGEX=DEVICE` overrides."""
    n_layer = len(w.layers)
    where: dict[Tensor, Device] = {}
    # the input embedding stays on the CPU whatever -ngl says
    where[w.tok_embd] = placement.cpu
    for il, layer in enumerate(w.layers):
        for t in layer.values():
            where[t] = placement.layer_device[il]
    for t in (w.output_norm, w.output):
        where[t] = placement.layer_device[n_layer]
    for t in (w.rope_freqs, w.cls_out):
        if t is not None:
            where[t] = placement.layer_device[n_layer]
    for t in where:
        names = (t.name, *t.params.get(FUSED_FROM, ()))
        for pattern, dev in overrides:
            if any(re.search(pattern, n) for n in names):
                where[t] = dev
                break
    return where


def _by_device(where: dict[Tensor, Device]) -> list[tuple[Device, list[Tensor]]]:
    by_dev: dict[str, tuple[Device, list[Tensor]]] = {}
    for t, dev in where.items():
        by_dev.setdefault(dev.name, (dev, []))[1].append(t)
    return list(by_dev.values())


def _weights_buffer(gf: GGUFFile, dev: Device, tensors: list[Tensor], cpu_matmul: str, key: str,
                    skip: Tensor | None = None) -> Buffer:  # fmt: skip
    """A device's weights buffer for `tensors` (less `skip`), reading from `gf` and caching its
    prepared weights under the file's content `key`."""
    buft = dev.buffer_type()
    buf = buft.alloc_buffer(sum(buft.alloc_size(t) for t in tensors if t is not skip), BufferUsage.WEIGHTS)
    buf.use_cache(key, str(gf.metadata.get("general.name", gf.path.stem)), cpu_matmul)
    buf.use_file(gf)
    return buf


def _set_from_file(gf: GGUFFile, buf: Buffer, t: Tensor, src: str, view: np.ndarray | None = None) -> None:
    buf.set(t, view if view is not None else gf.tensor_bytes(src))
    if buf.copies_weight(t):
        for n in t.params.get(FUSED_FROM, ()) or (src,):
            gf.release_pages(n)  # read once to make the copy; what runs is the copy


def fill_buffers(gf: GGUFFile, where: dict[Tensor, Device], buffers: list[Buffer], cpu_matmul: str = "q8") -> None:
    """Tensors read as the file stores them, each into a weights buffer of its device (appended
    to `buffers`); on OutOfMemoryError those are freed before the error propagates."""
    key = gf.content_key()
    try:
        for dev, tensors in _by_device(where):
            buf = _weights_buffer(gf, dev, tensors, cpu_matmul, key)
            buffers.append(buf)
            for t in tensors:
                buf.alloc_tensor(t)
                _set_from_file(gf, buf, t, t.name)
            buf.finish_loading()
    except OutOfMemoryError:
        for b in buffers:
            b.free()
        buffers.clear()
        raise


def load_weights(gf: GGUFFile, w: ModelWeights, placement: Placement, where: dict[Tensor, Device],
                 cpu_matmul: str = "q8") -> None:
    """Allocate one weights buffer per device and set every tensor from the mapped file
    (host matrices laid out for the `cpu_matmul` mode, ContextOptions.cpu_matmul).

    On OutOfMemoryError everything allocated so far is freed before the error propagates.
    """
    # a tied output in the embedding's own buffer is the same bytes: counted and stored once
    shared_output = w.tied_output and where[w.output] is where[w.tok_embd]
    key = gf.content_key()
    try:
        for dev, tensors in _by_device(where):
            buf = _weights_buffer(gf, dev, tensors, cpu_matmul, key, skip=w.output if shared_output else None)
            w.buffers.append(buf)
            for t in tensors:
                if shared_output and t is w.output:
                    t.buffer = buf
                    buf._store[t] = buf.storage(w.tok_embd)
                    buf._raw[t] = buf.raw(w.tok_embd)
                    continue
                buf.alloc_tensor(t)
                parts = t.params.get(FUSED_FROM, ())
                whole = gf.adjacent_bytes(parts) if parts else None  # the parts' rows in the file: no copy
                if parts and whole is None:
                    rows = ConcatRows([gf.tensor_bytes(n) for n in parts], axis=int(len(t.shape) == 1))
                    buf.set(t, rows)  # type: ignore[arg-type]
                    # the buffer holds the parts stacked (a copy, or views of the repack cache):
                    # the parts' own pages, read to make it, would count in the RSS twice
                    for n in parts:
                        gf.release_pages(n)
                    continue
                _set_from_file(gf, buf, t, "token_embd.weight" if (t is w.output and w.tied_output) else t.name, whole)
            buf.finish_loading()
    except OutOfMemoryError:
        w.free()
        for t in where:
            t.buffer = None
        raise
    w.placement = placement
