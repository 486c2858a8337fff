"""Built-in compression methods: importing this package registers every one of them.

One method = one module + one ``@register("name")`` entry; the registry feeds the CLI, the tests and the docs.
"""

from kvweave.methods import full  # noqa: F401
from kvweave.methods import window  # noqa: F401
