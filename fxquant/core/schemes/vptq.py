"""VPTQ (``vptq``): vector codebooks with residuals, for loading VPTQ checkpoints (transformers'
``VptqConfig``).

Declaration (``fxquant.core.scheme``); reference math in ``fxquant.core.vptq``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxquant.core import vptq
from fxquant.core.scheme import Scheme, check_int, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Vptq(Scheme):
    """VPTQ weights: vectors of ``vector_len`` weights down the output axis, each the sum of one
    of ``num_centroids`` main and one of ``num_res_centroids`` residual codebook entries (0: no
    residual), in ``group_num`` codebook groups of ``group_size`` input columns, after
    ``outlier_size`` outlier columns with a codebook of their own, with the input channels
    permuted and scaled as the checkpoint says (``fxquant.core.vptq``); activations in float.
    Loaded from checkpoints only (``fxquant.load_quantized``): the codebooks come from hours of
    Hessian-weighted k-means, which fxquant does not run.

    Args: the ``VptqLayerConfig`` fields of the same names (main part).
    """

    name: ClassVar[str] = "vptq"
    # packed indices int32 [C, Nv, P]; centroids fp32 [C, K, vl]; res_centroids fp32 [C, R, vl];
    # perm int64 [in]; weight_scale, weight_bias fp32 [in]; rows int64 [out]: the layer's rows
    # of the Nv·vl decoded ones (the last vector block is padded); outliers fp32 [out, S], the
    # first S permuted columns decoded at load (stored only when outlier_size > 0)
    constants = (
        "qweight",
        "centroids",
        "res_centroids",
        "perm",
        "weight_scale",
        "weight_bias",
        "rows",
    )
    optional_constants = ("outliers",)
    reference = staticmethod(vptq.vptq_linear)
    vector_len: int = 8
    num_centroids: int = 65536
    num_res_centroids: int = 256
    group_num: int = 1
    group_size: int = 4096
    outlier_size: int = 0

    def __post_init__(self) -> None:
        for f in ("vector_len", "num_centroids", "group_num", "group_size"):
            check_int("Vptq", f, getattr(self, f), minimum=1)
        for f in ("num_res_centroids", "outlier_size"):
            check_int("Vptq", f, getattr(self, f), minimum=0)
        for f in ("num_centroids", "num_res_centroids"):
            v = getattr(self, f)
            if v & (v - 1):
                raise ValueError(f"Vptq.{f}={v!r} is not supported; allowed: a power of two")

    @classmethod
    def out_features_of(cls, weight, *rest) -> int:
        return rest[5].shape[0]  # ``rows``: the indices also cover the last block's padding

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        want = self.outlier_size + self.group_num * self.group_size
        if in_features != want:
            return (
                f"in_features={in_features} is not outlier_size + group_num × group_size = {want}"
            )
        return None

    def bits(self) -> int:
        r = self.num_res_centroids
        return (self.num_centroids.bit_length() - 1) + (r.bit_length() - 1 if r > 0 else 0)

    def layout(self, shape):
        n, k = shape
        c, vl = self.group_num, self.vector_len
        words = -(-self.group_size * self.bits() // 32)
        return {
            "qweight": ((c, -(-n // vl), words), torch.int32),
            "centroids": ((c, self.num_centroids, vl), torch.float32),
            "res_centroids": ((c, self.num_res_centroids, vl), torch.float32),
            "perm": ((k,), torch.int64),
            "weight_scale": ((k,), torch.float32),
            "weight_bias": ((k,), torch.float32),
            "rows": ((n,), torch.int64),
        } | ({"outliers": ((n, self.outlier_size), torch.float32)} if self.outlier_size else {})

    def quantize(self, w):
        raise NotImplementedError(
            "VPTQ cannot quantize a float weight here: its codebooks come from hours of "
            "Hessian-weighted k-means (the vptq package); load a VPTQ checkpoint with "
            "fxquant.load_quantized"
        )
