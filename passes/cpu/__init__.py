"""The CPU lowering, one module per scheme family, named as its declarations are
(``fxquant/core/schemes/<family>.py``): ``int8``, ``int4``, ``float8``, ``mx``, ``bnb``,
``lowbit``, with ``experts`` (the mixture-of-experts GEMMs), ``norm`` (the fused norm →
quantize op), ``siblings`` (stacking linears that share an input), ``float32`` (the linears a
config leaves in fp32), ``common`` (shared epilogues) and ``parallel`` (a scope around
Inductor's C++ code generation: OpenMP regions that open by the size they run at).

Where it sits: below the lowering pass (``fxquant.passes.lower``), which reads what these
modules register. Each family module holds, for its ops:

- the aten compositions, ``@lowering("cpu", op)`` (``fxquant.core.registry``): semantic ops, and
  the ``fxquant::cpu_*`` device ops its prepack rules emit;
- the compositions around fxquant's native C++ kernels (``fxquant.kernels.cpu``),
  ``@lowering(NATIVE, op)`` with ``NATIVE = "cpu-native"``, which override ``"cpu"``'s where
  :func:`available`, with their own device ops (``fxquant::cpu_native_*``);
- its prepack rules, ``@prepack_rule("cpu" | NATIVE, op, consts=...)``
  (``fxquant.passes.cpu.prepack``), by the op's argument names.

Each module's docstring says why its lowering looks the way it does (measurements, kernel
preconditions). Importing this package imports each module in it, which registers them: a new
family is one new file here, with no list to edit.
"""

import importlib
import pkgutil

import fxquant.kernels.cpu as native

__all__ = ["available"]


def available() -> bool:
    """Whether the native kernels can serve this process (built and loaded): then the CPU
    lowering targets them (``"cpu-native"``). False where they cannot be built, and with
    ``FXQUANT_NATIVE=0``."""
    return native.available()


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
