"""``gpudiag engine serve``: the reference engine as an HTTP server (real tensors on cpu/cuda, or simulated).

Logs go to stderr, one line per event; the first says where it listens.
SIGTERM or SIGINT drains: new requests get 503, accepted ones finish, then
exit 0 (1 when the drain deadline passed with requests unanswered).
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import sys
from typing import Optional

import typer

from gpudiag.errors import GpudiagError


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s gpudiag-engine %(levelname)s %(message)s"))
    root = logging.getLogger("gpudiag")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def serve(cfg, verbose: bool = False) -> int:
    """Run the engine server until SIGTERM/SIGINT; returns the exit code."""
    from gpudiag.reference_engine.serving.server import EngineServer

    _setup_logging(verbose)
    try:
        server = EngineServer(cfg)
    except OSError as exc:
        raise GpudiagError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
    previous = {sig: signal.signal(sig, lambda *_: server.request_drain()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def register(app: typer.Typer) -> None:
    """Add ``gpudiag engine serve``."""
    sub = typer.Typer(help="The reference engine: serve it over HTTP.", no_args_is_help=True)

    @sub.command("serve")
    def serve_command(
        device: str = typer.Option("cpu", "--device", help="cpu (real tensors on the host), cuda, or sim "
                                                           "(no tensors: the cost model's time)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, logged)."),
        model_config: Optional[str] = typer.Option(None, "--model-config",
                                                   help="Preset (tiny, small, llama-7b, mistral-7b) or JSON config; "
                                                        "default tiny on cpu, small on cuda, llama-7b on sim."),
        checkpoint: Optional[str] = typer.Option(None, "--checkpoint",
                                                 help="Safetensors file or directory (default: seeded weights)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the drawn weights."),
        kv_strategy: str = typer.Option("paged", "--kv-strategy",
                                        help="paged, contiguous, reserve-max (chunked: sim only)."),
        kv_capacity_mb: Optional[float] = typer.Option(None, "--kv-capacity-mb",
                                                       help="Cap on the KV cache (cpu default 64)."),
        block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block (paged)."),
        prefix_caching: bool = typer.Option(False, "--prefix-caching",
                                            help="paged: share full blocks of equal prompt prefixes."),
        max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most sequences in a batch."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                    help="Most tokens per request (default: the model's)."),
        rate: Optional[float] = typer.Option(None, "--rate", help="Token bucket: requests per second (off)."),
        burst: Optional[float] = typer.Option(None, "--burst", help="Token bucket size (default: the rate, >= 1)."),
        max_queue: int = typer.Option(128, "--max-queue", help="Waiting requests beyond which 429 is answered."),
        drain_timeout: float = typer.Option(25.0, "--drain-timeout",
                                            help="Seconds a drain waits for in-flight requests."),
        otlp_endpoint: Optional[str] = typer.Option(None, "--otlp-endpoint",
                                                    help="OTLP/HTTP collector for request spans "
                                                         "(e.g. http://127.0.0.1:4318; off by default)."),
        runtime_dir: Optional[str] = typer.Option(None, "--runtime-dir",
                                                  help="Where the memory reporter writes (default: the agent's)."),
        threads: Optional[int] = typer.Option(None, "--threads", help="cpu: torch threads (default: torch's)."),
        gpu: str = typer.Option("A100-80GB", "--gpu", help="sim: the simulated GPU."),
        sim_speed: float = typer.Option(1.0, "--sim-speed", help="sim: simulated seconds per wall second."),
        node: Optional[str] = typer.Option(None, "--node", help="The node label (default: the host name)."),
        dialect: Optional[str] = typer.Option(None, "--dialect",
                                              help="/metrics as another engine names it: vllm (default), "
                                                   "vllm-v0, sglang, trtllm, triton, nim, llamacpp."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    ):
        """Serve the reference engine: POST /generate, GET /metrics (vLLM dialect), GET /health."""
        from gpudiag.reference_engine.serving.dialect_metrics import parse_spec

        parse_spec(dialect)  # a bad name is refused before anything starts
        from gpudiag.reference_engine.core.kv_manager import KVConfig
        from gpudiag.reference_engine.core.scheduler import SchedulerConfig
        from gpudiag.reference_engine.model.llm_engine import LLMEngineConfig
        from gpudiag.reference_engine.model.model_config import load_model_config
        from gpudiag.reference_engine.serving.admission import AdmissionConfig
        from gpudiag.reference_engine.serving.server import ServerConfig

        if kv_capacity_mb is not None and not (0 < kv_capacity_mb < math.inf):
            raise GpudiagError(f"--kv-capacity-mb must be a positive number, got {kv_capacity_mb:g}")
        if rate is None and burst is not None:
            raise GpudiagError("--burst needs --rate")
        kv = None
        if kv_strategy != "paged" or block_size != 16 or prefix_caching:
            mc = load_model_config(model_config or {"cpu": "tiny", "cuda": "small", "sim": "llama-7b"}.get(device,
                                                                                                       "tiny"))
            # Regions start at 256 tokens of this model: what a short request needs, so growth is visible.
            region = 256 * mc.kv_bytes_per_token()
            kv = KVConfig(strategy=kv_strategy, block_size=block_size, initial_bytes=region, chunk_bytes=region,
                          max_model_len=max_model_len or mc.max_position, prefix_caching=prefix_caching)
        engine = LLMEngineConfig(
            device=device, model=model_config, checkpoint=checkpoint, seed=seed, kv=kv,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs), gpu=gpu,
            kv_capacity_bytes=int(kv_capacity_mb * 2**20) if kv_capacity_mb else None,
            max_model_len=max_model_len, sim_speed=sim_speed, cpu_threads=threads)
        admission = AdmissionConfig(rate_per_s=rate, burst=burst if burst is not None else max(1.0, rate or 1.0),
                                    max_queue=max_queue)
        cfg = ServerConfig(host=host, port=port, engine=engine, admission=admission, drain_timeout_s=drain_timeout,
                           otlp_endpoint=otlp_endpoint, runtime_dir=runtime_dir, node=node or socket.gethostname(),
                           dialect=dialect)
        raise typer.Exit(serve(cfg, verbose=verbose))

    app.add_typer(sub, name="engine")
