"""What `kvwire bench transfer` can be asked for: methods, block placements, devices (no torch: the CLI imports it)."""

from __future__ import annotations

import enum


class Method(enum.StrEnum):
    LIMIT_MEMCPY = "limit-memcpy"
    LIMIT_TCP = "limit-tcp"
    # one process, per plane: `index_select` of the source blocks, `index_copy_` into the destination's (two launches
    # a plane, no stacking): issue 45's "one-process gather" that shm / auto on a GPU are held to half of
    LIMIT_GATHER = "limit-gather"
    NIXL = "nixl"  # NIXL READ, UCX backend, UCX's transports (on a GPU with cuda_ipc's get enabled: bench/transfer.py)
    NIXL_TCP = "nixl-tcp"  # NIXL WRITE with UCX_TLS=tcp
    NIXL_DEFAULTS = "nixl-defaults"  # GPU only: NIXL READ on UCX's defaults, as a NixlConnector runs untuned
    UCX = "ucx"
    UCX_TCP = "ucx-tcp"  # UCX restricted to TCP (UCX_TLS=tcp)
    UCXX_RAW = "ucxx-raw"  # ucxx's tag send / receive of the pieces, nothing of kvwire around it (bench/ucxx_run.py)
    UCXX_RAW_TCP = "ucxx-raw-tcp"
    SHM = "shm"
    TCP = "tcp"
    NCCL = "nccl"
    AUTO = "auto"


class Placement(enum.StrEnum):
    SCATTERED = "scattered"  # random, different block ids on each side: nothing merges
    CONTIGUOUS = "contiguous"  # blocks 0..n-1 on both sides: one run


class Device(enum.StrEnum):
    """Where both sides' pools live (each process uses its first device of the kind)."""

    CPU = "cpu"
    CUDA = "cuda"
