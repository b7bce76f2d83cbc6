"""The entry points: ``quantize`` (model or program → quantized program) and ``aot_compile``.

``quantize`` is the top of the data flow: it captures an ``nn.Module`` with ``torch.export``
(or takes an ``ExportedProgram``), runs the pass pipeline (``fxquant.passes.pipeline``: plan →
rewrite → fuse) and returns a *new* program with ``fxquant::`` ops; the caller's model and
program are left as they were. ``aot_compile`` lowers such a program for a device and packages
it with AOTInductor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from fxquant import runtime
from fxquant.core.config import QuantConfig, Scheme
from fxquant.core.scheme import QuantizedWeight
from fxquant.llm import decode_bytes, llm_info
from fxquant.passes.cpu.compiler_check import inductor_patches
from fxquant.passes.cpu.parallel import keyed as sized_regions_keyed
from fxquant.passes.cpu.parallel import sized_regions
from fxquant.passes.float8_regions import inference_config, uses_float8_training
from fxquant.passes.lower import (
    _device_type,
    inductor_decompositions,
    lower,
    lowerings,
    native_cpu,
    prepacked,
)
from fxquant.passes.pipeline import run_passes
from fxquant.passes.rewrite import ProgramEditor
from fxquant.passes.stock import register_decompositions

__all__ = ["aot_compile", "atomic_path", "quantize"]

# a quantized program's module() under torch.compile's default backend runs the lowering's
# kernels too (passes/stock.py)
register_decompositions()


def quantize(
    model: torch.nn.Module | ExportedProgram,
    config: QuantConfig | Scheme | str,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    progress: bool = False,
    weights: Mapping[str, QuantizedWeight] | None = None,
) -> ExportedProgram:
    """Quantize every linear-like layer the config assigns a scheme.

    Args:
        model: an ``nn.Module`` (captured here with ``torch.export.export``) or an
            ``ExportedProgram``.
        config: a ``QuantConfig``, a single scheme (applied to every layer but ``lm_head``) or a
            recipe name such as ``"int8wo"``. A config with a ``Float8Recipe`` exports the FP8
            inference graph of a model trained with it: the same regions, delayed-scaling
            input scales frozen in (``fxquant.passes.float8_regions.inference_config``).
        example_inputs, example_kwargs, dynamic_shapes: passed to ``torch.export.export`` when
            ``model`` is a module (``example_inputs`` is then required).
        progress: show a progress bar while weights are quantized.
        weights: constants made elsewhere (``fxquant.calibrate``, a checkpoint loader), by
            weight name, used instead of quantizing those float weights; each must have the
            layout of the scheme the plan gives its layer (else ``ValueError``).

    Returns:
        A new ``ExportedProgram`` whose chosen layers call ``fxquant::`` ops on quantized
        constants (a norm whose linears all quantize their input the same way becomes one
        ``fxquant::norm_quant`` feeding them, unless ``fuse_norms=False``);
        ``fxquant.report(ep)`` says what happened to each layer and norm.
    """
    config = QuantConfig.coerce(config)
    if uses_float8_training(config):
        if not isinstance(model, torch.nn.Module) or isinstance(model, ExportedProgram):
            raise ValueError(
                "quantize() with a Float8Recipe needs the trained nn.Module (its FP8 regions "
                "and delayed-scaling state live on its modules), not an ExportedProgram"
            )
        model = getattr(model, "_orig_mod", model)  # a torch.compile'd module
        config = inference_config(model, config)
    if isinstance(model, ExportedProgram):
        if example_inputs is not None or dynamic_shapes is not None:
            raise ValueError(
                "example_inputs/dynamic_shapes are only used to export an nn.Module; "
                "this is already an ExportedProgram"
            )
        ep = model
    elif isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise ValueError(
                "quantize(model, ...) of an nn.Module needs example_inputs=(...) to export it "
                "(or pass an ExportedProgram)"
            )
        if not isinstance(example_inputs, tuple):
            raise ValueError(
                f"example_inputs must be a tuple of the model's positional inputs, "
                f"got {type(example_inputs).__name__}"
            )
        ep = torch.export.export(
            model, example_inputs, kwargs=example_kwargs, dynamic_shapes=dynamic_shapes
        )
    else:
        raise ValueError(
            f"quantize() takes an nn.Module or a torch.export.ExportedProgram, "
            f"got {type(model).__name__}"
        )
    editor = ProgramEditor(ep)
    run_passes(editor, config, progress=progress, weights=weights, whole_model=True)
    return editor.finish()


def aot_compile(
    ep: ExportedProgram,
    package_path: str | os.PathLike,
    *,
    device: str = "cpu",
    inductor_configs: dict[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    load: bool = True,
) -> Callable | None:
    """Lower ``ep`` for ``device`` and package it with AOTInductor; return the loaded package
    (None with ``load=False``: a build process that only writes it skips the seconds a load of
    a few hundred MB takes).

    The package holds only aten ops and compiled kernels: it loads with
    ``torch._inductor.aoti_load_package(path)`` in a process that never imports fxquant, and
    keeps the program's dynamic dimensions dynamic. The file is written next to its final path
    and renamed into place, so a failed compile never leaves a half-written package.

    For a program from ``fxquant.export_llm`` the package's metadata also records what
    ``fxquant.runtime`` checks before serving it (cache length, batch, vocabulary, EOS ids, the
    config, and the torch, device and CPU it was built for), plus ``metadata``'s entries.
    """
    package_path = Path(package_path)
    if package_path.suffix != ".pt2":
        raise ValueError(f"package_path={str(package_path)!r} must end in .pt2 (AOTInductor)")
    cpu = _device_type(device) == "cpu"
    # CPU: AOTInductor decomposes the semantic ops itself while it traces (one trace, not two);
    # CUDA keeps the separately lowered program its tests run through the Triton interpreter
    lowered = prepacked(ep, device=device) if cpu else lower(ep, device=device)
    decompose = inductor_decompositions(lowerings(device)) if cpu else contextlib.nullcontext()
    configs = dict(inductor_configs or {})
    if cpu:
        # Inductor tries to fuse every pair of nodes that read one buffer, up to 64 apart among
        # its readers. In an unrolled decoder the rotary tables, the mask and the positions are
        # read by every layer, so nearly all those pairs are layers apart and cannot fuse; 8
        # gave SmolLM2 the same 182 kernel calls (identical code) and cut Inductor's
        # scheduling from ~15 s to ~8 s of a ~110 s build (one-off measurement, AVX2 EPYC)
        configs.setdefault("max_fusion_buffer_group_pairwise_attempts", 8)
        # The C++ wrapper only calls the kernels, in one function of thousands of lines that
        # g++ took ~17 s to optimise at -O1 (the default); at -O0 ~9 s less per SmolLM2 build,
        # and its decode step measured the same (9.9 vs 10.0 ms, interleaved; one-off). The
        # kernels themselves keep -O3.
        configs.setdefault("aot_inductor.compile_wrapper_opt_level", "O0")
        configs = {**inductor_patches(), **configs}  # where the host compiler needs a mend
    info = llm_info(ep)
    if info is not None:
        # what the runtime checks before serving (fxquant.runtime.LLMPackage)
        configs["aot_inductor.metadata"] = {
            **configs.get("aot_inductor.metadata", {}),
            runtime.METADATA_KEY: json.dumps(
                {**_package_info(ep, info, device), **(metadata or {})}, sort_keys=True
            ),
        }
    link = contextlib.nullcontext()
    regions = contextlib.nullcontext()
    if cpu:
        # kernels of dynamic size open their OpenMP regions by the size they run at
        # (fxquant.passes.cpu.parallel): an LLM's decode step runs its small kernels serial
        regions = sized_regions()
        configs = sized_regions_keyed(configs)
    if cpu and native_cpu():
        # the native kernels' C shims, linked statically into the package (fxquant.kernels.cpu)
        import fxquant.kernels.cpu as native

        configs = {**native.aoti_options(), **configs}
        link = native.link_path()
    with atomic_path(package_path, keep_name=True) as tmp, link, decompose, regions:
        torch._inductor.aoti_compile_and_package(
            lowered, package_path=str(tmp), inductor_configs=configs
        )
    if not load:
        return None
    return torch._inductor.aoti_load_package(str(package_path))


def _package_info(ep: ExportedProgram, info: dict, device: str | torch.device) -> dict:
    from fxquant.report import report

    rep = report(ep)
    weights, kv_per_position = decode_bytes(ep)
    return {
        **info,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_position": kv_per_position,
        "device": _device_type(device),
        "torch": torch.__version__,
        "fxquant": _version(),
        "isa_flags": runtime.isa_flags() if _device_type(device) == "cpu" else [],
        # which kernel each scheme's layers run, by M (the dispatch table of this CPU's class)
        **(_cpu_kernels(rep) if _device_type(device) == "cpu" else {}),
        "config": None if rep.config is None else rep.config.to_dict(),
    }


def _cpu_kernels(rep) -> dict:
    from fxquant.passes.cpu.dispatch import machine_class

    return {
        "cpu_class": machine_class(),
        "cpu_kernels": {k["scheme"]: k["kernel"] for k in rep.cpu_kernels()},
    }


def _version() -> str:
    from fxquant.version import __version__

    return __version__


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, keep_name: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it into place, else delete it.

    So a failed or interrupted write never leaves a half-written file at ``path``. With
    ``keep_name`` the temporary file has ``path``'s own name, in a temporary folder beside it
    (AOTInductor names the package's inner folder after the file it writes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if keep_name:
        folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        tmp = folder / path.name
    else:
        fd, name = tempfile.mkstemp(suffix=path.suffix, prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        tmp, folder = Path(name), None
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual mode
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
