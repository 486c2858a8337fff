"""Built-in compression methods: importing this package registers every one of them.

One method = one module in this package + one ``@register("name")`` entry; the registry feeds the CLI, the
contract tests and the docs. Every module here is imported, so adding a method is adding a file.
"""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
