"""connectors/vllm/layout.py against the per-layer KV tensors vLLM 0.32 registers, made by vLLM's own code.

Each case resolves the KV cache layout as vLLM's engine core does (`resolve_kv_cache_layout`, which asks
the configured connector, kvwire's, for its layout), picks kernel block sizes as the model runner does
(`prepare_kernel_block_sizes`) and allocates the views it hands `register_kv_caches`
(`allocate_kv_cache`), on CPU tensors. Backends whose modules cannot be imported here:
FlashInferBackend and FlashInferMLABackend (need the `flashinfer` package), FlashAttnMLABackend (needs
vllm-flash-attn's `flash_attn_varlen_func`), CutlassMLABackend (asserts CUDA at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CacheConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLABackend
from vllm.v1.attention.backends.mla.tokenspeed_mla import TokenspeedMLABackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec, prepare_kernel_block_sizes

from kvwire.connectors.transports.kv_region import KVRegion
from kvwire.connectors.vllm.connector import KvwireConnector
from kvwire.connectors.vllm.layout import region_of
from kvwire.connectors.wire import PoolLayout

NUM_BLOCKS, LAYERS = 6, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class FlashInferShapes(AttentionBackend):
    """FlashInferBackend's classmethods that shape its KV cache (flashinfer.py, off Blackwell), for its module
    imports `flashinfer`: `customize_spec` changes only nvfp4 caches, `supported_kv_cache_layouts` is None,
    kernel blocks are 16, 32 or 64 tokens."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [16, 32, 64]


def _dense(block_size: int, heads: int = 4, head_dim: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=torch.bfloat16)


def _mla(block_size: int) -> MLAAttentionSpec:  # DeepSeek's latent: kv_lora_rank 512 + rope 64
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str="auto")


DENSE = {  # backend -> its spec at a block size it runs unsplit (CPU: vLLM's CPU block size)
    FlashAttentionBackend: _dense(16), TritonAttentionBackend: _dense(16), FlashInferShapes: _dense(16),
    CPUAttentionBackend: _dense(128, heads=2, head_dim=32),
}
MLA = [CPUMLABackend, AMXMLABackend, TritonMLABackend, FlashMLABackend, TokenspeedMLABackend, AiterMLABackend]


@dataclass
class Registered:
    kv_caches: dict[str, torch.Tensor]  # layer -> [blocks, kv_heads, block_tokens, content] view
    layout: str  # vLLM's resolved KVCacheLayout
    num_blocks: int  # the block manager's, and its block size: what the connector is given
    block_size: int


def _config(mla: bool, connector: bool) -> SimpleNamespace:
    """The parts of a VllmConfig that layout resolution and allocation read (a real one needs a model)."""
    transfer = KVTransferConfig(kv_connector="KvwireConnector", kv_connector_module_path="kvwire.connectors.vllm",
                                kv_role="kv_both") if connector else None
    return SimpleNamespace(cache_config=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS), kv_transfer_config=transfer,
                           model_config=SimpleNamespace(use_mla=mla),
                           attention_config=SimpleNamespace(hisparse_config=None))


def _registered(backend: type[AttentionBackend], spec: AttentionSpec, connector: bool = True) -> Registered:
    """What vLLM 0.32's model runner hands `register_kv_caches` for LAYERS layers of `spec` on `backend`."""
    config = _config(isinstance(spec, MLAAttentionSpec), connector)
    spec = customize_attention_spec(backend, spec)
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    layout = resolve_kv_cache_layout(config, [supported], [spec])
    kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(LAYER_NAMES, spec)], 1 << 40)
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config,
                                                    [[SimpleNamespace(backend=backend, kv_cache_spec=spec)]])
    kv = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)
    return Registered(kv, layout.name, kv_cache_config.num_blocks, spec.block_size)


def _fill(reg: Registered) -> None:
    """A distinct code in every (layer, kernel block, head, token) through vLLM's views (bf16 bits as int16)."""
    for layer, view in enumerate(reg.kv_caches.values()):
        codes = torch.arange(layer * view[..., 0].numel(), (layer + 1) * view[..., 0].numel(), dtype=torch.int16)
        view.view(torch.int16).copy_(codes.view(view.shape[:3]).unsqueeze(-1).expand(view.shape))


def _assert_heads_are_row_slices(region: KVRegion, reg: Registered) -> None:
    """Each plane row is one contiguous run holding its block's heads in order: head slice [h0, h1) of block b
    is bytes [h0 * row / H, h1 * row / H) of row b, exactly the view's values for those heads."""
    heads = region.layout.num_kv_heads
    for plane, view in zip(region.planes, reg.kv_caches.values(), strict=True):
        assert plane.dtype == torch.uint8 and plane.stride(1) == 1 and plane.shape[0] == reg.num_blocks
        blocks = view.unflatten(0, (reg.num_blocks, -1))  # [num_blocks, kernel blocks per block, H, N, C]
        assert plane.shape[1] == blocks[0].numel() * view.element_size()
        step = plane.shape[1] // heads
        for b in range(reg.num_blocks):
            for h0, h1 in [(h, h + 1) for h in range(heads)] + [(0, heads), (heads // 2, heads)]:
                want = blocks[b][:, h0:h1].contiguous().view(torch.uint8).flatten()
                assert torch.equal(plane[b, h0 * step:h1 * step], want), (b, h0, h1)


def _assert_rows_tile_the_buffer(region: KVRegion) -> None:
    """The rows of every plane cover the allocation exactly: no byte twice, none left out."""
    spans = sorted((p.data_ptr() + b * p.stride(0), p.shape[1]) for p in region.planes for b in range(p.shape[0]))
    storage = region.planes[0].untyped_storage()
    assert spans[0][0] == storage.data_ptr()
    assert all(start + size == nxt for (start, size), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == storage.data_ptr() + storage.nbytes()


@pytest.mark.parametrize("backend", list(DENSE), ids=lambda b: b.get_name())
def test_dense_backends_register_lbhnc_views_whose_rows_hold_heads_in_order(backend):
    reg = _registered(backend, DENSE[backend])
    assert reg.layout == "LBHNC"
    spec = DENSE[backend]
    view = next(iter(reg.kv_caches.values()))
    assert tuple(view.shape) == (NUM_BLOCKS, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    assert view.is_contiguous()
    _fill(reg)
    region = region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=backend)
    pool = PoolLayout.VLLM_CPU if backend is CPUAttentionBackend else PoolLayout.VLLM_HNC
    assert region.layout.pool == pool and len(region.planes) == LAYERS
    assert (region.layout.num_kv_heads, region.layout.head_dim, region.layout.block_size) == (
        spec.num_kv_heads, spec.head_size, spec.block_size)
    _assert_heads_are_row_slices(region, reg)
    _assert_rows_tile_the_buffer(region)


@pytest.mark.parametrize("backend", MLA, ids=lambda b: b.get_name())
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_mla_backends_give_one_latent_plane_per_layer(backend, block_size):
    """MLA keeps vLLM's default layout (LBNHC: the same bytes with one head), and where a backend takes
    smaller kernel blocks (CPU_MLA: 16, FLASHMLA: 64) vLLM registers those; a block is then a run of them."""
    try:
        reg = _registered(backend, _mla(block_size))
    except ValueError as exc:  # e.g. FLASHMLA runs only 64-token kernel blocks: vLLM refuses --block-size 16
        if "No common block size" not in str(exc):
            raise
        pytest.skip(str(exc))
    assert reg.layout == "LBNHC"
    view = next(iter(reg.kv_caches.values()))
    kernel = view.shape[2]
    assert tuple(view.shape) == (NUM_BLOCKS * block_size // kernel, 1, kernel, 576)
    _fill(reg)
    region = region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=backend)
    assert region.layout.pool == PoolLayout.VLLM_MLA
    assert (region.layout.num_kv_heads, region.layout.head_dim, region.layout.block_size) == (1, 576, block_size)
    _assert_heads_are_row_slices(region, reg)
    _assert_rows_tile_the_buffer(region)


@pytest.mark.parametrize("backend", [FlashAttentionBackend, TritonAttentionBackend], ids=lambda b: b.get_name())
def test_vllms_default_lbnhc_is_refused_by_name(backend):
    reg = _registered(backend, DENSE[backend], connector=False)
    assert reg.layout == "LBNHC"
    view = next(iter(reg.kv_caches.values()))
    assert not view.is_contiguous()  # heads interleave token by token
    with pytest.raises(ValueError, match="resolved the KV cache layout LBNHC.*kvwire needs LBHNC"):
        region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=backend)


@pytest.mark.parametrize("forced", ["LBNHC", "NHD", "LHBNC", "BLNHC", "BHLNC"])
def test_a_layout_forced_past_the_connector_is_refused_by_name(monkeypatch, forced):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", forced)
    reg = _registered(FlashAttentionBackend, DENSE[FlashAttentionBackend])
    assert reg.layout == {"NHD": "LBNHC"}.get(forced, forced)
    with pytest.raises(ValueError, match=f"resolved the KV cache layout {reg.layout}.*kvwire needs LBHNC"):
        region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=FlashAttentionBackend)


def test_blhnc_is_refused_by_name(monkeypatch):
    """Block-outermost, each block's pages of every layer back to back: a layer's rows are strided, and kvwire
    moves a layer's consecutive blocks as one run, so it refuses this layout rather than move other layers'
    bytes."""
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    reg = _registered(TritonAttentionBackend, DENSE[TritonAttentionBackend])
    with pytest.raises(ValueError, match="resolved the KV cache layout BLHNC.*needs LBHNC"):
        region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=TritonAttentionBackend)


def test_kernel_blocks_that_scatter_heads_are_refused():
    """FlashInfer off Blackwell runs at most 64-token kernel blocks; vLLM registers a 128-token block as two,
    so each head of the block is two runs."""
    reg = _registered(FlashInferShapes, _dense(128))
    assert next(iter(reg.kv_caches.values())).shape[:3] == (2 * NUM_BLOCKS, 4, 64)
    with pytest.raises(ValueError, match="2 kernel blocks of 64.*--block-size 64"):
        region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=FlashInferShapes)


def test_the_connector_asks_for_lbhnc_except_for_mla():
    assert KvwireConnector.get_required_kvcache_layout(_config(mla=False, connector=True)) == "LBHNC"
    assert KvwireConnector.get_required_kvcache_layout(_config(mla=True, connector=True)) is None


def test_an_mla_region_never_equals_a_dense_one_of_the_same_bytes():
    """One KV head with 2 x 288 values per token is as many bytes as MLA's latent; only the backend tells them."""
    reg = _registered(TritonMLABackend, _mla(16))
    dense = region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=TritonAttentionBackend)
    mla = region_of(reg.kv_caches, reg.num_blocks, reg.block_size, backend=TritonMLABackend)
    assert dense.block_nbytes == mla.block_nbytes and dense.layout != mla.layout
