"""Every scheme's declaration, one module per family (``fxquant.core.scheme`` says what a
declaration holds). Importing this package imports each module in it, which registers its
schemes, defines their ``fxquant::`` ops and adds their recipes: a new family is one new file
here, with no list to edit. Each scheme class is then also a name of this package.
"""

import importlib
import pkgutil

from fxquant.core.scheme import SCHEMES

# These come first in RECIPES (so in ``--help`` and error messages); the rest in name order.
_FIRST = ("int8", "int4", "float8", "mx", "bnb", "lowbit")
_found = [m.name for m in pkgutil.iter_modules(__path__)]
for _name in [*[n for n in _FIRST if n in _found], *[n for n in _found if n not in _FIRST]]:
    importlib.import_module(f"{__name__}.{_name}")

globals().update({name: cls for name, cls in SCHEMES.items()})
__all__ = sorted(SCHEMES)  # noqa: PLE0605  (filled from the registry above)
