"""VPTQ checkpoints (``quant_method: "vptq"``, transformers' ``VptqConfig``, Microsoft's ``vptq``
package) → ``Vptq`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. The config gives each
layer its ``VptqLayerConfig`` in ``config_for_layers`` (by full module name) or
``shared_layer_config`` (by the name's last component, as the package and transformers 4.x match
it); pairs such as ``vector_lens`` are [outlier part, main part]. Per linear ``<m>``
(``VQuantLinear`` with packed indices): ``centroids.weight`` [C, K·vl], ``res_centroids.weight``
[C, R·vl] (R > 0), ``indices`` int32 [C, ⌈out/vl⌉, P], ``perm`` int16 [in] (read as uint16,
``enable_perm``), ``weight_scale`` / ``weight_bias`` [in] (``enable_norm``), ``bias``; with
``outlier_size`` S > 0, ``outlier_centroids.weight`` [1, K0·ovl] and ``outlier_indices`` int16
[1, ⌈out/ovl⌉, S] (not packed; read as uint16), which are decoded here into the dense
``outliers`` [out, S] the op adds. The layout is ``fxquant.core.vptq``'s; every shape is checked
against the layer's config. Unpacked indices and float indices are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    SCALE_DTYPES,
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    need,
    quantized_modules,
)
from fxquant.core import vptq
from fxquant.core.config import Vptq
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_vptq"]


def _layer_config(module: str, qcfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    per = qcfg.get("config_for_layers") or {}
    shared = qcfg.get("shared_layer_config") or {}
    return per.get(module) or shared.get(module.split(".")[-1])


def read_vptq(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """A VPTQ checkpoint's tensors → fxquant constants (module docstring)."""
    modules = quantized_modules(source, "indices", "VPTQ")
    out = LoadedCheckpoint(format="vptq")
    consumed: set[str] = set()
    for m in modules:
        cfg = _layer_config(m, qcfg)
        if cfg is None:
            raise CheckpointError(f"VPTQ layer {m} has indices but no entry in config_for_layers")
        scheme, weight, shape, used = _layer(source, m, cfg)
        out.add(m, scheme, weight, shape)
        consumed |= used
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out


def _layer(source, m: str, cfg: Mapping[str, Any]):
    where = f"VPTQ layer {m}"
    if not cfg.get("is_indice_packed", True) or cfg.get("indices_as_float", False):
        raise NotImplementedError(f"{where}: only packed integer indices load (is_indice_packed)")
    vl, k, r = cfg["vector_lens"][1], cfg["num_centroids"][1], cfg["num_res_centroids"][1]
    r = max(int(r), 0)
    c, g = int(cfg.get("group_num", 1)), int(cfg["group_size"])
    n_out, n_in = int(cfg["out_features"]), int(cfg["in_features"])
    s = max(int(cfg.get("outlier_size", 0) or 0), 0)
    scheme = Vptq(
        vector_len=vl, num_centroids=k, num_res_centroids=r, group_num=c, group_size=g,
        outlier_size=s,
    )  # fmt: skip
    if reason := scheme.unsupported_reason(out_features=n_out, in_features=n_in):
        raise CheckpointError(f"{where}: {reason}")
    want = scheme.layout((n_out, n_in))
    used = {f"{m}.indices", f"{m}.centroids.weight"}
    idx = expect(
        f"{m}.indices", source[f"{m}.indices"], dtype=torch.int32, shape=want["qweight"][0]
    )
    cb = need(source, f"{m}.centroids.weight", where)
    expect(f"{m}.centroids.weight", cb, dtype=SCALE_DTYPES, shape=(c, k * vl))
    if r > 0:
        rcb = need(source, f"{m}.res_centroids.weight", where)
        expect(f"{m}.res_centroids.weight", rcb, dtype=SCALE_DTYPES, shape=(c, r * vl))
        used.add(f"{m}.res_centroids.weight")
        res = rcb.float().reshape(c, r, vl)
    else:
        res = torch.zeros(c, 0, vl)
    if cfg.get("enable_perm", True):
        p = expect(f"{m}.perm", need(source, f"{m}.perm", where), shape=(n_in,))
        perm = p.view(torch.uint16).to(torch.int64) if p.dtype == torch.int16 else p.to(torch.int64)
        used.add(f"{m}.perm")
        if not torch.equal(torch.sort(perm).values, torch.arange(n_in)):
            raise CheckpointError(f"tensor '{m}.perm' is not a permutation of 0..{n_in - 1}")
    else:
        perm = torch.arange(n_in)
    if cfg.get("enable_norm", True):
        scale = need(source, f"{m}.weight_scale", where)
        wbias = need(source, f"{m}.weight_bias", where)
        expect(f"{m}.weight_scale", scale, dtype=SCALE_DTYPES, shape=(n_in,))
        expect(f"{m}.weight_bias", wbias, dtype=SCALE_DTYPES, shape=(n_in,))
        used |= {f"{m}.weight_scale", f"{m}.weight_bias"}
        scale, wbias = scale.float(), wbias.float()
    else:
        scale, wbias = torch.ones(n_in), torch.zeros(n_in)
    tensors = {
        "qweight": idx.contiguous(),
        "centroids": cb.float().reshape(c, k, vl).contiguous(),
        "res_centroids": res.contiguous(),
        "perm": perm.contiguous(),
        "weight_scale": scale.contiguous(),
        "weight_bias": wbias.contiguous(),
        "rows": torch.arange(n_out),
    }
    if s:
        tensors["outliers"] = _outliers(source, m, cfg, n_out, s)
        used |= {f"{m}.outlier_centroids.weight", f"{m}.outlier_indices"}
    return scheme, QuantizedWeight(tensors, None), (n_out, n_in), used


def _outliers(source, m: str, cfg: Mapping[str, Any], n_out: int, s: int) -> torch.Tensor:
    """The layer's outlier columns → fp32 [out, S], decoded once (``fxquant.core.vptq``)."""
    where = f"VPTQ layer {m}"
    ovl, k0, r0 = cfg["vector_lens"][0], cfg["num_centroids"][0], cfg["num_res_centroids"][0]
    if ovl <= 1 or k0 <= 0:
        # the package only builds the outlier codebook for vector_lens[0] > 1 and
        # num_centroids[0] > 0; without it the outlier columns have no weights at all
        raise CheckpointError(
            f"{where}: outlier_size={s} but no outlier codebook (vector_lens[0]={ovl}, "
            f"num_centroids[0]={k0}; the package needs vector_lens[0] > 1 and "
            "num_centroids[0] > 0)"
        )
    if r0 not in (-1, 0):
        raise NotImplementedError(
            f"{where}: residual codebooks on the outlier columns (num_res_centroids[0]={r0}) "
            "do not exist in the vptq package (its VQuantLinear raises on them)"
        )
    cb = need(source, f"{m}.outlier_centroids.weight", where)
    expect(f"{m}.outlier_centroids.weight", cb, dtype=SCALE_DTYPES, shape=(1, k0 * ovl))
    codes = need(source, f"{m}.outlier_indices", where)
    expect(f"{m}.outlier_indices", codes, dtype=torch.int16, shape=(1, -(-n_out // ovl), s))
    codes = codes[0].view(torch.uint16).to(torch.int64)
    if codes.numel() and int(codes.max()) >= k0:
        raise CheckpointError(
            f"tensor '{m}.outlier_indices' holds index {int(codes.max())}; the outlier codebook "
            f"has {k0} entries"
        )
    return vptq.decode_outliers(codes, cb.reshape(k0, ovl), rows=n_out).contiguous()
