"""`python -m jaxtrain VERB ...`: the `jaxtrain` command (`jaxtrain/commands/cli.py`)."""

import sys

from jaxtrain.commands.cli import main

sys.exit(main())
