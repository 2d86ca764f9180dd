"""Control vectors (llama.cpp's common_control_vector_load and llama_adapter_cvec; the graph's
build_cvec is models/layers.py's `cvec`).

A control vector file is a GGUF of float32 vectors `direction.N` (n_embd each, N >= 1): the
direction added to the output of layer N (0-based, as llama.cpp indexes its tensors; layer 0
has none). Several files, each with its strength (--control-vector-scaled FNAME:SCALE), are
summed layer by layer, as are two directions of one layer in one file. They apply to the layers
of `--control-vector-layer-range START END` (inclusive; default 1 to n_layer). Each layer's sum
lives in a weights buffer of that layer's device. What llama.cpp refuses (a name that is not
`direction.N` with N >= 1, a tensor that is not 1-D float32, sizes that disagree with each other
or with the model's n_embd) is refused in one line; a direction for a layer the model does not
have is not applied (llama.cpp allocates none for it), and the load log says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backend.interface import Buffer, BufferUsage, Device
from ..tensor import Tensor, TensorFlag
from ..types import GGMLType, GGUFError, LlamapyError
from .gguf import GGUFFile


@dataclass
class ControlVector:
    directions: dict[int, np.ndarray]  # layer -> (n_embd,) float32: the files' scaled sum
    layer_start: int
    layer_end: int
    beyond: list[int] = field(default_factory=list)  # layers the model does not have (not applied)
    tensors: dict[int, Tensor] = field(default_factory=dict)  # the applied ones, once loaded
    buffers: list[Buffer] = field(default_factory=list)

    def free(self) -> None:
        for b in self.buffers:
            b.free()
        self.buffers.clear()


def _read_one(path: str, strength: float, n_embd: int) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    try:
        gf = GGUFFile(path, join_splits=False)
    except GGUFError as e:
        raise GGUFError(f"control vector: {e}") from None
    with gf:
        if not gf.tensors:
            raise GGUFError(f"control vector {gf.path.name}: no direction tensors")
        for name, info in gf.tensors.items():
            head, _, index = name.partition(".")
            if head != "direction" or not index.isdigit() or int(index) == 0:
                raise GGUFError(f"control vector {gf.path.name}: tensor {name!r} is not direction.N with a layer N >= 1")
            if info.type != GGMLType.F32 or len(info.ne) != 1:
                raise GGUFError(f"control vector {gf.path.name}: {name!r} is {info.type.name} {list(info.ne)}, "
                                "expected a 1-D F32 vector")  # fmt: skip
            if info.ne[0] != n_embd:
                raise GGUFError(f"control vector {gf.path.name}: {name!r} has {info.ne[0]} values, the model's n_embd is {n_embd}")
            il = int(index)
            v = gf.tensor_bytes(name).view(np.float32).reshape(-1).astype(np.float32) * np.float32(strength)
            out[il] = out[il] + v if il in out else v
    return out


def read_control_vectors(items: Sequence[tuple[str, float]], n_embd: int, n_layer: int,
                         layer_range: tuple[int, int] | None = None) -> ControlVector:  # fmt: skip
    """The files' directions, scaled and summed (common_control_vector_load)."""
    start, end = layer_range or (0, 0)
    start, end = start if start > 0 else 1, end if end > 0 else n_layer  # llama.cpp's defaults for <= 0
    if start > end:
        raise LlamapyError(f"--control-vector-layer-range {start} {end}: the start is past the end")
    total: dict[int, np.ndarray] = {}
    for path, strength in items:
        for il, v in _read_one(path, strength, n_embd).items():
            total[il] = total[il] + v if il in total else v
    beyond = sorted(il for il in total if il >= n_layer)
    kept = {il: v for il, v in sorted(total.items()) if il < n_layer and start <= il <= end}
    return ControlVector(kept, start, end, beyond)


def load_control_vector(cv: ControlVector, layer_device: Sequence[Device]) -> None:
    """Each applied layer's direction into a weights buffer of that layer's device."""
    by_dev: dict[str, tuple[Device, list[int]]] = {}
    for il in cv.directions:
        by_dev.setdefault(layer_device[il].name, (layer_device[il], []))[1].append(il)
    for dev, layers in by_dev.values():
        ts = {il: Tensor(f"cvec.{il}", cv.directions[il].shape, GGMLType.F32, flags=TensorFlag.WEIGHT) for il in layers}
        buft = dev.buffer_type()
        buf = buft.alloc_buffer(sum(buft.alloc_size(t) for t in ts.values()), BufferUsage.WEIGHTS)
        cv.buffers.append(buf)
        for il, t in ts.items():
            buf.alloc_tensor(t)
            buf.set(t, cv.directions[il].view(np.uint8).reshape(1, -1))  # the bytes, as a file's row
        buf.finish_loading()
        cv.tensors.update(ts)
