"""The vLLM setups `kvwire bench vllm` measures, each started on its own and stopped whole.

1. PLAIN: one vLLM server with no KV connector, pinned to core 0: the single-node baseline.
2. KVWIRE: prefill (core 0) and decode (core 1) with KvwireConnector over one transport, the
   kvwire router in front (cluster/vllm_pd.py); with a tensor-parallel shape, every rank unbound.
   Measured per Dispatch: the router's default (decode alongside prefill) and, on the same two
   servers, a second router with `--sequential`.
3. NIXL: the same pair and router with vLLM's own NixlConnector on host memory. It needs the
   `nixl` Python package (vLLM imports `nixl._api`; the `nixl-cu12` wheel alone provides
   `nixl_cu12`); without it, or when the servers fail, the setup is reported with the reason.

`started(...)` yields where to send requests and, for a pair, how to read the decode server's
prompt tokens by source; leaving it (Ctrl-C included) stops every process of the setup.
"""

from __future__ import annotations

import enum
import importlib.util
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from kvwire.cluster.vllm_cluster import VLLMServerSpec, start_all
from kvwire.cluster.vllm_pd import DTYPE, kvwire_pair, nixl_pair, pd_cluster_of, with_tp
from kvwire.connectors.config import ConnectorKind

# a vLLM log line at ERROR, or the last line of a traceback, either behind vLLM's "(EngineCore pid=N) " prefix
_ERROR_LINE = re.compile(r"^(?:\([\w:]+ pid=\d+\) )?(?:ERROR [\d-]+ [\d:]+ \[[^\]]+\] (?P<log>.+)"
                         r"|(?P<exc>(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*))$")


class SetupKind(enum.StrEnum):
    PLAIN = "plain"
    KVWIRE = "kvwire"
    NIXL = "nixl"


class Dispatch(enum.StrEnum):
    """How the router in front of a KvwireConnector pair starts a request's decode step."""

    ALONGSIDE = "alongside"  # with the prefill step (the router's default)
    SEQUENTIAL = "sequential"  # once the prefill instance has answered (`kvwire router --sequential`)


class Setup(NamedTuple):
    kind: SetupKind
    transport: ConnectorKind | None = None  # KVWIRE only
    prefill_tp: int = 1  # a pair's tensor-parallel sizes
    decode_tp: int = 1

    @property
    def name(self) -> str:
        name = f"kvwire {self.transport}" if self.kind == SetupKind.KVWIRE else \
            "plain vLLM" if self.kind == SetupKind.PLAIN else "vLLM NixlConnector"
        tp = (self.prefill_tp, self.decode_tp)
        return name if tp == (1, 1) else f"{name} TP{tp[0]}->TP{tp[1]}"

    @property
    def slug(self) -> str:
        """The name as a folder name, for the setup's logs."""
        return self.name.replace(" ", "-").replace("->", "-to-")


class Target(NamedTuple):
    """A started setup: where requests go (per Dispatch for a kvwire pair; None: the only way), and the decode
    server's prompt tokens by source (a pair only)."""

    urls: dict[Dispatch | None, str]
    tokens_by_source: Callable[[], dict[str, float]] | None


def nixl_missing() -> str | None:
    """Why vLLM's NixlConnector cannot run here (a package it imports is missing), or None."""
    for module, package in (("nixl", "nixl"), ("nixl_cu12", "nixl-cu12")):
        if importlib.util.find_spec(module) is None:
            return (f"the `{package}` Python package is not installed (vLLM's NixlConnector imports "
                    f"`nixl._api`: the `nixl` meta package over `nixl-cu12`)")
    return None


@contextmanager
def started(setup: Setup, model_dir: Path, redis_url: str, log_dir: Path,
            dispatches: tuple[Dispatch, ...] = (Dispatch.ALONGSIDE,), plain_url: str = "") -> Iterator[Target]:
    """Start `setup` (logs under `log_dir`; a kvwire pair with a router per one of `dispatches`), yield its Target,
    stop it all on exit. A plain setup with `plain_url` is the server there, neither started nor stopped.

    Raises:
        ClusterError: a server or the router did not start (what did start is stopped).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    if setup.kind == SetupKind.PLAIN and plain_url:
        yield Target({None: plain_url.rstrip("/")}, None)
        return
    if setup.kind == SetupKind.PLAIN:
        (server,) = start_all([VLLMServerSpec(model_dir, cpu_cores="0", dtype=DTYPE, log_path=log_dir / "plain.log")])
        try:
            yield Target({None: server.url}, None)
        finally:
            server.stop()
        return
    if setup.kind == SetupKind.NIXL:  # the router's answers show no KvwireConnector: it runs sequential
        with pd_cluster_of(*with_tp(nixl_pair(model_dir, log_dir), setup.prefill_tp, setup.decode_tp),
                           log_dir) as cluster:
            yield Target({None: cluster.router_url}, cluster.prompt_tokens_by_source)
        return
    assert setup.transport is not None  # a KVWIRE setup names its transport
    pair = kvwire_pair(model_dir, redis_url, setup.transport, log_dir, named=False)
    with pd_cluster_of(*with_tp(pair, setup.prefill_tp, setup.decode_tp), log_dir,
                       sequential_router=Dispatch.SEQUENTIAL in dispatches) as cluster:
        urls = {Dispatch.ALONGSIDE: cluster.router_url, Dispatch.SEQUENTIAL: cluster.sequential_url}
        yield Target({d: urls[d] for d in dispatches}, cluster.prompt_tokens_by_source)


def failure_reason(exc: BaseException, log_dir: Path) -> str:
    """The exception, and the last error line the setup's servers logged (the cause, usually)."""
    lines: list[str] = []
    for log in sorted(log_dir.glob("*.log")):
        found = [m["log"] or m["exc"] for line in log.read_text(errors="replace").splitlines()
                 if (m := _ERROR_LINE.match(line))]
        if found:
            lines.append(f"{log.stem}: {found[-1][:300]}")
    return "; ".join([f"{type(exc).__name__}: {exc}", *lines])
