"""The core vocabulary every other layer speaks: configs (``config``), the reference math of each
format (``reference*``, ``hqq``) and the ``fxquant::`` ops (``ops``).

Lowest layer of the house (``docs/architecture.md``): it imports nothing of fxquant's above it.
"""
