"""A checkpoint's RoPE scaling, as its config.json says it: read, checked, written back (no torch).

`RopeScaling.from_hf` reads a config.json's `rope_parameters` (transformers v5) or
`rope_scaling` (v4). Types this engine does not implement (yarn, dynamic, longrope, ...) are
refused: silently running them as default RoPE would give wrong outputs. rope.py computes the
frequencies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class RopeType(enum.StrEnum):
    """Supported `rope_type`s besides "default" (which is `RopeScaling` None)."""

    LINEAR = "linear"  # positions divided by `factor`
    LLAMA3 = "llama3"  # Llama 3.1+: low frequencies divided by `factor`, a smooth band between


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE.

    Attributes:
        rope_type: which scaling.
        factor: how much longer the context is than in pretraining.
        low_freq_factor: llama3 only; wavelengths above `original / low_freq_factor` are scaled.
        high_freq_factor: llama3 only; wavelengths below `original / high_freq_factor` are kept.
        original_max_position_embeddings: llama3 only; the pretraining context length.
    """

    rope_type: RopeType
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_type", RopeType(self.rope_type))
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type is RopeType.LLAMA3:
            missing = [k for k in _LLAMA3_KEYS if getattr(self, k) is None]
            if missing:
                raise ValueError(f"llama3 rope scaling lacks {missing}")
            assert self.low_freq_factor is not None and self.high_freq_factor is not None  # checked above
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                 f"{self.low_freq_factor}, {self.high_freq_factor}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> RopeScaling | None:
        """Read the scaling of an HF config.json.

        Args:
            d: the parsed config.json.
        Returns:
            The scaling, or None for default RoPE.
        Raises:
            ValueError: a rope type this engine does not implement, a partial rotary factor,
                or a missing parameter.
        """
        ropes = (d.get("rope_parameters") or {}, d.get("rope_scaling") or {})
        for where in (d, *ropes):
            if where.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"partial_rotary_factor {where['partial_rotary_factor']} is not supported")
        scaled = [p for p in ropes if _type(p) != "default"]
        if not scaled:
            return None
        params = scaled[0]  # v5's rope_parameters win over v4's rope_scaling
        rope_type = _type(params)
        if rope_type not in set(RopeType):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, "
                             f"{', '.join(RopeType)})")
        if "factor" not in params:
            raise ValueError(f"rope scaling {rope_type!r} lacks 'factor'")
        return cls(RopeType(rope_type), float(params["factor"]),
                   low_freq_factor=_optional_float(params.get("low_freq_factor")),
                   high_freq_factor=_optional_float(params.get("high_freq_factor")),
                   original_max_position_embeddings=params.get("original_max_position_embeddings"))

    def to_hf(self, rope_theta: float) -> dict[str, Any]:
        """The `rope_parameters` (v5) / `rope_scaling` (v4) entry of a config.json."""
        fields = {"rope_type": str(self.rope_type), "rope_theta": rope_theta, "factor": self.factor}
        if self.rope_type is RopeType.LLAMA3:
            fields |= {k: getattr(self, k) for k in _LLAMA3_KEYS[1:]}
        return fields


def _type(params: dict[str, Any]) -> str:
    """A rope dict's type: v5 and newer v4 write `rope_type`, older v4 `type`."""
    return str(params.get("rope_type", params.get("type", "default")))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
