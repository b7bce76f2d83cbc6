"""FP8 training: the numerics of each ``Float8Recipe``, the delayed-scaling state kept between
steps, and the bridge from accelerate's recipe objects.

Where it sits: right above ``fxquant.core`` (``docs/architecture.md``), below the passes: it
imports nothing of fxquant's but the core. ``fxquant.passes.float8_regions`` rewrites a Dynamo
graph's FP8 regions into ``numerics.float8_training_linear``, and the backend wraps the compiled
graph in ``state.Float8TrainingProgram``.

- ``numerics``: the casts (current, delayed, MX, block scaling) and the autograd linear whose
  forward and backward GEMMs use them; the reference the compiled graphs are tested against.
- ``state``: per-layer amax histories and scales, their once-per-step update, and
  ``fp8_state_dict`` / ``load_fp8_state_dict`` to checkpoint them.
- ``accelerate``: ``from_accelerate``, accelerate / Transformer Engine / torchao recipe kwargs →
  a ``QuantConfig`` with a ``Float8Recipe``.
- ``autocast``: ``fp8_autocast``, FP8 regions written in a forward (node annotations the regions
  pass reads).
- ``layers``: ``Float8Linear`` / ``Float8LayerNorm``, the layers ``convert_model`` marks.
- ``fsdp``: the FP8 all-gather under FSDP2 (``enable_fsdp_float8_all_gather``,
  ``Float8AllGatherWeight``); ``gathered``: the weight it hands the graph
  (``Float8GatheredWeight``, e4m3 values and a scale the FP8 linear reads without a cast).

accelerate's four FP8 functions built on these are in ``fxquant.accelerate``.

The modules are imported by their own paths (``fxquant.training.state``); the public names are
re-exported by the ``fxquant`` facade.
"""
