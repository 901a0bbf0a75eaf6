import sys

from dslurm.cli import main

sys.exit(main())
