"""Rotary position embeddings: inverse frequencies (plain, linear, Llama-3 scaled) and a
precomputed cos/sin table indexed by absolute position."""

from __future__ import annotations

import math

import torch

from hydra_jury.hydra_model.config import DecoderConfig


def inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with the config's rope scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band between them interpolated smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryTable:
    """cos/sin for every position up to `max_positions`, in the compute dtype."""

    def __init__(
        self,
        config: DecoderConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        inv_freq = inverse_frequencies(config).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [P, hd/2]
        angles = torch.cat([angles, angles], dim=-1)  # [P, hd]
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def rotation(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, hd] of positions start..start+T-1 (the same for every layer
        of a forward: taken once)."""
        return self.cos[start : start + length, None, :], self.sin[start : start + length, None, :]

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotates x: [S, T, n_heads, hd] whose tokens sit at positions start..start+T-1."""
        return rotate(x, self.rotation(start, x.shape[1]))


def rotate(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [S, T, n_heads, hd] rotated by `rotation` (`RotaryTable.rotation` of its T)."""
    cos, sin = rotation
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
