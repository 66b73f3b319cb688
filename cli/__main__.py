"""`python -m hydra_jury.cli`: the `hydra-jury` command."""

import sys

from hydra_jury.cli import main

sys.exit(main())
