"""`llamapy serve` (llama-server): an OpenAI-compatible HTTP server with `-np` parallel slots.

`-c` is the context of ONE slot: the KV cache holds `-np × -c` cells, as the startup log and
/slots say (llama-server divides its -c among the slots; llamapy does not, so that a request
gets the context it was promised). Binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import typer

from ..types import LlamapyError
from . import app, common, log


def _api_key(key: str | None, key_file: str | None) -> str | None:
    if key is not None and key_file is not None:
        raise LlamapyError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise LlamapyError(f"--api-key-file {key_file}: {e.strerror or e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise LlamapyError(f"--api-key-file {key_file}: the first line is empty")
    if key is not None and not key.strip():
        raise LlamapyError("--api-key: the key is empty")
    return key


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise LlamapyError(f"--port {port}: must be between 0 and 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LlamapyError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise LlamapyError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _server_class(uvicorn: object) -> type:
    class Server(uvicorn.Server):  # type: ignore[name-defined,misc]
        """uvicorn's server, except that SIGTERM / SIGINT end `run()` normally (uvicorn re-raises
        the signal afterwards, which would kill the process before the engine is closed)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


@app.command()
def serve(
    model: str = common.MODEL_ARG,
    model_opt: str = common.MODEL_OPT,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (default: loopback only)"),
    port: int = typer.Option(8080, "--port", help="port to listen on (0: any free port, logged)"),
    n_parallel: int = typer.Option(4, "-np", "--parallel", help="slots: requests decoded together"),
    ctx_size: int = typer.Option(2048, "-c", "--ctx-size", help="context of EACH slot, in tokens"),
    max_queue: int = typer.Option(64, "--queue", help="requests that may wait for a slot; beyond: 503"),
    api_key: str = typer.Option(None, "--api-key", help="require this key (Authorization: Bearer KEY)"),
    api_key_file: str = typer.Option(None, "--api-key-file", help="read the key from the first line of a file"),
    metrics: bool = typer.Option(False, "--metrics", help="enable GET /metrics (Prometheus)"),
    cache_ram: int = typer.Option(-1, "--cache-ram", help="MiB of prompt cache idle slots may keep (-1: all of their cells, 0: none)"),
    alias: str = typer.Option(None, "-a", "--alias", help="model name in responses (default: the file name)"),
    batch: int = common.BATCH,
    ubatch: int = common.UBATCH,
    threads: int = common.THREADS,
    ngl: str = common.NGL,
    ot: list[str] = common.OT,
    cpu_moe: bool = common.CPU_MOE,
    n_cpu_moe: int = common.N_CPU_MOE,
    lora: list[str] = common.LORA,
    lora_scaled: list[str] = common.LORA_SCALED,
    control_vector: list[str] = common.CVEC,
    control_vector_scaled: list[str] = common.CVEC_SCALED,
    control_vector_layer_range: tuple[int, int] = common.CVEC_RANGE,
    model_draft: str = common.MODEL_DRAFT,
    spec_type: str = common.SPEC_TYPE,
    spec_n_max: int = common.SPEC_N_MAX,
    spec_n_min: int = common.SPEC_N_MIN,
    spec_p_min: float = common.SPEC_P_MIN,
    ngld: str = common.NGLD,
    spec_ngram_n: int = common.SPEC_NGRAM_N,
    spec_ngram_m: int = common.SPEC_NGRAM_M,
    ts: str = common.TS,
    mg: int = common.MG,
    ctk: str = common.CTK,
    ctv: str = common.CTV,
    nkvo: bool = common.NKVO,
    no_op_offload: bool = common.NO_OP_OFFLOAD,
    f32_activations: bool = common.F32_ACT,
    device: str = common.DEVICE,
    ray: str = common.RAY,
    no_warmup: bool = typer.Option(False, "--no-warmup", help="skip the warm-up run"),
    lora_init_without_apply: bool = typer.Option(False, "--lora-init-without-apply", help="load the LoRA adapters at scale 0 (set them later with POST /lora-adapters)"),
    embeddings: bool = typer.Option(False, "--embedding", "--embeddings", help="serve embeddings only: /v1/embeddings and /embedding (no completions)"),
    reranking: bool = typer.Option(False, "--reranking", "--rerank", help="serve a reranker: /v1/rerank (as --embeddings --pooling rank)"),
    pooling: str = typer.Option(None, "--pooling", metavar="{none,mean,cls,last,rank}", help="--embeddings: pooling of a text's tokens (default: the model's)"),
    embd_normalize: int = typer.Option(2, "--embd-normalize", metavar="N", help="--embeddings: -1 none, 0 max absolute int16, 1 taxicab, 2 euclidean, >2 p-norm"),
) -> None:
    """Serve a model over HTTP: OpenAI's /v1/chat/completions and /v1/completions, llama-server's
    /completion, /tokenize, /detokenize, /slots, /metrics, /lora-adapters and /health; with --embeddings,
    /v1/embeddings and /embedding instead of the completions, with --reranking /v1/rerank too."""
    try:
        import uvicorn

        from ..server.app import ServerState, create_app
    except ImportError as e:
        raise LlamapyError(f"llamapy serve needs the server extra: pip install 'llamapy[server]' ({e})") from None
    from ..engine import Engine

    if n_parallel < 1:
        raise LlamapyError(f"-np {n_parallel}: the number of slots must be >= 1")
    if ctx_size < 1:
        raise LlamapyError(f"-c {ctx_size}: the context of a slot must be >= 1 token")
    if max_queue < 0:
        raise LlamapyError(f"--queue {max_queue}: must be >= 0")
    if reranking:
        if pooling not in (None, "rank"):
            raise LlamapyError(f"--reranking with --pooling {pooling}: a reranker pools with rank")
        embeddings, pooling = True, "rank"
    if embeddings:
        from ..embedding import POOLING, check_embd_norm

        if pooling is not None and pooling not in POOLING:
            raise LlamapyError(f"--pooling {pooling}: expected one of {', '.join(POOLING)}")
        check_embd_norm(embd_normalize)  # a bad N is refused now
        if model_draft is not None or spec_type not in (None, "none"):
            raise LlamapyError("--embeddings serves no completions: speculative decoding (-md, --spec-type) has nothing to draft")
    elif pooling is not None:
        raise LlamapyError("--pooling needs --embeddings")
    spec_p = common.spec_params(model_draft, spec_type, spec_n_max, spec_n_min, spec_p_min, spec_ngram_n, spec_ngram_m)
    key = _api_key(api_key, api_key_file)
    path = common.resolve_model(model, model_opt)
    if "OMP_WAIT_POLICY" not in os.environ:
        # The kernels' OpenMP threads wait for the next parallel region by spinning, then sleep.
        # A server's steps are farther apart than a CLI run's (the event loop frames and sends
        # every token in between), so with libgomp's default spin the threads fall asleep between
        # steps and each step pays their wake-up: measured +2.4-2.8 ms a streamed token over the
        # engine alone (bench/serve_load.py), +0.7-1.4 ms when they spin longer. llama-server
        # polls too (--poll 50). Read by libgomp when the kernels load, after this point.
        os.environ.setdefault("GOMP_SPINCOUNT", "1000000")
    common.use_ray(ray)  # joined before listening: a cluster that cannot be used is an error here
    sock = _bind(host, port)
    state = ServerState(model_name=alias or path.name, api_key=key, metrics=metrics, embeddings=embeddings,
                        embd_norm=embd_normalize)  # fmt: skip
    config = uvicorn.Config(
        create_app(state), log_level="warning", timeout_graceful_shutdown=5, lifespan="off", access_log=False
    )
    server = _server_class(uvicorn)(config)
    holder: dict[str, object] = {}

    def load() -> None:
        try:
            llm = common.load(
                str(path), None, ngl, common.with_expert_overrides(ot, cpu_moe, n_cpu_moe), ts, mg, ctx_size * n_parallel, batch, ubatch, threads, ctk, ctv, nkvo,
                no_op_offload, device, f32_activations=f32_activations, extra=common.adapters(lora, lora_scaled, control_vector, control_vector_scaled, control_vector_layer_range),
            )  # fmt: skip
            holder["llm"] = llm
            if embeddings:
                from ..embedding import pooling_name

                state.pooling = pooling_name(pooling, llm.model)
                log(f"srv load_model: embeddings only, pooling {state.pooling}, normalisation {embd_normalize}")
            common.speculative(llm, spec_p, model_draft, ngld, ngl)
            if not no_warmup:
                log(f"common_init: warm-up run (compiled-kernel load) = {llm.warmup():.2f} ms")
            cache_bytes = None if cache_ram < 0 else cache_ram * 2**20
            if lora_init_without_apply:
                llm.ctx.set_lora_scales([0.0] * len(llm.model.adapters))
            engine = Engine(llm.ctx, n_parallel, ctx_size, max_queue, cache_bytes, draft=llm.draft)
            engine.start()
            holder["engine"] = engine
            state.attach(llm, engine)
            log(
                f"srv load_model: {n_parallel} slots, n_ctx_slot = {ctx_size} tokens each "
                f"(KV cache: {llm.ctx.n_ctx} cells), queue = {max_queue}"
            )
            log("srv update_slots: all slots are idle")
        except BaseException as e:  # noqa: BLE001 - reported, then the server exits
            state.load_error = str(e) or type(e).__name__
            holder["error"] = e
            server.should_exit = True

    actual = sock.getsockname()
    if key is None and not _is_loopback(actual[0]):
        log(f"warning: listening on {actual[0]} without --api-key: anyone who can reach it may use the model")
    shown = f"[{actual[0]}]" if ":" in actual[0] else actual[0]
    log(f"main: server is listening on http://{shown}:{actual[1]} - loading model {path}")
    loader = threading.Thread(target=load, name="llamapy-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        log("srv shutdown: stopping")
        loader.join()
        engine = holder.get("engine")
        if engine is not None:
            engine.close(cancel=True)  # type: ignore[attr-defined]
        llm = holder.get("llm")
        if llm is not None:
            llm.close()  # type: ignore[attr-defined]
        sock.close()
    err = holder.get("error")
    if err is not None:
        if isinstance(err, LlamapyError):
            raise err
        if isinstance(err, KeyboardInterrupt):
            raise SystemExit(130)
        raise LlamapyError(f"the model failed to load: {type(err).__name__}: {err}")
    log("srv shutdown: done")
