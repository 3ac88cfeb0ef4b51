"""``AdamW8bit`` / ``Adam8bit``: both moments as 8-bit codes plus one fp32 scale per tile.

Tiles follow :mod:`.tiles` (32x32 by default, partial at the edges, 1-D tensors in contiguous
blocks of 1024 elements); the quantisation is bitsandbytes' / torchao's dynamic map with
per-block absmax (signed for the first moment, unsigned for the second). Each rank steps its
own shard with no communication, which needs every tile on one rank:
``fully_shard(..., block_size_fn=tile_rows(32))`` guarantees it, and the constructor raises a
``ValueError`` naming the parameter and that fix otherwise.

State entries per parameter: ``step``, ``exp_avg_codes`` / ``exp_avg_sq_codes`` (uint8, the
parameter's shape and placement) and ``exp_avg_scales`` / ``exp_avg_sq_scales`` (fp32, one per
tile, shape ``(tile rows, tile cols)``, ``(blocks,)`` for 1-D). For DTensor parameters they are
DTensors whose ragged layouts keep tiles whole, so DCP reshards them bit-exactly. Underneath
they are views of flat buffers per contiguous run of parameters; on CUDA a run is one Triton
launch, on CPU the vectorised torch reference steps each parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vescale_plugins.optim.adamw import _check_hyper
from vescale_plugins.optim.flat import Run
from vescale_plugins.optim.flat_state import FlatStateOptimizer, StateSpec
from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper, adam8bit_step_
from vescale_plugins.optim.sharding import check_tiles_whole, scale_shape, scales_dtensor, wrap_like
from vescale_plugins.optim.tiles import TILE, TileGrid

__all__ = ["AdamW8bit", "Adam8bit"]


class _Adam8bitBase(FlatStateOptimizer):
    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        tile: int = TILE,
    ) -> None:
        _check_hyper(type(self).__name__, lr, betas, eps, weight_decay, amsgrad)
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"{type(self).__name__}: tile must be a positive int, got {tile!r}")
        self.tile = tile
        # Run layout -> its Triton tile table (device tensor), built once per layout.
        self._tile_tables: dict = {}
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def check_param(self, name: str, param: torch.Tensor) -> None:
        if not param.dtype.is_floating_point:
            raise ValueError(
                f"{type(self).__name__}: {name} has dtype {param.dtype}; only floating-point parameters can be optimised"
            )
        check_tiles_whole(f"{type(self).__name__}: {name}", param, self.tile)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_flat_cache"):
            group = self.param_groups[-1]
            for index, param in enumerate(group["params"]):
                self.check_param(f"parameter {index} of param group {len(self.param_groups) - 1}", param)

    def state_specs(self, group: dict[str, Any]) -> dict[str, StateSpec]:
        tile = self.tile
        codes = StateSpec(lambda t: torch.uint8, None, lambda t: tuple(t.shape), wrap_like)
        scales = StateSpec(
            lambda t: torch.float32,
            lambda t: TileGrid.of(t.shape, tile).num_tiles,
            lambda t: scale_shape(t.shape, tile),
            lambda local, p: scales_dtensor(local, p, tile),
        )
        return {
            "exp_avg_codes": codes,
            "exp_avg_scales": scales,
            "exp_avg_sq_codes": codes,
            "exp_avg_sq_scales": scales,
        }

    def step_run(
        self, run: Run, group: dict[str, Any], flats: dict[str, torch.Tensor], offsets: dict[str, list[int]], step: int
    ) -> None:
        beta1, beta2 = group["betas"]
        hyper = AdamHyper(float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], step, self._decoupled)
        if (
            run.param_flat.is_cuda
            and run.param_flat.is_contiguous()
            and run.grad_flat.is_contiguous()
            and _triton_available()
        ):
            self._step_run_triton(run, flats, offsets, hyper)
            return
        for index, m in enumerate(run.members):
            if not m.numel:
                continue
            grid = TileGrid.of(m.local.shape, self.tile)
            views = {}
            for name in ("exp_avg_codes", "exp_avg_sq_codes"):
                views[name] = self._matrix_view(flats[name], offsets[name][index], grid)
            for name in ("exp_avg_scales", "exp_avg_sq_scales"):
                start = offsets[name][index]
                views[name] = flats[name][start : start + grid.num_tiles].view(grid.tile_rows, grid.tile_cols)
            adam8bit_step_(
                m.local.view(grid.rows, grid.cols),
                m.grad.reshape(grid.rows, grid.cols),
                views["exp_avg_codes"],
                views["exp_avg_scales"],
                views["exp_avg_sq_codes"],
                views["exp_avg_sq_scales"],
                grid.tile_h,
                grid.tile_w,
                hyper,
            )

    def _step_run_triton(
        self, run: Run, flats: dict[str, torch.Tensor], offsets: dict[str, list[int]], hyper: AdamHyper
    ) -> None:
        """One launch for the whole run (CUDA); its tile table is built once per run layout."""
        from vescale_plugins.optim.kernels.adam8bit_triton import adam8bit_tiles_, tile_table

        key = (run.key, self.tile)
        grids = [TileGrid.of(m.local.shape, self.tile) for m in run.members]
        table = self._tile_tables.get(key)
        if table is None:
            table = self._tile_tables[key] = tile_table(
                [
                    (m.offset, (g.rows, g.cols), offsets["exp_avg_scales"][i])
                    for i, (m, g) in enumerate(zip(run.members, grids))
                ],
                [(g.tile_h, g.tile_w) for g in grids],
                self.tile,
                run.param_flat.device,
            )
        adam8bit_tiles_(
            run.param_flat,
            run.grad_flat,
            flats["exp_avg_codes"],
            flats["exp_avg_scales"],
            flats["exp_avg_sq_codes"],
            flats["exp_avg_sq_scales"],
            table,
            hyper,
        )

    @staticmethod
    def _matrix_view(flat: torch.Tensor, offset: int, grid: TileGrid) -> torch.Tensor:
        """A member's codes as its ``rows x cols`` matrix (a run of one keeps its own shape)."""
        if flat.dim() != 1:
            return flat.view(grid.rows, grid.cols)
        return flat[offset : offset + grid.numel].view(grid.rows, grid.cols)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (codes, scales and step counters)."""
        total = 0
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = value._local_tensor if hasattr(value, "_local_tensor") else value
                    total += local.numel() * local.element_size()
        return total


class AdamW8bit(_Adam8bitBase):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with 8-bit block-wise state.

    Arguments as ``torch.optim.AdamW`` (``amsgrad=True`` raises ``ValueError``), plus ``tile``:
    the tile side in rows and columns (default 32). Parameters must not be modified between
    steps through another optimizer. Moments are exact fp32 within a step and rounded to the
    nearest map value of their tile at its end.
    """

    _decoupled = True


class Adam8bit(_Adam8bitBase):
    """Adam (L2 weight decay added to the gradient, as ``torch.optim.Adam``) with 8-bit state.

    Arguments as :class:`AdamW8bit`; ``weight_decay`` defaults to 0 as in ``torch.optim.Adam``.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        tile: int = TILE,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, tile=tile)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (imported only to see whether it is installed)
    except ImportError:
        return False
    return True
