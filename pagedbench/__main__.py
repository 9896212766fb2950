import sys

from pagedbench.entrypoints.cli.main import main

sys.exit(main())
