"""FP8 *training* (``Float8Recipe``): a scheme with no inference op of its own; the FP8 regions
pass (``fxquant.passes.float8_regions``) reads it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import ClassVar

from fxquant.core.scheme import Scheme, check_choice, check_int, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Float8Recipe(Scheme):
    """FP8 *training*: the linears of an FP8 autocast region run their forward and backward GEMMs
    in float8, with the semantics of Transformer Engine's recipes and accelerate's
    ``TERecipeKwargs`` / ``AORecipeKwargs`` (../shared/FP8_RECIPES.md). Weights stay in high
    precision as the master copy; the optimizer sees ordinary parameters and gradients.

    Used through ``torch.compile(model, backend="fxquant", options={"config": cfg})``
    (``fxquant.passes.float8_regions`` rewrites the graph, ``fxquant.training.numerics`` holds the
    casts and the autograd linear, ``fxquant.training.state`` the delayed-scaling state). Given to
    ``fxquant.quantize``, the same recipe exports the fp8 inference graph.

    Args:
        scaling: ``"delayed"``: per-tensor scales from an amax history (TE ``DelayedScaling``);
            ``"current"``: scales from the tensor being cast (TE ``Float8CurrentScaling``, torchao
            tensorwise/rowwise); ``"mxfp8"``: one power-of-two (E8M0) scale per 32 values along
            each GEMM's reduction dim; ``"block"``: DeepSeek-V3 blocks (activations and gradients
            1×128, weights 128×128).
        fp8_format: ``"HYBRID"``: E4M3 forward, E5M2 gradients; ``"E4M3"``: E4M3 everywhere.
        granularity: current scaling only: ``"tensor"`` or ``"row"`` (each GEMM operand scaled
            per row along the GEMM's reduction dim, as torchao's rowwise recipe).
        margin: delayed scaling: scale = (fp8_max / amax) / 2**margin.
        amax_history_len: delayed scaling: rows of the amax history (TE default 1024).
        amax_compute_algo: delayed scaling: ``"max"`` over the history or ``"most_recent"``.
        interval: accepted for compatibility; TE never implemented it and removed it, so values
            other than 1 warn and are ignored (scales update every step).
        override_linear_precision: (fprop, dgrad, wgrad): run that GEMM in high precision. All
            three are honoured (TE only ever honoured wgrad; setting the others warns).
        use_autocast_during_eval: in ``model.eval()``, run FP8 with frozen scales instead of high
            precision.
        pad_inner_dim: when K or N is not a multiple of 16, pad it (with zeros, which change no
            result) instead of skipping the layer.
        emulate: allow emulated FP8 GEMMs (the fp8 values upcast, an fp32 GEMM: FP8 numerics,
            slower than high precision) where the device has no FP8 GEMM for the recipe (today
            ``mxfp8`` and ``block``); without it such a recipe is refused at compile time.
    """

    name: ClassVar[str] = "float8_training"
    quantizes_activation: ClassVar[bool] = True
    scaling: str = "delayed"
    fp8_format: str = "HYBRID"
    granularity: str = "tensor"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    interval: int = 1
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    use_autocast_during_eval: bool = False
    pad_inner_dim: bool = True
    emulate: bool = False

    def __post_init__(self) -> None:
        name = "Float8Recipe"
        check_choice(name, "scaling", self.scaling, ("delayed", "current", "mxfp8", "block"))
        if self.fp8_format == "E5M2":
            raise ValueError(
                "Float8Recipe.fp8_format='E5M2' is not supported: pure E5M2 training (E5M2 "
                "forward tensors) loses too much precision and Transformer Engine rejects it too; "
                "allowed: 'HYBRID' (E4M3 forward, E5M2 gradients) or 'E4M3'"
            )
        check_choice(name, "fp8_format", self.fp8_format, ("HYBRID", "E4M3"))
        check_choice(name, "granularity", self.granularity, ("tensor", "row"))
        if self.granularity == "row" and self.scaling != "current":
            raise ValueError(
                f"Float8Recipe.granularity='row' is not supported with scaling={self.scaling!r}; "
                "allowed: granularity='row' only with scaling='current'"
            )
        check_int(name, "margin", self.margin, minimum=0)
        check_int(name, "amax_history_len", self.amax_history_len, minimum=1)
        check_int(name, "interval", self.interval, minimum=1)
        check_choice(name, "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            raise ValueError(
                f"Float8Recipe.override_linear_precision={self.override_linear_precision!r} is "
                "not supported; allowed: three bools (fprop, dgrad, wgrad)"
            )
        object.__setattr__(self, "override_linear_precision", olp)
        check_choice(name, "use_autocast_during_eval", self.use_autocast_during_eval, (True, False))
        check_choice(name, "pad_inner_dim", self.pad_inner_dim, (True, False))
        check_choice(name, "emulate", self.emulate, (True, False))
        if self.interval != 1:
            warnings.warn(
                f"Float8Recipe.interval={self.interval} is ignored: scales update every step. "
                "Transformer Engine never implemented `interval` and removed it in 2.0, so no "
                "upstream recipe honoured it either.",
                stacklevel=3,
            )
        if olp[0] or olp[1]:
            warnings.warn(
                f"Float8Recipe.override_linear_precision={olp}: fxquant runs each flagged GEMM in "
                "high precision; Transformer Engine only ever honoured the wgrad flag and dropped "
                "the field in 2.0, so the same recipe there ran fprop/dgrad in FP8.",
                stacklevel=3,
            )
        # Every field in one string, which fxquant.fp8_autocast writes into the graph's node
        # annotations: Dynamo keeps a string as one constant, while an int read off the recipe
        # turns symbolic when the same forward is compiled again with another value.
        fields = tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        object.__setattr__(self, "region_key", repr(fields))

    @property
    def block_size(self) -> int | None:
        """Elements per scale along a GEMM's reduction dim (None: per tensor or per row)."""
        return {"mxfp8": 32, "block": 128}.get(self.scaling)

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        b = self.block_size
        if b is not None:
            bad = [
                f"{n}={v}"
                for n, v in (("in_features", in_features), ("out_features", out_features))
                if v % b
            ]
            if bad:
                return f"{' and '.join(bad)} not divisible by {b} ({self.scaling} blocks)"
            return None
        if not self.pad_inner_dim:
            bad = [
                f"{n}={v}"
                for n, v in (("in_features", in_features), ("out_features", out_features))
                if v % 16
            ]
            if bad:
                return (
                    f"{' and '.join(bad)} not divisible by 16 (FP8 GEMMs need it; "
                    "pad_inner_dim=True pads instead)"
                )
        return None

    def padded_in_features(self, in_features: int) -> int:
        if self.block_size is None and self.pad_inner_dim:
            return -(-in_features // 16) * 16
        return in_features
