"""`python -m colomem.runner [flags]`: the colocated GRPO job (the same as the `colomem-grpo` command)."""
import sys

from .cli import main

sys.exit(main())
