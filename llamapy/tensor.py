"""Graph nodes: the Tensor dataclass and the Op enum (ggml.h's `struct ggml_tensor`, `enum ggml_op`).

A Tensor is both a value's description and a node of the compute graph, as in ggml: `op` and
`src` say how it is computed, `buffer` says where a pre-allocated value (a weight, the KV cache)
lives, `view_src` says whose memory a view or an in-place op shares.

Shapes are in **numpy order** everywhere in llamapy: the last dimension is the contiguous one
(ggml's `ne[0]`). A GGUF weight with `ne = [n_in, n_out]` is a Tensor of shape `(n_out, n_in)`;
activations are `(n_tokens, n_embd)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, Flag, auto
from typing import TYPE_CHECKING, Any

from .types import GGMLType

if TYPE_CHECKING:
    from .backend.interface import Buffer


class Op(Enum):
    """The ops the llama graph uses, named as in ggml. Grouped as ggml.h orders them."""

    # Members are singletons compared by identity: hash them by identity too (C-level), not by
    # Enum's Python-level hash of the name (measured ~0.7 us per kernel-table lookup, 5 % of a
    # decode step).
    __hash__ = object.__hash__

    # ** leaf: no computation (weights, inputs, the KV cache)
    NONE = auto()
    # ** view ops: no data movement, share their source's memory
    RESHAPE = auto()
    VIEW = auto()
    PERMUTE = auto()
    # ** data movement
    GET_ROWS = auto()  # embedding lookup, selecting output rows
    SET_ROWS = auto()  # write rows into a pre-allocated tensor (the KV cache store)
    CONT = auto()
    # ** elementwise
    ADD = auto()
    ADD_ID = auto()  # a + b[ids]: a row of b per (token, slot), by expert id (the experts' biases)
    MUL = auto()
    DIV = auto()  # a / b, b broadcast (the router's weight normalisation)
    SCALE = auto()
    CLAMP = auto()  # params["min"], params["max"]
    GLU = auto()  # gated linear unit; params["op"]: "swiglu", "geglu" or "swiglu_oai"
    # ** normalization / reductions
    RMS_NORM = auto()
    SOFT_MAX = auto()
    SUM_ROWS = auto()  # (..., n) -> (..., 1)
    ARGSORT = auto()  # I32 indices of each row, descending (ggml_argsort with GGML_SORT_ORDER_DESC)
    # ** matrix multiplication
    MUL_MAT = auto()
    MUL_MAT_ID = auto()  # each token's rows times the experts its ids chose (mixture of experts)
    # ** llama-specific
    ROPE = auto()
    FLASH_ATTN_EXT = auto()


VIEW_OPS = frozenset({Op.RESHAPE, Op.VIEW, Op.PERMUTE})


class TensorFlag(Flag):
    NONE = 0
    INPUT = auto()  # set by the caller before each compute (token ids, positions, mask)
    OUTPUT = auto()  # read back after compute (logits)
    WEIGHT = auto()  # a model weight, pre-allocated in a weights buffer


@dataclass(eq=False)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type: GGMLType = GGMLType.F32
    op: Op = Op.NONE
    src: tuple[Tensor, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    flags: TensorFlag = TensorFlag.NONE
    # memory: a pre-allocated tensor lives in `buffer`; a view or in-place op shares `view_src`'s
    buffer: Buffer | None = None
    view_src: Tensor | None = None

    @property
    def is_leaf(self) -> bool:
        return self.op is Op.NONE

    @property
    def is_view(self) -> bool:
        return self.op in VIEW_OPS

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        from .types import row_nbytes

        if not self.shape:
            return row_nbytes(self.type, 1)
        rows = self.n_elements // self.shape[-1]
        return rows * row_nbytes(self.type, self.shape[-1])

    def root(self) -> Tensor:
        """The tensor whose memory this one uses (itself unless a view / in-place op)."""
        t = self
        while t.view_src is not None:
            t = t.view_src
        return t

    def __repr__(self) -> str:
        srcs = ", ".join(s.name for s in self.src)
        return f"Tensor({self.name!r}, {self.op.name}, {self.type.name}{list(self.shape)}, [{srcs}])"
