"""`python -m kvjax.cli`, as the `kvjax` console script."""

from . import console_main

console_main()
