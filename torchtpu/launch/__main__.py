import sys

from torchtpu.launch.cli import main

sys.exit(main())
