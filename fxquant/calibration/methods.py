"""The calibration methods: ``GPTQ``, ``AWQ``, ``SmoothQuant`` and ``AutoRound``, frozen
dataclasses that say which algorithm ``fxquant.calibrate`` runs and with which options.

Where this sits: at the bottom of ``fxquant.calibration``. It imports nothing of fxquant's (not
even the passes), so ``fxquant.hf`` can build a method from a Hugging Face config without
importing the pipeline. Each method's driver, the code that runs it at each planned linear, is
the module of the same name (``fxquant/calibration/gptq.py``, ``awq.py``, ``smoothquant.py``,
``autoround.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["AWQ", "GPTQ", "AutoRound", "Method", "SmoothQuant"]


def _check_number(cls: str, name: str, value: Any, lo: float, hi: float, *, lo_open: bool):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        lo_s = f"{lo} < " if lo_open else f"{lo} <= "
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: {lo_s}{name} <= {hi}")


def _check_bool(cls: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: True or False")


def _check_int(cls: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: an int >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class GPTQ:
    """GPTQ for ``Int4WeightOnly`` (and int8 per-channel weights: ``Int8WeightOnly``, the weight
    of ``Int8DynamicActivation``). Field names follow Hugging Face's ``GPTQConfig``.

    Args:
        damp_percent: damping added to diag(H), as a fraction of its mean (the GPTQ paper's and
            AutoGPTQ's 0.01; Hugging Face ``GPTQConfig`` defaults to 0.1).
        blocksize: columns per lazy batch update.
        desc_act: act-order: quantize columns by decreasing ``diag(H)``. With int4 groups this
            needs ``static_groups=True``: fxquant stores contiguous groups along K (no
            ``g_idx``), so group scales must be fixed in column order before the permuted pass.
            On SmolLM2-135M int4 g64 it gives GPTQ's best results (best with ``mse=2.4``,
            ``first_token_weight=32`` and ``damp_percent=0.1``, after ``AWQ(clip=False)``: +9.8 %
            perplexity), and plain GPTQ does not beat round-to-nearest there
            (``benchmarks/results/calibration*.json``, docs/calibration.md).
        static_groups: int4: fit every group's scale up front from the original weight.
        act_group_aware: int4 without ``desc_act``: group-aware reordering (GAR, GPTQModel's
            and ``GPTQConfig``'s ``act_group_aware``): groups visited by decreasing max
            ``diag(H)``, each group's columns by decreasing ``diag(H)``. Groups stay whole, so it
            needs neither ``g_idx`` nor static groups.
        sequential: ``True``: each linear's Hessian comes from the inputs the already-quantized
            layers before it produce; ``False``: all Hessians from one float pass.
        mse: ``0`` (default): each group's range is its min/max; ``p > 0``: shrink it by the
            factor (1 down to 0.21) minimising the p-norm of the group's rounding error (the
            GPTQ reference quantizer's and GPTQModel's ``mse``; they use p = 2.4).
        first_token_weight: how many times the first position of each calibration sequence
            counts in the Hessian (``1``: once, as the reference). The first position is the
            attention sink every later token attends to, so its error costs far more than one
            token's share; docs/calibration.md has the measurements.
    """

    name: ClassVar[str] = "gptq"
    damp_percent: float = 0.01
    blocksize: int = 128
    desc_act: bool = False
    static_groups: bool = False
    act_group_aware: bool = False
    sequential: bool = True
    mse: float = 0.0
    first_token_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_number("GPTQ", "damp_percent", self.damp_percent, 0.0, 1.0, lo_open=True)
        _check_number("GPTQ", "mse", self.mse, 0.0, 10.0, lo_open=False)
        _check_number("GPTQ", "first_token_weight", self.first_token_weight, 0.0, 1e6, lo_open=True)
        _check_int("GPTQ", "blocksize", self.blocksize, 1)
        for f in ("desc_act", "static_groups", "act_group_aware", "sequential"):
            _check_bool("GPTQ", f, getattr(self, f))


@dataclass(frozen=True, kw_only=True)
class AWQ:
    """AWQ for ``Int4WeightOnly``: activation-aware input-channel scales, then weight clipping.

    Args:
        n_grid: α = 0, 1/n_grid, … for the scale search (and clipping ratios 1 - i/n_grid).
        clip: search a per-group clipping range after scaling (llm-awq ``auto_clip``).
        clip_max_shrink: smallest range tried is ``(1 - clip_max_shrink) · amax``.
        no_clip: module-name patterns whose weights are not clipped; llm-awq leaves q/k out,
            since their error is seen through the attention scores, not the linear outputs.
        first_token_weight: how many times the first position of each calibration sequence
            counts in the statistics the searches use (``1``: once, as llm-awq); see ``GPTQ``.
    """

    name: ClassVar[str] = "awq"
    n_grid: int = 20
    clip: bool = True
    clip_max_shrink: float = 0.5
    no_clip: tuple[str, ...] = ("q_proj", "k_proj", "query", "key")
    first_token_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_number("AWQ", "first_token_weight", self.first_token_weight, 0.0, 1e6, lo_open=True)
        _check_int("AWQ", "n_grid", self.n_grid, 2)
        _check_bool("AWQ", "clip", self.clip)
        _check_number("AWQ", "clip_max_shrink", self.clip_max_shrink, 0.0, 1.0, lo_open=True)
        if isinstance(self.no_clip, str) or not all(isinstance(p, str) for p in self.no_clip):
            raise ValueError(
                f"AWQ.no_clip={self.no_clip!r} is not supported; allowed: a tuple of patterns"
            )
        object.__setattr__(self, "no_clip", tuple(self.no_clip))


@dataclass(frozen=True, kw_only=True)
class SmoothQuant:
    """SmoothQuant for activation-quantizing schemes (``Int8DynamicActivation``,
    ``Float8Dynamic``): migrate activation outliers into the weights through the preceding norm.

    Args:
        alpha: migration strength in [0, 1]; 0.5 is the paper's default for most models.
    """

    name: ClassVar[str] = "smoothquant"
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check_number("SmoothQuant", "alpha", self.alpha, 0.0, 1.0, lo_open=False)


@dataclass(frozen=True, kw_only=True)
class AutoRound:
    """AutoRound (SignRound, Intel's ``auto_round``; transformers' ``AutoRoundConfig``) for
    ``Int4WeightOnly``: per weight a rounding offset v in round(w / s + v) and per group two
    clipping factors of its [min, max] range, tuned with signed gradient descent block by block
    (each transformer block's output error on the calibration data). Field names and defaults
    follow auto-round's.

    Args:
        iters: tuning steps per block (auto-round's 200; its "light" recipe 50).
        lr: the offsets' step size (``None``: 1 / iters), decayed linearly to 0.
        minmax_lr: the clipping factors' step size (``None``: ``lr``).
        batch_size: calibration samples per step (auto-round's 8), drawn in a shuffled cycle.
        enable_minmax_tuning: tune the clipping factors too (``False``: offsets only).
        enable_quanted_input: each block is tuned on the outputs of the already-quantized
            blocks before it, against the float model's outputs (``False``: on float inputs).
        seed: the sample order's seed.
    """

    name: ClassVar[str] = "autoround"
    iters: int = 200
    lr: float | None = None
    minmax_lr: float | None = None
    batch_size: int = 8
    enable_minmax_tuning: bool = True
    enable_quanted_input: bool = True
    seed: int = 42

    def __post_init__(self) -> None:
        _check_int("AutoRound", "iters", self.iters, 1)
        _check_int("AutoRound", "batch_size", self.batch_size, 1)
        _check_int("AutoRound", "seed", self.seed, 0)
        for f in ("lr", "minmax_lr"):
            if getattr(self, f) is not None:
                _check_number("AutoRound", f, getattr(self, f), 0.0, 10.0, lo_open=True)
        for f in ("enable_minmax_tuning", "enable_quanted_input"):
            _check_bool("AutoRound", f, getattr(self, f))


Method = GPTQ | AWQ | SmoothQuant | AutoRound
