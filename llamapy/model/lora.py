"""LoRA adapters (llama.cpp's src/llama-adapter.cpp: llama_adapter_lora_init, and the graph's
build_lora_mm / build_inp_embd, which models/layers.py's `mm` and `input_embd` mirror).

An adapter is a GGUF with `general.type = adapter`, `adapter.type = lora`, the base model's
architecture and, for each adapted matrix `W` (ggml shape [n_in, n_out]), two tensors
`W.lora_a` [n_in, r] and `W.lora_b` [r, n_out]; its products become W·x + s·B(A·x), with
s = scale·alpha/r (scale alone when the file's `adapter.lora.alpha` is 0 or absent). The token
embedding is the exception llama.cpp makes: `token_embd.weight.lora_a` is [r, n_vocab] and
`.lora_b` [r, n_embd], the rows of A picked by token id. Norm vectors (`*_norm.weight`) in an
adapter are skipped, as llama.cpp skips them; every other tensor must pair up, name a matrix of
the base model that llamapy's graphs multiply (the experts' 3-D stacks are refused: llamapy has
no MUL_MAT_ID for adapters), and have the shapes above — else one line names it.

The adapters are loaded with the model, each pair on the device of the matrix it adapts, in a
weights buffer of its own (cached by the adapter's content, not the model's). Which adapters
apply and how strongly is the context's (llama_set_adapter_lora): an adapter at scale 0 is left
out of the graph, as common_set_adapter_lora leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..backend.interface import Buffer, Device
from ..tensor import Tensor, TensorFlag
from ..types import SUPPORTED_TYPES, GGUFError, UnsupportedError
from .gguf import GGUFFile
from .loader import fill_buffers

# the layer matrices the graphs multiply through models/layers.py's `mm`, and the model's own
LAYER_KEYS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp")
TOKEN_EMBD = "token_embd.weight"


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's pair for one matrix, as a graph applies it: + scale·B(A·x)."""

    a: Tensor  # (r, n_in); token_embd: (n_vocab, r)
    b: Tensor  # (n_out, r)
    scale: float


@dataclass
class LoraAdapter:
    path: Path
    alpha: float
    scale: float  # what contexts apply unless told otherwise (--lora-scaled)
    pairs: dict[str, tuple[Tensor, Tensor]]  # adapted matrix name -> (A, B)
    skipped: list[str] = field(default_factory=list)  # norm vectors, as llama.cpp skips them
    task_name: str = ""  # adapter.lora.task_name, .prompt_prefix (what llama-server lists)
    prompt_prefix: str = ""
    gguf: GGUFFile | None = None
    buffers: list[Buffer] = field(default_factory=list)

    def term(self, name: str, scale: float) -> LoraTerm:
        a, b = self.pairs[name]
        rank = b.shape[-1]  # llama_adapter_lora_weight::get_scale: b->ne[0]
        return LoraTerm(a, b, scale * self.alpha / rank if self.alpha else scale)

    def free(self) -> None:
        for buf in self.buffers:
            buf.free()
        self.buffers.clear()
        if self.gguf is not None:
            self.gguf.close()


def read_adapter(path: str | Path, scale: float, arch: str, model: GGUFFile) -> LoraAdapter:
    """Open an adapter and check it against the base model's file (llama_adapter_lora_init_impl's
    checks, in its order); its tensors are described, not loaded."""
    try:
        gf = GGUFFile(path)
    except GGUFError as e:
        raise GGUFError(f"LoRA adapter: {e}") from None
    try:
        return _check(gf, scale, arch, model)
    except (GGUFError, UnsupportedError) as e:
        gf.close()
        raise type(e)(f"LoRA adapter {gf.path.name}: {e}") from None


def _check(gf: GGUFFile, scale: float, arch: str, model: GGUFFile) -> LoraAdapter:
    md = gf.metadata
    if md.get("general.type") != "adapter":
        raise GGUFError(f"expected general.type 'adapter', got {md.get('general.type')!r}")
    if md.get("general.architecture") != arch:
        raise GGUFError(f"an adapter for architecture {md.get('general.architecture')!r}, the model is {arch!r}")
    if md.get("adapter.type") != "lora":
        raise UnsupportedError(f"adapter.type {md.get('adapter.type')!r}: llamapy reads 'lora' adapters")
    if "adapter.alora.invocation_tokens" in md:
        raise UnsupportedError("an activated LoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = md.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise GGUFError(f"adapter.lora.alpha must be a number, got {md.type_name('adapter.lora.alpha')}")
    halves: dict[str, dict[str, Tensor]] = {}
    skipped = []
    for name, info in gf.tensors.items():
        base, dot, half = name.rpartition(".")
        if dot and half in ("lora_a", "lora_b"):
            if info.type not in SUPPORTED_TYPES:
                raise UnsupportedError(f"tensor {name!r} has type {info.type.name}, which llamapy does not support")
            halves.setdefault(base, {})[half] = Tensor(name, tuple(info.shape), info.type, flags=TensorFlag.WEIGHT)
        elif name.endswith("_norm.weight"):
            skipped.append(name)
        else:
            raise GGUFError(f"tensor {name!r} has an unexpected suffix (a LoRA pair is NAME.lora_a and NAME.lora_b)")
    pairs = {}
    for base, ab in halves.items():
        if len(ab) != 2:
            raise GGUFError(f"the pair for {base!r} has only {next(iter(ab))}")
        pairs[base] = _pair(base, ab["lora_a"], ab["lora_b"], model)
    texts = [md.get(f"adapter.lora.{k}", "") for k in ("task_name", "prompt_prefix")]
    return LoraAdapter(gf.path, float(alpha), scale, pairs, skipped, *(t if isinstance(t, str) else "" for t in texts), gf)


def _pair(base: str, a: Tensor, b: Tensor, model: GGUFFile) -> tuple[Tensor, Tensor]:
    info = model.tensors.get(base)
    if info is None:
        raise GGUFError(f"{base!r} is not a tensor of the model (an adapter for another model?)")
    if len(info.ne) != 2 or len(a.shape) != 2 or len(b.shape) != 2:
        what = "the experts' stacks" if len(info.ne) == 3 else "vectors"
        raise UnsupportedError(f"{base!r}: llamapy applies adapters to matrices, not to {what}")
    layer_key = base.split(".")[2] if base.startswith("blk.") and base.count(".") == 3 else None
    if base not in (TOKEN_EMBD, "output.weight") and layer_key not in LAYER_KEYS:
        raise UnsupportedError(f"{base!r} is not a matrix llamapy's graphs apply an adapter to")
    if base == TOKEN_EMBD:  # A's rows are picked by token id: [r, n_vocab] and [r, n_embd]
        if (b.shape[0], a.shape[0]) != info.ne or a.shape[1] != b.shape[1]:
            raise GGUFError(f"{base!r}: lora_a {list(reversed(a.shape))} and lora_b {list(reversed(b.shape))} "
                            f"do not fit the embedding {list(info.ne)}")  # fmt: skip
        return a, b
    (ra, na), (nb, rb) = a.shape, b.shape  # numpy order: (r, n_in) and (n_out, r)
    if na != info.ne[0] or nb != info.ne[1]:
        raise GGUFError(f"{base!r}: lora_a {list(reversed(a.shape))} and lora_b {list(reversed(b.shape))} "
                        f"do not fit the matrix {list(info.ne)} (an adapter for another model?)")  # fmt: skip
    if ra != rb:
        raise GGUFError(f"{base!r}: lora_a has rank {ra}, lora_b {rb} (lora_a is not transposed?)")
    return a, b


def adapted(adapters: Sequence[LoraAdapter]) -> frozenset[str]:
    """The matrices some adapter adapts: the loader keeps them apart from fused weights."""
    return frozenset(name for ad in adapters for name in ad.pairs)


def load_adapter(ad: LoraAdapter, where: Mapping[str, Device], cpu_matmul: str) -> None:
    """Each pair into a buffer of the device that holds its matrix (`where`: name -> device)."""
    assert ad.gguf is not None
    placed = {t: where[base] for base, pair in ad.pairs.items() for t in pair}
    fill_buffers(ad.gguf, placed, ad.buffers, cpu_matmul)


def terms(adapters: Sequence[LoraAdapter], scales: Sequence[float]) -> dict[str, tuple[LoraTerm, ...]]:
    """Matrix name -> the applied adapters' terms, in the adapters' order; scale 0 applies none."""
    out: dict[str, list[LoraTerm]] = {}
    for ad, s in zip(adapters, scales):
        if s != 0.0:
            for name in ad.pairs:
                out.setdefault(name, []).append(ad.term(name, s))
    return {k: tuple(v) for k, v in out.items()}
