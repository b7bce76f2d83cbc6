"""Graph passes, in data-flow order: ``plan`` (which scheme for which node), ``rewrite`` (quantize
weights, emit ``fxquant::`` ops), ``lower`` (ops → per-device implementations)."""
