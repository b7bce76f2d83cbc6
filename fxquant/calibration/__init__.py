"""Calibration: quantize with an algorithm that sees real data (``fxquant.calibrate``).

Where it sits: an entry point beside ``fxquant.quantize``, above the passes
(``docs/architecture.md``). It plans the program as ``quantize`` does, runs the exported graph
over the calibration samples, lets the method act at each planned linear, then hands the result
to ``quantize``.

- ``api``: ``calibrate`` and ``calibration_pass``, the entry;
- ``interpreter``: ``CalibrationRun``, the graph run node by node over all samples, and
  ``input_moments``, the statistics every method reads;
- ``gptq``, ``awq``, ``smoothquant``: one module per algorithm, its math and its driver (a
  ``CalibrationRun`` that acts at each group of linears sharing an input);
- ``fold``: which op before a linear's input can absorb a per-channel scale (AWQ, SmoothQuant);
- ``methods``: the ``GPTQ``, ``AWQ`` and ``SmoothQuant`` configs, importing nothing of fxquant,
  so ``fxquant.hf`` can build one without importing the pipeline.

HQQ needs no data: its math is ``fxquant/core/hqq.py``. This package imports none of its
modules on import; the public names are re-exported by the ``fxquant`` facade.
"""
