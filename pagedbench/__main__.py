import sys

from pagedbench.cli import main

sys.exit(main())
