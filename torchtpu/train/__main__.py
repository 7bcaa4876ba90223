"""`python -m torchtpu.train --config FILE [...]`: the same as the `torchtpu-train` command."""

import sys

from torchtpu.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
